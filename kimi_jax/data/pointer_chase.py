"""The tiny verifiable task: follow a hidden permutation n steps.

A fixed random permutation f of the 100 states 00..99 (drawn from the task
seed) is never shown; it is learned from the data. A problem gives a start
state x and a step count n (prompt `37 c5 =`); the answer is f^n(x).

A chain-of-thought answer counts down and writes every intermediate state
(`c4 81 ; c3 12 ; c2 40 ; c1 07 ; c0 55 ; > 55`): each step is one lookup of
f, so a small model learns it and it generalises to unseen (x, n) pairs. A
direct answer (`> 55`) must compose n lookups in one forward pass, which a
small model can only memorise for the pairs it trained on. So writing the
steps out helps, and response length means something: the report's long-CoT
story in miniature. Difficulty is n. Train and held-out problems are disjoint
(x, n) pairs.
"""

from __future__ import annotations

import dataclasses
import hashlib
from typing import Any, Mapping

import numpy as np

from kimi_jax.data.word_tokenizer import WordTokenizer
from kimi_jax.rewards.base import RewardResult

N_STATES = 100
MAX_STEPS = 9


@dataclasses.dataclass(frozen=True)
class PointerChaseConfig:
  name: str = "pointer_chase"
  min_steps: int = 1
  max_steps: int = 8
  # Share of (x, n) pairs held out for evaluation.
  eval_fraction: float = 0.125
  # Fraction of warm-start examples that answer directly, without steps.
  direct_fraction: float = 0.5
  # Share of train problems the warm start sees. RL sees them all, so most
  # RL problems cannot be answered from a memorised direct answer.
  warmstart_fraction: float = 0.25

  def __post_init__(self):
    if self.name != "pointer_chase":
      raise ValueError(f"task.name: unknown task {self.name!r}")
    if not 1 <= self.min_steps <= self.max_steps <= MAX_STEPS:
      raise ValueError(f"task.min_steps/max_steps: need 1 <= min <= max <= "
                       f"{MAX_STEPS}, got {self.min_steps}, {self.max_steps}")
    if not 0.0 < self.eval_fraction < 1.0:
      raise ValueError(f"task.eval_fraction must be in (0, 1), got "
                       f"{self.eval_fraction}")
    if not 0.0 < self.warmstart_fraction <= 1.0:
      raise ValueError(f"task.warmstart_fraction must be in (0, 1], got "
                       f"{self.warmstart_fraction}")
    if not 0.0 <= self.direct_fraction <= 1.0:
      raise ValueError(f"task.direct_fraction must be in [0, 1], got "
                       f"{self.direct_fraction}")


def state(s: int) -> str:
  return f"{s:02d}"


def counter(c: int) -> str:
  return f"c{c}"


def tokenizer() -> WordTokenizer:
  return WordTokenizer(("=", ";", ">") + tuple(counter(c) for c in range(
      MAX_STEPS + 1)) + tuple(state(s) for s in range(N_STATES)))


def permutation(seed: int) -> np.ndarray:
  return np.random.default_rng([seed, 7]).permutation(N_STATES)


def chain(perm: np.ndarray, x: int, n: int) -> list[int]:
  """The states f(x), f(f(x)), ..., f^n(x)."""
  out, s = [], x
  for _ in range(n):
    s = int(perm[s])
    out.append(s)
  return out


def _held_out(x: int, n: int, seed: int, fraction: float) -> bool:
  h = hashlib.sha256(f"{seed}:{x}:{n}".encode()).digest()
  return int.from_bytes(h[:8], "little") / 2**64 < fraction


def make_problems(cfg: PointerChaseConfig, seed: int
                  ) -> tuple[list[dict], list[dict]]:
  """Every (x, n) pair, split into disjoint train and held-out records."""
  perm = permutation(seed)
  train, held = [], []
  for n in range(cfg.min_steps, cfg.max_steps + 1):
    for x in range(N_STATES):
      rec = {"id": f"pc-{x:02d}-{n}", "prompt": f"{state(x)} {counter(n)} =",
             "answer": state(chain(perm, x, n)[-1]), "difficulty": float(n),
             "x": x, "n": n}
      (held if _held_out(x, n, seed, cfg.eval_fraction) else train).append(rec)
  return train, held


def cot_solution(record: Mapping[str, Any], perm: np.ndarray) -> str:
  n = record["n"]
  steps = chain(perm, record["x"], n)
  body = " ".join(f"{counter(n - 1 - i)} {state(s)} ;"
                  for i, s in enumerate(steps))
  return f"{body} > {state(steps[-1])}"


def direct_solution(record: Mapping[str, Any]) -> str:
  return f"> {record['answer']}"


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


def warmstart_texts(records: list[dict], cfg: PointerChaseConfig, seed: int,
                    size: int) -> list[tuple[str, str]]:
  """`size` (prompt, solution) pairs over a `warmstart_fraction` subset of
  the records; a `direct_fraction` share answers directly."""
  perm = permutation(seed)
  rng = np.random.default_rng([seed, 11])
  pool = [records[i] for i in rng.permutation(len(records))[:max(
      1, round(cfg.warmstart_fraction * len(records)))]]
  out = []
  for i in range(size):
    r = pool[i % len(pool)]
    direct = rng.random() < cfg.direct_fraction
    out.append((r["prompt"], direct_solution(r) if direct else
                cot_solution(r, perm)))
  return out
