"""The pointer-chasing task's exact verifier (kimi_jax/data/pointer_chase.py).

A response ends with `> S`, S the two-digit final state; the record's
`answer` is f^n(x)."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kimi_jax.rewards.base import RewardResult


def final_answer(response: str) -> str | None:
  """The word after the last '>', if it is a state."""
  words = response.split()
  if ">" not in words:
    return None
  i = len(words) - 1 - words[::-1].index(">")
  tail = words[i + 1:]
  return tail[0] if len(tail) == 1 and len(tail[0]) == 2 and tail[
      0].isdigit() else None


@dataclasses.dataclass(frozen=True)
class PointerChaseReward:
  """Exact verifier: 1 if the final answer equals f^n(x), else 0."""

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    answer = final_answer(response)
    correct = answer is not None and answer == record["answer"]
    return RewardResult(score=1.0 if correct else 0.0, correct=correct,
                        info={"extracted": answer})
