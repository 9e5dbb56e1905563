"""Typed, frozen configuration of the policy transformer."""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kimi_jax.infra.dtypes import (NamedDtypes, check_dtypes,
                                   check_matmul_dtype)
from kimi_jax.model.rope import RopeScaling
from kimi_jax.vision import projector, tower
from kimi_jax.vision.config import VisionConfig

# Attention kinds of `ModelConfig.layer_types` (Hugging Face's names).
FULL = "full_attention"
SLIDING = "sliding_attention"
MLP_ACTIVATIONS = ("silu", "gelu_tanh")


@dataclasses.dataclass(frozen=True)
class ModelConfig(NamedDtypes):
  """A decoder-only transformer: pre-norm blocks of grouped-query attention
  with rotary embeddings and a gated MLP.

  The families differ by data, not code (kimi_jax/model/hf.py maps their
  Hugging Face configs): Llama is the defaults; Qwen2 adds `qkv_bias`;
  Qwen3 `qk_norm` (and a head_dim of its own); Llama 3.1 and long-context
  Qwen a `rope_scaling`; Gemma 3 `norm_offset=1`, `post_norms`,
  `mlp_activation="gelu_tanh"`, `embed_scale`, `query_pre_attn_scalar` and
  interleaved sliding-window layers (`layer_types`, `sliding_window`,
  `sliding_rope_theta`). Every new field defaults to what the model did
  before it existed.
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
  # The dtype the weight matmuls (projections, MLP and experts, the
  # unembedding) round their inputs to, accumulating in compute_dtype; the
  # weight matrices are rounded to it wherever they are read (the input
  # embedding too, so a tied table reads the same everywhere). "": the
  # compute dtype. The sampler sets it from `sampler.matmul_dtype`.
  matmul_dtype: str = ""
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
  # Family features (see the class doc). qk_norm: RMSNorm over each query
  # and key head before the rotary embedding. norm_offset: every RMSNorm
  # scales by (norm_offset + weight), in float32 when nonzero (Gemma's
  # zero-centred weights). post_norms: RMSNorms on the attention and MLP
  # outputs before each residual add. mlp_activation: the gate's "silu"
  # (SwiGLU) or "gelu_tanh" (GeGLU, tanh approximation). embed_scale:
  # token embeddings times sqrt(d_model), in the compute dtype.
  # query_pre_attn_scalar: attention scores scale by its inverse square
  # root (None: head_dim's). final_logit_softcap: logits become
  # cap * tanh(logits / cap) (None: none).
  qk_norm: bool = False
  norm_offset: float = 0.0
  post_norms: bool = False
  mlp_activation: str = "silu"
  embed_scale: bool = False
  query_pre_attn_scalar: float | None = None
  final_logit_softcap: float | None = None
  # Rotary scaling of the full-attention layers (a `RopeScaling` or its
  # mapping); None: unscaled.
  rope_scaling: RopeScaling | None = None
  # Attention kind of each layer: FULL or SLIDING (None: all FULL). A
  # sliding layer's query at position p sees keys in (p - sliding_window,
  # p] and rotates with base sliding_rope_theta (None: rope_theta),
  # unscaled; the sampler keeps only a sliding_window ring of its keys.
  layer_types: tuple[str, ...] | None = None
  sliding_window: int | None = None
  sliding_rope_theta: float | None = None
  # Mixture of experts (Qwen3-MoE; kimi_jax/model/moe.py). n_experts > 0
  # replaces the MLP of every layer not in `dense_layers` by
  # n_experts SwiGLU experts of width expert_mlp_dim, of which a router
  # picks n_experts_per_token per token (softmax over experts, top-k, the
  # k weights renormalised to sum 1 with norm_topk_prob). dense_layers keep
  # the dense MLP of width mlp_dim. 0: a dense model.
  n_experts: int = 0
  n_experts_per_token: int = 0
  expert_mlp_dim: int = 0
  norm_topk_prob: bool = False
  dense_layers: tuple[int, ...] = ()
  # Weight of the load-balancing (Switch) loss added to a training loss of
  # an MoE model (a run setting; 0: none, RL's default).
  router_aux_loss_coef: float = 0.0

  def __post_init__(self):
    if self.rope_scaling is not None and not isinstance(self.rope_scaling,
                                                        RopeScaling):
      object.__setattr__(self, "rope_scaling", RopeScaling.from_mapping(
          dict(self.rope_scaling.items())))
    if self.layer_types is not None and not isinstance(self.layer_types,
                                                       tuple):
      object.__setattr__(self, "layer_types", tuple(self.layer_types))
    if not isinstance(self.dense_layers, tuple):
      object.__setattr__(self, "dense_layers",
                         tuple(int(i) for i in self.dense_layers))
    self._check_family_fields()
    self._check_experts()
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
    check_matmul_dtype(self.matmul_dtype, "model.matmul_dtype",
                       self.compute_dtype)
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

  def _check_family_fields(self) -> None:
    if self.mlp_activation not in MLP_ACTIVATIONS:
      raise ValueError(f"model.mlp_activation must be one of "
                       f"{MLP_ACTIVATIONS}, got {self.mlp_activation!r}")
    for name in ("query_pre_attn_scalar", "final_logit_softcap",
                 "sliding_window", "sliding_rope_theta"):
      value = getattr(self, name)
      if value is not None and not value > 0:
        raise ValueError(f"model.{name} must be positive or None, got "
                         f"{value}")
    if self.layer_types is None:
      return
    if len(self.layer_types) != self.n_layers:
      raise ValueError(f"model.layer_types has {len(self.layer_types)} "
                       f"entries for model.n_layers={self.n_layers}")
    bad = sorted(set(self.layer_types) - {FULL, SLIDING})
    if bad:
      raise ValueError(f"model.layer_types: unknown kinds {bad}; each is "
                       f"{FULL!r} or {SLIDING!r}")
    if SLIDING in self.layer_types and self.sliding_window is None:
      raise ValueError(f"model.layer_types has {SLIDING!r} layers but "
                       f"model.sliding_window is None")

  def _check_experts(self) -> None:
    if self.router_aux_loss_coef < 0:
      raise ValueError(f"model.router_aux_loss_coef must be >= 0, got "
                       f"{self.router_aux_loss_coef}")
    if self.n_experts < 0:
      raise ValueError(f"model.n_experts must be >= 0, got {self.n_experts}")
    if not self.n_experts:
      if self.dense_layers:
        raise ValueError("model.dense_layers is set but model.n_experts is "
                         "0 (every layer is dense)")
      return
    if not 1 <= self.n_experts_per_token <= self.n_experts:
      raise ValueError(f"model.n_experts_per_token must be in [1, "
                       f"model.n_experts={self.n_experts}], got "
                       f"{self.n_experts_per_token}")
    if self.expert_mlp_dim <= 0:
      raise ValueError(f"model.expert_mlp_dim must be positive with "
                       f"experts, got {self.expert_mlp_dim}")
    if self.mlp_activation != "silu":
      raise ValueError("model.n_experts > 0 needs mlp_activation='silu' "
                       "(SwiGLU experts)")
    if self.windowed:
      raise ValueError("model.n_experts > 0 with sliding-window layers is "
                       "not implemented")
    layers = self.dense_layers
    if (list(layers) != sorted(set(layers)) or
        any(not 0 <= i < self.n_layers for i in layers)):
      raise ValueError(f"model.dense_layers must be distinct increasing "
                       f"layer indices below n_layers={self.n_layers}, got "
                       f"{layers}")

  @property
  def sparse_kinds(self) -> tuple[bool, ...]:
    """Whether each layer's MLP is a mixture of experts."""
    return tuple(bool(self.n_experts) and i not in self.dense_layers
                 for i in range(self.n_layers))

  @property
  def moe_layers(self) -> tuple[int, ...]:
    """Indices of the mixture-of-experts layers."""
    return tuple(i for i, s in enumerate(self.sparse_kinds) if s)

  @property
  def layer_kinds(self) -> tuple[str, ...]:
    """The attention kind of every layer (FULL or SLIDING)."""
    return self.layer_types or (FULL,) * self.n_layers

  @property
  def windowed(self) -> bool:
    """Whether some layer attends over a sliding window."""
    return SLIDING in self.layer_kinds

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
  if cfg.qk_norm:
    attn += 2 * hd
  per_layer = attn + (4 if cfg.post_norms else 2) * d
  n_moe = len(cfg.moe_layers)
  experts = n_moe * (d * cfg.n_experts +
                     3 * cfg.n_experts * d * cfg.expert_mlp_dim)
  mlp = (cfg.n_layers - n_moe) * 3 * d * f
  embed = cfg.vocab_size * d * (1 if cfg.tie_embeddings else 2)
  return (cfg.n_layers * per_layer + mlp + experts + embed + d +
          count_vision_params(cfg))


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
