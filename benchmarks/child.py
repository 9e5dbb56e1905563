"""A benchmark part run in a child process, pinned to given CPU cores and
with its own environment from its first instruction (before it imports
JAX, so XLA:CPU sizes its thread pool and reads XLA_FLAGS for that
process). The child answers on stdout, one `TAG`-prefixed JSON line per
answer; other output passes through untouched."""

from __future__ import annotations

import json
import os
import subprocess
import sys

TAG = "BENCH "  # the protocol's lines on a child's stdout start with it
HERE = os.path.dirname(os.path.abspath(__file__))


def say(**fields) -> None:
  """The child's answer: one line its parent reads with `Child.read`."""
  print(TAG + json.dumps(fields), flush=True)


class Child:
  """`python -c` running `call`, a call of a function of one of this
  directory's modules (e.g. "sampler_cores.serve(4, 16, 'fallback-tiny',
  False)"), on `cpus`, with `env` (default: this process's
  environment)."""

  def __init__(self, cpus: set[int], call: str,
               env: dict[str, str] | None = None):
    module = call.split(".", 1)[0]
    boot = (f"import os, sys; os.sched_setaffinity(0, {sorted(cpus)}); "
            f"sys.path.insert(0, {HERE!r}); import {module}; {call}")
    self.proc = subprocess.Popen([sys.executable, "-c", boot],
                                 stdin=subprocess.PIPE,
                                 stdout=subprocess.PIPE, text=True, env=env)

  def read(self) -> dict:
    for line in self.proc.stdout:
      if line.startswith(TAG):
        return json.loads(line[len(TAG):])
    raise RuntimeError(f"a benchmark child ended (exit code "
                       f"{self.proc.wait()}) before it answered")

  def ask(self, line: str) -> dict:
    self.proc.stdin.write(line + "\n")
    self.proc.stdin.flush()
    return self.read()

  def close(self) -> None:
    if self.proc.poll() is None:
      self.proc.stdin.close()
      self.proc.wait(timeout=60)


def allowed_cpus(part: str) -> list[int]:
  """The cores this process may use; at least two, or a clear exit."""
  allowed = sorted(os.sched_getaffinity(0))
  if len(allowed) < 2:
    raise SystemExit(f"--part {part} compares one core with several; this "
                     f"process may use only CPUs {allowed}")
  return allowed
