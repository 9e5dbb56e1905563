"""`Sampler.generate(keep_cut_kv=True)`: budget-cut requests stay in their
slots, and the next call continues them there without a prefill. Checked
against the prefilled continuation (same weights) and against the
trainer's cached forward with the cache built under the earlier weights
(new weights), on rows and on pages."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.driver import SampleRequest, Sampler, continuation
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, mlp_dim=256, qkv_bias=True,
                  max_seq_len=48)
ROWS = EngineConfig(max_slots=4, cache_len=48, prefill_buckets=(8, 32))
PAGES = EngineConfig(max_slots=4, cache_len=48, prefill_buckets=(8, 32),
                     page_size=8)
NO_REPEAT = RepeatConfig(enabled=False)
GREEDY = SamplingParams(greedy=True)


def _params(seed):
  # A larger init scale than training's makes greedy argmax free of ties.
  return jax.jit(lambda: transformer.init_params(
      CFG, jax.random.key(seed), std=0.2))()


@pytest.fixture(scope="module")
def params():
  return _params(0)


def _prompt(seed, n):
  return tuple(int(x) for x in np.random.default_rng(seed).integers(0, 64, n))


def _requests(budget, sampling=GREEDY):
  return [SampleRequest(f"r{i}", _prompt(i, n), max_new_tokens=30,
                        sampling=sampling, budget=budget)
          for i, n in enumerate([3, 11, 6])]


def _continue(requests, results, budget, seed=None):
  out = []
  for req, res in zip(requests, results):
    nxt = continuation(req, res, budget=budget)
    if seed is not None and not nxt.sampling.is_greedy:
      nxt = SampleRequest(nxt.id, nxt.prompt, prefix=nxt.prefix,
                          max_new_tokens=nxt.max_new_tokens, budget=budget,
                          sampling=SamplingParams(temperature=1.0, seed=seed))
    out.append(nxt)
  return out


@pytest.mark.parametrize("engine_cfg", [ROWS, PAGES], ids=["rows", "pages"])
def test_kept_slots_continue_like_a_prefill_under_the_same_weights(
    params, engine_cfg):
  requests = _requests(5) + [SampleRequest(
      "s", _prompt(9, 7), max_new_tokens=30, budget=5,
      sampling=SamplingParams(temperature=1.0, seed=4))]
  keeping = Sampler(Engine(CFG, engine_cfg), NO_REPEAT, steps_per_call=3)
  first, stats = keeping.generate(params, requests, keep_cut_kv=True)
  assert [r.finish_reason for r in first] == ["budget"] * 4
  assert stats.resumed == 0
  # The continuation draws with a new seed, as each RL iteration does.
  nxt = _continue(requests, first, budget=6, seed=11)
  kept, kept_stats = keeping.generate(params, nxt)
  assert kept_stats.resumed == 4 and kept_stats.prefill_tokens == 0
  fresh = Sampler(Engine(CFG, engine_cfg), NO_REPEAT, steps_per_call=3)
  prefilled, fresh_stats = fresh.generate(params, nxt)
  assert fresh_stats.resumed == 0 and fresh_stats.prefill_tokens > 0
  for a, b in zip(kept, prefilled):
    assert a.tokens == b.tokens and a.finish_reason == b.finish_reason
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-5)
  # That call did not keep its cut slots: the one after prefills again.
  again, again_stats = keeping.generate(params, _continue(nxt, kept, 4))
  assert again_stats.resumed == 0 and again_stats.prefill_tokens > 0
  assert all(len(r.tokens) == 4 for r in again)


@functools.partial(jax.jit, static_argnames="cfg")
def _cached_forward(params, tokens_1xT, start, cache, cfg):
  T = tokens_1xT.shape[1]
  positions = start + jnp.arange(T)[None]
  return transformer.forward(params, tokens_1xT, positions,
                             jnp.ones_like(tokens_1xT), cfg=cfg, cache=cache)


def _greedy_over_old_cache(old, new, context, n_new):
  """Greedy tokens and their log-probs under `new` weights, over a cache
  whose entries for `context[:-1]` were computed under `old` ones (the
  trainer's cached forward, one token at a time after the context)."""
  cache = transformer.init_cache(CFG, 1, 48)
  _, cache = _cached_forward(old, jnp.asarray([context[:-1]], jnp.int32), 0,
                             cache, CFG)
  token, tokens, logprobs = context[-1], [], []
  for t in range(n_new):
    logits, cache = _cached_forward(new, jnp.asarray([[token]], jnp.int32),
                                    len(context) - 1 + t, cache, CFG)
    logp = jax.nn.log_softmax(np.asarray(logits[0, -1], np.float64))
    token = int(np.argmax(logp))
    tokens.append(token)
    logprobs.append(float(logp[token]))
  return tuple(tokens), np.asarray(logprobs)


@pytest.mark.host_inputs  # the reference's tokens go to the device
@pytest.mark.parametrize("engine_cfg", [ROWS, PAGES], ids=["rows", "pages"])
def test_kept_slots_under_new_weights_read_the_old_keys_and_values(
    params, engine_cfg):
  new = _params(1)
  requests = _requests(4)
  sampler = Sampler(Engine(CFG, engine_cfg), NO_REPEAT, steps_per_call=3)
  first, _ = sampler.generate(params, requests, keep_cut_kv=True)
  nxt = _continue(requests, first, budget=5)
  kept, stats = sampler.generate(new, nxt)
  assert stats.resumed == 3
  prefilled, _ = Sampler(Engine(CFG, engine_cfg), NO_REPEAT,
                         steps_per_call=3).generate(new, nxt)
  for req, got, other in zip(nxt, kept, prefilled):
    want_tokens, want_logprobs = _greedy_over_old_cache(
        params, new, req.prompt + req.prefix, 5)
    assert got.tokens == want_tokens
    np.testing.assert_allclose(got.logprobs, want_logprobs, atol=1e-4)
    # Keys and values of the new weights would give other log-probs.
    assert np.max(np.abs(np.asarray(got.logprobs[:1]) -
                         np.asarray(other.logprobs[:1]))) > 1e-3


@pytest.mark.parametrize("mesh", [dict(data=2), dict(data=2, fsdp=2,
                                                      tensor=2)],
                         ids=["devices-loop-apart", "data-fsdp-tensor"])
def test_kept_slots_on_a_mesh_match_one_device(params, mesh):
  from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
  n = int(np.prod(list(mesh.values())))
  sharder = Sharder(make_mesh(MeshConfig(**mesh), jax.devices()[:n]))
  engine = Engine(CFG, PAGES, sharder=sharder)
  mesh_params = jax.device_put(params, engine.param_shardings)
  requests = _requests(5) + [SampleRequest(
      "s", _prompt(9, 7), max_new_tokens=30, budget=5,
      sampling=SamplingParams(temperature=1.0, seed=4))]
  out = []
  for sampler, p in ((Sampler(engine, NO_REPEAT, steps_per_call=3),
                      mesh_params),
                     (Sampler(Engine(CFG, PAGES), NO_REPEAT,
                              steps_per_call=3), params)):
    first, _ = sampler.generate(p, requests, keep_cut_kv=True)
    second, stats = sampler.generate(p, _continue(requests, first, 6,
                                                  seed=11))
    assert stats.resumed == 4 and stats.prefill_tokens == 0
    out.append((first, second))
  for on_mesh, single in zip(*out):
    assert [r.tokens for r in on_mesh] == [r.tokens for r in single]
    for a, b in zip(on_mesh, single):
      np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_slots_no_request_continues_are_freed(params):
  engine = Engine(CFG, PAGES)
  sampler = Sampler(engine, NO_REPEAT, steps_per_call=3)
  requests = _requests(4)
  first, _ = sampler.generate(params, requests, keep_cut_kv=True)
  state = sampler._state
  assert engine.host_lengths(state).tolist().count(0) == 1
  assert state.host.pages.free_pages < state.host.pages.n_pages
  # Only the first request continues; the other two slots are freed.
  nxt = _continue(requests[:1], first[:1], budget=3)
  other = SampleRequest("new", _prompt(20, 5), max_new_tokens=4,
                        sampling=GREEDY)
  out, stats = sampler.generate(params, nxt + [other])
  assert stats.resumed == 1
  assert [r.finish_reason for r in out] == ["budget", "length"]
  state = sampler._state
  assert not state.host.active.any()
  assert state.host.pages.free_pages == state.host.pages.n_pages
  assert not sampler._kept


def test_window_keeps_the_requests_its_close_cuts(params):
  """4 slots, 6 requests, a window of 6 tokens: two requests end early and
  their slots go to the queued ones; those the window's close cuts are
  kept, and the next call continues them without a prefill."""
  sampler = Sampler(Engine(CFG, ROWS), NO_REPEAT, steps_per_call=2)
  requests = [SampleRequest(f"q{i}", _prompt(30 + i, 4),
                            max_new_tokens=[2, 30, 30, 3, 30, 30][i],
                            sampling=GREEDY) for i in range(6)]
  out, _ = sampler.generate(params, requests, window=6, min_admit=1,
                            keep_cut_kv=True)
  cut = [i for i, r in enumerate(out) if r is not None and
         r.finish_reason == "budget"]
  assert cut and len(sampler._kept) == len(cut)
  nxt = [continuation(requests[i], out[i], budget=2) for i in cut]
  _, stats = sampler.generate(params, nxt)
  assert stats.resumed == len(cut) and stats.prefill_tokens == 0


def test_keep_cut_kv_refuses_routing_replay():
  moe = ModelConfig(vocab_size=64, d_model=32, n_layers=1, n_heads=2,
                    n_kv_heads=1, head_dim=16, mlp_dim=64, max_seq_len=16,
                    n_experts=4, n_experts_per_token=2, expert_mlp_dim=32)
  engine = Engine(moe, EngineConfig(max_slots=2, cache_len=16,
                                    record_experts=True))
  with pytest.raises(ValueError, match="keep_cut_kv"):
    Sampler(engine).generate(None, [SampleRequest(
        "a", (1, 2), max_new_tokens=3)], keep_cut_kv=True)


@pytest.mark.parametrize("overrides,needle", [
    ({"reference_logprobs": "sampler", "train_on_old_segments": False},
     "reference_logprobs='recompute'"),
    ({"routing_replay": True}, "routing_replay"),
    ({"keep_partial_kv": 1}, "true or false"),
])
def test_rl_keep_partial_kv_checks_name_the_key(overrides, needle):
  from kimi_jax.rl.config import RLConfig
  with pytest.raises(ValueError, match=r"config\.rl\.keep_partial_kv") as e:
    RLConfig(iterations=1, prompts_per_iteration=8, samples_per_prompt=2,
             **{"keep_partial_kv": True, **overrides})
  assert needle in str(e.value)
