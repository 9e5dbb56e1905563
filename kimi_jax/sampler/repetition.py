"""Detecting a response stuck in a loop, on the host, for all slots at once.

A response is caught when its tail is one block of p tokens repeated `times`
times in a row, for some p in 1..ngram: with n = len(response),

  response[n - p*times + j] == response[n - p*times + j + p]
      for all 0 <= j < p*(times - 1).

The check runs after every new token, so a loop is caught at the first token
that completes its `times`-th copy. The host's check decides; the device's
(`repeating_on_device`, the same rule) only tells the engine where a
multi-step decode call must end so that a freed slot is refilled at once.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np


@dataclasses.dataclass(frozen=True)
class RepeatConfig:
  """ngram: the longest repeated block looked for; times: copies needed."""

  ngram: int = 3
  times: int = 4
  enabled: bool = True

  def __post_init__(self):
    if self.ngram < 1:
      raise ValueError(f"repeat.ngram must be >= 1, got {self.ngram}")
    if self.times < 2:
      raise ValueError(f"repeat.times must be >= 2, got {self.times}")

  @property
  def window(self) -> int:
    """How many tail tokens the check looks at."""
    return self.ngram * self.times


def device_rule(cfg: RepeatConfig) -> tuple[int, int]:
  """(ngram, times) of the device-side check; (0, 0) when detection is off."""
  return (cfg.ngram, cfg.times) if cfg.enabled else (0, 0)


def tails(responses_NxR: np.ndarray, lengths_B: np.ndarray, window: int,
          rows_B: np.ndarray | None = None) -> np.ndarray:
  """The last `window` tokens of rows `rows_B` (default: row i for length
  i), rows shorter than it -1 filled. Only the tails are read: a row can be
  as long as the engine's cache, and copying whole rows at every decode
  step would cost time in proportion to it."""
  idx_BxW = lengths_B[:, None] - window + np.arange(window)[None, :]
  rows_B = np.arange(len(lengths_B)) if rows_B is None else rows_B
  picked = responses_NxR[rows_B[:, None], np.clip(idx_BxW, 0, None)]
  return np.where(idx_BxW >= 0, picked, -1)


def repeating(tail_BxW: np.ndarray, lengths_B: np.ndarray, cfg: RepeatConfig
              ) -> np.ndarray:
  """bool_B: whether each row's tail ends in a caught repetition.

  tail_BxW holds the last W >= cfg.window tokens of each response (as given
  by `tails`); lengths_B are the full response lengths.
  """
  caught_B = np.zeros(tail_BxW.shape[0], bool)
  if not cfg.enabled:
    return caught_B
  for p in range(1, cfg.ngram + 1):
    span = p * cfg.times
    block_BxS = tail_BxW[:, tail_BxW.shape[1] - span:]
    same_B = np.all(block_BxS[:, p:] == block_BxS[:, :-p], axis=1)
    caught_B |= same_B & (lengths_B >= span)
  return caught_B


def is_repeating(response: list[int] | tuple[int, ...] | np.ndarray,
                 cfg: RepeatConfig) -> bool:
  """Single-sequence convenience form of `repeating`."""
  row = np.asarray(response, np.int64)[None, :]
  if row.shape[1] == 0 or not cfg.enabled:
    return False
  lengths = np.array([row.shape[1]])
  return bool(repeating(tails(row, lengths, cfg.window), lengths, cfg)[0])


def repeating_on_device(tail_BxW: jax.Array, lengths_B: jax.Array,
                        ngram: int, times: int) -> jax.Array:
  """`repeating` in JAX, for a tail of exactly W = ngram * times tokens.

  Row b repeats with period p when its last p * times tokens are `times`
  copies of one block: tail[W-1-k] == tail[W-1-k-p] for every k < p *
  (times - 1), and the response is at least p * times long. All periods in
  one comparison of shape B x ngram x W.
  """
  W = ngram * times
  p_P = np.arange(1, ngram + 1)[:, None]  # periods
  k_K = np.arange(W)[None, :]
  later_PxK = W - 1 - k_K + 0 * p_P
  earlier_PxK = np.clip(later_PxK - p_P, 0, W - 1)
  checked_PxK = k_K < p_P * (times - 1)
  same_BxPxK = tail_BxW[:, later_PxK] == tail_BxW[:, earlier_PxK]
  block_BxP = jnp.all(same_BxPxK | ~checked_PxK[None], axis=2)
  long_enough_BxP = lengths_B[:, None] >= (p_P[:, 0] * times)[None, :]
  return jnp.any(block_BxP & long_enough_BxP, axis=1)
