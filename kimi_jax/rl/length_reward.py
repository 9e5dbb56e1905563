"""Length reward of Kimi k1.5 (report section 2.3.3) and its warm-up schedule.

Within the K responses of one prompt, shorter correct responses are rewarded
and longer ones penalised; incorrect responses can only be penalised. The
caller adds it to the task reward:

  total_reward = task_reward + length_reward_weight(i, ...) * length_reward(...)

Lengths are full response lengths in tokens (all partial-rollout segments,
see docs/rl.md), never the number of tokens that enter the loss. Rewards are
host-side values, so this is numpy.
"""

from __future__ import annotations

import numpy as np


def length_reward(lengths_PxK: np.ndarray, correct_PxK: np.ndarray
                  ) -> np.ndarray:
  """Per-response length reward; returns PxK float32.

  With min_len / max_len over the K responses of each prompt:
    if max_len == min_len:  reward_j = 0 for every j
    else: lambda_j = 0.5 - (len_j - min_len) / (max_len - min_len)
          reward_j = lambda_j            if correct_j
                     min(0, lambda_j)    otherwise
  lambda runs from +0.5 (shortest) to -0.5 (longest).
  """
  lengths = np.asarray(lengths_PxK, np.float32)
  min_P1 = np.min(lengths, axis=-1, keepdims=True)
  max_P1 = np.max(lengths, axis=-1, keepdims=True)
  same_P1 = max_P1 == min_P1
  # The denominator is replaced only where the result is discarded anyway.
  span_P1 = np.where(same_P1, np.float32(1.0), max_P1 - min_P1)
  lam_PxK = np.float32(0.5) - (lengths - min_P1) / span_P1
  reward = np.where(np.asarray(correct_PxK, bool), lam_PxK,
                    np.minimum(np.float32(0.0), lam_PxK))
  return np.where(same_P1, np.float32(0.0), reward).astype(np.float32)


def length_reward_weight(iteration: int, *, weight: float,
                         warmup_iterations: int) -> float:
  """Weight of the length reward at a (0-based) RL iteration.

    w(i) = 0        for i < warmup_iterations
           weight   otherwise

  The report trains without the length penalty first, then keeps it constant.
  """
  if warmup_iterations < 0:
    raise ValueError(f"warmup_iterations must be >= 0, got "
                     f"{warmup_iterations}")
  if iteration < 0:
    raise ValueError(f"iteration must be >= 0, got {iteration}")
  return 0.0 if iteration < warmup_iterations else float(weight)
