"""A synthetic task for throughput benchmarks: forced lengths, hash rewards.

It runs through the same RL loop as a real task, so a benchmark measures the
code users run. Every record holds random prompt token ids and, for each of
the K responses of its group, the exact number of tokens to generate (the
task's `response_cap`; there is no stop token, so a response ends exactly
there). Lengths follow a long tail: a `long_frac` share of responses need
`long_factor` x the median length, the rest about the median (uniform in
[0.75 L, 1.25 L]); `fixed_len` gives every response the same length instead.
The reward is a hash of the response text, fixed by the tokens, so groups
are informative without a verifier's cost. Everything is a pure
function of the seed.
"""

from __future__ import annotations

import dataclasses
import hashlib
import math
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.data.tasks import Task
from kimi_jax.rewards.base import RewardResult


@dataclasses.dataclass(frozen=True)
class SyntheticConfig:
  vocab_size: int
  group_size: int
  prompt_len: int = 8
  median_len: int = 16
  long_factor: int = 8
  long_frac: float = 0.1
  fixed_len: int = 0  # > 0: every response has exactly this many tokens
  n_prompts: int = 4096
  seed: int = 0

  @property
  def max_len(self) -> int:
    return self.fixed_len or self.long_factor * self.median_len

  @property
  def short_range(self) -> tuple[int, int]:
    """Inclusive range of the short responses' lengths, ~[0.75 L, 1.25 L]."""
    return (max(1, math.ceil(0.75 * self.median_len)),
            max(1, int(1.25 * self.median_len)))


def target_lengths_K(cfg: SyntheticConfig, index: int) -> list[int]:
  if cfg.fixed_len:
    return [cfg.fixed_len] * cfg.group_size
  rng = np.random.default_rng([cfg.seed, index, 0])
  lo, hi = cfg.short_range
  short_K = rng.integers(lo, hi + 1, cfg.group_size)
  is_long_K = rng.random(cfg.group_size) < cfg.long_frac
  return [int(x) for x in np.where(is_long_K, cfg.max_len, short_K)]


def records(cfg: SyntheticConfig, lengths_K=target_lengths_K
            ) -> list[dict[str, Any]]:
  """cfg.n_prompts prompts of random tokens, each with its K forced
  lengths `lengths_K(cfg, index)` (any cfg with the fields used here)."""
  out = []
  for i in range(cfg.n_prompts):
    rng = np.random.default_rng([cfg.seed, i, 1])
    # Token 0 is the pad id; prompts avoid it.
    prompt = [int(t) for t in rng.integers(1, cfg.vocab_size, cfg.prompt_len)]
    out.append({"id": i, "prompt_ids": prompt,
                "lengths_K": lengths_K(cfg, i)})
  return out


@dataclasses.dataclass(frozen=True)
class IdTokenizer:
  """Token ids as text ("17 4 99"); no bos or eos, pad 0."""

  vocab_size: int
  pad_id: int = 0
  bos_id: None = None
  eos_id: None = None

  def encode(self, text: str) -> list[int]:
    return [int(w) for w in text.split()]

  def decode(self, ids: Sequence[int]) -> str:
    return " ".join(str(int(i)) for i in ids)


@dataclasses.dataclass(frozen=True)
class HashReward:
  """A score in [0, 1) from a hash of the response text (correct when
  >= 0.5): K different responses almost never tie, so every group is
  informative."""

  def __call__(self, record: Mapping[str, Any], response: str
               ) -> RewardResult:
    digest = hashlib.blake2b(response.encode(), digest_size=2).digest()
    score = int.from_bytes(digest, "little") / 2**16
    return RewardResult(score=score, correct=score >= 0.5)


def make_synthetic_task(cfg: SyntheticConfig, lengths_K=target_lengths_K,
                        name: str = "synthetic") -> Task:
  recs = records(cfg, lengths_K)
  return Task(name=name, train=recs, eval=recs[:8],
              reward=HashReward(), tokenizer=IdTokenizer(cfg.vocab_size),
              encode_prompt=lambda r: list(r["prompt_ids"]),
              response_cap=lambda r, j: r["lengths_K"][j])
