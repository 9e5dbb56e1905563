"""Typed, frozen configuration of the vision tower and its projector."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kimi_jax.infra.dtypes import NamedDtypes, check_dtypes


@dataclasses.dataclass(frozen=True)
class VisionConfig(NamedDtypes):
  """A SigLIP-family ViT, its projector and how images enter token rows.

  Tower: square images of `image_size` pixels and `channels` channels cut
  into `patch_size` patches (a grid of g = image_size / patch_size per side,
  g * g patches), `n_layers` pre-norm encoder layers of width `d_model`,
  `n_heads` heads and an MLP of width `mlp_dim`; LayerNorm eps `norm_eps`.

  Projector: each `pool` x `pool` neighbourhood of patches is concatenated
  (width d_model * pool**2), then Linear -> GELU -> Linear into
  `lm_d_model`, the language model's width; the hidden width is
  `projector_dim` (default d_model * pool**2). An image becomes
  `tokens_per_image` = (g / pool)**2 embeddings.

  Rows: each image takes exactly `tokens_per_image` consecutive
  `image_token_id` placeholder tokens; a row holds at most `max_images`.
  """

  image_size: int
  patch_size: int
  d_model: int
  n_layers: int
  n_heads: int
  mlp_dim: int
  lm_d_model: int
  image_token_id: int
  channels: int = 3
  norm_eps: float = 1e-6
  pool: int = 2
  max_images: int = 1
  projector_dim: int | None = None
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # Rematerialise each encoder layer in the backward pass.
  remat: bool = False

  def __post_init__(self):
    for name in ("image_size", "patch_size", "d_model", "n_layers", "n_heads",
                 "mlp_dim", "lm_d_model", "channels", "pool", "max_images"):
      value = getattr(self, name)
      if isinstance(value, bool) or not isinstance(value, int) or value <= 0:
        raise ValueError(f"vision.{name} must be a positive integer, got "
                         f"{value!r}")
    if self.projector_dim is not None and (
        not isinstance(self.projector_dim, int) or self.projector_dim <= 0):
      raise ValueError(f"vision.projector_dim must be a positive integer or "
                       f"null, got {self.projector_dim!r}")
    if (isinstance(self.image_token_id, bool) or
        not isinstance(self.image_token_id, int) or self.image_token_id < 0):
      raise ValueError(f"vision.image_token_id must be a token id (>= 0), "
                       f"got {self.image_token_id!r}")
    if self.image_size % self.patch_size:
      raise ValueError(f"vision.image_size ({self.image_size}) must be "
                       f"divisible by vision.patch_size ({self.patch_size})")
    if self.grid % self.pool:
      raise ValueError(f"vision.pool ({self.pool}) must divide the patch "
                       f"grid vision.image_size / vision.patch_size = "
                       f"{self.grid}")
    if self.d_model % self.n_heads:
      raise ValueError(f"vision.d_model ({self.d_model}) must be divisible "
                       f"by vision.n_heads ({self.n_heads})")
    if not self.norm_eps > 0:
      raise ValueError(f"vision.norm_eps must be positive, got "
                       f"{self.norm_eps!r}")
    check_dtypes(self, "vision")

  @property
  def grid(self) -> int:
    """Patches per side."""
    return self.image_size // self.patch_size

  @property
  def n_patches(self) -> int:
    return self.grid * self.grid

  @property
  def head_dim(self) -> int:
    return self.d_model // self.n_heads

  @property
  def merged_dim(self) -> int:
    """Width of one pooled (pixel-shuffled) token: d_model * pool**2."""
    return self.d_model * self.pool * self.pool

  @property
  def projector_hidden(self) -> int:
    return self.projector_dim or self.merged_dim

  @property
  def tokens_per_image(self) -> int:
    return (self.grid // self.pool) ** 2

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "VisionConfig":
    """Builds from a config section, naming unknown keys."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown vision config keys: "
                       f"{['vision.' + k for k in unknown]}")
    required = [f.name for f in dataclasses.fields(cls)
                if f.default is dataclasses.MISSING]
    missing = [k for k in required if k not in values]
    if missing:
      raise ValueError(f"missing vision config keys: "
                       f"{['vision.' + k for k in missing]}")
    return cls(**dict(values))
