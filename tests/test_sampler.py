"""The decode engine and continuous-batching driver against the trainer's
uncached forward: greedy outputs, log-probs, slot reuse, partial rollouts,
repeat stops, bad requests, an 8-device mesh and the weight handoff."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler import handoff
from kimi_jax.sampler.driver import (SampleRequest, SampleRequestError,
                                     Sampler, continuation)
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, ShardingError, make_mesh

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, mlp_dim=256, qkv_bias=True,
                  max_seq_len=48)
ENGINE_CFG = EngineConfig(max_slots=4, cache_len=48, prefill_buckets=(8, 32))
NO_REPEAT = RepeatConfig(enabled=False)
GREEDY = SamplingParams(greedy=True)
REF_LEN = 48


@pytest.fixture(scope="module")
def params():
  # A larger init scale than training's 0.02 makes the next-token
  # distribution peaked, so greedy argmax has no near-ties.
  return jax.jit(lambda key: transformer.init_params(CFG, key, std=0.2))(
      jax.random.key(0))


@pytest.fixture(scope="module")
def engine(params):
  return Engine(CFG, ENGINE_CFG, params=params)


@pytest.fixture(scope="module")
def sampler(engine):
  # 3 steps per call: slots that stop mid-call must have their extra tokens
  # discarded.
  return Sampler(engine, NO_REPEAT, steps_per_call=3)


@jax.jit
def _ref_logits(params, tokens_1xT):
  """Uncached trainer forward over a right-padded row (causal, so padding
  after position n does not change the logits before it)."""
  T = tokens_1xT.shape[1]
  positions = jnp.arange(T)[None]
  logits, _ = transformer.forward(params, tokens_1xT, positions,
                                  jnp.ones_like(tokens_1xT), cfg=CFG)
  return logits[0]


def _ref_logp(params, seq):
  row = np.zeros((1, REF_LEN), np.int32)
  row[0, :len(seq)] = seq
  logits = np.asarray(_ref_logits(params, row), np.float64)
  return logits - np.log(np.exp(logits).sum(-1, keepdims=True))


def greedy_reference(params, prompt, n_new):
  """Step-by-step argmax over the full forward, no cache."""
  seq = list(prompt)
  for _ in range(n_new):
    seq.append(int(np.argmax(_ref_logp(params, seq)[len(seq) - 1])))
  return seq[len(prompt):]


def trainer_logprobs(params, prompt, response):
  """log pi(response_i | prompt, response_<i) from one uncached forward."""
  seq = list(prompt) + list(response)
  logp = _ref_logp(params, seq)
  n = len(prompt)
  return np.array([logp[n - 1 + i, t] for i, t in enumerate(response)])


def _prompt(seed, n):
  return tuple(int(x) for x in np.random.default_rng(seed).integers(0, 64, n))


MIXED = [(_prompt(i, n), m) for i, (n, m) in
         enumerate([(3, 9), (20, 14), (7, 5), (12, 16), (5, 11), (30, 6)])]


def test_greedy_matches_uncached_argmax_and_compiles_are_bounded(
    params, engine, sampler):
  reqs = [SampleRequest(i, p, max_new_tokens=m, sampling=GREEDY)
          for i, (p, m) in enumerate(MIXED)]
  results = sampler.generate(reqs)
  assert [r.id for r in results] == list(range(len(reqs)))
  for (prompt, m), res in zip(MIXED, results):
    assert res.tokens == tuple(greedy_reference(params, prompt, m))
    assert res.finish_reason == "length"
  stats = sampler.last_stats
  assert stats.tokens_generated == sum(m for _, m in MIXED)
  assert 0 < stats.slot_utilisation <= 1
  counts = engine.compile_count()
  assert counts["prefill"] <= 2 and counts["insert"] <= 2  # two buckets
  assert counts["generate"] == 1 and counts["init_decode_state"] == 1
  sampler.generate([SampleRequest("again", _prompt(9, 25), max_new_tokens=4,
                                   sampling=GREEDY)])
  assert engine.compile_count() == counts


def test_logprobs_equal_trainer_logprobs(params, sampler):
  settings = [SamplingParams(seed=1), SamplingParams(seed=2),
              SamplingParams(seed=3, temperature=0.7, top_k=5),
              SamplingParams(seed=4, top_p=0.8), GREEDY]
  reqs = [SampleRequest(i, _prompt(10 + i, 4 + 3 * i), max_new_tokens=12,
                        sampling=s) for i, s in enumerate(settings)]
  for req, res in zip(reqs, sampler.generate(reqs)):
    assert len(res.tokens) == 12
    want = trainer_logprobs(params, req.prompt, res.tokens)
    np.testing.assert_allclose(res.logprobs, want, atol=1e-4)
  # top_k=5 draws only among the model's 5 most likely tokens.
  res = sampler.generate([reqs[2]])[0]
  seq = list(reqs[2].prompt) + list(res.tokens)
  logp = _ref_logp(params, seq)
  for i, t in enumerate(res.tokens):
    top5 = np.argsort(-logp[len(reqs[2].prompt) - 1 + i])[:5]
    assert t in top5


def test_slot_reuse_and_batch_composition_do_not_change_results(sampler):
  target = SampleRequest("x", _prompt(50, 4), max_new_tokens=10,
                         sampling=SamplingParams(seed=42))
  alone = sampler.generate([target])[0]
  # Longer prompts first fill every slot; the target then lands in a slot
  # whose cache still holds a longer previous sequence.
  others = [SampleRequest(i, _prompt(60 + i, 25), max_new_tokens=3 + i,
                          sampling=SamplingParams(seed=i)) for i in range(6)]
  mixed = sampler.generate(others + [target])
  assert mixed[-1] == alone
  shuffled = sampler.generate([target] + others[::-1])
  assert shuffled[0] == alone
  assert {r.id: r for r in shuffled[1:]} == {r.id: r for r in mixed[:-1]}
  other_seed = sampler.generate([SampleRequest(
      "x", target.prompt, max_new_tokens=10,
      sampling=SamplingParams(seed=43))])[0]
  assert other_seed.tokens != alone.tokens


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(seed=7)])
def test_budget_stop_then_continue_equals_uninterrupted(sampler, sampling):
  req = SampleRequest("r", _prompt(70, 6), max_new_tokens=20,
                      sampling=sampling, budget=7)
  whole = sampler.generate([SampleRequest("r", req.prompt, max_new_tokens=20,
                                          sampling=sampling)])[0]
  first = sampler.generate([req])[0]
  assert first.finish_reason == "budget" and len(first.tokens) == 7
  second_req = continuation(req, first, budget=7)
  second = sampler.generate([second_req])[0]
  assert second.finish_reason == "budget" and len(second.tokens) == 7
  last = sampler.generate([continuation(second_req, second)])[0]
  assert last.finish_reason == "length" and len(last.tokens) == 6
  assert first.tokens + second.tokens + last.tokens == whole.tokens
  np.testing.assert_allclose(first.logprobs + second.logprobs + last.logprobs,
                             whole.logprobs, atol=1e-4)


def test_stop_tokens_and_first_token_finishes(params, sampler):
  prompt = _prompt(80, 5)
  ref = greedy_reference(params, prompt, 12)
  stop = ref[4]
  cut = ref.index(stop) + 1
  res = sampler.generate([
      SampleRequest("stop", prompt, max_new_tokens=12, sampling=GREEDY,
                    stop_tokens=(63 - stop, stop)),
      SampleRequest("first-stop", prompt, max_new_tokens=12, sampling=GREEDY,
                    stop_tokens=(ref[0],)),
      SampleRequest("one", prompt, max_new_tokens=1, sampling=GREEDY),
      SampleRequest("budget1", prompt, max_new_tokens=12, budget=1,
                    sampling=GREEDY),
  ])
  assert (res[0].tokens, res[0].finish_reason) == (tuple(ref[:cut]), "stop")
  assert (res[1].tokens, res[1].finish_reason) == ((ref[0],), "stop")
  assert (res[2].tokens, res[2].finish_reason) == ((ref[0],), "length")
  assert (res[3].tokens, res[3].finish_reason) == ((ref[0],), "budget")


def _first_repeat(response, ngram, times):
  """Brute force: shortest prefix of `response` ending in a block of p <=
  ngram tokens repeated `times` times."""
  for end in range(1, len(response) + 1):
    for p in range(1, ngram + 1):
      span = p * times
      tail = response[end - span:end] if end >= span else None
      if tail is not None and tail == tail[:p] * times:
        return end
  return None


def test_repeat_detector_stops_looping_responses(params, engine):
  repeat = RepeatConfig(ngram=2, times=3)
  looping = Sampler(engine, repeat, steps_per_call=3)
  reqs = [SampleRequest(i, _prompt(90 + i, 3 + i), max_new_tokens=30,
                        sampling=GREEDY) for i in range(6)]
  caught = 0
  for req, res in zip(reqs, looping.generate(reqs)):
    full = greedy_reference(params, req.prompt, 30)
    end = _first_repeat(full, 2, 3)
    if end is None or end == len(full):  # "length" outranks "repeat"
      assert (res.tokens, res.finish_reason) == (tuple(full), "length")
    else:
      caught += 1
      assert (res.tokens, res.finish_reason) == (tuple(full[:end]), "repeat")
  assert caught >= 1, "no greedy response looped: the test checks nothing"


def test_bad_requests_raise_naming_id_and_field_before_any_work(params):
  fresh = Engine(CFG, ENGINE_CFG, params=params)
  good = SampleRequest("good", (1, 2, 3), max_new_tokens=5)
  bad = [
      SampleRequest("long", tuple(range(40)), max_new_tokens=5),
      SampleRequest("empty", (), max_new_tokens=5),
      SampleRequest("budget", (1, 2), max_new_tokens=5, budget=6),
      SampleRequest("temp", (1, 2), max_new_tokens=5,
                    sampling=SamplingParams(temperature=-1.0)),
      SampleRequest("top_p", (1, 2), max_new_tokens=5,
                    sampling=SamplingParams(top_p=0.0)),
      SampleRequest("top_k", (1, 2), max_new_tokens=5,
                    sampling=SamplingParams(top_k=-2)),
      SampleRequest("vocab", (1, 64), max_new_tokens=5),
      SampleRequest("toolong", (1, 2), max_new_tokens=47),
      SampleRequest("prefix", (1, 2), prefix=(3, 4, 5), max_new_tokens=3),
  ]
  with pytest.raises(SampleRequestError) as info:
    Sampler(fresh).generate([good] + bad)
  got = {(rid, field) for rid, field, _ in info.value.problems}
  assert got == {("long", "prompt"), ("empty", "prompt"),
                 ("budget", "budget"), ("temp", "sampling.temperature"),
                 ("top_p", "sampling.top_p"), ("top_k", "sampling.top_k"),
                 ("vocab", "prompt"), ("toolong", "max_new_tokens"),
                 ("prefix", "prefix")}
  assert "'temp': sampling.temperature" in str(info.value)
  assert fresh.compile_count() == {}  # nothing was run


# ---- mesh and weight handoff ------------------------------------------------

@pytest.fixture(scope="module")
def sharder():
  return Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))


def test_mesh_engine_matches_single_device(params, sampler, sharder):
  mesh_engine = Engine(CFG, ENGINE_CFG, sharder=sharder)
  report = mesh_engine.load_params(params)  # single-device -> mesh
  assert report.kind == "resharded" and report.seconds >= 0
  assert mesh_engine.params["layers"]["wq"].sharding.spec == P(
      None, "fsdp", "tensor", None)
  state = mesh_engine.init_decode_state()
  assert state.cache.k.sharding.spec == P(None, ("data", "fsdp"), None,
                                          "tensor", None)
  reqs = [SampleRequest(i, p, max_new_tokens=m, sampling=GREEDY)
          for i, (p, m) in enumerate(MIXED)]
  reqs.append(SampleRequest("s", _prompt(5, 9), max_new_tokens=8,
                            sampling=SamplingParams(seed=3)))
  on_mesh = Sampler(mesh_engine, NO_REPEAT, steps_per_call=3).generate(reqs)
  single = sampler.generate(reqs)
  assert [r.tokens for r in on_mesh] == [r.tokens for r in single]
  for a, b in zip(on_mesh, single):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_handoff_shared_resharded_and_checkpoint(params, sharder, tmp_path):
  mesh_engine = Engine(CFG, ENGINE_CFG, sharder=sharder)
  trainer_params = jax.device_put(params, mesh_engine.param_shardings)
  report = mesh_engine.load_params(trainer_params)
  assert report.kind == "shared"
  for a, b in zip(jax.tree_util.tree_leaves(mesh_engine.params),
                  jax.tree_util.tree_leaves(trainer_params)):
    assert a is b
  # The trainer shards differently (everything replicated): a copy.
  replicated = jax.device_put(params, sharder.replicated())
  report = mesh_engine.load_params(replicated)
  assert report.kind == "resharded"
  # Another process: through an Orbax checkpoint, into our shardings.
  handoff.save_params(str(tmp_path / "params"), params)
  report = mesh_engine.load_checkpoint(str(tmp_path / "params"))
  assert report.kind == "checkpoint" and report.seconds > 0
  for got, want, sh in zip(jax.tree_util.tree_leaves(mesh_engine.params),
                           jax.tree_util.tree_leaves(params),
                           jax.tree_util.tree_leaves(
                               mesh_engine.param_shardings)):
    assert got.sharding == sh
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_mesh_rejects_slots_that_do_not_divide(sharder):
  with pytest.raises(ShardingError, match="decode_state"):
    Engine(CFG, EngineConfig(max_slots=6, cache_len=48), sharder=sharder)
