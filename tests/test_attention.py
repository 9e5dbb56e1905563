"""Memory-efficient attention, chunked log-probs and context parallelism
against the dense reference (float32, CPU, 8 fake devices)."""

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model import attention, logprobs, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

CFG = ModelConfig(vocab_size=96, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True,
                  attention="dot", attention_block=16, logprob_chunk=16)


@pytest.fixture(autouse=True)
def _strict():
  # What the project's test configuration will enforce everywhere.
  with jax.numpy_rank_promotion("raise"), \
      jax.transfer_guard_host_to_device("disallow"):
    yield


def _put(x):
  return jax.device_put(np.asarray(x))


def _params(cfg, seed):
  return jax.jit(lambda: transformer.init_params(cfg, jax.random.key(seed)))()


def _packed_segments(rng, B, T):
  """Rows of 1-3 packed sequences followed by padding (segment 0)."""
  seg = np.zeros((B, T), np.int32)
  pos = np.zeros((B, T), np.int32)
  for b in range(B):
    col = 0
    for s in range(1, rng.integers(1, 4) + 1):
      n = int(rng.integers(1, T // 2))
      n = min(n, T - col - 1)
      if n <= 0:
        break
      seg[b, col:col + n] = s
      pos[b, col:col + n] = np.arange(n)
      col += n
  return seg, pos


def _qkv(rng, B, T, H, K, Dh):
  f = lambda *s: rng.standard_normal(s).astype(np.float32)
  return f(B, T, H, Dh), f(B, T, K, Dh), f(B, T, K, Dh)


def _attention_loss(impl, block, seg, cot, sharder=None):
  def loss(q, k, v):
    out = attention.self_attention(q, k, v, seg, impl=impl, block=block,
                                   sharder=sharder)
    return jnp.sum(out * cot), out
  return jax.jit(jax.value_and_grad(loss, argnums=(0, 1, 2), has_aux=True))


def _valid_cotangent(rng, seg, shape):
  # Padding outputs are unspecified (and never trained on): weight them 0.
  cot = rng.standard_normal(shape).astype(np.float32)
  return cot * (seg != 0)[:, :, None, None].astype(np.float32)


def _close(a, b, rtol):
  a, b = np.asarray(a, np.float64), np.asarray(b, np.float64)
  scale = np.max(np.abs(b))
  assert np.max(np.abs(a - b)) <= rtol * scale, (
      f"max abs diff {np.max(np.abs(a - b)):.3g} vs scale {scale:.3g}")


@pytest.mark.parametrize("T,block", [
    (40, 16), pytest.param(64, 16, marks=pytest.mark.slow),
    pytest.param(33, 64, marks=pytest.mark.slow)])
def test_blockwise_equals_dense_forward_and_gradients(T, block):
  rng = np.random.default_rng(T)
  B, H, K, Dh = 3, 4, 2, 8
  q, k, v = map(_put, _qkv(rng, B, T, H, K, Dh))
  seg_np, _ = _packed_segments(rng, B, T)
  seg = _put(seg_np)
  cot = _put(_valid_cotangent(rng, seg_np, (B, T, H, Dh)))
  (l_ref, out_ref), g_ref = _attention_loss("dot", block, seg, cot)(q, k, v)
  (l_blk, out_blk), g_blk = _attention_loss("blockwise", block, seg, cot)(
      q, k, v)
  valid = (seg_np != 0)[:, :, None, None]
  _close(np.where(valid, out_blk, 0), np.where(valid, out_ref, 0), 1e-5)
  _close(l_blk, l_ref, 1e-5)
  for a, b in zip(g_blk, g_ref):
    _close(a, b, 1e-5)


def test_blockwise_query_slice_with_offset_equals_the_full_row():
  # What one context shard computes: its queries, every key of the row.
  rng = np.random.default_rng(0)
  B, T, H, K, Dh = 2, 64, 4, 2, 8
  q, k, v = map(_put, _qkv(rng, B, T, H, K, Dh))
  seg = _put(_packed_segments(rng, B, T)[0])
  full, part = jax.jit(lambda q, k, v, seg: (
      attention.blockwise_local(q, k, v, seg, seg, 0, block=16),
      attention.blockwise_local(q[:, 32:], k, v, seg[:, 32:], seg, 32,
                                block=16)))(q, k, v, seg)
  np.testing.assert_allclose(part, np.asarray(full)[:, 32:], rtol=1e-6,
                             atol=1e-6)


@pytest.mark.slow
def test_splash_interpret_equals_dense_forward_and_gradients():
  # The Pallas TPU kernel itself, run by the Pallas interpreter on CPU.
  rng = np.random.default_rng(1)
  B, T, H, K, Dh = 1, 256, 4, 2, 16
  q, k, v = map(_put, _qkv(rng, B, T, H, K, Dh))
  seg_np = np.zeros((B, T), np.int32)
  seg_np[0, :100], seg_np[0, 100:230] = 1, 2  # two sequences, then padding
  seg = _put(seg_np)
  cot = _put(_valid_cotangent(rng, seg_np, (B, T, H, Dh)))
  (_, out_ref), g_ref = _attention_loss("dot", 128, seg, cot)(q, k, v)
  (_, out_spl), g_spl = _attention_loss("splash", 128, seg, cot)(q, k, v)
  valid = (seg_np != 0)[:, :, None, None]
  _close(np.where(valid, out_spl, 0), np.where(valid, out_ref, 0), 1e-5)
  for a, b in zip(g_spl, g_ref):
    _close(a, b, 1e-4)


def _batch(rng, B, T, vocab):
  seg, pos = _packed_segments(rng, B, T)
  tokens = rng.integers(0, vocab, (B, T)).astype(np.int32)
  targets = rng.integers(0, vocab, (B, T)).astype(np.int32)
  return tokens, pos, seg, targets


def _masked_logp_loss(cfg, sharder, mask):
  def loss(params, tokens, pos, seg, targets):
    logp = logprobs.token_logprobs(params, tokens, pos, seg, targets, cfg=cfg,
                                   sharder=sharder)
    return jnp.sum(logp * mask), logp
  return jax.value_and_grad(loss, has_aux=True)


def _reference_logp_loss(cfg, mask):
  def loss(params, tokens, pos, seg, targets):
    logits, _ = transformer.forward(params, tokens, pos, seg, cfg=cfg)
    logp = transformer.token_logprobs(logits, targets)
    return jnp.sum(logp * mask), logp
  return jax.value_and_grad(loss, has_aux=True)


@pytest.mark.slow
@pytest.mark.parametrize("chunk", [16, 24, 64])
def test_chunked_logprobs_equal_full_logits(chunk):
  rng = np.random.default_rng(chunk)
  B, T = 3, 48
  data = [_put(x) for x in _batch(rng, B, T, CFG.vocab_size)]
  mask = _put((np.asarray(data[2]) != 0).astype(np.float32))
  params = _params(CFG, 0)
  cfg = dataclasses.replace(CFG, logprob_chunk=chunk)
  (l_ref, logp_ref), g_ref = jax.jit(_reference_logp_loss(CFG, mask))(
      params, *data)
  (l_chk, logp_chk), g_chk = jax.jit(_masked_logp_loss(cfg, None, mask))(
      params, *data)
  np.testing.assert_allclose(logp_chk, logp_ref, rtol=1e-6, atol=1e-6)
  jax.tree.map(lambda a, b: _close(a, b, 1e-6), g_chk, g_ref)
  _close(l_chk, l_ref, 1e-6)


def test_chunked_logprobs_keep_one_chunk_of_logits():
  # The compiled gradient's temporaries hold one chunk's logits, not T's.
  B, T, V = 2, 4096, 4096
  cfg = dataclasses.replace(CFG, vocab_size=V)
  params = transformer.abstract_params(cfg)
  x = jax.ShapeDtypeStruct((B, T, cfg.d_model), jnp.float32)
  targets = jax.ShapeDtypeStruct((B, T), jnp.int32)

  def temp_bytes(chunk):
    c = dataclasses.replace(cfg, logprob_chunk=chunk)
    fn = jax.jit(jax.grad(lambda p, x, y: jnp.sum(logprobs.hidden_logprobs(
        p, x, y, cfg=c)), argnums=(0, 1)))
    return fn.lower(params, x, targets).compile().memory_analysis(
    ).temp_size_in_bytes

  full_logits = B * T * V * 4
  unchunked, chunked = temp_bytes(T), temp_bytes(64)
  assert unchunked > full_logits, (unchunked, full_logits)
  assert chunked < full_logits / 8, (chunked, full_logits)


def _model_loss(cfg, sharder):
  def loss(params, tokens, pos, seg, targets):
    logp = logprobs.token_logprobs(params, tokens, pos, seg, targets, cfg=cfg,
                                   sharder=sharder)
    mask = (seg != 0).astype(jnp.float32)
    return -jnp.sum(logp * mask) / jnp.sum(mask)
  return jax.value_and_grad(loss)


@pytest.mark.slow
@pytest.mark.parametrize("impl", ["blockwise", "dot"])
def test_context_parallel_model_equals_unsplit(impl):
  """data=2 x context=2 x tensor=2 on 8 CPU devices: the sequence of every
  activation split in two, keys/values gathered; loss and gradients equal
  the single-device run of the dense model."""
  rng = np.random.default_rng(7)
  B, T = 4, 64
  data = [_put(x) for x in _batch(rng, B, T, CFG.vocab_size)]
  params = _params(CFG, 1)
  ref_loss, ref_grads = jax.jit(_model_loss(CFG, None))(params, *data)

  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=1, context=2,
                                         tensor=2)))
  cfg = dataclasses.replace(CFG, attention=impl)
  params_sh = transformer.param_shardings(cfg, sharder)
  row_sh = sharder.data_sharding((B, T), ("batch", "act_length"))
  assert row_sh.shard_shape((B, T)) == (2, 32)
  fn = jax.jit(_model_loss(cfg, sharder),
               in_shardings=(params_sh,) + (row_sh,) * 4)
  loss, grads = fn(jax.device_put(params, params_sh),
                   *[jax.device_put(x, row_sh) for x in data])
  _close(loss, ref_loss, 1e-5)
  jax.tree.map(lambda a, b: _close(a, b, 1e-5), grads, ref_grads)


@pytest.mark.slow
def test_context_parallel_splash_equals_dense():
  """Splash inside shard_map with its query blocks split over `context`
  (interpret mode on CPU): equal to dense attention."""
  rng = np.random.default_rng(3)
  B, T, H, K, Dh = 2, 512, 4, 2, 16
  q, k, v = map(_put, _qkv(rng, B, T, H, K, Dh))
  seg_np = np.zeros((B, T), np.int32)
  seg_np[:, :300], seg_np[:, 300:500] = 1, 2
  seg = _put(seg_np)
  cot = _put(_valid_cotangent(rng, seg_np, (B, T, H, Dh)))
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=1, context=2,
                                         tensor=2)))
  (_, out_ref), g_ref = _attention_loss("dot", 128, seg, cot)(q, k, v)
  (_, out_cp), g_cp = _attention_loss("splash", 128, seg, cot, sharder)(
      q, k, v)
  valid = (seg_np != 0)[:, :, None, None]
  _close(np.where(valid, out_cp, 0), np.where(valid, out_ref, 0), 1e-5)
  for a, b in zip(g_cp, g_ref):
    _close(a, b, 1e-4)


@pytest.mark.slow
def test_prefill_then_decode_over_a_long_cache_equals_full_forward():
  """A 200-token prompt prefilled with blockwise attention (blocks of 16)
  into an empty cache, then 8 decode steps over the 208-entry cache: every
  logit equals the dense forward of the whole sequence."""
  cfg = dataclasses.replace(CFG, attention="blockwise", max_seq_len=256)
  rng = np.random.default_rng(5)
  P, N, S = 200, 8, 224
  seq = rng.integers(0, cfg.vocab_size, (1, P + N)).astype(np.int32)
  params = _params(cfg, 2)
  ref_cfg = dataclasses.replace(cfg, attention="dot")
  ref = jax.jit(lambda p, t: transformer.forward(
      p, t, jnp.arange(P + N)[None], jnp.ones_like(t), cfg=ref_cfg)[0])(
          params, _put(seq))

  @jax.jit
  def prefill(params, tokens_1xS):
    seg = (jnp.arange(S) < P).astype(jnp.int32)[None]
    cache = transformer.init_cache(cfg, 1, S)
    return transformer.forward(params, tokens_1xS, jnp.arange(S)[None], seg,
                               cfg=cfg, cache=cache, prefill=True)

  @jax.jit
  def step(params, token_1x1, cache):
    return transformer.forward(params, token_1x1, cache.lengths[:, None],
                               jnp.ones((1, 1), jnp.int32), cfg=cfg,
                               cache=cache)

  padded = np.zeros((1, S), np.int32)
  padded[0, :P] = seq[0, :P]
  logits, cache = prefill(params, _put(padded))
  ref, logits = np.asarray(ref), np.asarray(logits)
  np.testing.assert_allclose(logits[0, :P], ref[0, :P], rtol=1e-5, atol=1e-5)
  for t in range(N):
    logits, cache = step(params, _put(seq[:, P + t:P + t + 1]), cache)
    np.testing.assert_allclose(np.asarray(logits)[0, 0], ref[0, P + t], rtol=1e-5,
                               atol=1e-5)
  assert int(cache.lengths[0]) == P + N


def test_auto_picks_by_the_mesh_platform():
  assert attention.resolve("auto", None) == "blockwise"  # CPU backend
  sharder = Sharder(make_mesh(MeshConfig(data=8)))
  assert attention.resolve("auto", sharder) == "blockwise"
  assert attention.resolve("dot", sharder) == "dot"
  with pytest.raises(ValueError, match="model.attention"):
    attention.resolve("flash", None)
  with pytest.raises(ValueError, match="model.attention"):
    dataclasses.replace(CFG, attention="flash")
