"""The policy: a functional decoder-only transformer (Llama, Qwen2, Qwen3,
Qwen3-MoE, Gemma 3: the families differ by `ModelConfig` fields, see its
doc; the mixture-of-experts MLP is kimi_jax/model/moe.py).

Parameters are a plain pytree of arrays passed in; layers are stacked along a
leading `layers` axis and run with `lax.scan`, so compile time does not grow
with depth. Nothing here calls `jit`: callers jit with their own shardings.

Layers of two attention kinds (`ModelConfig.layer_types`) share the scan:
each layer's kind is a scanned flag that picks its rotary frequencies and,
through `lax.cond`, its attention (full or sliding window). Cached decoding
keeps full-attention layers in `KVCache.k`/`v` and sliding layers in ring
buffers of `sliding_window` entries (`KVCache.local_k`/`local_v`).

Shapes in names: B batch, T new tokens, S cache length, D model width,
H query heads, K key/value heads, G = H // K, Dh head dim, F MLP width,
V vocabulary, L layers.
"""

from __future__ import annotations

import math
from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kimi_jax.model import attention, moe, rope
from kimi_jax.model.config import FULL, SLIDING, ModelConfig
from kimi_jax.model.projection import project, weight_operands
from kimi_jax import sharding as sharding_lib
from kimi_jax.sharding import Sharder, constrain, tree_param_shardings
from kimi_jax.vision import merge, projector, tower

Params = dict[str, Any]


class KVCache(NamedTuple):
  """Per-slot key/value cache.

  k_LxBxSxKxDh, v_LxBxSxKxDh: cached keys and values (compute dtype).
  lengths_B: how many cache entries of each row are valid; the next token of
    row b is written at index lengths_B[b].
  A model with sliding-window layers (`cfg.windowed`) keeps only its
  full-attention layers in k and v (in layer order) and its sliding layers
  in local_k, local_v: Ls x B x R x K x Dh ring buffers, R =
  min(sliding_window, S), cache index c at entry c % R (None otherwise).
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array
  local_k: jax.Array | None = None
  local_v: jax.Array | None = None


CACHE_LOGICAL = ("layers", "batch", "length", "kv_heads", "head_dim")


def param_logical_axes(cfg: ModelConfig) -> Params:
  """Logical axis names of every parameter, same tree as the params."""
  layers = {
      "attn_norm": ("layers", "norm"),
      "wq": ("layers", "embed", "heads", "head_dim"),
      "wk": ("layers", "embed", "kv_heads", "head_dim"),
      "wv": ("layers", "embed", "kv_heads", "head_dim"),
      "wo": ("layers", "heads", "head_dim", "embed"),
      "mlp_norm": ("layers", "norm"),
      "w_gate": ("layers", "embed", "mlp"),
      "w_up": ("layers", "embed", "mlp"),
      "w_down": ("layers", "mlp", "embed"),
  }
  if cfg.qkv_bias:
    layers["bq"] = ("layers", "heads", "head_dim")
    layers["bk"] = ("layers", "kv_heads", "head_dim")
    layers["bv"] = ("layers", "kv_heads", "head_dim")
  if cfg.qk_norm:
    layers["q_norm"] = ("layers", "norm")
    layers["k_norm"] = ("layers", "norm")
  if cfg.post_norms:
    layers["post_attn_norm"] = ("layers", "norm")
    layers["post_mlp_norm"] = ("layers", "norm")
  if cfg.n_experts:
    layers.update(moe.layer_logical_axes())
    if not moe.has_dense_mlp(cfg):
      for name in moe.DENSE_MLP_PARAMS:
        del layers[name]
  params = {"embed": ("vocab", "embed"), "layers": layers,
            "final_norm": ("norm",)}
  if not cfg.tie_embeddings:
    params["lm_head"] = ("embed", "vocab")
  if cfg.vision is not None:
    params["vision"] = tower.param_logical_axes(cfg.vision)
    params["projector"] = projector.param_logical_axes(cfg.vision)
  return params


def param_shapes(cfg: ModelConfig) -> Params:
  """Shape of every parameter, same tree as the params."""
  params = _text_param_shapes(cfg)
  if cfg.vision is not None:
    params["vision"] = tower.param_shapes(cfg.vision)
    params["projector"] = projector.param_shapes(cfg.vision)
  return params


def _text_param_shapes(cfg: ModelConfig) -> Params:
  L, D, H, K, Dh, F, V = (cfg.n_layers, cfg.d_model, cfg.n_heads,
                          cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim,
                          cfg.vocab_size)
  layers = {
      "attn_norm": (L, D), "wq": (L, D, H, Dh), "wk": (L, D, K, Dh),
      "wv": (L, D, K, Dh), "wo": (L, H, Dh, D), "mlp_norm": (L, D),
      "w_gate": (L, D, F), "w_up": (L, D, F), "w_down": (L, F, D),
  }
  if cfg.qkv_bias:
    layers.update(bq=(L, H, Dh), bk=(L, K, Dh), bv=(L, K, Dh))
  if cfg.qk_norm:
    layers.update(q_norm=(L, Dh), k_norm=(L, Dh))
  if cfg.post_norms:
    layers.update(post_attn_norm=(L, D), post_mlp_norm=(L, D))
  if cfg.n_experts:
    layers.update(moe.layer_param_shapes(cfg))
    if not moe.has_dense_mlp(cfg):
      for name in moe.DENSE_MLP_PARAMS:
        del layers[name]
  params = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not cfg.tie_embeddings:
    params["lm_head"] = (D, V)
  return params


# The text model's weight matrices, which `cfg.matmul_dtype` rounds (the
# router's stays in the compute dtype: routing follows small differences).
MATMUL_WEIGHTS = frozenset({"embed", "lm_head", "wq", "wk", "wv", "wo",
                            "w_gate", "w_up", "w_down", "expert_gate",
                            "expert_up", "expert_down"})


def round_weights(params: Params, cfg: ModelConfig) -> Params:
  """params with the text model's weight matrices stored in
  `cfg.matmul_dtype` (the rest as they are): the model rounds them so as it
  reads them, so its results do not change, and a decode loop given these
  does not round them again at every step. Without a matmul dtype of its
  own, params as they are."""
  mm = cfg.matmul_jnp_dtype
  if not cfg.matmul_dtype or mm == cfg.compute_jnp_dtype:
    return params
  cast = lambda d: {k: v.astype(mm) if k in MATMUL_WEIGHTS else v
                    for k, v in d.items()}
  return {**cast(params), "layers": cast(params["layers"])}


def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02
                ) -> Params:
  """Random init: normal(std) matrices, unit norms (scale norm_offset +
  weight: weights 1 - norm_offset), zero biases. The
  language model's draws do not depend on whether a vision tower is there;
  the tower and projector draw from keys folded from `rng`."""
  params = _init_text_params(cfg, rng, std)
  if cfg.vision is not None:
    params["vision"] = tower.init_params(cfg.vision,
                                         jax.random.fold_in(rng, 1), std)
    params["projector"] = projector.init_params(
        cfg.vision, jax.random.fold_in(rng, 2), std)
  return params


def _init_text_params(cfg: ModelConfig, rng: jax.Array, std: float
                      ) -> Params:
  shapes = _text_param_shapes(cfg)
  flat, treedef = jax.tree_util.tree_flatten_with_path(
      shapes, is_leaf=lambda x: isinstance(x, tuple))
  keys = jax.random.split(rng, len(flat))
  leaves = []
  for (path, shape), key in zip(flat, keys):
    name = jax.tree_util.keystr(path)
    if "norm" in name:
      leaf = jnp.full(shape, 1.0 - cfg.norm_offset, cfg.param_jnp_dtype)
    elif name.endswith("['bq']") or name.endswith("['bk']") or name.endswith(
        "['bv']"):
      leaf = jnp.zeros(shape, cfg.param_jnp_dtype)
    else:
      leaf = (std * jax.random.normal(key, shape, jnp.float32)).astype(
          cfg.param_jnp_dtype)
    leaves.append(leaf)
  params = jax.tree_util.tree_unflatten(treedef, leaves)
  params["layers"] = moe.zero_unused(cfg, params["layers"])
  return params


def abstract_params(cfg: ModelConfig) -> Params:
  return jax.eval_shape(lambda: init_params(cfg, jax.random.key(0)))


def param_shardings(cfg: ModelConfig, sharder: Sharder) -> Params:
  """NamedShardings of every parameter; raises naming any that can't divide."""
  return tree_param_shardings(sharder, abstract_params(cfg),
                              param_logical_axes(cfg))


def init_sharded(cfg: ModelConfig, seed: int, sharder: Sharder,
                 std: float = 0.02) -> Params:
  """Creates params directly in their shardings: no device holds them all.

  The key is `jax.random.key(seed)`, made inside the jitted init.
  """
  return sharding_lib.init_sharded(
      lambda key: init_params(cfg, key, std), param_logical_axes(cfg),
      sharder, seed)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  """An empty cache of `length` entries per row (see `KVCache`)."""
  dt = cfg.compute_jnp_dtype
  lengths = jnp.zeros((batch,), jnp.int32)
  n_full = cfg.layer_kinds.count(FULL)
  # Without full layers the (empty) stack has no length either, as
  # `from_decode_cache` rebuilds it.
  zeros = jnp.zeros((n_full, batch, length if n_full else 0, cfg.n_kv_heads,
                     cfg.head_dim), dt)
  if not cfg.windowed:
    return KVCache(k=zeros, v=zeros, lengths=lengths)
  ring = jnp.zeros((cfg.n_layers - n_full, batch, ring_length(cfg, length),
                    cfg.n_kv_heads, cfg.head_dim), dt)
  return KVCache(k=zeros, v=zeros, lengths=lengths, local_k=ring,
                 local_v=ring)


def ring_length(cfg: ModelConfig, length: int) -> int:
  """Entries of a sliding layer's ring in a cache of `length` entries."""
  return min(cfg.sliding_window, length)


def cache_shardings(cfg: ModelConfig, sharder: Sharder, batch: int,
                    length: int, what: str = "KV cache") -> KVCache:
  """NamedShardings of `init_cache(cfg, batch, length)`: rows over the
  batch axes, kv heads over `tensor`; raises ShardingError naming `what`
  when they cannot divide."""
  cache = jax.eval_shape(lambda: init_cache(cfg, batch, length))
  kv = lambda name, x: None if x is None else sharder.param_sharding(
      f"{what}.{name}", x.shape, CACHE_LOGICAL)
  return KVCache(k=kv("k", cache.k), v=kv("v", cache.v),
                 lengths=sharder.param_sharding(f"{what}.lengths", (batch,),
                                                ("batch",)),
                 local_k=kv("local_k", cache.local_k),
                 local_v=kv("local_v", cache.local_v))


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float,
             offset: float = 0.0) -> jax.Array:
  """RMSNorm over the last axis, scaled by `offset + scale_D`: without an
  offset in x's dtype (Llama), with one in float32 (Gemma)."""
  x32 = x_BxTxD.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) +
                               eps)
  shape = (1,) * (x_BxTxD.ndim - 1) + scale_D.shape
  if offset:
    scale32 = offset + scale_D.astype(jnp.float32).reshape(shape)
    return (normed * scale32).astype(x_BxTxD.dtype)
  scale = scale_D.astype(x_BxTxD.dtype).reshape(shape)
  return normed.astype(x_BxTxD.dtype) * scale


def _norm(x, scale, cfg: ModelConfig) -> jax.Array:
  return rms_norm(x, scale, cfg.norm_eps, cfg.norm_offset)


def _attn_scale(cfg: ModelConfig) -> float | None:
  """The attention scores' scale (None: 1 / sqrt(head_dim))."""
  if cfg.query_pre_attn_scalar is None:
    return None
  return cfg.query_pre_attn_scalar ** -0.5


# ---- attention kinds ------------------------------------------------------
#
# A layer's kind is `sliding`: a Python bool where it is known when tracing
# (a model of one kind, unrolled layers) or a traced bool scalar (scanned
# layers of a model with both kinds).


def _rope_of_kind(cfg: ModelConfig, sliding: bool):
  """(inverse frequencies, cos/sin scale or None) of one layer kind."""
  if sliding:
    theta = cfg.sliding_rope_theta or cfg.rope_theta
    return rope.inv_frequencies(cfg.head_dim, theta), None
  scaling = cfg.rope_scaling
  return (rope.inv_frequencies(cfg.head_dim, cfg.rope_theta, scaling),
          None if scaling is None else scaling.cos_sin_scale)


def _rope(cfg: ModelConfig, sliding):
  if isinstance(sliding, bool):
    return _rope_of_kind(cfg, sliding)
  (f_s, c_s), (f_f, c_f) = _rope_of_kind(cfg, True), _rope_of_kind(cfg,
                                                                   False)
  scale = None
  if c_s is not None or c_f is not None:
    scale = jnp.where(sliding, c_s or 1.0, c_f or 1.0)
  return jnp.where(sliding, f_s, f_f), scale


def _scanned_kinds(cfg: ModelConfig):
  """The kind of every layer as the scan over layers sees it: one Python
  bool for a model of one kind, else a per-layer bool array to scan."""
  kinds = cfg.layer_kinds
  if len(set(kinds)) == 1:
    return kinds[0] == SLIDING
  return jnp.asarray([k == SLIDING for k in kinds])


def _self_attend(q, k, v, segment_ids_BxT, cfg: ModelConfig,
                 sharder: Sharder | None, sliding) -> jax.Array:
  """`attention.self_attention` with the layer kind's window."""

  def attend(window):
    return attention.self_attention(
        q, k, v, segment_ids_BxT, impl=cfg.attention,
        block=cfg.attention_block, sharder=sharder, window=window,
        scale=_attn_scale(cfg))

  if isinstance(sliding, bool):
    out = attend(cfg.sliding_window if sliding else None)
  else:
    out = jax.lax.cond(sliding, lambda: attend(cfg.sliding_window),
                       lambda: attend(None))
  return constrain(sharder, out, ("batch", "act_length", "heads", "head_dim"))


def _attend(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, cfg: ModelConfig,
            sharder: Sharder | None) -> jax.Array:
  out = attention.dense(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS,
                        _attn_scale(cfg))
  return constrain(sharder, out, ("batch", "length", "heads", "head_dim"))


def _qkv(x_BxTxD, lp: Params, positions_BxT, cfg: ModelConfig,
         sharder: Sharder | None, sliding=False):
  """Pre-norm query, key and value projections with rotary embeddings."""
  dt = cfg.compute_jnp_dtype
  h = _norm(x_BxTxD, lp["attn_norm"], cfg)
  q = _times_weight("btd,dhk->bthk", h, lp["wq"], cfg)
  k = _times_weight("btd,dhk->bthk", h, lp["wk"], cfg)
  v = _times_weight("btd,dhk->bthk", h, lp["wv"], cfg)
  if cfg.qkv_bias:
    q = q + lp["bq"].astype(dt)[None, None]
    k = k + lp["bk"].astype(dt)[None, None]
    v = v + lp["bv"].astype(dt)[None, None]
  if cfg.qk_norm:
    q = _norm(q, lp["q_norm"], cfg)
    k = _norm(k, lp["k_norm"], cfg)
  inv_freq, cos_sin_scale = _rope(cfg, sliding)
  q = constrain(sharder, rope.apply(q, positions_BxT, inv_freq,
                                    cos_sin_scale),
                ("batch", "act_length", "heads", "head_dim"))
  k = constrain(sharder, rope.apply(k, positions_BxT, inv_freq,
                                    cos_sin_scale),
                ("batch", "act_length", "kv_heads", "head_dim"))
  v = constrain(sharder, v, ("batch", "act_length", "kv_heads", "head_dim"))
  return q, k, v


def _times_weight(spec: str, x: jax.Array, w: jax.Array, cfg: ModelConfig
                  ) -> jax.Array:
  """x times a weight matrix (`project`); with a `cfg.matmul_dtype` of its
  own, both rounded to it and the product accumulated in the compute
  dtype."""
  return project(spec, *weight_operands(x, w, cfg.compute_jnp_dtype,
                                        cfg.matmul_jnp_dtype))


def _gate(gate_BxTxF: jax.Array, cfg: ModelConfig) -> jax.Array:
  if cfg.mlp_activation == "gelu_tanh":
    return jax.nn.gelu(gate_BxTxF, approximate=True)
  return jax.nn.silu(gate_BxTxF)


def _dense_mlp(h_BxTxD, lp: Params, cfg: ModelConfig,
               sharder: Sharder | None) -> jax.Array:
  gate = _times_weight("btd,df->btf", h_BxTxD, lp["w_gate"], cfg)
  up = _times_weight("btd,df->btf", h_BxTxD, lp["w_up"], cfg)
  act = constrain(sharder, _gate(gate, cfg) * up,
                  ("batch", "act_length", "mlp"))
  return _times_weight("btf,fd->btd", act, lp["w_down"], cfg)


def _residual_and_ffn(x_BxTxD, attn_BxTxHxDh, lp: Params, cfg: ModelConfig,
                      sharder: Sharder | None, sparse=False, valid_BxT=None,
                      experts_BxTxK=None
                      ) -> tuple[jax.Array, moe.Trace | None]:
  """The attention output projection and residual, then the gated MLP or,
  where `sparse`, the mixture of experts (`moe.ffn`; each branch output
  normed first with `cfg.post_norms`). Also returns the MoE layer's
  trace (None for a dense model)."""
  out = _times_weight("bthk,hkd->btd", attn_BxTxHxDh, lp["wo"], cfg)
  if cfg.post_norms:
    out = _norm(out, lp["post_attn_norm"], cfg)
  x_BxTxD = constrain(sharder, x_BxTxD + out,
                      ("batch", "act_length", "act_embed"))
  h = _norm(x_BxTxD, lp["mlp_norm"], cfg)
  out, trace = moe.ffn(h, lp, cfg, sharder, sparse,
                       lambda h: _dense_mlp(h, lp, cfg, sharder), valid_BxT,
                       experts_BxTxK)
  if cfg.post_norms:
    out = _norm(out, lp["post_mlp_norm"], cfg)
  return (constrain(sharder, x_BxTxD + out,
                    ("batch", "act_length", "act_embed")), trace)


def _residual_and_mlp(x_BxTxD, attn_BxTxHxDh, lp: Params, cfg: ModelConfig,
                      sharder: Sharder | None) -> jax.Array:
  """`_residual_and_ffn` of a dense layer."""
  return _residual_and_ffn(x_BxTxD, attn_BxTxHxDh, lp, cfg, sharder)[0]


def _layer(x_BxTxD, lp: Params, positions_BxT, mask_BxTxS, cache_kv,
           write_idx_BxT, cfg: ModelConfig, sharder: Sharder | None,
           segment_ids_BxT=None, sliding=False, return_kv=False,
           sparse=False, experts_BxTxK=None):
  """One pre-norm block. `cache_kv` is (k_BxSxKxDh, v_BxSxKxDh) or None.

  `mask_BxTxS` None: the new tokens attend only to each other (training, or
  a prefill into an empty cache) with `cfg.attention` over `segment_ids_BxT`;
  otherwise densely over the cache under that mask. Without a cache the
  block returns its new keys and values when `return_kv`. Returns (x, new
  keys and values, MoE trace or None); `sparse` and `experts_BxTxK` as in
  `_residual_and_ffn`."""
  q, k, v = _qkv(x_BxTxD, lp, positions_BxT, cfg, sharder, sliding)
  if cache_kv is None:
    keys, values = k, v
    new_kv = (k, v) if return_kv else None
  else:
    ck, cv = cache_kv
    rows = jnp.arange(ck.shape[0])[:, None]
    # mode="drop": padding written past the end of the cache is discarded
    # rather than clamped onto valid entries.
    keys = ck.at[rows, write_idx_BxT].set(k.astype(ck.dtype), mode="drop")
    values = cv.at[rows, write_idx_BxT].set(v.astype(cv.dtype), mode="drop")
    new_kv = (keys, values)
  if mask_BxTxS is None:
    attn = _self_attend(q, k, v, segment_ids_BxT, cfg, sharder, sliding)
  else:
    attn = _attend(q, keys, values, mask_BxTxS, cfg, sharder)
  valid = None if segment_ids_BxT is None else segment_ids_BxT != 0
  x_BxTxD, trace = _residual_and_ffn(x_BxTxD, attn, lp, cfg, sharder, sparse,
                                     valid, experts_BxTxK)
  return x_BxTxD, new_kv, trace


def _cached_mask(lengths_B: jax.Array, T: int, S: int) -> jax.Array:
  """Query t of row b sees cache entries 0 .. lengths_B[b] + t."""
  q_idx_BxT = lengths_B[:, None] + jnp.arange(T)[None, :]
  return jnp.arange(S)[None, None, :] <= q_idx_BxT[:, :, None]


def _embed_tokens(params: Params, tokens_BxT: jax.Array,
                  cfg: ModelConfig) -> jax.Array:
  dt = cfg.compute_jnp_dtype
  x = jnp.take(params["embed"], tokens_BxT, axis=0)
  # Rounded as the table is where the weights are (see `round_weights`).
  x = x.astype(cfg.matmul_jnp_dtype).astype(dt)
  if cfg.embed_scale:
    x = x * jnp.asarray(math.sqrt(cfg.d_model), dt)
  return x


def embed_inputs(params: Params, tokens_BxT: jax.Array, *, cfg: ModelConfig,
                 images: merge.RowImages | None = None,
                 sharder: Sharder | None = None) -> jax.Array:
  """Input embeddings x_BxTxD: the token embeddings, and with `images` (a
  model with a vision tower) each image's embeddings at its placeholders."""
  x = _embed_tokens(params, tokens_BxT, cfg)
  if images is not None:
    if cfg.vision is None:
      raise ValueError("images given to a model without model.vision")
    v = cfg.vision
    B, I = images.mask_BxI.shape
    pixels = images.pixels_BxIxHxWxC
    flat_NxHxWxC = pixels.reshape((B * I,) + pixels.shape[2:])
    emb = projector.embed_images(params["vision"], params["projector"],
                                 flat_NxHxWxC, v, sharder=sharder)
    x = merge.merge_image_embeddings(
        x, tokens_BxT, emb.reshape(B, I, v.tokens_per_image, -1),
        images.mask_BxI, v.image_token_id)
  return constrain(sharder, x, ("batch", "act_length", "act_embed"))


def hidden_states(params: Params, tokens_BxT: jax.Array,
                  positions_BxT: jax.Array, segment_ids_BxT: jax.Array, *,
                  cfg: ModelConfig, cache: KVCache | None = None,
                  prefill: bool = False, sharder: Sharder | None = None,
                  images: merge.RowImages | None = None,
                  experts_BxTxLxK: jax.Array | None = None
                  ) -> tuple[jax.Array, KVCache | None]:
  """`traced_hidden_states` without the MoE trace."""
  x, cache, _ = traced_hidden_states(
      params, tokens_BxT, positions_BxT, segment_ids_BxT, cfg=cfg,
      cache=cache, prefill=prefill, sharder=sharder, images=images,
      experts_BxTxLxK=experts_BxTxLxK)
  return x, cache


def traced_hidden_states(params: Params, tokens_BxT: jax.Array,
                         positions_BxT: jax.Array, segment_ids_BxT: jax.Array,
                         *, cfg: ModelConfig, cache: KVCache | None = None,
                         prefill: bool = False,
                         sharder: Sharder | None = None,
                         images: merge.RowImages | None = None,
                         experts_BxTxLxK: jax.Array | None = None
                         ) -> tuple[jax.Array, KVCache | None,
                                    moe.Trace | None]:
  """The final-norm hidden states x_BxTxD, and the updated cache.

  Without a cache, rows may hold several packed sequences (segment ids 1, 2,
  ...; 0 marks padding) that never attend to each other; attention is
  `cfg.attention` (kimi_jax/model/attention.py), never T x T unless "dot".
  With a cache, each row is one sequence: its T new tokens are right-padded
  (segment id 0 after the real ones) and written at `cache.lengths`;
  `lengths` grows by the number of real tokens. `prefill=True` promises the
  cache is empty (lengths 0): the new tokens then attend only to each other
  with `cfg.attention` too, so a long prefill does not build T x S either.
  A windowed model's sliding layers keep the last R real tokens of a row
  in their rings (see `KVCache`); over a non-empty cache its layers run
  unrolled (their caches differ in length).
  images: the rows' images (see `embed_inputs`); None for text only.
  An MoE model (`cfg.n_experts`) also returns its MoE layers' `moe.Trace`
  stacked over them (None for a dense model); `experts_BxTxLxK` replays
  those layers' choices of experts (routing replay, kimi_jax/model/moe.py).
  """
  B, T = tokens_BxT.shape
  x = embed_inputs(params, tokens_BxT, cfg=cfg, images=images,
                   sharder=sharder)
  if cache is not None and cfg.windowed:
    run = _windowed_prefill if prefill else _windowed_cached
    x, cache = run(params, x, positions_BxT, segment_ids_BxT, cache, cfg,
                   sharder)
    return _norm(x, params["final_norm"], cfg), cache, None
  if cache is None:
    mask = write_idx = xs_cache = None
  else:
    S = cache.k.shape[2]
    mask = None if prefill else _cached_mask(cache.lengths, T, S)
    write_idx = cache.lengths[:, None] + jnp.arange(T)[None, :]
    xs_cache = (cache.k, cache.v)
  kinds = _scanned_kinds(cfg)
  scanned = not isinstance(kinds, bool)
  sparse = moe.scanned_sparse(cfg)
  sparse_scanned = not isinstance(sparse, bool)
  replay = (None if experts_BxTxLxK is None else
            moe.layers_replay(cfg, experts_BxTxLxK))

  def layer_fn(sliding, sparse_kind):
    """The block of a static kind, or (None) of the kind scanned in xs."""
    def body(x_BxTxD, xs):
      lp, kv, flag, sparse_flag, experts = xs
      x_BxTxD, new_kv, trace = _layer(
          x_BxTxD, lp, positions_BxT, mask, kv, write_idx, cfg, sharder,
          segment_ids_BxT, flag if sliding is None else sliding,
          sparse=sparse_flag if sparse_kind is None else sparse_kind,
          experts_BxTxK=experts)
      return x_BxTxD, (new_kv, trace)
    return jax.checkpoint(body, prevent_cse=False) if cfg.remat else body

  if cache is None and not cfg.scan_layers:
    traces = []
    for i, (kind, sparse_i) in enumerate(zip(cfg.layer_kinds,
                                             cfg.sparse_kinds)):
      lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
      x, (_, trace) = layer_fn(kind == SLIDING, sparse_i)(
          x, (lp, None, None, None, None if replay is None else replay[i]))
      traces.append(trace)
    new_kv = None
    trace = (None if not cfg.n_experts else
             jax.tree.map(lambda *xs: jnp.stack(xs), *traces))
  else:
    x, (new_kv, trace) = jax.lax.scan(
        layer_fn(None if scanned else kinds,
                 None if sparse_scanned else sparse), x,
        (params["layers"], xs_cache, kinds if scanned else None,
         sparse if sparse_scanned else None, replay))
  if trace is not None:
    trace = moe.moe_traces(cfg, trace)
  x = _norm(x, params["final_norm"], cfg)
  if cache is None:
    return x, None, trace
  n_new_B = jnp.sum(segment_ids_BxT != 0, axis=1).astype(jnp.int32)
  return x, KVCache(k=new_kv[0], v=new_kv[1],
                    lengths=cache.lengths + n_new_B), trace


# ---- caches of sliding-window models -----------------------------------------


def _layer_groups(cfg: ModelConfig) -> tuple[list[int], list[int]]:
  """Indices of the full-attention and of the sliding layers."""
  kinds = cfg.layer_kinds
  return ([i for i, k in enumerate(kinds) if k == FULL],
          [i for i, k in enumerate(kinds) if k == SLIDING])


def _ring_index(lengths_B: jax.Array, n_new_B: jax.Array, T: int,
                R: int) -> jax.Array:
  """Ring entry of each of T new tokens (cache index c at c % R), R (out of
  range: dropped) for padding and for tokens that later new tokens of
  the row overwrite."""
  t_T = jnp.arange(T)
  keep = ((t_T[None, :] < n_new_B[:, None]) &
          (t_T[None, :] >= n_new_B[:, None] - R))
  return jnp.where(keep, (lengths_B[:, None] + t_T[None, :]) % R, R)


def _ring_mask(lengths_B: jax.Array, T: int, R: int, window: int
               ) -> jax.Array:
  """Mask B x T x (R + T) of T new queries over a ring (before their
  writes) followed by the new keys: entry j holds the latest cache index
  below lengths_B congruent to j mod R (none when negative)."""
  last_B1 = lengths_B[:, None] - 1
  held_BxR = last_B1 - (last_B1 - jnp.arange(R)[None, :]) % R
  q_BxT = lengths_B[:, None] + jnp.arange(T)[None, :]
  ring = ((held_BxR[:, None, :] >= 0) &
          (held_BxR[:, None, :] > q_BxT[:, :, None] - window))
  t = jnp.arange(T)
  new_TxT = (t[None, :] <= t[:, None]) & (t[:, None] - t[None, :] < window)
  return jnp.concatenate(
      [ring, jnp.broadcast_to(new_TxT[None], (lengths_B.shape[0], T, T))],
      axis=-1)


def _stack_or(arrays: list[jax.Array], empty: jax.Array) -> jax.Array:
  return jnp.stack(arrays) if arrays else empty


def _windowed_prefill(params, x_BxTxD, positions_BxT, segment_ids_BxT,
                      cache: KVCache, cfg: ModelConfig,
                      sharder: Sharder | None):
  """`hidden_states` with `prefill=True` for a windowed model: the scan
  carries the cache, and each layer writes its new keys and values into it
  (a full layer into its cache entry, a sliding layer its last R real
  tokens into its ring). Scanning out every layer's T keys instead would
  hold n_layers / n_full times the full layers' cache at once."""
  B, T = segment_ids_BxT.shape
  kinds = _scanned_kinds(cfg)
  scanned = not isinstance(kinds, bool)
  full, local = _layer_groups(cfg)
  # Each layer's entry among the full layers and among the sliding ones;
  # the other is out of range, so that write is dropped.
  at_full, at_local = [len(full)] * cfg.n_layers, [len(local)] * cfg.n_layers
  for j, i in enumerate(full):
    at_full[i] = j
  for j, i in enumerate(local):
    at_local[i] = j
  rows = jnp.arange(B)[:, None]
  n_new_B = jnp.sum(segment_ids_BxT != 0, axis=1).astype(jnp.int32)
  write_idx = cache.lengths[:, None] + jnp.arange(T)[None, :]
  ring_idx = _ring_index(cache.lengths, n_new_B, T, cache.local_k.shape[2])
  put = lambda c, i, new, idx: c.at[i, rows, idx].set(new.astype(c.dtype),
                                                       mode="drop")

  def layer(x, lp, sliding):
    return _layer(x, lp, positions_BxT, None, None, None, cfg, sharder,
                  segment_ids_BxT, sliding if scanned else kinds,
                  return_kv=True)[:2]

  if cfg.remat:
    layer = jax.checkpoint(layer, prevent_cse=False)

  def body(carry, xs):
    x, (ck, cv, lk, lv) = carry
    lp, sliding, i_full, i_local = xs
    x, (k, v) = layer(x, lp, sliding)
    return (x, (put(ck, i_full, k, write_idx), put(cv, i_full, v, write_idx),
                put(lk, i_local, k, ring_idx),
                put(lv, i_local, v, ring_idx))), None

  caches = (cache.k, cache.v, cache.local_k, cache.local_v)
  (x, (k, v, local_k, local_v)), _ = jax.lax.scan(
      body, (x_BxTxD, caches),
      (params["layers"], kinds if scanned else None,
       jnp.asarray(at_full, jnp.int32), jnp.asarray(at_local, jnp.int32)))
  return x, KVCache(k=k, v=v, lengths=cache.lengths + n_new_B,
                    local_k=local_k, local_v=local_v)


def _windowed_cached(params, x_BxTxD, positions_BxT, segment_ids_BxT,
                     cache: KVCache, cfg: ModelConfig,
                     sharder: Sharder | None):
  """`hidden_states` over a non-empty cache for a windowed model, layers
  unrolled (their caches differ in length): full layers as for any model,
  sliding layers over their ring followed by the new keys, whose last R
  real ones then enter the ring."""
  B, T = segment_ids_BxT.shape
  lengths = cache.lengths
  n_new_B = jnp.sum(segment_ids_BxT != 0, axis=1).astype(jnp.int32)
  full_mask = _cached_mask(lengths, T, cache.k.shape[2])
  write_idx = lengths[:, None] + jnp.arange(T)[None, :]
  R = cache.local_k.shape[2]
  ring_mask = _ring_mask(lengths, T, R, cfg.sliding_window)
  ring_idx = _ring_index(lengths, n_new_B, T, R)
  rows = jnp.arange(B)[:, None]
  out = {"k": [], "v": [], "local_k": [], "local_v": []}
  n_full = 0
  for i, kind in enumerate(cfg.layer_kinds):
    lp = jax.tree.map(lambda a, i=i: a[i], params["layers"])
    if kind == FULL:
      x_BxTxD, (k, v), _ = _layer(
          x_BxTxD, lp, positions_BxT, full_mask,
          (cache.k[n_full], cache.v[n_full]), write_idx, cfg, sharder)
      out["k"].append(k)
      out["v"].append(v)
      n_full += 1
      continue
    j = i - n_full
    ring_k, ring_v = cache.local_k[j], cache.local_v[j]
    q, k, v = _qkv(x_BxTxD, lp, positions_BxT, cfg, sharder, True)
    k, v = k.astype(ring_k.dtype), v.astype(ring_v.dtype)
    attn = _attend(q, jnp.concatenate([ring_k, k], axis=1),
                   jnp.concatenate([ring_v, v], axis=1), ring_mask, cfg,
                   sharder)
    x_BxTxD = _residual_and_mlp(x_BxTxD, attn, lp, cfg, sharder)
    out["local_k"].append(ring_k.at[rows, ring_idx].set(k, mode="drop"))
    out["local_v"].append(ring_v.at[rows, ring_idx].set(v, mode="drop"))
  return x_BxTxD, KVCache(
      k=_stack_or(out["k"], cache.k), v=_stack_or(out["v"], cache.v),
      lengths=lengths + n_new_B, local_k=jnp.stack(out["local_k"]),
      local_v=jnp.stack(out["local_v"]))


def unembed(params: Params, x_BxTxD: jax.Array, *, cfg: ModelConfig,
            sharder: Sharder | None = None) -> jax.Array:
  """Logits (float32) of hidden states x_BxTxD (any T, e.g. a chunk)."""
  mm = cfg.matmul_jnp_dtype
  x_BxTxD = x_BxTxD.astype(mm)
  if cfg.tie_embeddings:
    logits = jnp.einsum("btd,vd->btv", x_BxTxD, params["embed"].astype(mm),
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", x_BxTxD, params["lm_head"].astype(mm),
                        preferred_element_type=jnp.float32)
  if cfg.final_logit_softcap is not None:
    cap = jnp.float32(cfg.final_logit_softcap)
    logits = jnp.tanh(logits / cap) * cap
  return constrain(sharder, logits, ("batch", "act_length", "vocab"))


def forward(params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            segment_ids_BxT: jax.Array, *, cfg: ModelConfig,
            cache: KVCache | None = None, prefill: bool = False,
            sharder: Sharder | None = None,
            images: merge.RowImages | None = None
            ) -> tuple[jax.Array, KVCache | None]:
  """Logits_BxTxV (float32) of every position, and the updated cache (see
  `hidden_states`). For log-probs of targets over long rows use
  `kimi_jax.model.logprobs`, which never holds B x T x V."""
  x, cache = hidden_states(params, tokens_BxT, positions_BxT, segment_ids_BxT,
                           cfg=cfg, cache=cache, prefill=prefill,
                           sharder=sharder, images=images)
  return unembed(params, x, cfg=cfg, sharder=sharder), cache


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array
                   ) -> jax.Array:
  """log p(target) at every position, in float32."""
  logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
