"""Typed, frozen configuration of the policy transformer."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kimi_jax.infra.dtypes import NamedDtypes, check_dtypes
from kimi_jax.vision import projector, tower
from kimi_jax.vision.config import VisionConfig


@dataclasses.dataclass(frozen=True)
class ModelConfig(NamedDtypes):
  """A decoder-only transformer of the Llama / Qwen2 family.

  Qwen2 differs from Llama only by `qkv_bias=True` (and usually tied
  embeddings on the small sizes); both use RMSNorm, rotary embeddings,
  grouped-query attention and a SwiGLU MLP.
  """

  vocab_size: int
  d_model: int
  n_layers: int
  n_heads: int
  n_kv_heads: int
  head_dim: int
  mlp_dim: int
  rope_theta: float = 1_000_000.0
  norm_eps: float = 1e-6
  tie_embeddings: bool = False
  qkv_bias: bool = False
  max_seq_len: int = 4096
  param_dtype: str = "float32"
  compute_dtype: str = "float32"
  # Rematerialise each layer in the backward pass (memory for compute).
  remat: bool = False
  # Run the layers of the cache-free path (training, reference and
  # evaluation log-probs) in a lax.scan (True: compile time independent of
  # depth, the memory plan's assumption) or unrolled (False: no stacked
  # residual buffers to fill and slice, faster for shallow models, but
  # XLA may keep more temporaries alive; docs/speed.md). Prefill and
  # decoding are unaffected.
  scan_layers: bool = True
  # Attention of the training path and the prefill (kimi_jax/model/
  # attention.py): "dot" (dense T x T), "blockwise" (online softmax, plain
  # JAX), "splash" (Pallas TPU kernel), "auto" (splash on TPU, else
  # blockwise). attention_block: query/key block length of the latter two.
  attention: str = "auto"
  attention_block: int = 512
  # Log-probs of targets are computed this many positions at a time
  # (kimi_jax/model/logprobs.py), so B x T x V logits never exist at once.
  logprob_chunk: int = 1024
  # A vision tower and projector (kimi_jax/vision): images enter token rows
  # at `vision.image_token_id` placeholders. None: a text-only model. A
  # config section (mapping) is typed here; `lm_d_model` defaults to
  # `d_model`.
  vision: VisionConfig | None = None

  def __post_init__(self):
    if self.vision is not None and not isinstance(self.vision, VisionConfig):
      section = dict(self.vision.items())
      section.setdefault("lm_d_model", self.d_model)
      object.__setattr__(self, "vision", VisionConfig.from_mapping(section))
    if self.vision is not None:
      if self.vision.lm_d_model != self.d_model:
        raise ValueError(f"model.vision.lm_d_model ({self.vision.lm_d_model})"
                         f" must equal model.d_model ({self.d_model})")
      if self.vision.image_token_id >= self.vocab_size:
        raise ValueError(f"model.vision.image_token_id "
                         f"({self.vision.image_token_id}) is not a token id "
                         f"below model.vocab_size ({self.vocab_size})")
    for name in ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
                 "head_dim", "mlp_dim", "max_seq_len"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got "
                         f"{getattr(self, name)}")
    if self.n_heads % self.n_kv_heads:
      raise ValueError(f"model.n_heads ({self.n_heads}) must be a multiple of "
                       f"model.n_kv_heads ({self.n_kv_heads})")
    if self.head_dim % 2:
      raise ValueError(f"model.head_dim must be even for rotary embeddings, "
                       f"got {self.head_dim}")
    check_dtypes(self, "model")
    attentions = ("dot", "blockwise", "splash", "auto")
    if self.attention not in attentions:
      raise ValueError(f"model.attention must be one of {attentions}, got "
                       f"{self.attention!r}")
    for name in ("attention_block", "logprob_chunk"):
      if getattr(self, name) <= 0:
        raise ValueError(f"model.{name} must be positive, got "
                         f"{getattr(self, name)}")
    if self.rope_theta <= 0:
      raise ValueError(f"model.rope_theta must be positive, got "
                       f"{self.rope_theta}")

  @classmethod
  def from_mapping(cls, values: Mapping[str, Any]) -> "ModelConfig":
    """Builds from a config section, naming unknown keys."""
    known = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(values) - known)
    if unknown:
      raise ValueError(f"unknown model config keys: {unknown}")
    return cls(**dict(values))


def count_params(cfg: ModelConfig) -> int:
  """Number of parameters, computed from the shapes alone."""
  d, h, k, hd, f = (cfg.d_model, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim,
                    cfg.mlp_dim)
  attn = d * h * hd + 2 * d * k * hd + h * hd * d
  if cfg.qkv_bias:
    attn += h * hd + 2 * k * hd
  per_layer = attn + 3 * d * f + 2 * d
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
  return cfg.n_layers * per_layer + embed + d + count_vision_params(cfg)


def count_vision_params(cfg: ModelConfig) -> int:
  """Parameters of the vision tower and projector (0 without vision)."""
  if cfg.vision is None:
    return 0
  import math
  shapes = (list(_leaves(tower.param_shapes(cfg.vision))) +
            list(_leaves(projector.param_shapes(cfg.vision))))
  return sum(math.prod(s) for s in shapes)


def _leaves(tree: Mapping[str, Any]):
  for value in tree.values():
    if isinstance(value, Mapping):
      yield from _leaves(value)
    else:
      yield value
