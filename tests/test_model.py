"""The transformer: sharded == single device, causality, packing, KV cache."""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model import attention, transformer
from kimi_jax.model.config import FULL, SLIDING, ModelConfig
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

# Numerics of pure functions on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, rope_theta=10000.0,
                  qkv_bias=True, max_seq_len=64)
# Gemma-style blocks with sliding layers of window 3 around a full one.
WINDOWED = dataclasses.replace(
    CFG, n_layers=3, qkv_bias=False, qk_norm=True, norm_offset=1.0,
    post_norms=True, mlp_activation="gelu_tanh", embed_scale=True,
    query_pre_attn_scalar=12.0, layer_types=(SLIDING, FULL, SLIDING),
    sliding_window=3, sliding_rope_theta=100.0)


def _random_params(cfg: ModelConfig, seed: int) -> transformer.Params:
  """Host-random params (no init compile); norms and biases away from 1 / 0
  so that their placement matters."""
  rng = np.random.RandomState(seed)

  def leaf(path, shape):
    name = jax.tree_util.keystr(path)
    noise = rng.normal(size=shape).astype(np.float32)
    if "norm" in name:
      return jnp.asarray(1.0 + 0.3 * noise)
    if name.endswith(("['bq']", "['bk']", "['bv']")):
      return jnp.asarray(0.3 * noise)
    return jnp.asarray(0.2 * noise)

  return jax.tree_util.tree_map_with_path(
      leaf, transformer.param_shapes(cfg),
      is_leaf=lambda x: isinstance(x, tuple))


def _tokens(shape: tuple[int, ...], seed: int) -> np.ndarray:
  return np.random.RandomState(seed).randint(0, CFG.vocab_size, shape)


def _positions(B: int, T: int) -> np.ndarray:
  return np.broadcast_to(np.arange(T, dtype=np.int32), (B, T)).copy()


@functools.partial(jax.jit, static_argnames="cfg")
def _logits(params, tokens, positions, segments, cfg):
  return transformer.forward(params, tokens, positions, segments, cfg=cfg)[0]


# --------------------------------------------------------------------------
# Sharded (data=2 x fsdp=2 x tensor=2) == single device


def _loss(params, tokens_BxT, cfg, sharder):
  B, T = tokens_BxT.shape
  positions = jnp.broadcast_to(jnp.arange(T), (B, T))
  segments = jnp.ones((B, T), jnp.int32)
  logits, _ = transformer.forward(params, tokens_BxT, positions, segments,
                                  cfg=cfg, sharder=sharder)
  logp = transformer.token_logprobs(logits[:, :-1], tokens_BxT[:, 1:])
  return -jnp.mean(logp), logits


def test_sharded_logits_and_grads_equal_single_device():
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  params = transformer.init_sharded(CFG, 0, sharder)
  tokens = _tokens((4, 12), seed=1)
  batch_sharding = sharder.data_sharding(tokens.shape, ("batch", "length"))
  tokens_sharded = jax.device_put(tokens, batch_sharding)
  grad_fn = jax.value_and_grad(_loss, has_aux=True)

  sharded = jax.jit(functools.partial(grad_fn, cfg=CFG, sharder=sharder))
  (loss, logits), grads = sharded(params, tokens_sharded)

  device0 = jax.devices()[0]
  host_params = jax.device_get(params)
  single = jax.jit(functools.partial(grad_fn, cfg=CFG, sharder=None))
  (ref_loss, ref_logits), ref_grads = single(
      jax.device_put(host_params, device0), jax.device_put(tokens, device0))

  # The sharded run really was sharded: batch split 4 ways, vocab 2 ways.
  assert logits.sharding.shard_shape(logits.shape) == (1, 12, 32)
  np.testing.assert_allclose(loss, ref_loss, rtol=1e-5)
  np.testing.assert_allclose(logits, ref_logits, rtol=1e-5, atol=1e-5)
  flat = jax.tree_util.tree_flatten_with_path(jax.device_get(grads))[0]
  ref_flat = jax.tree_util.tree_leaves(jax.device_get(ref_grads))
  for (path, g), ref_g in zip(flat, ref_flat):
    assert np.abs(ref_g).max() > 0, jax.tree_util.keystr(path)
    np.testing.assert_allclose(g, ref_g, rtol=1e-5, atol=1e-6,
                               err_msg=jax.tree_util.keystr(path))


# --------------------------------------------------------------------------
# hidden_states / unembed: the states every head reads


def test_hidden_states_are_final_normed_and_give_forward_logits():
  """hidden_states returns the stream after the final norm (what the LM
  head and a reward model's value head read): divided by the final norm's
  scale each vector has RMS 1; forward's logits (unembed of them) equal
  h @ embed^T recomputed on the host (tied embeddings)."""
  cfg = dataclasses.replace(CFG, tie_embeddings=True)
  params = _random_params(cfg, seed=11)
  tokens = _tokens((2, 9), seed=12)
  pos, seg = _positions(2, 9), np.ones((2, 9), np.int32)
  h, _ = jax.jit(functools.partial(transformer.hidden_states, cfg=cfg))(
      params, tokens, pos, seg)
  h = np.asarray(h, np.float64)
  unit = h / np.asarray(params["final_norm"], np.float64)
  np.testing.assert_allclose(np.sqrt((unit ** 2).mean(-1)), 1.0, rtol=1e-4)
  logits = np.asarray(_logits(params, tokens, pos, seg, cfg))
  np.testing.assert_allclose(
      logits, h @ np.asarray(params["embed"], np.float64).T, rtol=1e-4,
      atol=1e-4)


# --------------------------------------------------------------------------
# Causality and packing


def test_changing_a_later_token_leaves_earlier_logits():
  params = _random_params(CFG, seed=2)
  tokens = _tokens((1, 10), seed=3)
  changed = tokens.copy()
  changed[0, 6] = (changed[0, 6] + 1) % CFG.vocab_size
  pos, seg = _positions(1, 10), np.ones((1, 10), np.int32)
  a = np.asarray(_logits(params, tokens, pos, seg, CFG))
  b = np.asarray(_logits(params, changed, pos, seg, CFG))
  np.testing.assert_array_equal(a[:, :6], b[:, :6])
  assert np.all(np.abs(a[:, 6:] - b[:, 6:]).max(axis=-1) > 1e-4)


def test_logits_have_zero_gradient_wrt_later_token_embeddings():
  cfg = dataclasses.replace(CFG, tie_embeddings=False)  # embed only as input
  params = _random_params(cfg, seed=4)
  T = 10
  tokens = np.random.RandomState(5).permutation(cfg.vocab_size)[None, :T]
  pos, seg = _positions(1, T), np.ones((1, T), np.int32)

  def logits_sum_T(embed_VxD):
    p = dict(params, embed=embed_VxD)
    return transformer.forward(p, tokens, pos, seg, cfg=cfg)[0][0].sum(-1)

  jac_TxVxD = np.asarray(jax.jacrev(logits_sum_T)(params["embed"]))
  for t in range(T):
    grad_norm_T = np.abs(jac_TxVxD[t][tokens[0]]).sum(-1)  # per position t'
    assert np.all(grad_norm_T[:t + 1] > 0), t
    np.testing.assert_array_equal(grad_norm_T[t + 1:], 0.0)


def test_packed_segments_match_sequences_run_alone():
  params = _random_params(CFG, seed=6)
  a, b = _tokens((1, 5), seed=7), _tokens((1, 6), seed=8)
  packed = np.concatenate([a, b, np.zeros((1, 1), int)], axis=1)
  seg = np.array([[1] * 5 + [2] * 6 + [0]], np.int32)
  pos = np.array([list(range(5)) + list(range(6)) + [0]], np.int32)
  out = np.asarray(_logits(params, packed, pos, seg, CFG))
  alone_a = _logits(params, a, _positions(1, 5), np.ones((1, 5), np.int32),
                    CFG)
  alone_b = _logits(params, b, _positions(1, 6), np.ones((1, 6), np.int32),
                    CFG)
  np.testing.assert_allclose(out[:, :5], alone_a, rtol=1e-5, atol=1e-5)
  np.testing.assert_allclose(out[:, 5:11], alone_b, rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------
# KV cache decoding == full forward


@functools.partial(jax.jit, static_argnames="cfg")
def _cached_step(params, tokens, positions, segments, cache, cfg):
  return transformer.forward(params, tokens, positions, segments, cfg=cfg,
                             cache=cache)


@pytest.mark.parametrize("prefill_len, cfg", [
    (1, CFG), (4, CFG), pytest.param(4, WINDOWED, marks=pytest.mark.slow)])
def test_decode_with_cache_matches_full_forward(prefill_len, cfg):
  params = _random_params(cfg, seed=9)
  B, T = 2, 9
  tokens = _tokens((B, T), seed=10)
  full = np.asarray(_logits(params, tokens, _positions(B, T),
                            np.ones((B, T), np.int32), cfg))
  cache = transformer.init_cache(cfg, B, 16)
  steps = [(0, prefill_len)] + [(t, t + 1) for t in range(prefill_len, T)]
  for start, end in steps:
    n = end - start
    logits, cache = _cached_step(
        params, tokens[:, start:end], _positions(B, end)[:, start:],
        np.ones((B, n), np.int32), cache, cfg)
    np.testing.assert_allclose(logits, full[:, start:end], rtol=1e-5,
                               atol=1e-5, err_msg=f"tokens {start}:{end}")
  np.testing.assert_array_equal(cache.lengths, [T, T])


@pytest.mark.parametrize("cfg", [
    CFG, pytest.param(WINDOWED, marks=pytest.mark.slow)])
def test_right_padded_prefill_rows_of_different_lengths_then_decode(cfg):
  params = _random_params(cfg, seed=11)
  lengths = [7, 4]
  n_decode = 3
  seqs = [_tokens((n + n_decode,), seed=12 + i) for i, n in
          enumerate(lengths)]
  P = max(lengths)
  prefill = np.zeros((2, P), np.int64)
  seg = np.zeros((2, P), np.int32)
  for i, n in enumerate(lengths):
    prefill[i, :n] = seqs[i][:n]
    seg[i, :n] = 1
  cache = transformer.init_cache(cfg, 2, 16)
  logits, cache = _cached_step(params, prefill, _positions(2, P), seg, cache,
                               cfg)
  np.testing.assert_array_equal(cache.lengths, lengths)
  got = [[np.asarray(logits[i, :n])] for i, n in enumerate(lengths)]
  for step in range(n_decode):
    pos = np.array([[n + step] for n in lengths], np.int32)
    tok = np.array([[s[n + step]] for s, n in zip(seqs, lengths)])
    logits, cache = _cached_step(params, tok, pos, np.ones((2, 1), np.int32),
                                 cache, cfg)
    for i in range(2):
      got[i].append(np.asarray(logits[i]))
  for i, s in enumerate(seqs):
    alone = _logits(params, s[None], _positions(1, len(s)),
                    np.ones((1, len(s)), np.int32), cfg)[0]
    np.testing.assert_allclose(np.concatenate(got[i]), alone, rtol=1e-5,
                               atol=1e-5, err_msg=f"row {i}")


# --------------------------------------------------------------------------
# Unrolled layers (model.scan_layers=False) == the scan


def test_unrolled_layers_give_the_scans_loss_gradients_and_cache():
  unrolled = dataclasses.replace(CFG, scan_layers=False)
  params = _random_params(CFG, seed=21)
  tokens = jnp.asarray(_tokens((3, 12), seed=22))
  grad = jax.jit(jax.value_and_grad(
      lambda p, c: _loss(p, tokens, c, None)[0]), static_argnums=1)
  (loss_s, g_s), (loss_u, g_u) = grad(params, CFG), grad(params, unrolled)
  np.testing.assert_allclose(float(loss_u), float(loss_s), rtol=1e-6)
  for a, b in zip(jax.tree.leaves(g_u), jax.tree.leaves(g_s)):
    np.testing.assert_allclose(np.asarray(a), np.asarray(b), rtol=1e-5,
                               atol=1e-7)
  # The setting is for the cache-free path only: prefill into a cache
  # scans as before, so sampling is the same program either way.
  lowered = {
      c.scan_layers: jax.jit(
          lambda p, c=c: transformer.forward(
              p, tokens, _positions(3, 12), np.ones((3, 12), np.int32),
              cfg=c, cache=transformer.init_cache(c, 3, 16),
              prefill=True)).lower(params).as_text()
      for c in (CFG, unrolled)}
  assert lowered[True] == lowered[False]
  cache_free = {
      c.scan_layers: jax.jit(lambda p, c=c: _loss(p, tokens, c, None)[0]
                             ).lower(params).as_text()
      for c in (CFG, unrolled)}
  assert "while" in cache_free[True] and "while" not in cache_free[False]


# --------------------------------------------------------------------------
# Sliding-window layers


def _windowed_attention_loss(impl, block, seg, cot, window):
  def loss(q, k, v):
    out = attention.self_attention(q, k, v, seg, impl=impl, block=block,
                                   sharder=None, window=window, scale=0.3)
    return jnp.sum(out * cot), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _windowed_inputs(T: int, seed: int):
  """q, k, v of two rows (two packed sequences, then padding; one whole
  sequence), their segments, and a cotangent that is 0 on padding."""
  rng = np.random.default_rng(seed)
  B, H, K, Dh = 2, 4, 2, 8
  f = lambda *shape: rng.standard_normal(shape).astype(np.float32)
  seg = np.ones((B, T), np.int32)
  seg[0, T // 3:] = 2
  seg[0, T - 3:] = 0
  cot = f(B, T, H, Dh) * (seg != 0)[:, :, None, None]
  return f(B, T, H, Dh), f(B, T, K, Dh), f(B, T, K, Dh), seg, cot


def test_windowed_blockwise_attention_equals_dense():
  """Forward and gradients of blockwise attention with a window (key blocks
  wholly outside it skipped) equal the dense reference; the window
  changes the output."""
  q, k, v, seg, cot = _windowed_inputs(40, seed=0)
  (_, ref), g_ref = _windowed_attention_loss("dot", 8, seg, cot, 5)(q, k, v)
  (_, out), g = _windowed_attention_loss("blockwise", 8, seg, cot, 5)(q, k, v)
  valid = (seg != 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0),
                             rtol=1e-5, atol=1e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)
  (_, full), _ = _windowed_attention_loss("dot", 8, seg, cot, None)(q, k, v)
  assert np.abs(np.where(valid, full - ref, 0)).max() > 1e-2


@pytest.mark.slow
def test_windowed_splash_attention_equals_dense():
  # The Pallas TPU kernel with a local mask, run by the Pallas interpreter.
  q, k, v, seg, cot = _windowed_inputs(256, seed=1)
  (_, ref), g_ref = _windowed_attention_loss("dot", 128, seg, cot, 40)(q, k,
                                                                       v)
  (_, out), g = _windowed_attention_loss("splash", 128, seg, cot, 40)(q, k,
                                                                      v)
  valid = (seg != 0)[:, :, None, None]
  np.testing.assert_allclose(np.where(valid, out, 0), np.where(valid, ref, 0),
                             rtol=1e-5, atol=1e-5)
  for a, b in zip(g, g_ref):
    np.testing.assert_allclose(a, b, rtol=1e-4, atol=1e-4)


@pytest.mark.slow
def test_mixed_layer_kinds_scan_unrolled_and_blockwise_agree():
  """A model with full and sliding layers: the scan (kinds as a scanned
  flag, attention through lax.cond), the unrolled layers (static kinds)
  with remat, and blockwise attention give one loss and one gradient; a
  window that covers the rows gives the all-full model's."""
  params = _random_params(WINDOWED, seed=31)
  tokens = jnp.asarray(_tokens((2, 12), seed=32))
  grad = jax.jit(jax.value_and_grad(
      lambda p, c: _loss(p, tokens, c, None)[0]), static_argnums=1)
  loss, g = grad(params, WINDOWED)
  for changes in (dict(scan_layers=False, remat=True),
                  dict(attention="blockwise", attention_block=4)):
    loss2, g2 = grad(params, dataclasses.replace(WINDOWED, **changes))
    np.testing.assert_allclose(float(loss2), float(loss), rtol=1e-6)
    for a, b in zip(jax.tree.leaves(g2), jax.tree.leaves(g)):
      b = np.asarray(b)
      np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4,
                                 atol=1e-4 * np.abs(b).max())
  wide = dataclasses.replace(WINDOWED, sliding_window=12,
                             sliding_rope_theta=None)
  all_full = dataclasses.replace(wide, layer_types=None)
  np.testing.assert_allclose(float(grad(params, wide)[0]),
                             float(grad(params, all_full)[0]), rtol=1e-6)
  assert abs(float(grad(params, all_full)[0]) - float(loss)) > 1e-4


def test_windowed_prefill_holds_no_layers_keys_beyond_its_caches():
  """A prefill into an empty cache fills the same cache as the cached path,
  and its temporaries do not grow with the number of sliding layers: each
  layer writes its keys into the cache as the scan goes, none are stacked
  for all layers (at 32k tokens those would be 7x Gemma 3's full cache)."""
  B, T = 2, 512
  tokens = _tokens((B, 12), seed=41)
  pos, seg = _positions(B, 12), np.array([[1] * 12, [1] * 7 + [0] * 5])
  run = jax.jit(lambda p, c, prefill: transformer.hidden_states(
      p, tokens, pos, seg, cfg=c, cache=transformer.init_cache(c, B, 16),
      prefill=prefill), static_argnums=(1, 2))
  params = _random_params(WINDOWED, seed=42)
  (x, cache), (x_ref, cache_ref) = (run(params, WINDOWED, True),
                                    run(params, WINDOWED, False))
  close = functools.partial(np.testing.assert_allclose, rtol=1e-5, atol=1e-5)
  # Padding (row 1 past 7) differs by design; real tokens and rings agree.
  real, held = seg.astype(bool), np.pad(seg, ((0, 0), (0, 4))).astype(bool)
  x, x_ref, cache, cache_ref = jax.tree.map(
      np.asarray, (x, x_ref, cache, cache_ref))
  close(x[real], x_ref[real])
  close(cache.k[:, held], cache_ref.k[:, held])
  close(cache.v[:, held], cache_ref.v[:, held])
  close(cache.local_k, cache_ref.local_k)
  close(cache.local_v, cache_ref.local_v)
  np.testing.assert_array_equal(cache.lengths, [12, 7])

  def temp_bytes(n_layers: int) -> int:
    cfg = dataclasses.replace(
        CFG, n_layers=n_layers, max_seq_len=T, attention="blockwise",
        attention_block=64, sliding_window=16,
        layer_types=(SLIDING,) * (n_layers - 1) + (FULL,))
    tok = jax.ShapeDtypeStruct((B, T), jnp.int32)
    fn = jax.jit(lambda p, t: transformer.hidden_states(
        p, t, t, t, cfg=cfg, cache=transformer.init_cache(cfg, B, T),
        prefill=True))
    return fn.lower(transformer.abstract_params(cfg), tok).compile(
        ).memory_analysis().temp_size_in_bytes

  one_layer_kv = 2 * B * T * CFG.n_kv_heads * CFG.head_dim * 4
  assert temp_bytes(12) - temp_bytes(2) < one_layer_kv
