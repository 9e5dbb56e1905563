"""Rotary position embeddings: the inverse frequencies of each rope type,
computed as `transformers` computes them (its modeling_rope_utils.py, in
float32), and their application to queries and keys.

A model's layers use one of two ropes: full-attention layers the model's
`rope_theta` with its `rope_scaling`, sliding-window layers (Gemma 3) their
own base `sliding_rope_theta`, unscaled (see `ModelConfig`).
"""

from __future__ import annotations

import dataclasses
import math
from typing import Any, Mapping

import jax
import jax.numpy as jnp

ROPE_TYPES = ("linear", "llama3", "yarn")


@dataclasses.dataclass(frozen=True)
class RopeScaling:
  """A rotary scaling rule of a long-context checkpoint; the fields carry
  the names of Hugging Face's `rope_parameters`.

  rope_type "linear": every frequency divided by `factor`.
  "llama3" (Llama 3.1 and later): wavelengths longer than
    original_max_position_embeddings / low_freq_factor are divided by
    `factor`, those shorter than original_max_position_embeddings /
    high_freq_factor kept, and the band between blended smoothly.
  "yarn" (Qwen2.5 / Qwen3 past 32k): interpolated (divided by `factor`) and
    extrapolated frequencies blended by a ramp between the dimensions that
    turn beta_fast and beta_slow times over original_max_position_embeddings
    (ramp bounds rounded outwards when `truncate`), and cos / sin multiplied
    by `attention_factor` (None: 0.1 ln(factor) + 1, YaRN's mscale), which
    scales the attention logits by its square.
  """

  rope_type: str
  factor: float
  original_max_position_embeddings: int | None = None
  low_freq_factor: float | None = None
  high_freq_factor: float | None = None
  beta_fast: float = 32.0
  beta_slow: float = 1.0
  attention_factor: float | None = None
  truncate: bool = True

  def __post_init__(self):
    where = "model.rope_scaling"
    if self.rope_type not in ROPE_TYPES:
      raise ValueError(f"{where}.rope_type must be one of {ROPE_TYPES}, got "
                       f"{self.rope_type!r}")
    if not self.factor > 0:
      raise ValueError(f"{where}.factor must be positive, got {self.factor}")
    needs = {"linear": (),
             "llama3": ("original_max_position_embeddings",
                        "low_freq_factor", "high_freq_factor"),
             "yarn": ("original_max_position_embeddings",)}[self.rope_type]
    for name in needs:
      if getattr(self, name) is None:
        raise ValueError(f"{where}: rope_type {self.rope_type!r} needs "
                         f"{name}")
    if (self.rope_type == "llama3" and
        not self.low_freq_factor < self.high_freq_factor):
      raise ValueError(f"{where}: low_freq_factor ({self.low_freq_factor}) "
                       f"must be below high_freq_factor "
                       f"({self.high_freq_factor})")

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "RopeScaling":
    """Builds from a config section, naming unknown keys."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown model.rope_scaling keys: {unknown}")
    return cls(**dict(values))

  @property
  def cos_sin_scale(self) -> float | None:
    """What cos and sin are multiplied by; None for 1."""
    if self.rope_type != "yarn":
      return None
    if self.attention_factor is not None:
      return float(self.attention_factor)
    return yarn_mscale(self.factor)


def yarn_mscale(factor: float, mscale: float = 1.0) -> float:
  """YaRN's attention temperature term, as transformers' `get_mscale`."""
  if factor <= 1:
    return 1.0
  return 0.1 * mscale * math.log(factor) + 1.0


def inv_frequencies(head_dim: int, theta: float,
                    scaling: RopeScaling | None = None) -> jax.Array:
  """The head_dim / 2 rotary inverse frequencies (float32)."""
  half = head_dim // 2
  # Written as the unscaled rope has always been computed here.
  freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2 /
                          head_dim))
  if scaling is None:
    return freq
  if scaling.rope_type == "linear":
    return freq / scaling.factor
  if scaling.rope_type == "llama3":
    return _llama3(freq, scaling)
  return _yarn(head_dim, theta, scaling)


def _llama3(freq: jax.Array, s: RopeScaling) -> jax.Array:
  """transformers' `_compute_llama3_parameters`."""
  old_len = s.original_max_position_embeddings
  low_wavelen = old_len / s.low_freq_factor
  high_wavelen = old_len / s.high_freq_factor
  wavelen = 2 * math.pi / freq
  scaled = jnp.where(wavelen > low_wavelen, freq / s.factor, freq)
  smooth = ((old_len / wavelen - s.low_freq_factor) /
            (s.high_freq_factor - s.low_freq_factor))
  smoothed = (1 - smooth) * scaled / s.factor + smooth * scaled
  medium = ~(wavelen < high_wavelen) & ~(wavelen > low_wavelen)
  return jnp.where(medium, smoothed, scaled)


def _yarn(head_dim: int, theta: float, s: RopeScaling) -> jax.Array:
  """transformers' `_compute_yarn_parameters` (frequencies only)."""
  half = head_dim // 2

  def correction_dim(rotations: float) -> float:
    return (head_dim * math.log(s.original_max_position_embeddings /
                                (rotations * 2 * math.pi)) /
            (2 * math.log(theta)))

  low, high = correction_dim(s.beta_fast), correction_dim(s.beta_slow)
  if s.truncate:
    low, high = math.floor(low), math.ceil(high)
  low, high = max(low, 0), min(high, head_dim - 1)
  if low == high:
    high += 0.001  # as transformers: no zero-width ramp
  pos_freqs = theta ** (jnp.arange(half, dtype=jnp.float32) * 2 / head_dim)
  extrapolation = 1.0 / pos_freqs
  interpolation = 1.0 / (s.factor * pos_freqs)
  ramp = jnp.clip((jnp.arange(half, dtype=jnp.float32) - low) /
                  (high - low), 0, 1)
  keep = 1 - ramp  # the share of the extrapolated (unscaled) frequency
  return interpolation * (1 - keep) + extrapolation * keep


def apply(x_BxTxNxDh: jax.Array, positions_BxT: jax.Array,
          inv_freq: jax.Array, cos_sin_scale: Any = None) -> jax.Array:
  """Rotary embedding, split-halves convention (as Hugging Face Llama).

  cos_sin_scale: None, or what cos and sin are multiplied by (yarn)."""
  half = x_BxTxNxDh.shape[-1] // 2
  angle_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * inv_freq[
      None, None, :]
  cos = jnp.cos(angle_BxTxHalf)[:, :, None, :]
  sin = jnp.sin(angle_BxTxHalf)[:, :, None, :]
  if cos_sin_scale is not None:
    cos, sin = cos * cos_sin_scale, sin * cos_sin_scale
  x1 = x_BxTxNxDh[..., :half].astype(jnp.float32)
  x2 = x_BxTxNxDh[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxDh.dtype)
