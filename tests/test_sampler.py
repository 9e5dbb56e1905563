"""The decode engine and continuous-batching driver against the trainer's
uncached forward: greedy outputs, log-probs, slot reuse, partial rollouts,
repeat stops, bad requests, an 8-device mesh, the weight handoff, and the
batched admission (prefill_batch / insert_batch / free_slots) against the
one-request-at-a-time engine methods."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler import handoff
from kimi_jax.sampler.build import make_engine, make_sampler
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sampler.driver import (SampleRequest, SampleRequestError,
                                     SampleResult, Sampler, admission_groups,
                                     continuation)
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
  return jax.jit(
      lambda: transformer.init_params(CFG, jax.random.key(0), std=0.2))()


@pytest.fixture(scope="module")
def engine(params):
  return Engine(CFG, ENGINE_CFG)


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
  logits = np.asarray(_ref_logits(params, jax.device_put(row)), np.float64)
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


def results_of(sampler, params, requests, **kw):
  """Sampler.generate's results, without its statistics."""
  return sampler.generate(params, requests, **kw)[0]


def _prompt(seed, n):
  return tuple(int(x) for x in np.random.default_rng(seed).integers(0, 64, n))


MIXED = [(_prompt(i, n), m) for i, (n, m) in
         enumerate([(3, 9), (20, 14), (7, 5), (12, 16), (5, 11), (30, 6)])]


def test_greedy_matches_uncached_argmax_and_compiles_are_bounded(
    params, engine, sampler):
  reqs = [SampleRequest(i, p, max_new_tokens=m, sampling=GREEDY)
          for i, (p, m) in enumerate(MIXED)]
  results, stats = sampler.generate(params, reqs)
  assert [r.id for r in results] == list(range(len(reqs)))
  for (prompt, m), res in zip(MIXED, results):
    assert res.tokens == tuple(greedy_reference(params, prompt, m))
    assert res.finish_reason == "length"
  assert stats.tokens_generated == sum(m for _, m in MIXED)
  assert 0 < stats.slot_utilisation <= 1
  counts = engine.compile_count()
  # Batched admission: at most one compile per (length bucket, batch bucket);
  # 2 x 3 here. The single-request prefill / insert / free are not used.
  assert counts["prefill_batch"] <= 2 * 3 and counts["insert_batch"] <= 2 * 3
  assert counts["generate"] == 1 and counts["init_decode_state"] == 1
  assert counts["free_slots"] == 1
  assert not {"prefill", "insert", "free_resource"} & set(counts)
  results_of(sampler, params, [SampleRequest("again", _prompt(9, 25), max_new_tokens=4,
                                   sampling=GREEDY)])
  assert engine.compile_count() == counts


def test_logprobs_equal_trainer_logprobs(params, sampler):
  settings = [SamplingParams(seed=1), SamplingParams(seed=2),
              SamplingParams(seed=3, temperature=0.7, top_k=5),
              SamplingParams(seed=4, top_p=0.8), GREEDY]
  reqs = [SampleRequest(i, _prompt(10 + i, 4 + 3 * i), max_new_tokens=12,
                        sampling=s) for i, s in enumerate(settings)]
  for req, res in zip(reqs, results_of(sampler, params, reqs)):
    assert len(res.tokens) == 12
    want = trainer_logprobs(params, req.prompt, res.tokens)
    np.testing.assert_allclose(res.logprobs, want, atol=1e-4)
  # top_k=5 draws only among the model's 5 most likely tokens.
  res = results_of(sampler, params, [reqs[2]])[0]
  seq = list(reqs[2].prompt) + list(res.tokens)
  logp = _ref_logp(params, seq)
  for i, t in enumerate(res.tokens):
    top5 = np.argsort(-logp[len(reqs[2].prompt) - 1 + i])[:5]
    assert t in top5


def assert_same_results(got, want):
  """Same ids, tokens and finish reasons; log-probs equal up to the float
  rounding that differs between prefill batch sizes."""
  assert len(got) == len(want)
  for a, b in zip(got, want):
    assert (a.id, a.tokens, a.finish_reason) == (b.id, b.tokens,
                                                 b.finish_reason)
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_slot_reuse_and_batch_composition_do_not_change_results(params, sampler):
  target = SampleRequest("x", _prompt(50, 4), max_new_tokens=10,
                         sampling=SamplingParams(seed=42))
  alone = results_of(sampler, params, [target])[0]
  # Longer prompts first fill every slot; the target then lands in a slot
  # whose cache still holds a longer previous sequence.
  others = [SampleRequest(i, _prompt(60 + i, 25), max_new_tokens=3 + i,
                          sampling=SamplingParams(seed=i)) for i in range(6)]
  mixed = results_of(sampler, params, others + [target])
  assert_same_results(mixed[-1:], [alone])
  shuffled = results_of(sampler, params, [target] + others[::-1])
  assert_same_results(shuffled[:1], [alone])
  # Batched prefill: a request's prefill batch size depends on the mix, so
  # log-probs may differ by float rounding; tokens may not.
  assert_same_results(sorted(shuffled[1:], key=lambda r: r.id), mixed[:-1])
  other_seed = results_of(sampler, params, [SampleRequest(
      "x", target.prompt, max_new_tokens=10,
      sampling=SamplingParams(seed=43))])[0]
  assert other_seed.tokens != alone.tokens


@pytest.mark.parametrize("sampling", [GREEDY, SamplingParams(seed=7)])
def test_budget_stop_then_continue_equals_uninterrupted(params, sampler, sampling):
  req = SampleRequest("r", _prompt(70, 6), max_new_tokens=20,
                      sampling=sampling, budget=7)
  whole = results_of(sampler, params, [SampleRequest("r", req.prompt, max_new_tokens=20,
                                          sampling=sampling)])[0]
  first = results_of(sampler, params, [req])[0]
  assert first.finish_reason == "budget" and len(first.tokens) == 7
  second_req = continuation(req, first, budget=7)
  second = results_of(sampler, params, [second_req])[0]
  assert second.finish_reason == "budget" and len(second.tokens) == 7
  last = results_of(sampler, params, [continuation(second_req, second)])[0]
  assert last.finish_reason == "length" and len(last.tokens) == 6
  assert first.tokens + second.tokens + last.tokens == whole.tokens
  np.testing.assert_allclose(first.logprobs + second.logprobs + last.logprobs,
                             whole.logprobs, atol=1e-4)


def test_stop_tokens_and_first_token_finishes(params, sampler):
  prompt = _prompt(80, 5)
  ref = greedy_reference(params, prompt, 12)
  stop = ref[4]
  cut = ref.index(stop) + 1
  res = results_of(sampler, params, [
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


def test_window_admits_queued_requests_into_freed_slots(params, engine):
  """4 slots, 8 requests, a window of 8 tokens, min_admit 3, one decode step
  per call. Hand-worked schedule (steps = decode steps done):
    step 0: r0..r3 start; r0 (max 3) ends "length" after step 2;
    step 2: 6 left >= 3, r4 (max 4) starts, ends "length" after step 5;
    step 5: 3 left, r5 starts with a cap of 3, ends "budget" after step 7;
    r1..r3 end "budget" at 8 tokens after step 7; 1 left < 3: r6, r7 never
    start (None)."""
  windowed = Sampler(engine, NO_REPEAT, steps_per_call=1)
  max_new = [3, 10, 10, 10, 4, 10, 10, 10]
  reqs = [SampleRequest(i, _prompt(300 + i, 4 + i), max_new_tokens=m,
                        sampling=GREEDY) for i, m in enumerate(max_new)]
  res, st = windowed.generate(params, reqs, window=8, min_admit=3)
  want = [(3, "length"), (8, "budget"), (8, "budget"), (8, "budget"),
          (4, "length"), (3, "budget"), None, None]
  got = [None if r is None else (len(r.tokens), r.finish_reason) for r in res]
  assert got == want
  for req, r in zip(reqs, res):
    if r is not None:  # a slot taken mid-window decodes like a fresh one
      assert r.tokens == tuple(greedy_reference(params, req.prompt,
                                                len(r.tokens)))
  assert (st.requests, st.decode_steps) == (6, 7)
  assert st.tokens_generated == 3 + 3 * 8 + 4 + 3
  # Without a window the same requests all run to their end.
  assert all(r.finish_reason == "length"
             for r in results_of(windowed, params, reqs))
  with pytest.raises(ValueError, match="min_admit"):
    results_of(windowed, params, reqs, window=8, min_admit=0)


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
  for req, res in zip(reqs, results_of(looping, params, reqs)):
    full = greedy_reference(params, req.prompt, 30)
    end = _first_repeat(full, 2, 3)
    if end is None or end == len(full):  # "length" outranks "repeat"
      assert (res.tokens, res.finish_reason) == (tuple(full), "length")
    else:
      caught += 1
      assert (res.tokens, res.finish_reason) == (tuple(full[:end]), "repeat")
  assert caught >= 1, "no greedy response looped: the test checks nothing"


def test_bad_requests_raise_naming_id_and_field_before_any_work(params):
  fresh = Engine(CFG, ENGINE_CFG)
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
    Sampler(fresh).generate(params, [good] + bad)
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
  # single-device -> mesh
  mesh_params, report = handoff.place_params(params,
                                             mesh_engine.param_shardings)
  assert report.kind == "resharded" and report.seconds >= 0
  assert mesh_params["layers"]["wq"].sharding.spec == P(
      None, ("fsdp", "context"), "tensor", None)
  state = mesh_engine.init_decode_state()
  # Per layer, keys B x K x Dh x S: slots over the batch axes, heads over
  # tensor.
  assert state.cache.kt[0].sharding.spec == P(("data", "fsdp"), "tensor",
                                             None, None)
  reqs = [SampleRequest(i, p, max_new_tokens=m, sampling=GREEDY)
          for i, (p, m) in enumerate(MIXED)]
  reqs.append(SampleRequest("s", _prompt(5, 9), max_new_tokens=8,
                            sampling=SamplingParams(seed=3)))
  on_mesh = results_of(Sampler(mesh_engine, NO_REPEAT, steps_per_call=3),
                       mesh_params, reqs)
  single = results_of(sampler, params, reqs)
  assert [r.tokens for r in on_mesh] == [r.tokens for r in single]
  for a, b in zip(on_mesh, single):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)


def test_data_mesh_devices_loop_apart_and_match_single_device(params,
                                                             sampler):
  """On a mesh that splits only the slots, each device steps its own slots
  in a loop of its own: a device whose slots are all done ends its loop
  (-1 for the steps it did not run) while another goes on, and the driver
  reads each slot's steps as they ran. Same tokens as one device."""
  data = Sharder(make_mesh(MeshConfig(data=2), jax.devices()[:2]))
  mesh_engine = Engine(CFG, ENGINE_CFG, sharder=data)
  assert mesh_engine._loop_axes == ("data", "fsdp")
  mesh_params = jax.device_put(params, mesh_engine.param_shardings)
  # Slots 0-1 on the first device may take 1 step, slots 2-3 three.
  state = mesh_engine.init_decode_state()
  prefix = mesh_engine.prefill_batch(
      mesh_params, [_prompt(s, 4 + s) for s in range(4)], [GREEDY] * 4,
      [0] * 4)
  state = mesh_engine.insert_batch(prefix, state, [0, 1, 2, 3])
  _, tokens_NxB, _ = mesh_engine.generate(mesh_params, state, 3,
                                          steps_left=[1, 1, 3, 3])
  tokens_NxB = np.asarray(tokens_NxB)
  assert (tokens_NxB[0] >= 0).all() and (tokens_NxB[1:, 2:] >= 0).all()
  assert (tokens_NxB[1:, :2] == -1).all()  # the first device's loop ended
  reqs = [SampleRequest(i, p, max_new_tokens=m, sampling=GREEDY)
          for i, (p, m) in enumerate(MIXED)]
  reqs += [SampleRequest(f"s{i}", _prompt(9 + i, 5 + i), max_new_tokens=m,
                         sampling=SamplingParams(seed=i))
           for i, m in enumerate((8, 2, 13))]
  on_mesh = results_of(Sampler(mesh_engine, NO_REPEAT, steps_per_call=3),
                       mesh_params, reqs)
  single = results_of(sampler, params, reqs)
  assert [r.tokens for r in on_mesh] == [r.tokens for r in single]
  assert [r.finish_reason for r in on_mesh] == [r.finish_reason
                                                for r in single]
  for a, b in zip(on_mesh, single):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=1e-4)
  # A window's queued requests start at the step a slot frees up on any
  # device: a call that watches for that keeps one loop over all slots.
  windowed = [results_of(s, p, reqs, window=8, min_admit=3) for s, p in (
      (Sampler(mesh_engine, NO_REPEAT, steps_per_call=3), mesh_params),
      (sampler, params))]
  ended = lambda results: [None if r is None else (r.tokens, r.finish_reason)
                           for r in results]
  assert ended(windowed[0]) == ended(windowed[1])
  assert "budget" in [r.finish_reason for r in windowed[1] if r is not None]


def test_handoff_shared_resharded_and_checkpoint(params, sharder, tmp_path):
  mesh_engine = Engine(CFG, ENGINE_CFG, sharder=sharder)
  trainer_params = jax.device_put(params, mesh_engine.param_shardings)
  placed, report = handoff.place_params(trainer_params,
                                        mesh_engine.param_shardings)
  assert report.kind == "shared"
  for a, b in zip(jax.tree_util.tree_leaves(placed),
                  jax.tree_util.tree_leaves(trainer_params)):
    assert a is b
  # The trainer shards differently (everything replicated): a copy.
  replicated = jax.device_put(params, sharder.replicated())
  placed, report = handoff.place_params(replicated,
                                        mesh_engine.param_shardings)
  assert report.kind == "resharded"
  # Another process: through an Orbax checkpoint, into our shardings.
  handoff.save_params(str(tmp_path / "params"), params)
  restored, report = handoff.restore_params(
      str(tmp_path / "params"), transformer.abstract_params(CFG),
      mesh_engine.param_shardings)
  assert report.kind == "checkpoint" and report.seconds > 0
  for got, want, sh in zip(jax.tree_util.tree_leaves(restored),
                           jax.tree_util.tree_leaves(params),
                           jax.tree_util.tree_leaves(
                               mesh_engine.param_shardings)):
    assert got.sharding == sh
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


def test_mesh_rejects_slots_that_do_not_divide(sharder):
  with pytest.raises(ShardingError, match="decode_state"):
    Engine(CFG, EngineConfig(max_slots=6, cache_len=48), sharder=sharder)


# ---- batched admission ------------------------------------------------------

@pytest.fixture(scope="module")
def mesh_engine(sharder):
  return Engine(CFG, ENGINE_CFG, sharder=sharder)


@pytest.fixture(scope="module")
def mesh_params(params, mesh_engine):
  return handoff.place_params(params, mesh_engine.param_shardings)[0]


def test_batch_buckets_default_and_validation():
  assert EngineConfig(max_slots=6, cache_len=48).batch_buckets == (1, 2, 4, 6)
  assert EngineConfig(max_slots=8, cache_len=48).batch_buckets == (1, 2, 4, 8)
  assert EngineConfig(max_slots=1, cache_len=48).batch_buckets == (1,)
  for bad in [(), (0, 2), (2, 1), (1, 8)]:
    with pytest.raises(ValueError, match="sampler.prefill_batch_buckets"):
      EngineConfig(max_slots=4, cache_len=48, prefill_batch_buckets=bad)


def test_admission_groups_split_by_bucket_and_batch_cap(engine):
  lengths = [3, 20, 7, 30, 5, 8, 9]  # buckets 8, 32, 8, 32, 8, 8, 32
  assert admission_groups(lengths, engine.bucket_for, 2) == [
      [0, 2], [4, 5], [1, 3], [6]]
  assert admission_groups(lengths, engine.bucket_for, 4) == [
      [0, 2, 4, 5], [1, 3, 6]]


# (tokens, sampling, first index): two length buckets, continuations
# (first index > 0), seeded and greedy rows.
BATCH_SEQS = [
    (_prompt(100, 3), SamplingParams(seed=11), 0),
    (_prompt(101, 7), GREEDY, 0),
    (_prompt(102, 5), SamplingParams(seed=12, temperature=0.8, top_k=6), 2),
    (_prompt(103, 20), SamplingParams(seed=13), 5),
    (_prompt(104, 30), GREEDY, 0),
]


def _host_state(state):
  return jax.tree_util.tree_map(np.asarray, state)


@pytest.mark.parametrize("on_mesh", [False, True])
def test_prefill_batch_and_insert_batch_match_one_at_a_time(
    params, mesh_params, engine, mesh_engine, on_mesh):
  eng = mesh_engine if on_mesh else engine
  p = mesh_params if on_mesh else params
  short, long_ = BATCH_SEQS[:3], BATCH_SEQS[3:]
  # Row 1 of the short group stands for a request that finished on its first
  # token: it is not inserted. The short group (3 rows) pads to batch 4.
  plan = [(short, [0, None, 2]), (long_, [1, 3])]
  ref = eng.init_decode_state()
  got = eng.init_decode_state()
  for seqs, slots in plan:
    prefix = eng.prefill_batch(p, *map(list, zip(*seqs)))
    assert prefix.k.shape[1] == eng.batch_bucket_for(len(seqs))
    assert np.isfinite(np.asarray(prefix.logprob)).all()  # padding rows too
    for row, ((tokens, sampling, first), slot) in enumerate(zip(seqs, slots)):
      one = eng.prefill(p, tokens, sampling, first)
      assert np.asarray(one.token)[0] == np.asarray(prefix.token)[row]
      np.testing.assert_allclose(np.asarray(one.logprob)[0],
                                 np.asarray(prefix.logprob)[row], atol=1e-5)
      n = len(tokens)
      np.testing.assert_allclose(np.asarray(one.k)[:, 0, :n],
                                 np.asarray(prefix.k)[:, row, :n], atol=1e-4)
      if slot is not None:
        ref = eng.insert(one, ref, slot)
    got = eng.insert_batch(prefix, got, slots)
  if on_mesh:
    assert got.cache.kt[0].sharding.spec == P(("data", "fsdp"), "tensor",
                                             None, None)
    assert got.active.sharding.spec == ref.active.sharding.spec
  a, b = _host_state(got), _host_state(ref)
  assert a.active.tolist() == [True, True, True, True]
  for field in ("tokens", "index", "active"):
    np.testing.assert_array_equal(getattr(a, field), getattr(b, field))
  np.testing.assert_array_equal(a.lengths, b.lengths)
  for x, y in zip(a.sampling, b.sampling):
    np.testing.assert_array_equal(x, y)
  # The same continuation: greedy and seeded decode from both states.
  got, tokens_got, logp_got = eng.generate(p, got, 3)
  ref, tokens_ref, logp_ref = eng.generate(p, ref, 3)
  got, t2_got, l2_got = eng.generate(p, got, 3)
  ref, t2_ref, l2_ref = eng.generate(p, ref, 3)
  np.testing.assert_array_equal(np.concatenate([tokens_got, t2_got]),
                                np.concatenate([tokens_ref, t2_ref]))
  np.testing.assert_allclose(np.concatenate([logp_got, l2_got]),
                             np.concatenate([logp_ref, l2_ref]), atol=1e-4)


def test_insert_batch_skips_rows_and_leaves_other_slots_alone(params, engine):
  state = engine.insert(engine.prefill(params, _prompt(105, 6),
                                       GREEDY), engine.init_decode_state(), 2)
  before = _host_state(state)
  prefix = engine.prefill_batch(params, [_prompt(106, 4)] * 3,
                                [GREEDY] * 3, [0] * 3)
  after = _host_state(engine.insert_batch(prefix, state, [None, 0]))
  assert after.active.tolist() == [True, False, True, False]
  assert after.lengths.tolist() == [4, 0, 6, 0]
  for k_after, k_before in zip(after.cache.kt, before.cache.kt):
    np.testing.assert_array_equal(k_after[1:], k_before[1:])
  with pytest.raises(ValueError, match="repeat"):
    engine.insert_batch(prefix, engine.init_decode_state(), [1, 1])
  with pytest.raises(ValueError, match="outside"):
    engine.insert_batch(prefix, engine.init_decode_state(), [4])
  with pytest.raises(ValueError, match="2 slots for a prefix of 1 rows"):
    engine.insert_batch(engine.prefill(params, (1, 2), GREEDY),
                        engine.init_decode_state(), [0, 1])


def test_free_slots_frees_exactly_the_masked_slots(params, engine):
  def full_state():
    prefix = engine.prefill_batch(
        params, [_prompt(110 + i, 3 + i) for i in range(4)],
        [SamplingParams(seed=i) for i in range(4)], [0] * 4)
    return engine.insert_batch(prefix, engine.init_decode_state(),
                               [0, 1, 2, 3])

  before = _host_state(full_state())
  mask_B = np.array([True, False, True, False])
  got = engine.free_slots(full_state(), mask_B)
  ref = full_state()
  for slot in (0, 2):  # the one-at-a-time path
    ref = engine.free_resource(ref, slot)
  a, b = _host_state(got), _host_state(ref)
  assert a.active.tolist() == [False, True, False, True]
  assert a.lengths.tolist() == [0, 4, 0, 6]
  for x, y, z in zip(jax.tree_util.tree_leaves(a),
                     jax.tree_util.tree_leaves(b),
                     jax.tree_util.tree_leaves(before)):
    np.testing.assert_array_equal(x, y)
    assert x.shape == z.shape
  np.testing.assert_array_equal(a.cache.kt, before.cache.kt)
  with pytest.raises(ValueError, match="mask"):
    engine.free_slots(got, np.ones((3,), bool))


def one_at_a_time(engine, params, req):
  """Reference: one request alone in slot 0, through the single-request
  methods (prefill, insert, one-step generate, free_resource), with the
  driver's finish rules (stop > length > budget; no repeat detector)."""
  prefix = engine.prefill(params, req.prompt + req.prefix,
                          req.sampling, len(req.prefix))
  state = engine.insert(prefix, engine.init_decode_state(), 0)
  tokens = [int(np.asarray(prefix.token)[0])]
  logprobs = [float(np.asarray(prefix.logprob)[0])]
  budget = req.max_new_tokens if req.budget is None else req.budget

  def reason():
    if tokens[-1] in req.stop_tokens:
      return "stop"
    if len(req.prefix) + len(tokens) >= req.max_new_tokens:
      return "length"
    return "budget" if len(tokens) >= budget else None

  while reason() is None:
    state, t, lp = engine.generate(params, state, 1)
    tokens.append(int(np.asarray(t)[0, 0]))
    logprobs.append(float(np.asarray(lp)[0, 0]))
  engine.free_resource(state, 0)
  return SampleResult(req.id, tuple(tokens), tuple(logprobs), reason())


def _recording(engine, monkeypatch):
  """Records (length bucket, batch bucket) of every prefill_batch call."""
  calls = []
  real = engine.prefill_batch

  def prefill_batch(params, seqs, samplings, firsts):
    calls.append((engine.bucket_for(max(len(s) for s in seqs)),
                  engine.batch_bucket_for(len(seqs))))
    return real(params, seqs, samplings, firsts)

  monkeypatch.setattr(engine, "prefill_batch", prefill_batch)
  return calls


def _mixed_requests(params, n, seed):
  """Mixed lengths over both buckets, continuations, budgets, stop tokens
  (some hit on the first token), seeded and greedy sampling."""
  rng = np.random.default_rng(seed)
  reqs = []
  for i in range(n):
    prompt = _prompt(seed * 100 + i, int(rng.choice([2, 5, 8, 14, 26])))
    prefix = _prompt(seed * 100 + 50 + i, int(rng.integers(0, 4)))
    sampling = GREEDY if i % 3 == 0 else SamplingParams(seed=seed * 100 + i)
    stop = ()
    if i % 4 == 1:  # stops on its first token
      stop = (greedy_reference(params, prompt + prefix, 1)[0],)
      sampling = GREEDY
    elif i % 4 == 2:
      stop = tuple(int(t) for t in rng.integers(0, 64, 3))
    budget = int(rng.integers(1, 6)) if i % 5 == 3 else None
    reqs.append(SampleRequest(
        (seed, i), prompt, prefix=prefix,
        max_new_tokens=len(prefix) + int(rng.integers(1, 12)),
        sampling=sampling, stop_tokens=stop, budget=budget))
  return reqs


def test_continuous_batching_matches_each_request_alone(params, engine,
                                                        sampler, monkeypatch):
  reqs = _mixed_requests(params, 17, seed=3)
  calls = _recording(engine, monkeypatch)
  results, stats = sampler.generate(params, reqs)
  calls = list(calls)  # the reference below calls the engine too
  want = [one_at_a_time(engine, params, r) for r in reqs]
  assert_same_results(results, want)
  reasons = [r.finish_reason for r in results]
  assert {"stop", "length", "budget"} <= set(reasons)
  assert sum(len(r.tokens) == 1 and r.finish_reason == "stop"
             for r in results) >= 2  # finished on the first token
  # Admission really was batched, in more than one length bucket.
  assert len(calls) < len(reqs) and max(n for _, n in calls) > 1
  assert len({t for t, _ in calls}) == 2
  assert stats.requests == len(reqs)
  assert stats.tokens_generated == sum(len(r.tokens) for r in results)
  assert stats.prefill_tokens == sum(len(r.prompt) + len(r.prefix)
                                     for r in reqs)
  assert 0 < stats.slot_utilisation <= 1


def test_compiles_bounded_by_length_and_batch_buckets_used(params,
                                                           monkeypatch):
  fresh = Engine(CFG, ENGINE_CFG)
  calls = _recording(fresh, monkeypatch)
  sampler = Sampler(fresh, NO_REPEAT, steps_per_call=2)
  results_of(sampler, params, _mixed_requests(params, 11, seed=4))
  results_of(sampler, params, [SampleRequest(i, _prompt(120 + i, 3 + 5 * i),
                                  max_new_tokens=4 + i) for i in range(6)])
  counts = fresh.compile_count()
  used_t, used_n = {t for t, _ in calls}, {n for _, n in calls}
  bound = len(used_t) * len(used_n)
  assert counts["prefill_batch"] == len(set(calls)) <= bound
  assert counts["insert_batch"] <= len(set(calls)) <= bound
  assert counts["free_slots"] == 1 and counts["generate"] == 1
  assert not {"prefill", "insert", "free_resource"} & set(counts)
  # The first mix again: the same shapes, nothing new to compile.
  seen = set(calls)
  results_of(sampler, params, _mixed_requests(params, 11, seed=4))
  assert set(calls) == seen and fresh.compile_count() == counts


def test_warm_up_admission_compiles_every_shape_ahead(params):
  fresh = Engine(CFG, ENGINE_CFG)
  assert fresh.warm_up_admission(params, lengths=[3, 7]) == 3  # 1 x (1, 2, 4)
  counts = fresh.compile_count()
  assert counts["prefill_batch"] == counts["insert_batch"] == 3
  Sampler(fresh, NO_REPEAT).generate(
      params, [SampleRequest(i, _prompt(130 + i, 2 + i), max_new_tokens=3,
                     sampling=GREEDY) for i in range(7)])
  assert {k: v for k, v in fresh.compile_count().items()
          if k != "generate"} == counts


def test_batched_admission_on_mesh_matches_each_request_alone(
    params, mesh_params, engine, mesh_engine):
  reqs = _mixed_requests(params, 9, seed=5)
  on_mesh = results_of(Sampler(mesh_engine, NO_REPEAT, steps_per_call=2),
                       mesh_params, reqs)
  assert_same_results(on_mesh, [one_at_a_time(engine, params, r)
                                for r in reqs])
  assert mesh_engine.compile_count()["free_slots"] == 1



def test_make_sampler_takes_every_setting_of_the_section():
  section = SamplerConfig(max_slots=4, cache_len=48, prefill_buckets=(8, 32),
                          repeat_ngram=2, repeat_times=5, steps_per_call=7)
  built = make_sampler(CFG, section)
  assert built.engine.engine_cfg == ENGINE_CFG
  assert built.repeat == RepeatConfig(ngram=2, times=5)
  assert built.steps_per_call == 7
  assert make_engine(CFG, section).engine_cfg == ENGINE_CFG
  # The section's default is the shipped experiments' decode steps.
  assert SamplerConfig(max_slots=4, cache_len=48).steps_per_call == 16
