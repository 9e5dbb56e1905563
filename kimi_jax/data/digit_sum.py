"""The tiny verifiable task: the sum of a list of digits, modulo 10.

Prompt `3+5+9+2=`. A chain-of-thought answer writes the running sums modulo
10 and then the result (`3;8;7;9>9`); a direct answer writes only the result
(`>9`). A small model cannot add many digits in one step, so writing the
steps out helps and response length means something: that is the Kimi k1.5
long-CoT story in miniature. Difficulty is the number of digits.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping

import numpy as np

from kimi_jax.data.char_tokenizer import CharTokenizer
from kimi_jax.rewards.base import RewardResult

CHARS = "0123456789+=>;"


@dataclasses.dataclass(frozen=True)
class DigitSumConfig:
  name: str = "digit_sum"
  min_digits: int = 2
  max_digits: int = 8
  num_train: int = 4000
  num_eval: int = 256
  direct_fraction: float = 0.5

  def __post_init__(self):
    if self.name != "digit_sum":
      raise ValueError(f"task.name: unknown task {self.name!r}")
    if not 1 <= self.min_digits <= self.max_digits:
      raise ValueError(f"task.min_digits/max_digits: need 1 <= min <= max, "
                       f"got {self.min_digits}, {self.max_digits}")
    if not 0.0 <= self.direct_fraction <= 1.0:
      raise ValueError(f"task.direct_fraction must be in [0, 1], got "
                       f"{self.direct_fraction}")
    if self.num_train <= 0 or self.num_eval <= 0:
      raise ValueError("task.num_train and task.num_eval must be positive")


def tokenizer() -> CharTokenizer:
  return CharTokenizer(CHARS)


def _is_eval(digits: str) -> bool:
  # A fixed hash split keeps train and held-out problems disjoint for any seed.
  return int(hashlib.sha256(digits.encode()).hexdigest(), 16) % 8 == 0


def _record(digits: str) -> dict[str, Any]:
  return {"id": f"ds-{digits}", "prompt": "+".join(digits) + "=",
          "answer": str(sum(int(d) for d in digits) % 10),
          "difficulty": float(len(digits))}


def make_problems(cfg: DigitSumConfig, seed: int
                  ) -> tuple[list[dict], list[dict]]:
  """Disjoint train and held-out problem records, deterministic in `seed`."""
  rng = np.random.default_rng(seed)
  train: dict[str, dict] = {}
  held: dict[str, dict] = {}
  while len(train) < cfg.num_train or len(held) < cfg.num_eval:
    n = int(rng.integers(cfg.min_digits, cfg.max_digits + 1))
    digits = "".join(str(d) for d in rng.integers(0, 10, size=n))
    target = held if _is_eval(digits) else train
    limit = cfg.num_eval if target is held else cfg.num_train
    if len(target) < limit:
      target.setdefault(digits, _record(digits))
  return list(train.values()), list(held.values())


def running_sums(digits: str) -> list[int]:
  out, total = [], 0
  for d in digits:
    total = (total + int(d)) % 10
    out.append(total)
  return out


def cot_solution(record: Mapping[str, Any]) -> str:
  digits = record["prompt"].rstrip("=").replace("+", "")
  steps = running_sums(digits)
  return ";".join(str(s) for s in steps) + ">" + str(steps[-1])


def direct_solution(record: Mapping[str, Any]) -> str:
  return ">" + record["answer"]


def final_answer(response: str) -> str | None:
  """The text after the last '>', if it is a single digit."""
  if ">" not in response:
    return None
  tail = response.rsplit(">", 1)[1].strip()
  return tail if len(tail) == 1 and tail.isdigit() else None


@dataclasses.dataclass(frozen=True)
class DigitSumReward:
  """Exact verifier: 1 if the final answer equals the reference, else 0."""

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    answer = final_answer(response)
    correct = answer is not None and answer == record["answer"]
    return RewardResult(score=1.0 if correct else 0.0, correct=correct,
                        info={"extracted": answer})


def warmstart_texts(records: list[dict], direct_fraction: float, seed: int
                    ) -> list[tuple[str, str]]:
  """(prompt, solution) pairs: a `direct_fraction` share answers directly."""
  rng = np.random.default_rng(seed)
  direct = rng.random(len(records)) < direct_fraction
  return [(r["prompt"], direct_solution(r) if d else cot_solution(r))
          for r, d in zip(records, direct)]
