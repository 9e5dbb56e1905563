#!/usr/bin/env python3
"""Run one program in the code sandbox by hand; see docs/sandbox.md.

  python launch/sandbox_run.py prog.py --lang python --stdin input.txt
  python launch/sandbox_run.py main.cpp --memory-mb 256 --cpu-time-s 1
  python launch/sandbox_run.py bomb.js --json          # the ExecResult as JSON

The language defaults from the file extension (.py, .cpp/.cc/.cxx, .js/.mjs).
Prints the status, exit code, wall time, then the program's stdout and
stderr; exits 0 when the status is "ok", 1 otherwise, 2 on a bad request.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.sandbox import (LANGUAGES, ExecRequest, Sandbox,  # noqa: E402
                              SandboxRequestError)
from kimi_jax.sandbox.flags import (add_limit_flags, add_sandbox_flags,  # noqa: E402
                                    limits_from_args)

_EXTENSIONS = {".py": "python", ".cpp": "cpp", ".cc": "cpp", ".cxx": "cpp",
               ".js": "javascript", ".mjs": "javascript"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("file", help="the program's source file")
  p.add_argument("--lang", choices=LANGUAGES, default=None,
                 help="language (default: from the file extension)")
  p.add_argument("--stdin", default=None,
                 help="file whose contents are the program's stdin "
                 "('-' reads this process's stdin)")
  p.add_argument("--file", dest="extra_files", action="append", default=[],
                 metavar="NAME=PATH",
                 help="extra file placed next to the program (repeatable)")
  p.add_argument("--json", action="store_true",
                 help="print the ExecResult as one JSON object")
  add_limit_flags(p)
  add_sandbox_flags(p)
  return p.parse_args(argv)


def _read(path: str) -> str:
  if path == "-":
    return sys.stdin.read()
  with open(path, encoding="utf-8") as f:
    return f.read()


def main(argv: list[str] | None = None) -> int:
  a = parse_args(argv)
  language = a.lang or _EXTENSIONS.get(os.path.splitext(a.file)[1].lower())
  if language is None:
    print(f"sandbox_run: cannot tell the language of {a.file!r}; pass "
          f"--lang {{{','.join(LANGUAGES)}}}", file=sys.stderr)
    return 2
  files = {}
  for spec in a.extra_files:
    name, sep, path = spec.partition("=")
    if not sep:
      print(f"sandbox_run: --file {spec!r}: expected NAME=PATH",
            file=sys.stderr)
      return 2
    files[name] = _read(path)
  request = ExecRequest(language=language, source=_read(a.file),
                        stdin=_read(a.stdin) if a.stdin else "",
                        files=files, limits=limits_from_args(a))
  extra = {} if a.host_uid is None else {"host_uid": a.host_uid}
  try:
    with Sandbox(limits=request.limits, max_workers=1,
                 seccomp_filter=not a.no_seccomp,
                 memory_poll_s=a.memory_poll_s, **extra) as sb:
      result = sb.run(request)
  except SandboxRequestError as e:
    print(f"sandbox_run: bad request: {e}", file=sys.stderr)
    return 2
  if a.json:
    print(json.dumps(result.to_dict()))
  else:
    print(f"status: {result.status}  exit code: {result.exit_code}  "
          f"wall: {result.wall_s:.3f} s"
          f"{'  (output truncated)' if result.truncated else ''}")
    print("--- stdout ---")
    sys.stdout.write(result.stdout)
    print("--- stderr ---")
    sys.stdout.write(result.stderr)
  return 0 if result.ok else 1


if __name__ == "__main__":
  sys.exit(main())
