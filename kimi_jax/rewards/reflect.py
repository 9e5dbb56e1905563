"""The verifier of the table-inversion task (kimi_jax/data/reflect.py
generates the problems): the problem, the response format, its parser
and the step check.

`ReflectReward()`: 1 when the response's final answer (`=d`, its last
piece) is the x with f^n(x) = y, else 0; what RL trains on and what
evaluation counts. `ReflectReward(check_steps=True)` (`reflect_steps`)
scores 1 only a verified reasoning path: the right answer, checked by an
attempt that ends in `+`, every attempt's lookups and verdict right. A
right bare answer (a lucky guess) or a right answer after a wrong lookup
scores 0, while `correct` stays the answer's verdict: what the warm-up data
keeps (`warmup.accept="score"`, report 2.2's "accurately verified
reasoning paths").
"""

from __future__ import annotations

import dataclasses
import re
from typing import Any, Mapping

from kimi_jax.rewards.base import RewardResult

DATASET = "reflect"
YES, NO, ANSWER, AGAINST = "+", "-", "=", ":"
_ATTEMPT = re.compile(r"^(\d)(\d+):(\d)([+-])$")
_ANSWER = re.compile(r"^=(\d)$")


@dataclasses.dataclass(frozen=True)
class Problem:
  """One problem: `table` as (source, target) pairs in prompt order."""

  table: tuple[tuple[int, int], ...]
  steps: int
  target: int
  level: int

  def f(self, s: int) -> int:
    return dict(self.table)[s]

  def chain(self, x: int) -> list[int]:
    """f(x), f(f(x)), ..., f^n(x)."""
    out, s = [], x
    for _ in range(self.steps):
      s = self.f(s)
      out.append(s)
    return out

  def answer(self) -> int:
    (x,) = [s for s, _ in self.table if self.chain(s)[-1] == self.target]
    return x

  def candidates(self) -> list[int]:
    """The search order: the table's sources as listed."""
    return [s for s, _ in self.table]

  def prompt(self) -> str:
    pairs = " ".join(f"{s}{t}" for s, t in self.table)
    return f"{pairs} ?{'>' * self.steps}{self.target}"


def problem_of(record: Mapping[str, Any]) -> Problem:
  spec = record[DATASET]
  return Problem(table=tuple((int(s), int(t)) for s, t in spec["table"]),
                 steps=int(spec["steps"]), target=int(spec["target"]),
                 level=int(spec["level"]))


def attempt(problem: Problem, x: int) -> str:
  """`x`, its n successors, the target and the verdict, e.g. `37:4-`."""
  chain = problem.chain(x)
  verdict = YES if chain[-1] == problem.target else NO
  return f"{x}{''.join(map(str, chain))}{AGAINST}{problem.target}{verdict}"


@dataclasses.dataclass(frozen=True)
class Parsed:
  """A response read: its attempts (candidate, chain, copied target,
  verdict), the final answer (None without one) and the first malformed
  piece, if any."""

  attempts: tuple[tuple[int, tuple[int, ...], int, str], ...]
  answer: int | None
  malformed: str | None = None


def parse(response: str) -> Parsed:
  """Space-separated attempts, the last piece `=d`."""
  pieces = response.split()
  answer = None
  if pieces and _ANSWER.match(pieces[-1]):
    answer = int(pieces[-1][1])
    pieces = pieces[:-1]
  attempts, malformed = [], None
  for piece in pieces:
    m = _ATTEMPT.match(piece)
    if m is None:
      malformed = malformed or piece
      continue
    attempts.append((int(m.group(1)), tuple(int(c) for c in m.group(2)),
                     int(m.group(3)), m.group(4)))
  return Parsed(tuple(attempts), answer, malformed)


def wrong_step(record: Mapping[str, Any], response: str) -> str | None:
  """The first attempt of `response` whose lookups, copied target or
  verdict are wrong (or a malformed piece); None when every attempt is
  right."""
  problem = problem_of(record)
  parsed = parse(response)
  if parsed.malformed is not None:
    return f"malformed {parsed.malformed[:20]!r}"
  sources = set(problem.candidates())
  for i, (x, chain, target, verdict) in enumerate(parsed.attempts):
    if x not in sources:
      return f"attempt {i + 1}: {x} is not in the table"
    text = f"{x}{''.join(map(str, chain))}{AGAINST}{target}{verdict}"
    if text != attempt(problem, x):
      return f"attempt {i + 1}: {text!r}, not {attempt(problem, x)!r}"
  return None


def response_stats(record: Mapping[str, Any], response: str) -> dict:
  """How many attempts a response makes and whether it checked its answer
  (a `+` attempt on the candidate it answers)."""
  parsed = parse(response)
  checked = any(v == YES and x == parsed.answer
                for x, _, _, v in parsed.attempts)
  return {"attempts": len(parsed.attempts), "checked_answer": checked}


@dataclasses.dataclass(frozen=True)
class ReflectReward:
  check_steps: bool = False

  def __call__(self, record: Mapping[str, Any], response: str
               ) -> RewardResult:
    if DATASET not in record:
      raise ValueError(f"record {record.get('id')!r}: no {DATASET!r} "
                       f"field (not a table-inversion problem)")
    parsed = parse(response)
    correct = (parsed.answer is not None and
               str(parsed.answer) == str(record["answer"]))
    info: dict[str, Any] = {"extracted": parsed.answer,
                            "attempts": len(parsed.attempts)}
    score = 1.0 if correct else 0.0
    if self.check_steps and correct:
      wrong = wrong_step(record, response)
      if wrong is None and not response_stats(
          record, response)["checked_answer"]:
        wrong = "the answer is not checked"
      if wrong is not None:
        info["wrong_step"] = wrong
        score = 0.0
    return RewardResult(score=score, correct=correct, info=info)
