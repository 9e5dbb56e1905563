"""The policy: a functional decoder-only transformer (Llama / Qwen2 family).

Parameters are a plain pytree of arrays passed in; layers are stacked along a
leading `layers` axis and run with `lax.scan`, so compile time does not grow
with depth. Nothing here calls `jit`: callers jit with their own shardings.

Shapes in names: B batch, T new tokens, S cache length, D model width,
H query heads, K key/value heads, G = H // K, Dh head dim, F MLP width,
V vocabulary, L layers.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

from kimi_jax.model import attention
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.projection import project
from kimi_jax import sharding as sharding_lib
from kimi_jax.sharding import Sharder, constrain, tree_param_shardings
from kimi_jax.vision import merge, projector, tower

Params = dict[str, Any]


class KVCache(NamedTuple):
  """Per-slot key/value cache.

  k_LxBxSxKxDh, v_LxBxSxKxDh: cached keys and values (compute dtype).
  lengths_B: how many cache entries of each row are valid; the next token of
    row b is written at index lengths_B[b].
  """

  k: jax.Array
  v: jax.Array
  lengths: jax.Array


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
  params = {"embed": (V, D), "layers": layers, "final_norm": (D,)}
  if not cfg.tie_embeddings:
    params["lm_head"] = (D, V)
  return params


def init_params(cfg: ModelConfig, rng: jax.Array, std: float = 0.02
                ) -> Params:
  """Random init: normal(std) matrices, unit norms, zero biases. The
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
      leaf = jnp.ones(shape, cfg.param_jnp_dtype)
    elif name.endswith("['bq']") or name.endswith("['bk']") or name.endswith(
        "['bv']"):
      leaf = jnp.zeros(shape, cfg.param_jnp_dtype)
    else:
      leaf = (std * jax.random.normal(key, shape, jnp.float32)).astype(
          cfg.param_jnp_dtype)
    leaves.append(leaf)
  return jax.tree_util.tree_unflatten(treedef, leaves)


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
  shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
  zeros = jnp.zeros(shape, cfg.compute_jnp_dtype)
  return KVCache(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  x32 = x_BxTxD.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) +
                               eps)
  scale = scale_D.astype(x_BxTxD.dtype).reshape((1,) * (x_BxTxD.ndim - 1) +
                                                 scale_D.shape)
  return normed.astype(x_BxTxD.dtype) * scale


def rotary(x_BxTxNxDh: jax.Array, positions_BxT: jax.Array,
           theta: float) -> jax.Array:
  """Rotary embedding, split-halves convention (as Hugging Face Llama)."""
  half = x_BxTxNxDh.shape[-1] // 2
  freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2 /
                          x_BxTxNxDh.shape[-1]))
  angle_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * freq[
      None, None, :]
  cos = jnp.cos(angle_BxTxHalf)[:, :, None, :]
  sin = jnp.sin(angle_BxTxHalf)[:, :, None, :]
  x1 = x_BxTxNxDh[..., :half].astype(jnp.float32)
  x2 = x_BxTxNxDh[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxDh.dtype)


def _attend(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, cfg: ModelConfig,
            sharder: Sharder | None) -> jax.Array:
  del cfg
  out = attention.dense(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS)
  return constrain(sharder, out, ("batch", "length", "heads", "head_dim"))


def _qkv(x_BxTxD, lp: Params, positions_BxT, cfg: ModelConfig,
         sharder: Sharder | None):
  """Pre-norm query, key and value projections with rotary embeddings."""
  dt = cfg.compute_jnp_dtype
  h = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps)
  q = project("btd,dhk->bthk", h, lp["wq"].astype(dt))
  k = project("btd,dhk->bthk", h, lp["wk"].astype(dt))
  v = project("btd,dhk->bthk", h, lp["wv"].astype(dt))
  if cfg.qkv_bias:
    q = q + lp["bq"].astype(dt)[None, None]
    k = k + lp["bk"].astype(dt)[None, None]
    v = v + lp["bv"].astype(dt)[None, None]
  q = constrain(sharder, rotary(q, positions_BxT, cfg.rope_theta),
                ("batch", "act_length", "heads", "head_dim"))
  k = constrain(sharder, rotary(k, positions_BxT, cfg.rope_theta),
                ("batch", "act_length", "kv_heads", "head_dim"))
  v = constrain(sharder, v, ("batch", "act_length", "kv_heads", "head_dim"))
  return q, k, v


def _residual_and_mlp(x_BxTxD, attn_BxTxHxDh, lp: Params, cfg: ModelConfig,
                      sharder: Sharder | None) -> jax.Array:
  """The attention output projection and residual, then the SwiGLU MLP."""
  dt = cfg.compute_jnp_dtype
  x_BxTxD = x_BxTxD + project("bthk,hkd->btd", attn_BxTxHxDh,
                               lp["wo"].astype(dt))
  x_BxTxD = constrain(sharder, x_BxTxD, ("batch", "act_length", "act_embed"))
  h = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.norm_eps)
  gate = project("btd,df->btf", h, lp["w_gate"].astype(dt))
  up = project("btd,df->btf", h, lp["w_up"].astype(dt))
  act = constrain(sharder, jax.nn.silu(gate) * up,
                  ("batch", "act_length", "mlp"))
  x_BxTxD = x_BxTxD + project("btf,fd->btd", act, lp["w_down"].astype(dt))
  return constrain(sharder, x_BxTxD, ("batch", "act_length", "act_embed"))


def _layer(x_BxTxD, lp: Params, positions_BxT, mask_BxTxS, cache_kv,
           write_idx_BxT, cfg: ModelConfig, sharder: Sharder | None,
           segment_ids_BxT=None):
  """One pre-norm block. `cache_kv` is (k_BxSxKxDh, v_BxSxKxDh) or None.

  `mask_BxTxS` None: the new tokens attend only to each other (training, or
  a prefill into an empty cache) with `cfg.attention` over `segment_ids_BxT`;
  otherwise densely over the cache under that mask."""
  q, k, v = _qkv(x_BxTxD, lp, positions_BxT, cfg, sharder)
  if cache_kv is None:
    keys, values, new_kv = k, v, None
  else:
    ck, cv = cache_kv
    rows = jnp.arange(ck.shape[0])[:, None]
    # mode="drop": padding written past the end of the cache is discarded
    # rather than clamped onto valid entries.
    keys = ck.at[rows, write_idx_BxT].set(k.astype(ck.dtype), mode="drop")
    values = cv.at[rows, write_idx_BxT].set(v.astype(cv.dtype), mode="drop")
    new_kv = (keys, values)
  if mask_BxTxS is None:
    attn = constrain(sharder, attention.self_attention(
        q, k, v, segment_ids_BxT, impl=cfg.attention,
        block=cfg.attention_block, sharder=sharder),
                     ("batch", "act_length", "heads", "head_dim"))
  else:
    attn = _attend(q, keys, values, mask_BxTxS, cfg, sharder)
  return _residual_and_mlp(x_BxTxD, attn, lp, cfg, sharder), new_kv


def _cached_mask(lengths_B: jax.Array, T: int, S: int) -> jax.Array:
  """Query t of row b sees cache entries 0 .. lengths_B[b] + t."""
  q_idx_BxT = lengths_B[:, None] + jnp.arange(T)[None, :]
  return jnp.arange(S)[None, None, :] <= q_idx_BxT[:, :, None]


def embed_inputs(params: Params, tokens_BxT: jax.Array, *, cfg: ModelConfig,
                 images: merge.RowImages | None = None,
                 sharder: Sharder | None = None) -> jax.Array:
  """Input embeddings x_BxTxD: the token embeddings, and with `images` (a
  model with a vision tower) each image's embeddings at its placeholders."""
  dt = cfg.compute_jnp_dtype
  x = jnp.take(params["embed"], tokens_BxT, axis=0).astype(dt)
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
                  images: merge.RowImages | None = None
                  ) -> tuple[jax.Array, KVCache | None]:
  """The final-norm hidden states x_BxTxD, and the updated cache.

  Without a cache, rows may hold several packed sequences (segment ids 1, 2,
  ...; 0 marks padding) that never attend to each other; attention is
  `cfg.attention` (kimi_jax/model/attention.py), never T x T unless "dot".
  With a cache, each row is one sequence: its T new tokens are right-padded
  (segment id 0 after the real ones) and written at `cache.lengths`;
  `lengths` grows by the number of real tokens. `prefill=True` promises the
  cache is empty (lengths 0): the new tokens then attend only to each other
  with `cfg.attention` too, so a long prefill does not build T x S either.
  images: the rows' images (see `embed_inputs`); None for text only.
  """
  B, T = tokens_BxT.shape
  x = embed_inputs(params, tokens_BxT, cfg=cfg, images=images,
                   sharder=sharder)
  if cache is None:
    mask = write_idx = xs_cache = None
  else:
    S = cache.k.shape[2]
    mask = None if prefill else _cached_mask(cache.lengths, T, S)
    write_idx = cache.lengths[:, None] + jnp.arange(T)[None, :]
    xs_cache = (cache.k, cache.v)

  def body(x_BxTxD, xs):
    lp, kv = xs
    return _layer(x_BxTxD, lp, positions_BxT, mask, kv, write_idx, cfg,
                  sharder, segment_ids_BxT)

  if cfg.remat:
    body = jax.checkpoint(body, prevent_cse=False)
  if cache is None and not cfg.scan_layers:
    for i in range(cfg.n_layers):
      x, _ = body(x, (jax.tree.map(lambda a: a[i], params["layers"]), None))
    new_kv = None
  else:
    x, new_kv = jax.lax.scan(body, x, (params["layers"], xs_cache))
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  if cache is None:
    return x, None
  n_new_B = jnp.sum(segment_ids_BxT != 0, axis=1).astype(jnp.int32)
  return x, KVCache(k=new_kv[0], v=new_kv[1], lengths=cache.lengths + n_new_B)


def unembed(params: Params, x_BxTxD: jax.Array, *, cfg: ModelConfig,
            sharder: Sharder | None = None) -> jax.Array:
  """Logits (float32) of hidden states x_BxTxD (any T, e.g. a chunk)."""
  dt = cfg.compute_jnp_dtype
  if cfg.tie_embeddings:
    logits = jnp.einsum("btd,vd->btv", x_BxTxD, params["embed"].astype(dt),
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", x_BxTxD, params["lm_head"].astype(dt),
                        preferred_element_type=jnp.float32)
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


# The sampler calls `decode_step` once per generated token. `forward` runs the
# layers in a lax.scan over stacked weights and a stacked cache: per token
# that copies every layer's weights and cache slice out of the stacks and the
# whole cache back into a fresh stack, and transposes each layer's keys and
# values for the attention matmuls (measured: most of a CPU decode step that
# is not matmul). Here the layers run unrolled, over weights split per layer
# once per sampler call (`to_decode_params`) and over per-layer caches in the
# layouts the attention matmuls read (`to_decode_cache`, once per engine
# call): a token's cache write is an in-place scatter into its layer's
# buffers. The arithmetic is
# `forward`'s with T=1, op for op, so the numbers are the same bits
# (tests/test_sampler_golden.py).


class DecodeCache(NamedTuple):
  """Per-layer caches as decoding reads them.

  k[l]: keys, (B, K, S, Dh); vt[l]: values transposed, (B, K, Dh, S).
  """

  k: list[jax.Array]
  vt: list[jax.Array]


class DecodeParams(NamedTuple):
  """Params as `decode_step` reads them: `layers` split per layer (a copy
  of the layer weights), `top` the rest (embeddings, final norm, head)."""

  top: Params
  layers: list[Params]


def to_decode_params(params: Params) -> DecodeParams:
  top = {k: v for k, v in params.items() if k != "layers"}
  return DecodeParams(top=top, layers=split_layers(params["layers"]))


def split_layers(stacked: Any) -> list[Any]:
  """Layer l of every leaf of a pytree stacked along a leading layer axis."""
  n = jax.tree_util.tree_leaves(stacked)[0].shape[0]
  return [jax.tree_util.tree_map(lambda x, l=l: x[l], stacked)
          for l in range(n)]


def to_decode_cache(cache: KVCache) -> DecodeCache:
  """KVCache's (L, B, S, K, Dh) arrays as per-layer decode layouts."""
  return DecodeCache(
      k=[k.transpose(0, 2, 1, 3) for k in split_layers(cache.k)],
      vt=[v.transpose(0, 2, 3, 1) for v in split_layers(cache.v)])


def from_decode_cache(cache: DecodeCache, lengths_B: jax.Array) -> KVCache:
  """The inverse of `to_decode_cache`."""
  return KVCache(k=jnp.stack([k.transpose(0, 2, 1, 3) for k in cache.k]),
                 v=jnp.stack([v.transpose(0, 3, 1, 2) for v in cache.vt]),
                 lengths=lengths_B)


def _decode_attend(q_Bx1xHxDh, k_BxKxSxDh, vt_BxKxDhxS, mask_Bx1xS,
                   cfg: ModelConfig, sharder: Sharder | None) -> jax.Array:
  """`_attend` for one query per row over the decode cache layouts."""
  B, T, H, Dh = q_Bx1xHxDh.shape
  K = cfg.n_kv_heads
  q_BxTxKxGxDh = q_Bx1xHxDh.reshape(B, T, K, H // K, Dh)
  scores = jnp.einsum("btkgd,bksd->bkgts", q_BxTxKxGxDh, k_BxKxSxDh,
                      preferred_element_type=jnp.float32) / jnp.sqrt(
                          jnp.float32(Dh))
  scores = jnp.where(mask_Bx1xS[:, None, None, :, :], scores, attention.MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(vt_BxKxDhxS.dtype)
  out = jnp.einsum("bkgts,bkds->btkgd", probs, vt_BxKxDhxS)
  out = out.reshape(B, T, H, Dh)
  return constrain(sharder, out, ("batch", "length", "heads", "head_dim"))


def _decode_layer(x_Bx1xD, lp: Params, positions_Bx1, mask_Bx1xS,
                  k_BxKxSxDh, vt_BxKxDhxS, cfg: ModelConfig,
                  sharder: Sharder | None):
  """`_layer` for one new token per row, writing it into the decode cache."""
  q, k, v = _qkv(x_Bx1xD, lp, positions_Bx1, cfg, sharder)
  rows_B = jnp.arange(x_Bx1xD.shape[0])
  pos_B = positions_Bx1[:, 0]
  # mode="drop": a write past the end of the cache is discarded.
  k_BxKxSxDh = k_BxKxSxDh.at[rows_B, :, pos_B].set(
      k[:, 0].astype(k_BxKxSxDh.dtype), mode="drop")
  vt_BxKxDhxS = vt_BxKxDhxS.at[rows_B, :, :, pos_B].set(
      v[:, 0].astype(vt_BxKxDhxS.dtype), mode="drop")
  attn = _decode_attend(q, k_BxKxSxDh, vt_BxKxDhxS, mask_Bx1xS, cfg, sharder)
  return (_residual_and_mlp(x_Bx1xD, attn, lp, cfg, sharder), k_BxKxSxDh,
          vt_BxKxDhxS)


def decode_step(params: DecodeParams, tokens_B: jax.Array,
                lengths_B: jax.Array, cache: DecodeCache, *,
                cfg: ModelConfig, sharder: Sharder | None = None
                ) -> tuple[jax.Array, DecodeCache]:
  """Logits of one new token per slot, and the cache with it written.

  params: `to_decode_params(params)`. Slot b's token goes to position
  lengths_B[b] and attends to positions 0..lengths_B[b]; the caller advances
  the lengths of the slots that hold a sequence. Returns logits_Bx1xV
  (float32).
  """
  dt = cfg.compute_jnp_dtype
  S = cache.k[0].shape[2]
  layers, params = params.layers, params.top
  positions_Bx1 = lengths_B[:, None]
  x = jnp.take(params["embed"], tokens_B[:, None], axis=0).astype(dt)
  x = constrain(sharder, x, ("batch", "length", "act_embed"))
  mask_Bx1xS = _cached_mask(lengths_B, 1, S)
  ks, vts = [], []
  for lp, k, vt in zip(layers, cache.k, cache.vt):
    x, k, vt = _decode_layer(x, lp, positions_Bx1, mask_Bx1xS, k, vt, cfg,
                             sharder)
    ks.append(k)
    vts.append(vt)
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  return unembed(params, x, cfg=cfg, sharder=sharder), DecodeCache(k=ks,
                                                                   vt=vts)
