"""Code benchmark readers: LiveCodeBench and MBPP files -> code items.

Every item is a record of the code reward (kimi_jax/rewards/code.py),
scored in the sandbox: stdin/stdout items carry `tests`, function items a
`test` defining `check(candidate)`, the `entry_point` that `candidate`
calls in the response's process and a `code_prefix` run before the
response's code.

LiveCodeBench (code_generation_lite JSONL): question_id, question_content,
starter_code, public_test_cases and private_test_cases (JSON text of
[{input, output, testtype}]; private ones of the published files may be
base64 of zlib of a pickled JSON string), metadata (JSON text; func_name
for functional tests). A problem's tests are all "stdin" (the program reads
stdin, its stdout must equal the output) or all "functional" (each input
line is a JSON argument of `Solution().<func_name>`, the output the JSON of
the return value). Every public and private case must pass.

MBPP (google-research mbpp.jsonl, or the sanitized set with `prompt` for
`text` and `test_imports` for `test_setup_code`): task_id, text, code,
test_list, test_setup_code. The asserts of test_list must pass; the tested
function is the one the reference `code` defines that test_list calls.
"""

from __future__ import annotations

import base64
import binascii
import io
import json
import pickle
import re
import zlib
from typing import Any, Mapping, Sequence

from kimi_jax.evaluation.rows import bad, field, optional, read_rows

# LiveCodeBench's own harness gives each test 6 s; ours runs each stdin
# case under this CPU limit, and a functional problem's calls under four
# times it (code.function_job).
LIVECODEBENCH_TIME_LIMIT_S = 6.0
# What LeetCode's judge has imported before the solution runs (starter
# code annotates with List, Optional, ...); put before a functional
# response as LiveCodeBench's harness does.
FUNCTIONAL_HEADER = (
    "import bisect, collections, functools, heapq, itertools, math, "
    "operator, random, re, string, sys\n"
    "from bisect import *\nfrom collections import *\n"
    "from functools import *\nfrom heapq import *\nfrom itertools import *\n"
    "from math import *\nfrom typing import *\n")
# The function the harness calls for a functional LiveCodeBench problem: a
# fresh Solution per case (a stateful solution cannot leak between cases).
ENTRY = "benchmark_entry_"

STDIN_FORMAT = ("Write a Python 3 program that reads the input from "
                "standard input and prints the answer to standard output. "
                "Reply with the whole program in one ```python code block.")
STARTER_FORMAT = ("Complete the following starter code. Reply with the whole "
                  "solution in one ```python code block.")
MBPP_FORMAT = ("Reply with the Python function in one ```python code "
               "block.")


class _NoGlobals(pickle.Unpickler):
  """Unpickles plain data only: a pickle naming any class or function
  (which could run code) is refused."""

  def find_class(self, module: str, name: str) -> Any:
    raise pickle.UnpicklingError(f"refusing {module}.{name}")


def decode_cases(text: Any) -> Any:
  """A LiveCodeBench test-case field: JSON text, or base64 of zlib of a
  pickled JSON string (the published private cases); an already decoded
  list passes through."""
  if not isinstance(text, str):
    return text
  if not text.strip():
    return []
  try:
    return json.loads(text)
  except ValueError:
    pass
  try:
    raw = zlib.decompress(base64.b64decode(text.encode("utf-8"),
                                           validate=True))
    inner = _NoGlobals(io.BytesIO(raw)).load()
  except (binascii.Error, zlib.error, pickle.UnpicklingError, EOFError,
          ValueError) as exc:
    raise ValueError(f"neither JSON nor base64+zlib+pickle ({exc})") from None
  if isinstance(inner, bytes):
    inner = inner.decode("utf-8")
  return json.loads(inner) if isinstance(inner, str) else inner


def _cases(path: str, i: int, row: Mapping[str, Any], name: str
           ) -> list[dict[str, str]]:
  try:
    cases = decode_cases(field(path, i, row, name))
  except ValueError as exc:
    raise bad(path, i, name, str(exc)) from None
  if not isinstance(cases, list):
    raise bad(path, i, name, f"expected a list of test cases, got "
              f"{type(cases).__name__}")
  for n, case in enumerate(cases):
    if not isinstance(case, dict) or not {"input", "output"} <= set(case):
      raise bad(path, i, name, f"case {n}: expected {{input, output, "
                "testtype}")
    if case.get("testtype", "stdin") not in ("stdin", "functional"):
      raise bad(path, i, name, f"case {n}: testtype "
                f"{case.get('testtype')!r} is not 'stdin' or 'functional'")
  return cases


def _metadata(path: str, i: int, row: Mapping[str, Any]) -> dict[str, Any]:
  value = row.get("metadata") or {}
  if isinstance(value, str):
    try:
      value = json.loads(value)
    except ValueError as exc:
      raise bad(path, i, "metadata", f"not JSON ({exc})") from None
  if not isinstance(value, dict):
    raise bad(path, i, "metadata", "expected a JSON object")
  return value


def functional_check(cases: Sequence[tuple[list[Any], Any]]) -> str:
  """`check(candidate)` source calling candidate(*args) for every (args,
  expected) case; a tuple result counts as the list it equals (JSON has no
  tuples)."""
  return (
      "import json\n"
      f"CASES = json.loads({json.dumps(json.dumps(cases))})\n"
      "def check(candidate):\n"
      "  for n, (args, expected) in enumerate(CASES):\n"
      "    got = candidate(*args)\n"
      "    if isinstance(got, tuple):\n"
      "      got = list(got)\n"
      "    assert got == expected, 'case %d' % n\n")


def _functional_record(path: str, i: int, row: Mapping[str, Any],
                       cases: Sequence[Mapping[str, str]], n_public: int
                       ) -> dict[str, Any]:
  func = _metadata(path, i, row).get("func_name")
  if not isinstance(func, str) or not func.isidentifier():
    raise bad(path, i, "metadata", f"functional tests need a func_name, got "
              f"{func!r}")
  parsed = []
  for n, case in enumerate(cases):
    try:
      args = [json.loads(line) for line in str(case["input"]).split("\n")
              if line.strip()]
      expected = json.loads(str(case["output"]))
    except ValueError as exc:
      name, k = (("public_test_cases", n) if n < n_public else
                 ("private_test_cases", n - n_public))
      raise bad(path, i, name, f"functional case {k}: input lines and "
                f"output must be JSON ({exc})") from None
    parsed.append((args, expected))
  prefix = (f"{FUNCTIONAL_HEADER}\n\ndef {ENTRY}(*args):\n"
            f"  return Solution().{func}(*args)\n\n")
  return dict(test=functional_check(parsed), entry_point=ENTRY,
              code_prefix=prefix, func_name=func)


def read_livecodebench(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    question = str(field(path, i, row, "question_content"))
    qid = field(path, i, row, "question_id")
    starter = str(row.get("starter_code") or "")
    public = _cases(path, i, row, "public_test_cases")
    private = _cases(path, i, row, "private_test_cases")
    cases = public + private
    if not cases:
      raise bad(path, i, "private_test_cases", "no test cases at all")
    kinds = {c.get("testtype", "stdin") for c in cases}
    if len(kinds) > 1:
      raise bad(path, i, "private_test_cases", "mixes stdin and functional "
                "test cases")
    item = dict(id=str(qid), kind="code",
                time_limit_s=LIVECODEBENCH_TIME_LIMIT_S,
                n_public=len(public), n_private=len(private),
                platform=row.get("platform"),
                difficulty=row.get("difficulty"),
                contest_date=row.get("contest_date"))
    if kinds == {"functional"}:
      item.update(_functional_record(path, i, row, cases, len(public)))
    else:
      item.update(language="python", tests=[
          dict(input=str(c["input"]), output=str(c["output"]))
          for c in cases])
    form = (f"{STARTER_FORMAT}\n\n```python\n{starter.rstrip()}\n```"
            if starter.strip() else STDIN_FORMAT)
    item["prompt"] = f"{question.strip()}\n\n{form}"
    items.append(item)
  return items


CALL = re.compile(r"([A-Za-z_]\w*)\s*\(")
DEF = re.compile(r"^def\s+([A-Za-z_]\w*)\s*\(", re.MULTILINE)


def mbpp_entry_point(code: str, tests: Sequence[str]) -> str | None:
  """The function of the reference `code` that the tests call first (a
  top-level def whose name is called in a test), or None."""
  defined = set(DEF.findall(code))
  for test in tests:
    for name in CALL.findall(test):
      if name in defined:
        return name
  return None


def _indented(lines: Sequence[str]) -> str:
  return "".join("  " + line + "\n" for test in lines
                 for line in test.split("\n"))


def read_mbpp(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    task_id = field(path, i, row, "task_id")
    text = row.get("text", row.get("prompt"))
    if text is None:
      field(path, i, row, "text")  # raises, naming the field
    code = str(field(path, i, row, "code"))
    tests = field(path, i, row, "test_list")
    if (not isinstance(tests, list) or not tests
        or not all(isinstance(t, str) for t in tests)):
      raise bad(path, i, "test_list", "expected a non-empty list of assert "
                "statements")
    setup = row.get("test_setup_code") or ""
    imports = optional(row, "test_imports") or []
    if not isinstance(setup, str) or not isinstance(imports, list):
      raise bad(path, i, "test_setup_code", "expected code text (or "
                "test_imports: a list of import lines)")
    setup = "\n".join([*map(str, imports), setup]).strip()
    entry = mbpp_entry_point(code, tests)
    if entry is None:
      raise bad(path, i, "test_list", "calls no function that field 'code' "
                "defines")
    shown = "\n".join(tests)
    items.append(dict(
        id=str(task_id), kind="code", entry_point=entry,
        code_prefix=setup + "\n" if setup else "",
        test=f"{setup}\n\ndef check(candidate):\n{_indented(tests)}",
        prompt=(f"{str(text).strip()}\nYour code should pass these tests:\n"
                f"\n{shown}\n\n{MBPP_FORMAT}")))
  return items
