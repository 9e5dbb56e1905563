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

from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import Sharder, constrain, tree_param_shardings

Params = dict[str, Any]
_MASK_VALUE = -0.7 * float(jnp.finfo(jnp.float32).max)


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
  return params


def param_shapes(cfg: ModelConfig) -> Params:
  """Shape of every parameter, same tree as the params."""
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
  """Random init: normal(std) matrices, unit norms, zero biases."""
  shapes = param_shapes(cfg)
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


def init_sharded(cfg: ModelConfig, rng: jax.Array, sharder: Sharder) -> Params:
  """Creates params directly in their shardings: no device holds them all."""
  shardings = param_shardings(cfg, sharder)
  return jax.jit(lambda r: init_params(cfg, r), out_shardings=shardings)(rng)


def init_cache(cfg: ModelConfig, batch: int, length: int) -> KVCache:
  shape = (cfg.n_layers, batch, length, cfg.n_kv_heads, cfg.head_dim)
  zeros = jnp.zeros(shape, cfg.compute_jnp_dtype)
  return KVCache(k=zeros, v=zeros, lengths=jnp.zeros((batch,), jnp.int32))


def rms_norm(x_BxTxD: jax.Array, scale_D: jax.Array, eps: float) -> jax.Array:
  x32 = x_BxTxD.astype(jnp.float32)
  normed = x32 * jax.lax.rsqrt(jnp.mean(x32 * x32, axis=-1, keepdims=True) +
                               eps)
  return (normed.astype(x_BxTxD.dtype) * scale_D.astype(x_BxTxD.dtype))


def rotary(x_BxTxNxDh: jax.Array, positions_BxT: jax.Array,
           theta: float) -> jax.Array:
  """Rotary embedding, split-halves convention (as Hugging Face Llama)."""
  half = x_BxTxNxDh.shape[-1] // 2
  freq = 1.0 / (theta ** (jnp.arange(half, dtype=jnp.float32) * 2 /
                          x_BxTxNxDh.shape[-1]))
  angle_BxTxHalf = positions_BxT.astype(jnp.float32)[..., None] * freq
  cos = jnp.cos(angle_BxTxHalf)[:, :, None, :]
  sin = jnp.sin(angle_BxTxHalf)[:, :, None, :]
  x1 = x_BxTxNxDh[..., :half].astype(jnp.float32)
  x2 = x_BxTxNxDh[..., half:].astype(jnp.float32)
  out = jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1)
  return out.astype(x_BxTxNxDh.dtype)


def _attend(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, mask_BxTxS, cfg: ModelConfig,
            sharder: Sharder | None) -> jax.Array:
  B, T, H, Dh = q_BxTxHxDh.shape
  K = cfg.n_kv_heads
  q_BxTxKxGxDh = q_BxTxHxDh.reshape(B, T, K, H // K, Dh)
  scores = jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxDh, k_BxSxKxDh,
                      preferred_element_type=jnp.float32) / jnp.sqrt(
                          jnp.float32(Dh))
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, _MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh)
  out = out.reshape(B, T, H, Dh)
  return constrain(sharder, out, ("batch", "length", "heads", "head_dim"))


def _layer(x_BxTxD, lp: Params, positions_BxT, mask_BxTxS, cache_kv,
           write_idx_BxT, cfg: ModelConfig, sharder: Sharder | None):
  """One pre-norm block. `cache_kv` is (k_BxSxKxDh, v_BxSxKxDh) or None."""
  dt = cfg.compute_jnp_dtype
  h = rms_norm(x_BxTxD, lp["attn_norm"], cfg.norm_eps)
  q = jnp.einsum("btd,dhk->bthk", h, lp["wq"].astype(dt))
  k = jnp.einsum("btd,dhk->bthk", h, lp["wk"].astype(dt))
  v = jnp.einsum("btd,dhk->bthk", h, lp["wv"].astype(dt))
  if cfg.qkv_bias:
    q, k, v = q + lp["bq"].astype(dt), k + lp["bk"].astype(dt), v + lp[
        "bv"].astype(dt)
  q = constrain(sharder, rotary(q, positions_BxT, cfg.rope_theta),
                ("batch", "length", "heads", "head_dim"))
  k = constrain(sharder, rotary(k, positions_BxT, cfg.rope_theta),
                ("batch", "length", "kv_heads", "head_dim"))
  v = constrain(sharder, v, ("batch", "length", "kv_heads", "head_dim"))
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
  attn = _attend(q, keys, values, mask_BxTxS, cfg, sharder)
  x_BxTxD = x_BxTxD + jnp.einsum("bthk,hkd->btd", attn, lp["wo"].astype(dt))
  x_BxTxD = constrain(sharder, x_BxTxD, ("batch", "length", "act_embed"))
  h = rms_norm(x_BxTxD, lp["mlp_norm"], cfg.norm_eps)
  gate = jnp.einsum("btd,df->btf", h, lp["w_gate"].astype(dt))
  up = jnp.einsum("btd,df->btf", h, lp["w_up"].astype(dt))
  act = constrain(sharder, jax.nn.silu(gate) * up, ("batch", "length", "mlp"))
  x_BxTxD = x_BxTxD + jnp.einsum("btf,fd->btd", act, lp["w_down"].astype(dt))
  x_BxTxD = constrain(sharder, x_BxTxD, ("batch", "length", "act_embed"))
  return x_BxTxD, new_kv


def _packed_mask(segment_ids_BxT: jax.Array) -> jax.Array:
  """Causal within a segment; segment 0 is padding and sees nothing."""
  T = segment_ids_BxT.shape[1]
  causal_TxT = jnp.tril(jnp.ones((T, T), bool))
  same = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  valid = (segment_ids_BxT != 0)[:, :, None]
  return causal_TxT[None] & same & valid


def _cached_mask(lengths_B: jax.Array, T: int, S: int) -> jax.Array:
  """Query t of row b sees cache entries 0 .. lengths_B[b] + t."""
  q_idx_BxT = lengths_B[:, None] + jnp.arange(T)[None, :]
  return jnp.arange(S)[None, None, :] <= q_idx_BxT[:, :, None]


def forward(params: Params, tokens_BxT: jax.Array, positions_BxT: jax.Array,
            segment_ids_BxT: jax.Array, *, cfg: ModelConfig,
            cache: KVCache | None = None, sharder: Sharder | None = None
            ) -> tuple[jax.Array, KVCache | None]:
  """Logits of every position, and the cache with the new tokens appended.

  Without a cache, rows may hold several packed sequences (segment ids 1, 2,
  ...; 0 marks padding) that never attend to each other. With a cache, each
  row is one sequence: its T new tokens are right-padded (segment id 0 after
  the real ones) and written at `cache.lengths`; `lengths` grows by the number
  of real tokens.

  Returns logits_BxTxV in float32.
  """
  dt = cfg.compute_jnp_dtype
  B, T = tokens_BxT.shape
  x = jnp.take(params["embed"], tokens_BxT, axis=0).astype(dt)
  x = constrain(sharder, x, ("batch", "length", "act_embed"))
  if cache is None:
    mask = _packed_mask(segment_ids_BxT)
    write_idx = None
    xs_cache = None
  else:
    S = cache.k.shape[2]
    mask = _cached_mask(cache.lengths, T, S)
    write_idx = cache.lengths[:, None] + jnp.arange(T)[None, :]
    xs_cache = (cache.k, cache.v)

  def body(x_BxTxD, xs):
    lp, kv = xs
    return _layer(x_BxTxD, lp, positions_BxT, mask, kv, write_idx, cfg,
                  sharder)

  if cfg.remat:
    body = jax.checkpoint(body, prevent_cse=False)
  x, new_kv = jax.lax.scan(body, x, (params["layers"], xs_cache))
  x = rms_norm(x, params["final_norm"], cfg.norm_eps)
  if cfg.tie_embeddings:
    logits = jnp.einsum("btd,vd->btv", x, params["embed"].astype(dt),
                        preferred_element_type=jnp.float32)
  else:
    logits = jnp.einsum("btd,dv->btv", x, params["lm_head"].astype(dt),
                        preferred_element_type=jnp.float32)
  logits = constrain(sharder, logits, ("batch", "length", "vocab"))
  if cache is None:
    return logits, None
  n_new_B = jnp.sum(segment_ids_BxT != 0, axis=1).astype(jnp.int32)
  return logits, KVCache(k=new_kv[0], v=new_kv[1],
                         lengths=cache.lengths + n_new_B)


def token_logprobs(logits_BxTxV: jax.Array, targets_BxT: jax.Array
                   ) -> jax.Array:
  """log p(target) at every position, in float32."""
  logp = jax.nn.log_softmax(logits_BxTxV.astype(jnp.float32), axis=-1)
  return jnp.take_along_axis(logp, targets_BxT[..., None], axis=-1)[..., 0]
