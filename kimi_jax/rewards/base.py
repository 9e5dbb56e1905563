"""The reward plug-in interface shared by every task.

A reward function maps (problem record, response text) to a score and a
correctness flag. The RL loop only ever calls `score_all`, which keeps one bad
record or one buggy verifier from stopping a run: an exception scores 0 and is
counted.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Protocol, Sequence, runtime_checkable


@dataclasses.dataclass(frozen=True)
class RewardResult:
  """Outcome of scoring one response.

  score: the task reward r(x, y) before length reward and penalties.
  correct: whether the response's answer solves the problem (drives
    accuracy, success-rate statistics and pass@1; `verified` below drives
    the length reward and ReST).
  error: a short message when scoring failed; the score is then 0.
  info: optional details (extracted answer, failing test, ...), for logs only.
  """

  score: float
  correct: bool
  error: str | None = None
  info: Mapping[str, Any] = dataclasses.field(default_factory=dict)

  @property
  def verified(self) -> bool:
    """Right, and not vetoed by the score: a process check
    (reasoning_gym_steps) scores a right answer reached through a wrong
    step 0 while `correct` stays the answer's verdict. What ReST fits, what
    the length reward counts as correct and what `warmup.accept="score"`
    keeps."""
    return bool(self.correct) and self.score > 0


@runtime_checkable
class RewardFn(Protocol):
  """Scores one response to one problem record."""

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    ...


@runtime_checkable
class BatchRewardFn(RewardFn, Protocol):
  """A reward that can score many responses at once (process pools, sandboxes)."""

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    ...


@runtime_checkable
class ReportingRewardFn(RewardFn, Protocol):
  """A reward that counts its own work (reward models: calls, seconds,
  malformed verdicts); the RL loop logs what it counted per iteration."""

  def take_stats(self) -> dict[str, float]:
    """The counters since the last call, then reset."""
    ...


def reward_stats(fn: RewardFn) -> dict[str, float]:
  """`fn.take_stats()` for a reporting reward, else nothing."""
  return fn.take_stats() if isinstance(fn, ReportingRewardFn) else {}


def _failed(exc: BaseException) -> RewardResult:
  return RewardResult(score=0.0, correct=False,
                      error=f"{type(exc).__name__}: {exc}")


def score_all(fn: RewardFn, records: Sequence[Mapping[str, Any]],
              responses: Sequence[str]) -> list[RewardResult]:
  """Scores every (record, response) pair; failures score 0 with `error` set.

  Uses `fn.batch` when the reward provides it. If a batch call raises as a
  whole, falls back to scoring one by one so only the guilty items score 0.
  """
  if len(records) != len(responses):
    raise ValueError(f"score_all: {len(records)} records but "
                     f"{len(responses)} responses")
  if isinstance(fn, BatchRewardFn):
    try:
      results = list(fn.batch(records, responses))
      if len(results) == len(records):
        return results
    except Exception:  # noqa: BLE001 - fall through to per-item scoring
      pass
  out = []
  for record, response in zip(records, responses):
    try:
      out.append(fn(record, response))
    except Exception as exc:  # noqa: BLE001 - a verifier bug must not stop RL
      out.append(_failed(exc))
  return out
