"""One decode step per generated token, over a cache that costs what is live.

The sampler calls `decode_step` once per generated token. `forward` runs the
layers in a lax.scan over stacked weights and a stacked cache: per token
that would copy every layer's weights and cache slice out of the stacks.
Here the layers run unrolled, over weights split per layer once per sampler
call (`to_decode_params`) and over per-layer caches kept in the layouts the
attention matmuls read (`DecodeCache`), so a token's cache write is an
in-place scatter into its layer's buffers. The arithmetic is `forward`'s
with T=1, op for op.

What a step reads of the full-attention layers' caches is bounded by the
longest live slot, not by the reserved length (the caller picks a static
bound per call, see `kimi_jax.sampler.engine`):

  rows   each slot owns S entries (v: B x K x S x Dh); a step reads the
         first `view_len` entries of every row.
  pages  a pool of P pages of `page` entries shared by the slots (v:
         P x K x page x Dh); slot b's entries 0.. live in pages
         pages_BxV[b, 0], pages_BxV[b, 1], ...; a step reads the V pages of
         every slot named there. Page id P means "none": a read of it is
         clamped onto some page and masked, a write to it is dropped. On a
         mesh the pool splits over the batch axes like the slots: each
         shard's slots hold pages of its own part of the pool, and page
         ids are local to the shard (the step runs in `jax.shard_map`, so
         no page ever crosses devices).

Either way entries past a slot's length are masked to exactly zero weight,
so a longer view changes nothing but the order of float additions.

With `kernel="pallas_tpu"` the pool keeps the layout of Pallas's TPU paged
attention kernel instead, keys and values alike (kt, v: K x P x page x
Dh), and the kernel reads each slot's pages only up to its length: no
gather, no masked tail.
Sliding-window layers keep per-slot rings of at most `sliding_window`
entries (already bounded), read whole.

Shapes in names: B slots, K key/value heads, H query heads, G = H // K, Dh
head dim, S entries per row, P pages, V pages per slot in view, D width.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import jax
import jax.numpy as jnp

import functools
import math

from kimi_jax.model import attention
from kimi_jax.model.config import SLIDING, ModelConfig
from kimi_jax.model.transformer import (KVCache, _attn_scale, _embed_tokens,
                                        _norm, _qkv, _residual_and_ffn,
                                        _stack_or, unembed)
from kimi_jax.sharding import Sharder, constrain

Params = dict[str, Any]


class DecodeCache(NamedTuple):
  """Per-layer caches as decoding reads them.

  kt[l]: keys transposed, v[l]: values, of the full-attention layers: rows
  (B, K, Dh, S) and (B, K, S, Dh), or pages (P, K, Dh, page) and
  (P, K, page, Dh), or for the TPU kernel keys (not transposed) and values
  both (K, P, page, Dh). local_kt, local_v: the sliding layers' rings as
  rows (S = R; None for a model without them).

  Keys with the entries last and values with them second-last are the
  operand layouts XLA:CPU's batched matmuls read fastest for one query
  per slot (the scores contract the head dim, the values the entries):
  the other way round, the attention of the peer benchmark's decode step
  took about twice as long.
  """

  kt: list[jax.Array]
  v: list[jax.Array]
  local_kt: list[jax.Array] | None = None
  local_v: list[jax.Array] | None = None


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


def keys_rows(k_LxBxSxKxDh: jax.Array) -> list[jax.Array]:
  """Stacked (L, B, S, K, Dh) keys as per-layer (B, K, Dh, S) rows."""
  return [k.transpose(0, 2, 3, 1) for k in split_layers(k_LxBxSxKxDh)]


def values_rows(v_LxBxSxKxDh: jax.Array) -> list[jax.Array]:
  """Stacked (L, B, S, K, Dh) values as per-layer (B, K, S, Dh) rows."""
  return [v.transpose(0, 2, 1, 3) for v in split_layers(v_LxBxSxKxDh)]


def to_decode_cache(cache: KVCache) -> DecodeCache:
  """KVCache's (L, B, S, K, Dh) arrays as per-layer decode rows."""
  if cache.local_k is None:
    return DecodeCache(kt=keys_rows(cache.k), v=values_rows(cache.v))
  return DecodeCache(kt=keys_rows(cache.k), v=values_rows(cache.v),
                     local_kt=keys_rows(cache.local_k),
                     local_v=values_rows(cache.local_v))


def from_decode_cache(cache: DecodeCache, lengths_B: jax.Array) -> KVCache:
  """The inverse of `to_decode_cache` (rows only)."""
  keys = lambda kts: [kt.transpose(0, 3, 1, 2) for kt in kts]
  values = lambda vs: [v.transpose(0, 2, 1, 3) for v in vs]
  if cache.local_kt is None:
    return KVCache(k=jnp.stack(keys(cache.kt)), v=jnp.stack(values(cache.v)),
                   lengths=lengths_B)
  B, K, _, Dh = cache.local_v[0].shape
  empty = jnp.zeros((0, B, 0, K, Dh), cache.local_v[0].dtype)
  stack = lambda xs: _stack_or(xs, empty)
  return KVCache(k=stack(keys(cache.kt)), v=stack(values(cache.v)),
                 lengths=lengths_B, local_k=stack(keys(cache.local_kt)),
                 local_v=stack(values(cache.local_v)))


def rows_prefix(cache: DecodeCache, n: int) -> DecodeCache:
  """The first n entries of the full-attention layers' rows (sliding rings
  whole). A generate call whose view is n reads and writes only these, so
  it takes them out once per call and steps over them: a slice is a copy,
  and slicing the view in every step copied it once per token."""
  return cache._replace(kt=[kt[..., :n] for kt in cache.kt],
                        v=[v[:, :, :n] for v in cache.v])


def with_rows_written(cache: DecodeCache, prefix: DecodeCache,
                      start_B: jax.Array, n_steps: int) -> DecodeCache:
  """`cache` with what up to n_steps decode steps wrote into `prefix`
  (`rows_prefix(cache, n)`, sliding rings whole) put back: slot b's entries
  start_B[b] .. start_B[b] + n_steps - 1 that lie in the view. The rest of
  the view is as it was sliced out. Putting back the whole view cost more:
  the keys' entries are the minor axis of their rows, so the view is a
  strided block of a long cache."""
  B, _, n, _ = prefix.v[0].shape
  S = cache.v[0].shape[2]
  pos_BxN = start_B[:, None] + jnp.arange(n_steps)[None, :]
  read_BxN = jnp.minimum(pos_BxN, n - 1)
  write_BxN = jnp.where(pos_BxN < n, pos_BxN, S)  # S: past the end, dropped
  rows_Bx1 = jnp.arange(B)[:, None]

  def put(full, part, axis):
    # Entries on `axis`: 3 for keys (B, K, Dh, S), 2 for values
    # (B, K, S, Dh); either way the picked entries come out B x N x K x Dh.
    at = lambda pos_BxN: (rows_Bx1,) + (slice(None),) * (axis - 1) + (
        pos_BxN,)
    return full.at[at(write_BxN)].set(
        part[at(read_BxN)].astype(full.dtype), mode="drop")

  return prefix._replace(
      kt=[put(f, p, 3) for f, p in zip(cache.kt, prefix.kt)],
      v=[put(f, p, 2) for f, p in zip(cache.v, prefix.v)])


# ---- one layer --------------------------------------------------------------


def _attend_blocks(q_Bx1xHxDh, kt_BxVxKxDhxS, v_BxVxKxSxDh, mask_BxVS,
                   cfg: ModelConfig, sharder: Sharder | None) -> jax.Array:
  """Attention of one query per slot over V blocks of S entries per slot
  (rows: V = 1), with one softmax over all V x S entries."""
  B, T, H, Dh = q_Bx1xHxDh.shape
  _, V, K, S, _ = v_BxVxKxSxDh.shape
  M, N = T * (H // K), V * S  # queries per key head, entries in view
  q_BxKxMxDh = q_Bx1xHxDh.reshape(B, T, K, H // K, Dh).transpose(
      0, 2, 1, 3, 4).reshape(B, K, M, Dh)
  # Rows (V = 1): reshapes, no copies. Both products are then plain
  # batched matmuls (B x K batches of M x Dh by Dh x N, and of M x N by
  # N x Dh), written as dot_general so that XLA keeps these operand roles:
  # an einsum let it pick the cache as the left operand and copy it into
  # that layout at every step.
  kt_BxKxDhxN = jnp.moveaxis(kt_BxVxKxDhxS, 1, 3).reshape(B, K, Dh, N)
  v_BxKxNxDh = jnp.moveaxis(v_BxVxKxSxDh, 1, 2).reshape(B, K, N, Dh)
  batched = (((3,), (2,)), ((0, 1), (0, 1)))
  scores = attention.scale_scores(
      jax.lax.dot_general(q_BxKxMxDh, kt_BxKxDhxN, batched,
                          preferred_element_type=jnp.float32),
      Dh, _attn_scale(cfg))
  scores = jnp.where(mask_BxVS[:, None, None, :], scores,
                     attention.MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxVxKxSxDh.dtype)
  out_BxKxMxDh = jax.lax.dot_general(probs, v_BxKxNxDh, batched)
  out = out_BxKxMxDh.reshape(B, K, T, H // K, Dh).transpose(
      0, 2, 1, 3, 4).reshape(B, T, H, Dh)
  return constrain(sharder, out, ("batch", "length", "heads", "head_dim"))


def _write_entries(kt_XxKxDhxN, v_XxKxNxDh, k_BxKxDh, v_BxKxDh, block_B,
                   at_B):
  """The new token's key and value at entry at_B of block block_B (a row
  or a page; an index past the end is dropped)."""
  kt_XxKxDhxN = kt_XxKxDhxN.at[block_B, :, :, at_B].set(
      k_BxKxDh.astype(kt_XxKxDhxN.dtype), mode="drop")
  v_XxKxNxDh = v_XxKxNxDh.at[block_B, :, at_B].set(
      v_BxKxDh.astype(v_XxKxNxDh.dtype), mode="drop")
  return kt_XxKxDhxN, v_XxKxNxDh


def page_of(pages_BxV: jax.Array, pos_B: jax.Array, page: int, n_pages: int
            ) -> jax.Array:
  """The pool page holding entry pos_B of each slot (n_pages: none, also
  when the entry lies past the slot's V pages in view)."""
  V = pages_BxV.shape[1]
  idx_B = pos_B // page
  held_B = jnp.take_along_axis(pages_BxV, jnp.minimum(idx_B, V - 1)[:, None],
                               axis=1)[:, 0]
  return jnp.where(idx_B < V, held_B, n_pages)


def _write_pages(kt_PxKxDhxN, v_PxKxNxDh, k_BxKxDh, v_BxKxDh, pos_B,
                 pages_BxV):
  """The new token's key and value into its page (N entries per page)."""
  P, _, N, _ = v_PxKxNxDh.shape
  return _write_entries(kt_PxKxDhxN, v_PxKxNxDh, k_BxKxDh, v_BxKxDh,
                        page_of(pages_BxV, pos_B, N, P), pos_B % N)


def _rows_view(kt_BxKxDhxS, v_BxKxSxDh, view_len: int | None = None):
  """The first view_len entries of each row (None: all) as one block:
  (B, 1, K, Dh, S) and (B, 1, K, S, Dh)."""
  n = v_BxKxSxDh.shape[2] if view_len is None else view_len
  return kt_BxKxDhxS[:, None, ..., :n], v_BxKxSxDh[:, None, :, :n]


def _pages_view(kt_PxKxDhxN, v_PxKxNxDh, pages_BxV):
  """Each slot's V pages in view: (B, V, K, Dh, N) and (B, V, K, N, Dh)."""
  # Page id P (none) is clamped onto a real page: its entries are masked.
  safe_BxV = jnp.minimum(pages_BxV, v_PxKxNxDh.shape[0] - 1)
  return kt_PxKxDhxN[safe_BxV], v_PxKxNxDh[safe_BxV]


def _attend_upto(q, kt_view, v_view, pos_B, cfg: ModelConfig,
                 sharder: Sharder | None) -> jax.Array:
  """One query per slot over the V x S entries in view, of which those at
  0 .. pos_B count (a ring holds only written entries once pos >= R, and
  entries 0 .. pos before)."""
  n = v_view.shape[1] * v_view.shape[3]
  mask_BxN = jnp.arange(n)[None, :] <= pos_B[:, None]
  return _attend_blocks(q, kt_view, v_view, mask_BxN, cfg, sharder)


def _paged_attend(q, k_new, v_new, kt_pool, v_pool, pages_BxV, pos_B,
                  cfg: ModelConfig):
  """Writes one token per slot into its page and attends over the slot's
  pages: (attention out, kt_pool, v_pool). Shard-local on a mesh."""
  kt_pool, v_pool = _write_pages(kt_pool, v_pool, k_new[:, 0], v_new[:, 0],
                                 pos_B, pages_BxV)
  kt_view, v_view = _pages_view(kt_pool, v_pool, pages_BxV)
  return (_attend_upto(q, kt_view, v_view, pos_B, cfg, None), kt_pool,
          v_pool)


# Pages the TPU kernel copies into VMEM per block (at most; it must divide
# the pages in view).
KERNEL_BLOCK_PAGES = 8


def _write_kernel_pages(k_KxPxNxDh, v_KxPxNxDh, k_BxKxDh, v_BxKxDh, pos_B,
                        pages_BxV):
  """`_write_pages` for the TPU kernel's layout."""
  _, P, N, _ = k_KxPxNxDh.shape
  page_B = page_of(pages_BxV, pos_B, N, P)
  at_B = pos_B % N
  put = lambda pool, new_BxKxDh: pool.at[:, page_B, at_B].set(
      new_BxKxDh.transpose(1, 0, 2).astype(pool.dtype), mode="drop")
  return put(k_KxPxNxDh, k_BxKxDh), put(v_KxPxNxDh, v_BxKxDh)


def _kernel_attend(q, k_new, v_new, k_pool, v_pool, pages_BxV, pos_B,
                   cfg: ModelConfig, interpret: bool):
  """`_paged_attend` by Pallas's TPU paged attention kernel (in its TPU
  interpreter when `interpret`)."""
  # Imported here: only a TPU-kernel engine needs Pallas's TPU modules.
  from jax.experimental.pallas import tpu as pltpu
  from jax.experimental.pallas.ops.tpu.paged_attention import paged_attention
  k_pool, v_pool = _write_kernel_pages(k_pool, v_pool, k_new[:, 0],
                                       v_new[:, 0], pos_B, pages_BxV)
  Dh = q.shape[-1]
  scale = _attn_scale(cfg) or Dh ** -0.5
  # The kernel does not scale scores: the query carries the scale.
  q_BxHxDh = (q[:, 0].astype(jnp.float32) * scale).astype(q.dtype)
  P, V = k_pool.shape[1], pages_BxV.shape[1]
  call = functools.partial(
      paged_attention, q_BxHxDh, k_pool, v_pool,
      (pos_B + 1).astype(jnp.int32),
      jnp.minimum(pages_BxV, P - 1).astype(jnp.int32),
      pages_per_compute_block=math.gcd(V, KERNEL_BLOCK_PAGES))
  if interpret:
    with pltpu.force_tpu_interpret_mode():
      out_BxHxDh = call()
  else:
    out_BxHxDh = call()
  return out_BxHxDh[:, None], k_pool, v_pool


def _paged_layer_attention(q, k_new, v_new, kt_pool, v_pool, pages_BxV,
                           pos_B, cfg: ModelConfig, sharder: Sharder | None,
                           kernel: str = "xla"):
  """`_paged_attend` (or the TPU kernel's), on a mesh inside
  `jax.shard_map`: slots and pool pages over the batch axes, query and
  key heads over `tensor` when both split alike (else whole)."""
  if kernel == "xla":
    fn = functools.partial(_paged_attend, cfg=cfg)
  else:
    fn = functools.partial(_kernel_attend, cfg=cfg,
                           interpret=not on_tpu(sharder))
  if sharder is None:
    return fn(q, k_new, v_new, kt_pool, v_pool, pages_BxV, pos_B)
  B, _, H, _ = q.shape
  K = k_new.shape[2]
  batch = attention._axes(sharder, "batch", B)
  heads = attention._axes(sharder, "heads", H)
  heads = heads if heads and heads == attention._axes(sharder, "kv_heads",
                                                      K) else ()
  spec = attention._spec
  qkv = spec(batch, (), heads, ())
  pool = spec(batch, heads, (), ()) if kernel == "xla" else spec(
      heads, batch, (), ())
  return jax.shard_map(
      fn, mesh=sharder.mesh,
      in_specs=(qkv, qkv, qkv, pool, pool, spec(batch, ()), spec(batch)),
      out_specs=(qkv, pool, pool), check_vma=False)(
          q, k_new, v_new, kt_pool, v_pool, pages_BxV, pos_B)


def on_tpu(sharder: Sharder | None) -> bool:
  """Whether the step runs on TPU devices (on a CPU host compiling for a
  TPU slice, the mesh's devices say so)."""
  if sharder is None:
    return jax.default_backend() == "tpu"
  return sharder.mesh.devices.flat[0].platform == "tpu"


def _decode_layer(x_Bx1xD, lp: Params, positions_Bx1, kt, v,
                  cfg: ModelConfig, sharder: Sharder | None, sliding: bool,
                  view_len: int | None, pages_BxV, kernel: str,
                  sparse: bool = False):
  """`transformer._layer` for one new token per slot, writing it into the
  layer's cache first (a sliding layer's ring at position mod its length)
  and attending to what the slot holds up to and including it. Also
  returns the MoE layer's trace (None for a dense model)."""
  q, k_new, v_new = _qkv(x_Bx1xD, lp, positions_Bx1, cfg, sharder, sliding)
  pos_B = positions_Bx1[:, 0]
  if pages_BxV is not None and not sliding:
    attn, kt, v = _paged_layer_attention(q, k_new, v_new, kt, v, pages_BxV,
                                         pos_B, cfg, sharder, kernel)
    attn = constrain(sharder, attn, ("batch", "length", "heads", "head_dim"))
  else:
    # A sliding layer's ring: written at position mod its length, read whole.
    at_B = pos_B % v.shape[2] if sliding else pos_B
    kt, v = _write_entries(kt, v, k_new[:, 0], v_new[:, 0],
                           jnp.arange(v.shape[0]), at_B)
    attn = _attend_upto(q, *_rows_view(kt, v, None if sliding else view_len),
                        pos_B, cfg, sharder)
  x_Bx1xD, trace = _residual_and_ffn(x_Bx1xD, attn, lp, cfg, sharder, sparse)
  return x_Bx1xD, kt, v, trace


def decode_step(params: DecodeParams, tokens_B: jax.Array,
                lengths_B: jax.Array, cache: DecodeCache, *,
                cfg: ModelConfig, sharder: Sharder | None = None,
                view_len: int | None = None,
                pages_BxV: jax.Array | None = None, kernel: str = "xla"
                ) -> tuple[jax.Array, DecodeCache]:
  """`traced_decode_step` without the experts."""
  logits, cache, _ = traced_decode_step(
      params, tokens_B, lengths_B, cache, cfg=cfg, sharder=sharder,
      view_len=view_len, pages_BxV=pages_BxV, kernel=kernel)
  return logits, cache


def traced_decode_step(params: DecodeParams, tokens_B: jax.Array,
                       lengths_B: jax.Array, cache: DecodeCache, *,
                       cfg: ModelConfig, sharder: Sharder | None = None,
                       view_len: int | None = None,
                       pages_BxV: jax.Array | None = None,
                       kernel: str = "xla"
                       ) -> tuple[jax.Array, DecodeCache, jax.Array | None]:
  """Logits of one new token per slot, the cache with it written, and an
  MoE model's choice of experts for the token (B x Lm x K; None dense).

  params: `to_decode_params(params)`. Slot b's token goes to position
  lengths_B[b] and attends to positions 0..lengths_B[b]; the caller advances
  the lengths of the slots that hold a sequence. The full layers' caches
  are rows read up to `view_len` entries (None: all), or pages read
  through `pages_BxV` (see the module doc; `kernel` "pallas_tpu": by the
  TPU kernel, in its layout); either must cover every position a slot
  attends to. A sliding layer's token goes to its ring
  (see `transformer.KVCache`) and attends to every ring entry written so
  far. Returns logits_Bx1xV (float32).
  """
  layers, params = params.layers, params.top
  positions_Bx1 = lengths_B[:, None]
  x = _embed_tokens(params, tokens_B[:, None], cfg)
  x = constrain(sharder, x, ("batch", "length", "act_embed"))
  caches = {False: iter(zip(cache.kt, cache.v)),
            True: iter(zip(cache.local_kt or (), cache.local_v or ()))}
  out = {False: ([], []), True: ([], [])}
  experts = []
  for lp, kind, sparse in zip(layers, cfg.layer_kinds, cfg.sparse_kinds):
    sliding = kind == SLIDING
    kt, v = next(caches[sliding])
    x, kt, v, trace = _decode_layer(x, lp, positions_Bx1, kt, v, cfg,
                                    sharder, sliding, view_len, pages_BxV,
                                    kernel, sparse)
    out[sliding][0].append(kt)
    out[sliding][1].append(v)
    if sparse:
      experts.append(trace.experts_BxTxK[:, 0])
  x = _norm(x, params["final_norm"], cfg)
  if cache.local_kt is None:
    new_cache = DecodeCache(kt=out[False][0], v=out[False][1])
  else:
    new_cache = DecodeCache(kt=out[False][0], v=out[False][1],
                            local_kt=out[True][0], local_v=out[True][1])
  experts_BxLxK = jnp.stack(experts, axis=1) if experts else None
  return unembed(params, x, cfg=cfg, sharder=sharder), new_cache, experts_BxLxK
