"""Model families: each Hugging Face architecture as data over the one
transformer (kimi_jax/model/transformer.py).

A `Family` says how its `config.json` maps onto `ModelConfig` (both ways)
and what its layer tensors are called. Reading a config.json takes the keys
every family shares here (sizes, norm epsilon, embeddings), then the
family's own: its attention biases or q/k norms, its rotary embedding, its
attention pattern. Writing is the inverse; `config_to_hf` checks that the
written config reads back as the same model, so a model the family cannot
express is refused rather than exported wrong.

Adding a family: the block features it needs as `ModelConfig` fields (with
defaults that leave the other families as they are) and their arithmetic in
transformer.py, then a `Family` here with its reader, writer and tensor
names, and a parity test against `transformers` (tests/test_hf_families.py).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable, Mapping

from kimi_jax.model import rope
from kimi_jax.model.config import FULL, SLIDING, ModelConfig


class HFCheckpointError(ValueError):
  """A Hugging Face checkpoint does not match what the model expects."""


QWEN2 = "Qwen2ForCausalLM"
LLAMA = "LlamaForCausalLM"
QWEN3 = "Qwen3ForCausalLM"
QWEN3_MOE = "Qwen3MoeForCausalLM"
GEMMA3 = "Gemma3ForCausalLM"

# Layer params every family has, with their HF names under
# model.layers.{i}. (biases only where the config has them).
_ATTENTION = (
    ("attn_norm", "input_layernorm.weight"),
    ("wq", "self_attn.q_proj.weight"),
    ("wk", "self_attn.k_proj.weight"),
    ("wv", "self_attn.v_proj.weight"),
    ("bq", "self_attn.q_proj.bias"),
    ("bk", "self_attn.k_proj.bias"),
    ("bv", "self_attn.v_proj.bias"),
    ("wo", "self_attn.o_proj.weight"),
)
_MLP = (
    ("w_gate", "mlp.gate_proj.weight"),
    ("w_up", "mlp.up_proj.weight"),
    ("w_down", "mlp.down_proj.weight"),
)
_QK_NORM = (
    ("q_norm", "self_attn.q_norm.weight"),
    ("k_norm", "self_attn.k_norm.weight"),
)
# Mixture-of-experts layers (kimi_jax/model/moe.py); {j} is the expert.
_EXPERTS = (
    ("router", "mlp.gate.weight"),
    ("expert_gate", "mlp.experts.{j}.gate_proj.weight"),
    ("expert_up", "mlp.experts.{j}.up_proj.weight"),
    ("expert_down", "mlp.experts.{j}.down_proj.weight"),
)
_LLAMA_NORMS = (("mlp_norm", "post_attention_layernorm.weight"),)
# Gemma's post_attention_layernorm norms the attention output; the MLP's
# pre-norm is pre_feedforward_layernorm.
_GEMMA_NORMS = (
    ("post_attn_norm", "post_attention_layernorm.weight"),
    ("mlp_norm", "pre_feedforward_layernorm.weight"),
    ("post_mlp_norm", "post_feedforward_layernorm.weight"),
)


@dataclasses.dataclass(frozen=True)
class Family:
  """One Hugging Face causal-LM architecture.

  architecture, model_type: its names in config.json. max_positions,
  head_dim, tie_embeddings: transformers' defaults for keys a config.json
  may omit (head_dim None: hidden_size / num_attention_heads).
  activation_key: where its MLP activation is named; activations: the
  names it may hold, as `ModelConfig.mlp_activation` values.
  layer_tensors: (our layer param, HF name under model.layers.{i}.).
  read(config, source, max_positions): its own ModelConfig fields (rotary
  embeddings included); write(cfg): its own config.json keys.
  """

  architecture: str
  model_type: str
  max_positions: int
  head_dim: int | None
  tie_embeddings: bool
  activation_key: str
  activations: Mapping[str, str]
  layer_tensors: tuple[tuple[str, str], ...]
  read: Callable[[Mapping[str, Any], str, int], dict[str, Any]]
  write: Callable[[ModelConfig], dict[str, Any]]


# ---------------------------------------------------------------------------
# Rotary embeddings in config.json

_DEFAULT_ROPE_THETA = 10000.0


def _rope_kind(section: Mapping[str, Any]) -> str:
  return section.get("rope_type", section.get("type")) or "default"


def rope_scaling_from_hf(section: Mapping[str, Any], max_positions: int,
                         where: str) -> rope.RopeScaling | None:
  """The RopeScaling of one HF rope section (None: unscaled), with the
  defaults transformers fills in."""
  kind = _rope_kind(section)
  if section.get("partial_rotary_factor") not in (None, 1, 1.0):
    raise HFCheckpointError(f"{where} has partial_rotary_factor "
                            f"{section['partial_rotary_factor']}; only "
                            f"full-width rotary embeddings are implemented")
  if kind == "default":
    return None
  if kind not in rope.ROPE_TYPES:
    raise HFCheckpointError(
        f"{where} has rope type {kind!r}; implemented: default, "
        f"{', '.join(rope.ROPE_TYPES)}")
  original = section.get("original_max_position_embeddings") or max_positions
  factor = section.get("factor")
  if factor is None and kind == "yarn":
    factor = max_positions / original
  if factor is None:
    raise HFCheckpointError(f"{where}: rope type {kind!r} needs a factor")
  fields: dict[str, Any] = {"rope_type": kind, "factor": float(factor)}
  if kind == "llama3":
    for key in ("low_freq_factor", "high_freq_factor"):
      if section.get(key) is None:
        raise HFCheckpointError(f"{where}: rope type 'llama3' needs {key}")
      fields[key] = float(section[key])
    fields["original_max_position_embeddings"] = int(original)
  if kind == "yarn":
    attention_factor = section.get("attention_factor")
    mscale, mscale_all = section.get("mscale"), section.get("mscale_all_dim")
    if attention_factor is None and mscale and mscale_all:
      attention_factor = (rope.yarn_mscale(factor, mscale) /
                          rope.yarn_mscale(factor, mscale_all))
    fields.update(
        original_max_position_embeddings=int(original),
        beta_fast=float(section.get("beta_fast") or 32.0),
        beta_slow=float(section.get("beta_slow") or 1.0),
        attention_factor=(None if attention_factor is None else
                          float(attention_factor)),
        truncate=bool(section.get("truncate", True)))
  try:
    return rope.RopeScaling(**fields)
  except ValueError as exc:
    raise HFCheckpointError(f"{where}: {exc}") from None


# The keys each rope type writes: those transformers reads for it (it warns
# about any other key, e.g. yarn's betas in a llama3 section).
_ROPE_KEYS = {
    "linear": ("factor",),
    "llama3": ("factor", "original_max_position_embeddings",
               "low_freq_factor", "high_freq_factor"),
    "yarn": ("factor", "original_max_position_embeddings", "beta_fast",
             "beta_slow", "attention_factor", "truncate"),
}


def _scaling_keys(scaling: rope.RopeScaling) -> dict[str, Any]:
  values = dataclasses.asdict(scaling)
  return {k: values[k] for k in ("rope_type",) + _ROPE_KEYS[
      scaling.rope_type] if values[k] is not None}


def rope_section(theta: float, scaling: rope.RopeScaling | None
                 ) -> dict[str, Any]:
  """A transformers 5 rope_parameters section."""
  out: dict[str, Any] = {"rope_type": "default", "rope_theta": theta}
  if scaling is not None:
    out.update(_scaling_keys(scaling))
  return out


def _scaling_section(scaling: rope.RopeScaling | None) -> dict[str, Any]:
  """rope_scaling as transformers 4.x reads it (empty when unscaled)."""
  if scaling is None:
    return {}
  return {"rope_scaling": _scaling_keys(scaling)}


def _one_rope(hf: Mapping[str, Any], max_positions: int, source: str
              ) -> dict[str, Any]:
  """rope_theta and rope_scaling of a family with one rope for all layers:
  from `rope_parameters` (transformers 5) or the top level and
  `rope_scaling` (4.x; a rope_scaling wins, as in transformers)."""
  params = hf.get("rope_parameters") or {}
  scaling = hf.get("rope_scaling") or {}
  section, where = ((scaling, "rope_scaling") if scaling else
                    (params, "rope_parameters"))
  thetas = {float(v) for v in (params.get("rope_theta"),
                               hf.get("rope_theta")) if v is not None}
  if len(thetas) > 1:
    raise HFCheckpointError(f"{source}: rope_theta and rope_parameters."
                            f"rope_theta disagree: {sorted(thetas)}")
  return {"rope_theta": thetas.pop() if thetas else _DEFAULT_ROPE_THETA,
          "rope_scaling": rope_scaling_from_hf(section, max_positions,
                                               f"{source}: {where}")}


def _write_one_rope(cfg: ModelConfig) -> dict[str, Any]:
  # Both spellings: transformers 4.x reads rope_theta (and rope_scaling),
  # 5.x rope_parameters.
  return {"rope_theta": cfg.rope_theta,
          "rope_parameters": rope_section(cfg.rope_theta, cfg.rope_scaling),
          **_scaling_section(cfg.rope_scaling)}


# ---------------------------------------------------------------------------
# Llama, Qwen2, Qwen3


def _no_sliding(hf: Mapping[str, Any], source: str, arch: str) -> None:
  if hf.get("use_sliding_window"):
    raise HFCheckpointError(f"{source}: {arch} with use_sliding_window=true "
                            f"is not supported")


def _no_attention_bias(hf: Mapping[str, Any], source: str, arch: str) -> None:
  if hf.get("attention_bias"):
    # Their attention_bias also adds an o_proj bias, which we don't have.
    raise HFCheckpointError(
        f"{source}: {arch} with attention_bias=true (biases on q/k/v and "
        f"o_proj) is not supported; the model has q/k/v biases only")


def _read_llama(hf, source, max_positions):
  _no_attention_bias(hf, source, LLAMA)
  return _one_rope(hf, max_positions, source)


def _read_qwen2(hf, source, max_positions):
  _no_sliding(hf, source, QWEN2)
  return {"qkv_bias": True, **_one_rope(hf, max_positions, source)}


def _read_qwen3(hf, source, max_positions):
  _no_sliding(hf, source, QWEN3)
  _no_attention_bias(hf, source, QWEN3)
  return {"qk_norm": True, **_one_rope(hf, max_positions, source)}


def _read_qwen3_moe(hf, source, max_positions):
  _no_sliding(hf, source, QWEN3_MOE)
  _no_attention_bias(hf, source, QWEN3_MOE)
  n_layers = int(hf["num_hidden_layers"])
  # transformers 5 writes num_experts as num_local_experts.
  n_experts = int(hf.get("num_experts", hf.get("num_local_experts", 0)) or 0)
  step = int(hf.get("decoder_sparse_step", 1) or 1)
  only_mlp = {int(i) for i in hf.get("mlp_only_layers") or ()}
  bad = sorted(i for i in only_mlp if not 0 <= i < n_layers)
  if bad:
    raise HFCheckpointError(f"{source}: mlp_only_layers {bad} are not layer "
                            f"indices below num_hidden_layers={n_layers}")
  out = {"qk_norm": True, **_one_rope(hf, max_positions, source)}
  if not n_experts:
    return out
  # As transformers builds the layers: sparse unless listed in
  # mlp_only_layers or skipped by decoder_sparse_step.
  dense = tuple(i for i in range(n_layers)
                if i in only_mlp or (i + 1) % step)
  for key in ("num_experts_per_tok", "moe_intermediate_size"):
    if hf.get(key) is None:
      raise HFCheckpointError(f"{source}: missing required key {key!r}")
  return dict(out, n_experts=n_experts,
              n_experts_per_token=int(hf["num_experts_per_tok"]),
              expert_mlp_dim=int(hf["moe_intermediate_size"]),
              norm_topk_prob=bool(hf.get("norm_topk_prob", False)),
              dense_layers=dense)


def _write_qwen3_moe(cfg):
  return dict(_write_qwen3(cfg), num_experts=cfg.n_experts,
              num_experts_per_tok=cfg.n_experts_per_token,
              moe_intermediate_size=cfg.expert_mlp_dim,
              norm_topk_prob=cfg.norm_topk_prob,
              mlp_only_layers=list(cfg.dense_layers), decoder_sparse_step=1,
              output_router_logits=False)


def _write_llama(cfg):
  return {"hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
          **_write_one_rope(cfg)}


def _write_qwen2(cfg):
  return {"hidden_act": "silu", "use_sliding_window": False,
          **_write_one_rope(cfg)}


def _write_qwen3(cfg):
  return {"hidden_act": "silu", "attention_bias": False,
          "use_sliding_window": False, **_write_one_rope(cfg)}


# ---------------------------------------------------------------------------
# Gemma 3 (text)

_GEMMA3_THETAS = {FULL: 1_000_000.0, SLIDING: 10_000.0}


def _gemma3_layer_types(hf: Mapping[str, Any]) -> tuple[str, ...]:
  if hf.get("layer_types"):
    return tuple(hf["layer_types"])
  pattern = hf.get("sliding_window_pattern",
                   hf.get("_sliding_window_pattern", 6))
  return tuple(SLIDING if (i + 1) % pattern else FULL
               for i in range(int(hf["num_hidden_layers"])))


def _gemma3_ropes(hf: Mapping[str, Any], max_positions: int, source: str
                  ) -> dict[str, Any]:
  """Both ropes: rope_parameters nested by layer type (transformers 5), or
  rope_theta, rope_local_base_freq and rope_scaling (4.x); a rope_scaling
  applies to the full-attention layers, as in transformers."""
  params = hf.get("rope_parameters") or {}
  nested = (params if FULL in params or SLIDING in params else
            {FULL: params})
  full = dict(nested.get(FULL) or {})
  full.update(hf.get("rope_scaling") or {})
  sliding = nested.get(SLIDING) or {}
  if _rope_kind(sliding) != "default":
    raise HFCheckpointError(
        f"{source}: rope_parameters.{SLIDING} has rope type "
        f"{_rope_kind(sliding)!r}; sliding layers use unscaled rotary "
        f"embeddings only")
  return {
      "rope_theta": float(full.get("rope_theta") or hf.get("rope_theta") or
                          _GEMMA3_THETAS[FULL]),
      "rope_scaling": rope_scaling_from_hf(
          full, max_positions, f"{source}: rope_parameters.{FULL}"),
      "sliding_rope_theta": float(
          sliding.get("rope_theta") or hf.get("rope_local_base_freq") or
          _GEMMA3_THETAS[SLIDING]),
  }


def _read_gemma3(hf, source, max_positions):
  _no_attention_bias(hf, source, GEMMA3)
  if hf.get("use_bidirectional_attention"):
    raise HFCheckpointError(f"{source}: {GEMMA3} with "
                            f"use_bidirectional_attention=true is not "
                            f"supported (the policy is causal)")
  if hf.get("attn_logit_softcapping") is not None:
    raise HFCheckpointError(
        f"{source}: attn_logit_softcapping="
        f"{hf['attn_logit_softcapping']} is not supported (only None, "
        f"Gemma 3's default)")
  layer_types = _gemma3_layer_types(hf)
  window = hf.get("sliding_window", 4096)
  if SLIDING in layer_types and not window:
    raise HFCheckpointError(f"{source}: sliding_attention layers need a "
                            f"sliding_window")
  softcap = hf.get("final_logit_softcapping")
  return {
      "qk_norm": True, "norm_offset": 1.0, "post_norms": True,
      "embed_scale": True,
      "query_pre_attn_scalar": float(hf.get("query_pre_attn_scalar", 256)),
      "final_logit_softcap": None if softcap is None else float(softcap),
      "layer_types": layer_types,
      "sliding_window": int(window) if window else None,
      **_gemma3_ropes(hf, max_positions, source),
  }


def _whole(x: float) -> float | int:
  """x as an int when it is one (transformers types some keys as int)."""
  return int(x) if float(x).is_integer() else x


def _write_gemma3(cfg):
  sliding_theta = cfg.sliding_rope_theta or cfg.rope_theta
  out = {
      "hidden_activation": "gelu_pytorch_tanh",
      "query_pre_attn_scalar": _whole(cfg.query_pre_attn_scalar or
                                      cfg.head_dim),
      "final_logit_softcapping": cfg.final_logit_softcap,
      "attn_logit_softcapping": None,
      "sliding_window": cfg.sliding_window,
      "layer_types": list(cfg.layer_kinds),
      "attention_bias": False, "use_bidirectional_attention": False,
      "rope_parameters": {
          FULL: rope_section(cfg.rope_theta, cfg.rope_scaling),
          SLIDING: rope_section(sliding_theta, None)},
      # transformers 4.x spellings
      "rope_theta": cfg.rope_theta, "rope_local_base_freq": sliding_theta,
      **_scaling_section(cfg.rope_scaling),
  }
  return out


# ---------------------------------------------------------------------------

FAMILIES: dict[str, Family] = {f.architecture: f for f in (
    Family(QWEN2, "qwen2", 32768, None, False, "hidden_act",
           {"silu": "silu"}, _ATTENTION + _LLAMA_NORMS + _MLP,
           _read_qwen2, _write_qwen2),
    Family(LLAMA, "llama", 2048, None, False, "hidden_act",
           {"silu": "silu"}, _ATTENTION + _LLAMA_NORMS + _MLP,
           _read_llama, _write_llama),
    Family(QWEN3, "qwen3", 32768, 128, False, "hidden_act",
           {"silu": "silu"}, _ATTENTION + _QK_NORM + _LLAMA_NORMS + _MLP,
           _read_qwen3, _write_qwen3),
    Family(QWEN3_MOE, "qwen3_moe", 32768, 128, False, "hidden_act",
           {"silu": "silu"},
           _ATTENTION + _QK_NORM + _LLAMA_NORMS + _MLP + _EXPERTS,
           _read_qwen3_moe, _write_qwen3_moe),
    Family(GEMMA3, "gemma3_text", 131_072, 256, True, "hidden_activation",
           {"gelu_pytorch_tanh": "gelu_tanh"},
           _ATTENTION + _QK_NORM + _GEMMA_NORMS + _MLP,
           _read_gemma3, _write_gemma3),
)}


def default_architecture(cfg: ModelConfig) -> str:
  """The family a ModelConfig looks like (export's default)."""
  if cfg.n_experts:
    return QWEN3_MOE
  if cfg.norm_offset or cfg.post_norms or cfg.embed_scale or cfg.windowed:
    return GEMMA3
  if cfg.qk_norm:
    return QWEN3
  return QWEN2 if cfg.qkv_bias else LLAMA


# ModelConfig fields that describe the computation (what a checkpoint
# fixes); the rest are run settings and implementation choices.
ARCHITECTURE_FIELDS = (
    "vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads", "head_dim",
    "mlp_dim", "rope_theta", "norm_eps", "tie_embeddings", "qkv_bias",
    "qk_norm", "norm_offset", "post_norms", "mlp_activation", "embed_scale",
    "query_pre_attn_scalar", "final_logit_softcap", "rope_scaling",
    "layer_types", "sliding_window", "sliding_rope_theta", "n_experts",
    "n_experts_per_token", "expert_mlp_dim", "norm_topk_prob",
    "dense_layers")


def architecture_of(cfg: ModelConfig) -> dict[str, Any]:
  """The architecture fields, normalised so that equal computations
  compare equal (layer kinds spelled out; the window and the sliding rope
  only where a layer slides; the attention scale as a number)."""
  out = {f: getattr(cfg, f) for f in ARCHITECTURE_FIELDS}
  out["layer_types"] = cfg.layer_kinds
  out["query_pre_attn_scalar"] = float(cfg.query_pre_attn_scalar or
                                       cfg.head_dim)
  if cfg.windowed:
    out["sliding_rope_theta"] = cfg.sliding_rope_theta or cfg.rope_theta
  else:
    out["sliding_window"] = out["sliding_rope_theta"] = None
  return out
