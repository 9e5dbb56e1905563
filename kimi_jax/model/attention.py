"""Causal self-attention over packed rows, with and without a T x T matrix.

`self_attention(q, k, v, segment_ids, impl=...)` is what the training path
and the prefill of `transformer.forward` call. Token t of a row attends to
tokens s <= t of the same segment (segment ids 1, 2, ...; 0 is padding).
Four implementations, chosen by `model.attention`:

  dot        the dense reference: B x K x G x T x S scores, then softmax.
  blockwise  online softmax in plain JAX (any backend): queries and keys in
             blocks, a custom VJP that keeps only the output and the
             log-sum-exp per query and recomputes block scores in the
             backward pass. Memory O(T x block); key blocks entirely after a
             query block are skipped.
  splash     the Pallas TPU splash-attention kernel (grouped-query through
             its multi-query form, segment ids, causal block sparsity); on a
             non-TPU mesh it runs in Pallas interpret mode (tests).
  auto       splash on TPU, blockwise elsewhere (decided by the mesh's
             devices, so an ahead-of-time compile for a TPU topology on a
             CPU host picks splash); rows no longer than one block take the
             dense path off TPU, which is what one block computes anyway.

On a mesh, blockwise and splash run inside `jax.shard_map`: rows over the
batch axes, heads over `tensor`, and the sequence over the `act_length`
rule's axes (context parallelism). Each device keeps its slice of queries
and all-gathers the keys, values and key segment ids of its row along the
context axes, then attends with its slice's offset in the row. Keys and
values are the small side under grouped-query attention (K of H heads), so
the gather moves K/H of what gathering queries would; causal work is
unbalanced across context shards (the last slice sees the whole row), the
memory is balanced.

Positions that are padding (segment 0) get an unspecified finite output
(dot: the mean of all values; blockwise: zero; splash: attention over
earlier padding); callers mask them out of every loss.

Every implementation takes `window` (sliding-window layers: token t sees
only tokens s > t - window of its segment; blockwise skips key blocks
wholly outside it, splash builds a local mask) and `scale` (scores are
q.k * scale; None: 1 / sqrt(head_dim)).
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec

from kimi_jax.sharding import Sharder

IMPLEMENTATIONS = ("dot", "blockwise", "splash", "auto")
MASK_VALUE = -0.7 * float(np.finfo(np.float32).max)
_SPLASH_LANES = 128  # splash blocks are multiples of the TPU lane width


def resolve(impl: str, sharder: Sharder | None) -> str:
  """The implementation `impl` stands for on this mesh (or default backend)."""
  if impl not in IMPLEMENTATIONS:
    raise ValueError(f"model.attention must be one of {IMPLEMENTATIONS}, got "
                     f"{impl!r}")
  if impl != "auto":
    return impl
  return "splash" if _platform(sharder) == "tpu" else "blockwise"


def _platform(sharder: Sharder | None) -> str:
  if sharder is None:
    return jax.default_backend()
  return sharder.mesh.devices.flat[0].platform


# ---- dense ------------------------------------------------------------------


def scale_scores(scores: jax.Array, head_dim: int,
                 scale: float | None) -> jax.Array:
  """Scores times `scale`, or divided by sqrt(head_dim) when None."""
  if scale is None:
    return scores / jnp.sqrt(jnp.float32(head_dim))
  return scores * jnp.float32(scale)


def dense(q_BxTxHxDh: jax.Array, k_BxSxKxDh: jax.Array, v_BxSxKxDh: jax.Array,
          mask_BxTxS: jax.Array, scale: float | None = None) -> jax.Array:
  """Softmax attention under an explicit mask; materialises B H T S."""
  B, T, H, Dh = q_BxTxHxDh.shape
  K = k_BxSxKxDh.shape[2]
  q_BxTxKxGxDh = q_BxTxHxDh.reshape(B, T, K, H // K, Dh)
  scores = scale_scores(
      jnp.einsum("btkgd,bskd->bkgts", q_BxTxKxGxDh, k_BxSxKxDh,
                 preferred_element_type=jnp.float32), Dh, scale)
  scores = jnp.where(mask_BxTxS[:, None, None, :, :], scores, MASK_VALUE)
  probs = jax.nn.softmax(scores, axis=-1).astype(v_BxSxKxDh.dtype)
  out = jnp.einsum("bkgts,bskd->btkgd", probs, v_BxSxKxDh)
  return out.reshape(B, T, H, Dh)


def packed_causal_mask(segment_ids_BxT: jax.Array,
                       window: int | None = None) -> jax.Array:
  """Causal within a segment (and within `window`); segment 0 is padding
  and sees nothing."""
  T = segment_ids_BxT.shape[1]
  causal_TxT = jnp.tril(jnp.ones((T, T), bool))
  if window is not None:
    causal_TxT &= ~jnp.tril(jnp.ones((T, T), bool), -window)
  same = segment_ids_BxT[:, :, None] == segment_ids_BxT[:, None, :]
  valid = (segment_ids_BxT != 0)[:, :, None]
  return causal_TxT[None] & same & valid


# ---- blockwise (online softmax, custom VJP) -----------------------------------


def _block_mask(q_seg_Bxb, kv_seg_Bxc, q_pos_b, kv_pos_c, window):
  same = q_seg_Bxb[:, :, None] == kv_seg_Bxc[:, None, :]
  valid = (q_seg_Bxb != 0)[:, :, None]
  causal = kv_pos_c[None, None, :] <= q_pos_b[None, :, None]
  if window is not None:
    causal &= kv_pos_c[None, None, :] > q_pos_b[None, :, None] - window
  return same & valid & causal  # B x b x c


def _kv_blocks_needed(q_start, iq, bq: int, bk: int, nk: int):
  """Key blocks 0 .. n-1 hold every key a query block can see (causal)."""
  last_q = q_start + (iq + 1) * bq - 1
  return jnp.clip(last_q // bk + 1, 0, nk)


def _kv_blocks_from(q_start, iq, bq: int, bk: int, nk: int, window):
  """First key block a query block can see (0 without a window)."""
  if window is None:
    return 0
  first_q = q_start + iq * bq
  return jnp.clip((first_q - window + 1) // bk, 0, nk)


def _q_blocks_from(q_start, jk, bq: int, bk: int, nq: int):
  """First query block that can see key block jk (causal)."""
  return jnp.clip((jk * bk - q_start) // bq, 0, nq)


def _q_blocks_needed(q_start, jk, bq: int, bk: int, nq: int, window):
  """Query blocks before this one can see key block jk (all without a
  window)."""
  if window is None:
    return nq
  last_q = (jk + 1) * bk - 1 + window - 1
  return jnp.clip((last_q - q_start) // bq + 1, 0, nq)


def _scores(q_BxbxKxGxDh, k_BxcxKxDh, scale):
  return jnp.einsum("bqkgd,bskd->bkgqs", q_BxbxKxGxDh, k_BxcxKxDh,
                    preferred_element_type=jnp.float32) * scale


def _probs(s, mask_Bxbxc, ref_BxKxGxb):
  """exp(s - ref) where the mask allows, exactly 0 elsewhere."""
  keep = mask_Bxbxc[:, None, None]
  return jnp.where(keep, jnp.exp(jnp.where(keep, s, 0.0) -
                                 ref_BxKxGxb[..., None]), 0.0)


def _blockwise_fwd_impl(q, k, v, q_seg, kv_seg, q_start, bq, bk, window,
                        scale):
  """q: B x T x K x G x Dh (T = nq bq); k, v: B x S x K x Dh (S = nk bk).

  Returns out (B x T x K x G x Dh, q's dtype) and lse (B x K x G x T, f32).
  """
  B, T, K, G, Dh = q.shape
  S = k.shape[1]
  nq, nk = T // bq, S // bk
  scale = 1.0 / math.sqrt(Dh) if scale is None else scale

  def q_block(iq):
    qb = jax.lax.dynamic_slice_in_dim(q, iq * bq, bq, axis=1)
    qs = jax.lax.dynamic_slice_in_dim(q_seg, iq * bq, bq, axis=1)
    q_pos = q_start + iq * bq + jnp.arange(bq)

    def kv_step(jk, carry):
      m, l, acc = carry
      kb = jax.lax.dynamic_slice_in_dim(k, jk * bk, bk, axis=1)
      vb = jax.lax.dynamic_slice_in_dim(v, jk * bk, bk, axis=1)
      ks = jax.lax.dynamic_slice_in_dim(kv_seg, jk * bk, bk, axis=1)
      mask = _block_mask(qs, ks, q_pos, jk * bk + jnp.arange(bk), window)
      s = _scores(qb, kb, scale)
      m_new = jnp.maximum(m, jnp.max(jnp.where(mask[:, None, None], s,
                                               MASK_VALUE), axis=-1))
      p = _probs(s, mask, m_new)
      corr = jnp.exp(m - m_new)
      l = l * corr + p.sum(-1)
      acc = acc * corr[..., None] + jnp.einsum(
          "bkgqs,bskd->bkgqd", p.astype(v.dtype), vb,
          preferred_element_type=jnp.float32)
      return m_new, l, acc

    init = (jnp.full((B, K, G, bq), MASK_VALUE, jnp.float32),
            jnp.zeros((B, K, G, bq), jnp.float32),
            jnp.zeros((B, K, G, bq, Dh), jnp.float32))
    n = _kv_blocks_needed(q_start, iq, bq, bk, nk)
    first = _kv_blocks_from(q_start, iq, bq, bk, nk, window)
    m, l, acc = jax.lax.fori_loop(first, n, kv_step, init)
    safe_l = jnp.where(l > 0, l, 1.0)
    out = acc / safe_l[..., None]
    return out, m + jnp.log(safe_l)

  out, lse = jax.lax.map(q_block, jnp.arange(nq))
  # nq x B x K x G x bq x Dh -> B x T x K x G x Dh
  out = jnp.transpose(out, (1, 0, 4, 2, 3, 5)).reshape(B, T, K, G, Dh)
  lse = jnp.transpose(lse, (1, 2, 3, 0, 4)).reshape(B, K, G, T)
  return out.astype(q.dtype), lse


def _blockwise_bwd_impl(q, k, v, q_seg, kv_seg, q_start, out, lse, dout,
                        bq, bk, window, scale):
  B, T, K, G, Dh = q.shape
  S = k.shape[1]
  nq, nk = T // bq, S // bk
  scale = 1.0 / math.sqrt(Dh) if scale is None else scale
  # D_t = sum_d dout * out: the softmax backward's row term.
  delta = jnp.einsum("btkgd,btkgd->bkgt", dout.astype(jnp.float32),
                     out.astype(jnp.float32))

  def q_slices(iq):
    sl = lambda x, axis=1: jax.lax.dynamic_slice_in_dim(x, iq * bq, bq, axis)
    return (sl(q), sl(dout), sl(q_seg), sl(lse, 3), sl(delta, 3),
            q_start + iq * bq + jnp.arange(bq))

  def kv_slices(jk):
    sl = lambda x: jax.lax.dynamic_slice_in_dim(x, jk * bk, bk, axis=1)
    return sl(k), sl(v), sl(kv_seg), jk * bk + jnp.arange(bk)

  def block_grads(iq, jk):
    """p and dS of one (query block, key block) pair."""
    qb, dob, qs, lse_b, delta_b, q_pos = q_slices(iq)
    kb, vb, ks, kv_pos = kv_slices(jk)
    mask = _block_mask(qs, ks, q_pos, kv_pos, window)
    p = _probs(_scores(qb, kb, scale), mask, lse_b)
    dp = jnp.einsum("bqkgd,bskd->bkgqs", dob, vb,
                    preferred_element_type=jnp.float32)
    ds = p * (dp - delta_b[..., None])
    return p, ds, qb, dob, kb

  def dq_block(iq):
    def step(jk, dq):
      _, ds, _, _, kb = block_grads(iq, jk)
      return dq + jnp.einsum("bkgqs,bskd->bqkgd", ds, kb.astype(jnp.float32))
    n = _kv_blocks_needed(q_start, iq, bq, bk, nk)
    first = _kv_blocks_from(q_start, iq, bq, bk, nk, window)
    return jax.lax.fori_loop(first, n, step, jnp.zeros((B, bq, K, G, Dh),
                                                       jnp.float32)) * scale

  def dkv_block(jk):
    def step(iq, carry):
      dk, dv = carry
      p, ds, qb, dob, _ = block_grads(iq, jk)
      dv = dv + jnp.einsum("bkgqs,bqkgd->bskd", p, dob.astype(jnp.float32))
      dk = dk + jnp.einsum("bkgqs,bqkgd->bskd", ds, qb.astype(jnp.float32))
      return dk, dv
    zeros = jnp.zeros((B, bk, K, Dh), jnp.float32)
    dk, dv = jax.lax.fori_loop(
        _q_blocks_from(q_start, jk, bq, bk, nq),
        _q_blocks_needed(q_start, jk, bq, bk, nq, window), step,
        (zeros, zeros))
    return dk * scale, dv

  dq = jax.lax.map(dq_block, jnp.arange(nq))
  dq = jnp.moveaxis(dq, 0, 1).reshape(B, T, K, G, Dh)
  dk, dv = jax.lax.map(dkv_block, jnp.arange(nk))
  dk = jnp.moveaxis(dk, 0, 1).reshape(B, S, K, Dh)
  dv = jnp.moveaxis(dv, 0, 1).reshape(B, S, K, Dh)
  return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)


@functools.partial(jax.custom_vjp, nondiff_argnums=(6, 7, 8, 9))
def _blockwise_core(q, k, v, q_seg, kv_seg, q_start, bq, bk, window, scale):
  return _blockwise_fwd_impl(q, k, v, q_seg, kv_seg, q_start, bq, bk, window,
                             scale)[0]


def _blockwise_core_fwd(q, k, v, q_seg, kv_seg, q_start, bq, bk, window,
                        scale):
  out, lse = _blockwise_fwd_impl(q, k, v, q_seg, kv_seg, q_start, bq, bk,
                                 window, scale)
  return out, (q, k, v, q_seg, kv_seg, q_start, out, lse)


def _blockwise_core_bwd(bq, bk, window, scale, res, dout):
  q, k, v, q_seg, kv_seg, q_start, out, lse = res
  dq, dk, dv = _blockwise_bwd_impl(q, k, v, q_seg, kv_seg, q_start, out, lse,
                                   dout, bq, bk, window, scale)
  return dq, dk, dv, None, None, None


_blockwise_core.defvjp(_blockwise_core_fwd, _blockwise_core_bwd)


def _pad_len(x: jax.Array, axis: int, multiple: int) -> jax.Array:
  n = x.shape[axis]
  extra = -n % multiple
  if not extra:
    return x
  pad = [(0, 0)] * x.ndim
  pad[axis] = (0, extra)
  return jnp.pad(x, pad)  # zeros: padded tokens get segment 0


def blockwise_local(q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_seg_BxT, kv_seg_BxS,
                    q_start, *, block: int, window: int | None = None,
                    scale: float | None = None) -> jax.Array:
  """Blockwise attention of T queries that start at row index `q_start`
  over the S keys of the whole row (S = T without context parallelism)."""
  B, T, H, Dh = q_BxTxHxDh.shape
  S, K = k_BxSxKxDh.shape[1], k_BxSxKxDh.shape[2]
  bq, bk = min(block, T), min(block, S)
  q = _pad_len(q_BxTxHxDh.reshape(B, T, K, H // K, Dh), 1, bq)
  out = _blockwise_core(q, _pad_len(k_BxSxKxDh, 1, bk),
                        _pad_len(v_BxSxKxDh, 1, bk), _pad_len(q_seg_BxT, 1, bq),
                        _pad_len(kv_seg_BxS, 1, bk), q_start, bq, bk, window,
                        scale)
  return out[:, :T].reshape(B, T, H, Dh)


# ---- splash (Pallas TPU kernel) ------------------------------------------------


def _splash_block(length: int, block: int) -> int:
  """Largest multiple of 128 that is <= block and divides `length`."""
  b = max(_SPLASH_LANES, block // _SPLASH_LANES * _SPLASH_LANES)
  while length % b:
    b -= _SPLASH_LANES
  return b


def _splash_kernel(groups: int, length: int, q_shards: int, block: int,
                   interpret: bool, window: int | None = None):
  """A multi-query splash kernel for `groups` query heads per key head over a
  causal (or local: `window`) length x length mask, its query blocks split
  into `q_shards`."""
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash, splash_attention_mask as masks)
  b = _splash_block(length // q_shards, block)
  sizes = splash.BlockSizes(
      block_q=b, block_kv=b, block_kv_compute=b, block_q_dkv=b,
      block_kv_dkv=b, block_kv_dkv_compute=b, block_q_dq=b, block_kv_dq=b)
  if window is None:
    one = masks.CausalMask((length, length))
  else:  # keys in (q - window, q]
    one = masks.LocalMask((length, length), (window - 1, 0), offset=0)
  mask = masks.MultiHeadMask([one] * groups)
  # The kernel builds its block-sparsity tables from the static mask as
  # small constant arrays; they are part of the program, not input data.
  with jax.transfer_guard_host_to_device("allow"):
    return splash.make_splash_mqa(mask, block_sizes=sizes, head_shards=1,
                                  q_seq_shards=q_shards, interpret=interpret)


def _splash_local(kernel, q_BxTxHxDh, k_BxSxKxDh, v_BxSxKxDh, q_seg_BxT,
                  kv_seg_BxS, scale: float | None = None) -> jax.Array:
  from jax.experimental.pallas.ops.tpu.splash_attention import (
      splash_attention_kernel as splash)
  B, T, H, Dh = q_BxTxHxDh.shape
  K = k_BxSxKxDh.shape[2]
  # Splash does not scale scores; pre-scale the queries instead.
  scale = 1.0 / math.sqrt(Dh) if scale is None else scale
  q = (q_BxTxHxDh * jnp.asarray(scale, q_BxTxHxDh.dtype))
  q_BxKxGxTxDh = jnp.transpose(q.reshape(B, T, K, H // K, Dh), (0, 2, 3, 1, 4))
  k_BxKxSxDh = jnp.transpose(k_BxSxKxDh, (0, 2, 1, 3))
  v_BxKxSxDh = jnp.transpose(v_BxSxKxDh, (0, 2, 1, 3))

  def one_row(q_KxGxTxDh, k_KxSxDh, v_KxSxDh, q_seg_T, kv_seg_S):
    seg = splash.SegmentIds(q=q_seg_T, kv=kv_seg_S)
    return jax.vmap(lambda q_, k_, v_: kernel(q_, k_, v_, segment_ids=seg))(
        q_KxGxTxDh, k_KxSxDh, v_KxSxDh)

  out = jax.vmap(one_row)(q_BxKxGxTxDh, k_BxKxSxDh, v_BxKxSxDh, q_seg_BxT,
                          kv_seg_BxS)
  return jnp.transpose(out, (0, 3, 1, 2, 4)).reshape(B, T, H, Dh)


# ---- dispatch -----------------------------------------------------------------


def _axes(sharder: Sharder, name: str, dim: int) -> tuple[str, ...]:
  axes = sharder.rule_map.get(name, ())
  return axes if axes and dim % sharder.axis_size(axes) == 0 else ()


def _spec(*parts: tuple[str, ...]) -> PartitionSpec:
  return PartitionSpec(*[(p if len(p) > 1 else p[0]) if p else None
                         for p in parts])


def self_attention(q_BxTxHxDh: jax.Array, k_BxTxKxDh: jax.Array,
                   v_BxTxKxDh: jax.Array, segment_ids_BxT: jax.Array, *,
                   impl: str, block: int, sharder: Sharder | None,
                   window: int | None = None, scale: float | None = None
                   ) -> jax.Array:
  """Causal attention within segments of packed rows (see module doc)."""
  chosen = resolve(impl, sharder)
  if chosen == "dot" or (impl == "auto" and chosen == "blockwise" and
                         q_BxTxHxDh.shape[1] <= block):
    # Rows of one block: blockwise would compute exactly this, slower.
    return dense(q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh,
                 packed_causal_mask(segment_ids_BxT, window), scale)
  impl = chosen
  B, T, H, _ = q_BxTxHxDh.shape
  K = k_BxTxKxDh.shape[2]
  if sharder is None:
    batch = heads = context = ()
  else:
    batch = _axes(sharder, "batch", B)
    # Query and key heads split together, or the groups would not line up.
    heads = _axes(sharder, "heads", H)
    heads = heads if heads and heads == _axes(sharder, "kv_heads", K) else ()
    context = _axes(sharder, "act_length", T)
  n_ctx = sharder.axis_size(context) if context else 1

  if impl == "splash":
    length = T + (-T % (_SPLASH_LANES * n_ctx))
    pad = lambda x: _pad_len(x, 1, length)
    q, k, v, seg = map(pad, (q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh,
                             segment_ids_BxT))
    kernel = _splash_kernel(H // K, length, n_ctx, block,
                            interpret=_platform(sharder) != "tpu",
                            window=window)
  else:
    q, k, v, seg, kernel = (q_BxTxHxDh, k_BxTxKxDh, v_BxTxKxDh,
                            segment_ids_BxT, None)

  def local(kernel, q, k, v, seg):
    if context:
      gather = lambda x: jax.lax.all_gather(x, context, axis=1, tiled=True)
      k, v, kv_seg = gather(k), gather(v), gather(seg)
      q_start = jax.lax.axis_index(context) * q.shape[1]
    else:
      kv_seg, q_start = seg, 0
    if impl == "splash":
      return _splash_local(kernel, q, k, v, seg, kv_seg, scale)
    return blockwise_local(q, k, v, seg, kv_seg, q_start, block=block,
                           window=window, scale=scale)

  if sharder is None:
    return local(kernel, q, k, v, seg)[:, :T]
  mesh = sharder.mesh
  qo_spec = _spec(batch, context, heads, ())
  seg_spec = _spec(batch, context)
  specs = (qo_spec, qo_spec, qo_spec, seg_spec)
  if kernel is None:
    fn, args = functools.partial(local, None), (q, k, v, seg)
  else:
    # The kernel's block tables follow the query blocks of each context shard.
    specs = (kernel.manual_sharding_spec(
        NamedSharding(mesh, _spec((), context))),) + specs
    fn, args = local, (kernel, q, k, v, seg)
  out = jax.shard_map(fn, mesh=mesh, in_specs=specs, out_specs=qo_spec,
                      check_vma=False)(*args)
  return out[:, :T]
