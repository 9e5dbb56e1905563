"""Weight matmuls in a narrower dtype (`model.matmul_dtype`,
`sampler.matmul_dtype`): the model rounds its weight matrices and their
inputs to it and accumulates in the compute dtype; weights stored rounded
(`round_weights`, what the engine's decode loop reads) give the same bits;
an engine run so decodes as that model does, away from the float32 one;
bad values are refused naming their key."""

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, mlp_dim=128, qkv_bias=True,
                  max_seq_len=48)
MOE = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=48, qk_norm=True,
                  n_experts=8, n_experts_per_token=2, expert_mlp_dim=16,
                  norm_topk_prob=True, tie_embeddings=True, max_seq_len=48)
BF16 = "bfloat16"
T = 24


def _params(cfg):
  # A larger init scale than training's: peaked next-token distributions,
  # so greedy argmax has no near-ties.
  return jax.jit(lambda: transformer.init_params(cfg, jax.random.key(0),
                                                 std=0.2))()


@functools.partial(jax.jit, static_argnames="cfg")
def _jit_logits(params, tokens_1xT, cfg):
  positions = jnp.arange(tokens_1xT.shape[1])[None]
  return transformer.forward(params, tokens_1xT, positions,
                             jnp.ones_like(tokens_1xT), cfg=cfg)[0][0]


def _logits(params, tokens_1xT, cfg):
  return _jit_logits(params, jax.device_put(tokens_1xT), cfg=cfg)


def _tokens(seed, n=T):
  return np.random.default_rng(seed).integers(0, 64, (1, n)).astype(np.int32)


@pytest.mark.parametrize("cfg", [CFG, MOE], ids=["dense", "moe"])
def test_weights_stored_rounded_give_the_same_bits(cfg):
  params = _params(cfg)
  low = dataclasses.replace(cfg, matmul_dtype=BF16)
  rounded = transformer.round_weights(params, low)
  for name, x in [*rounded.items(), *rounded["layers"].items()]:
    if name == "layers":
      continue
    want = (jnp.bfloat16 if name in transformer.MATMUL_WEIGHTS
            else jnp.float32)
    assert x.dtype == want, name
  assert rounded["layers"]["router" if cfg.n_experts else "wq"].dtype == (
      jnp.float32 if cfg.n_experts else jnp.bfloat16)
  assert transformer.round_weights(params, cfg) is params
  tokens = _tokens(0)
  got = np.asarray(_logits(params, tokens, low))
  np.testing.assert_array_equal(np.asarray(_logits(rounded, tokens, low)),
                                got)
  # Rounded inputs change the logits, by about bfloat16's precision.
  exact = np.asarray(_logits(params, tokens, cfg))
  diff = np.abs(got - exact).max()
  assert 1e-4 * np.abs(exact).max() < diff < 5e-2 * np.abs(exact).max()


def _bf16(a):
  """a rounded to bfloat16 (on the host), back in float64."""
  return np.asarray(a).astype(jnp.bfloat16).astype(np.float64)


def test_weight_products_round_inputs_and_accumulate_in_float32():
  """A dense projection and an expert product of the bfloat16-matmul model
  are the exact products of the rounded inputs, to float32 accumulation
  (a bfloat16 result would be ~4e-3 off)."""
  rng = np.random.default_rng(0)
  x = rng.standard_normal((2, 3, 64)).astype(np.float32)
  w = rng.standard_normal((64, 128)).astype(np.float32)
  low = dataclasses.replace(CFG, matmul_dtype=BF16)
  got = transformer._times_weight("btd,df->btf", *jax.device_put((x, w)),
                                  low)
  assert got.dtype == jnp.float32
  np.testing.assert_allclose(got, np.einsum("btd,df->btf", _bf16(x),
                                            _bf16(w)), rtol=0, atol=1e-4)
  # Experts: rows 0-2 to expert 0, rows 3-5 to expert 1.
  from kimi_jax.model import moe
  xs = rng.standard_normal((6, 32)).astype(np.float32)
  ws = rng.standard_normal((2, 32, 16)).astype(np.float32)
  sizes = np.array([3, 3], np.int32)
  got = moe._expert_product(*jax.device_put((xs, ws, sizes)),
                            dataclasses.replace(MOE, matmul_dtype=BF16))
  assert got.dtype == jnp.float32
  want = np.concatenate([_bf16(xs[:3]) @ _bf16(ws[0]),
                         _bf16(xs[3:]) @ _bf16(ws[1])])
  np.testing.assert_allclose(got, want, rtol=0, atol=1e-4)


def _ref_logp(params, seq, cfg):
  row = np.zeros((1, 48), np.int32)
  row[0, :len(seq)] = seq
  logits = np.asarray(_logits(params, row, cfg), np.float64)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def test_an_engine_with_bfloat16_matmuls_decodes_as_that_model_does():
  """Greedy tokens are the step-by-step argmax of the uncached forward with
  the same matmul dtype, and every log-prob is that forward's, far closer
  than to the float32 model's."""
  params = _params(CFG)
  low = dataclasses.replace(CFG, matmul_dtype=BF16)
  engine = Engine(CFG, EngineConfig(max_slots=4, cache_len=48,
                                    prefill_buckets=(8, 32),
                                    matmul_dtype=BF16))
  assert engine.cfg.matmul_dtype == BF16
  # The decode loop reads weights rounded once per rollout, not per step.
  decode_params = engine.decode_params(params)
  assert decode_params.layers[0]["w_up"].dtype == jnp.bfloat16
  assert decode_params.top["embed"].dtype == jnp.bfloat16
  sampler = Sampler(engine, RepeatConfig(enabled=False), steps_per_call=3)
  prompts = [tuple(int(t) for t in _tokens(s, n)[0])
             for s, n in ((1, 5), (2, 11), (3, 7), (4, 20), (5, 3))]
  greedy = [SampleRequest(i, p, max_new_tokens=10,
                          sampling=SamplingParams(greedy=True))
            for i, p in enumerate(prompts)]
  drawn = [SampleRequest(10 + i, p, max_new_tokens=12,
                         sampling=SamplingParams(seed=i))
           for i, p in enumerate(prompts)]
  results, _ = sampler.generate(params, greedy + drawn)
  near, far = [], []
  for req, res in zip(greedy + drawn, results):
    seq = list(req.prompt)
    for t, lp in zip(res.tokens, res.logprobs):
      ref_low = _ref_logp(params, seq, low)[len(seq) - 1]
      ref_exact = _ref_logp(params, seq, CFG)[len(seq) - 1]
      if req.sampling.greedy:
        assert t == int(np.argmax(ref_low))
      near.append(abs(lp - ref_low[t]))
      far.append(abs(lp - ref_exact[t]))
      seq.append(t)
  assert max(near) < 1e-5
  assert np.mean(far) > 1e-3


def test_bad_matmul_dtypes_are_refused_naming_their_key():
  with pytest.raises(ValueError, match="sampler.matmul_dtype"):
    SamplerConfig(max_slots=2, cache_len=8, matmul_dtype="float64")
  with pytest.raises(ValueError, match="model.matmul_dtype"):
    dataclasses.replace(CFG, matmul_dtype="int8")
  half = dataclasses.replace(CFG, compute_dtype=BF16)
  with pytest.raises(ValueError, match="model.matmul_dtype"):
    dataclasses.replace(half, matmul_dtype="float32")
  with pytest.raises(ValueError, match="sampler.matmul_dtype='float32' is "
                     "wider than model.compute_dtype"):
    Engine(half, EngineConfig(max_slots=2, cache_len=8,
                              matmul_dtype="float32"))
