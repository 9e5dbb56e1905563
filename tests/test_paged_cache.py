"""The paged KV cache and decode views bounded by the live tokens.

Every engine layout must sample what the row cache read whole samples:
the same tokens (greedy and seeded), log-probs within float rounding (a
shorter view or another page order only reorders additions of exact
zeros' neighbours). A pool smaller than slots x cache_len must preempt and
resume requests without changing what they generate.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimi_jax.model import decode, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler import handoff
from kimi_jax.sampler.driver import SampleRequest, Sampler, continuation
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.pages import PageTable, PoolExhausted
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

CFG = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=16, mlp_dim=128, max_seq_len=96)
# Sliding layers keep rings; their full layers page like any model's.
WINDOWED = dataclasses.replace(CFG, layer_types=("sliding_attention",
                                                 "full_attention"),
                               sliding_window=8)
NO_REPEAT = RepeatConfig(enabled=False)
ROWS_WHOLE = dict(max_slots=4, cache_len=96, prefill_buckets=(16, 96),
                  min_view=96)


def _requests(n: int = 7, seed: int = 0) -> list[SampleRequest]:
  """Mixed prompt lengths and budgets, greedy and seeded."""
  rng = np.random.default_rng(seed)
  out = []
  for i in range(n):
    prompt = tuple(int(t) for t in rng.integers(0, 64, 3 + 2 * i))
    sampling = (SamplingParams(greedy=True) if i % 2 else
                SamplingParams(seed=i))
    out.append(SampleRequest(i, prompt, max_new_tokens=10 + 9 * i,
                             sampling=sampling))
  return out


def _params(cfg):
  # A larger init scale than training's makes the next-token distribution
  # peaked, so greedy argmax has no near-ties.
  return jax.jit(lambda: transformer.init_params(cfg, jax.random.key(0),
                                                 std=0.2))()


def _run(cfg, engine_cfg, requests, steps=4, **kw):
  engine = Engine(cfg, EngineConfig(**engine_cfg))
  params = _params(cfg)
  return Sampler(engine, NO_REPEAT, steps_per_call=steps).generate(
      params, requests, **kw)


def _same(got, ref):
  assert [r.tokens for r in got] == [r.tokens for r in ref]
  assert [r.finish_reason for r in got] == [r.finish_reason for r in ref]
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a.logprobs, b.logprobs, rtol=1e-5, atol=1e-5)


@pytest.fixture(scope="module", params=[CFG, WINDOWED],
                ids=["full", "windowed"])
def reference(request):
  cfg = request.param
  return cfg, _run(cfg, ROWS_WHOLE, _requests())[0]


@pytest.mark.slow
@pytest.mark.parametrize("layout", [
    dict(min_view=16),                       # rows, views 16 .. 96
    dict(page_size=8, min_view=16),          # pages, pool for every slot
    dict(page_size=16, kv_pages=7),          # pages, 7 of 24 pages
], ids=["rows_views", "pages", "pages_small_pool"])
def test_layouts_sample_what_the_whole_row_cache_samples(reference, layout):
  cfg, ref = reference
  got, stats = _run(cfg, dict(ROWS_WHOLE, **layout), _requests())
  _same(got, ref)
  if layout.get("kv_pages"):
    assert stats.preemptions > 0  # 7 requests of up to 79 entries


@pytest.mark.slow
def test_views_compile_once_each_and_follow_the_longest_slot():
  engine = Engine(CFG, EngineConfig(max_slots=4, cache_len=96,
                                    prefill_buckets=(16,), min_view=16))
  assert engine.engine_cfg.views == (16, 32, 64, 96)
  params = _params(CFG)
  sampler = Sampler(engine, NO_REPEAT, steps_per_call=8)
  reqs = [SampleRequest(i, (1, 2, 3), max_new_tokens=20,
                        sampling=SamplingParams(seed=i)) for i in range(4)]
  sampler.generate(params, reqs)
  # Lengths 3 .. 23: views 16 (reach <= 16) and 32, never 64 or 96.
  assert engine.compile_count()["generate"] == 2
  sampler.generate(params, reqs)
  assert engine.compile_count()["generate"] == 2


@pytest.mark.slow
def test_window_with_a_small_pool_continues_to_the_same_tokens():
  """Partial rollouts over a pool that preempts: every budget-cut result
  continued to its end gives the whole run's tokens."""
  reqs = _requests(6, seed=1)
  whole = _run(CFG, ROWS_WHOLE, reqs)[0]
  small = dict(ROWS_WHOLE, page_size=16, kv_pages=7, min_view=16)
  first, _ = _run(CFG, small, reqs, window=24)
  rest = [continuation(q, r) for q, r in zip(reqs, first)
          if r is not None and r.finish_reason == "budget"]
  done = {r.id: r for r in _run(CFG, small, rest)[0]}
  for q, r, w in zip(reqs, first, whole):
    if r is None:
      continue
    tokens = r.tokens + (done[q.id].tokens if q.id in done else ())
    assert tokens == w.tokens


def test_pages_go_back_to_the_pool_when_slots_are_freed():
  engine = Engine(CFG, EngineConfig(max_slots=2, cache_len=96,
                                    prefill_buckets=(16,), page_size=8))
  params = _params(CFG)
  state = engine.init_decode_state()
  n = engine.free_pages(state)
  assert n == 2 * 12
  prefix = engine.prefill_batch(params, [(1,) * 9, (2,) * 3],
                                [SamplingParams(greedy=True)] * 2, [0, 0])
  state = engine.insert_batch(prefix, state, [0, 1])
  assert engine.free_pages(state) == n - 2 - 1  # 9 and 3 entries
  state, _, _ = engine.generate(params, state, 8)
  # 9 + 8 = 17 entries: 3 pages; 3 + 8 = 11: 2 pages.
  assert engine.free_pages(state) == n - 5
  np.testing.assert_array_equal(engine.host_lengths(state), [17, 11])
  state = engine.free_slots(state, np.array([True, True]))
  assert engine.free_pages(state) == n


def test_page_table_takes_and_returns_pages_and_names_the_key():
  table = PageTable(n_pages=5, page_size=4, n_slots=2, pages_per_slot=3)
  table.grow(0, 9)  # 3 pages
  assert table.held.tolist() == [3, 0] and table.free_pages == 2
  assert table.shortfall([1], [12]) == 1
  with pytest.raises(PoolExhausted, match="sampler.kv_pages"):
    table.grow(1, 12)
  assert table.free_pages == 2 and table.held[1] == 0  # took nothing
  table.grow(1, 5)
  pages = set(table.table[0, :3]) | set(table.table[1, :2])
  assert pages == set(range(5))  # every page held once
  table.release(0)
  assert table.free_pages == 3 and (table.table[0] == 5).all()


def test_page_table_keeps_each_shard_to_its_part_of_the_pool():
  table = PageTable(n_pages=8, page_size=4, n_slots=4, pages_per_slot=4,
                    n_shards=2)  # slots 0, 1: shard 0; 2, 3: shard 1
  table.grow(0, 16)
  assert table.free_per_shard().tolist() == [0, 4]
  assert table.shortfall([1, 2], [4, 4]) == 1  # shard 0 is out
  with pytest.raises(PoolExhausted, match="its shard's 4"):
    table.grow(1, 4)
  table.grow(2, 16)
  # Local ids: both shards use 0 .. 3, "none" is 4.
  assert sorted(table.table[0]) == sorted(table.table[2]) == [0, 1, 2, 3]
  assert (table.table[1] == 4).all()
  with pytest.raises(ValueError, match="sampler.kv_pages"):
    PageTable(n_pages=9, page_size=4, n_slots=4, pages_per_slot=4,
              n_shards=2)


def test_engine_config_errors_name_the_key():
  with pytest.raises(ValueError, match="sampler.kv_pages"):
    EngineConfig(max_slots=2, cache_len=64, kv_pages=10)  # rows
  with pytest.raises(ValueError, match="sampler.kv_pages"):
    EngineConfig(max_slots=2, cache_len=64, page_size=16, kv_pages=3)
  with pytest.raises(ValueError, match="sampler.page_size"):
    EngineConfig(max_slots=2, cache_len=64, page_size=-1)


@pytest.mark.slow
def test_paged_pool_on_a_mesh_samples_what_one_device_samples(reference):
  """Slots and pool pages over data x fsdp (4 shards, each its own part of
  the pool), heads over tensor: the decode's paged attention runs per
  shard in shard_map."""
  cfg, ref = reference
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  # 8 slots, 2 per shard; each shard's 12 pages hold one full slot.
  engine = Engine(cfg, EngineConfig(**dict(ROWS_WHOLE, max_slots=8,
                                           page_size=8, kv_pages=48)),
                  sharder=sharder)
  state = engine.init_decode_state()
  assert state.cache.kt[0].sharding.spec == P(("data", "fsdp"), "tensor",
                                             None, None)
  assert state.host.pages.local_pages == 12
  params = handoff.place_params(_params(cfg), engine.param_shardings)[0]
  got, stats = Sampler(engine, NO_REPEAT, steps_per_call=4).generate(
      params, _requests())
  _same(got, ref)
  assert stats.preemptions > 0


def test_kv_capacity_counts_the_pool_and_the_sequences_it_holds():
  rows = Engine(CFG, EngineConfig(max_slots=4, cache_len=96))
  pages = Engine(CFG, EngineConfig(max_slots=16, cache_len=96, page_size=8,
                                   kv_pages=48))  # rows' 4 x 96 entries
  a, b = rows.kv_capacity([24, 48]), pages.kv_capacity([24, 48])
  # 2 layers x (k + v) x 4 x 96 entries x 2 heads x 16 dims x 4 bytes.
  assert a["bytes_per_device"] == b["bytes_per_device"] == 2 * 2 * 4 * 96 * \
      2 * 16 * 4
  assert a["sequences_at_mean_live"] == {"24": 4, "48": 4}
  assert b["sequences_at_mean_live"] == {"24": 16, "48": 8}


def test_long_tail_lengths_are_heavy_tailed_and_capped():
  import importlib.util
  import os
  import sys
  bench = os.path.join(os.path.dirname(__file__), "..", "benchmarks")
  sys.path.insert(0, bench)
  try:
    spec = importlib.util.spec_from_file_location(
        "sampler_length", os.path.join(bench, "sampler_length.py"))
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
  finally:
    sys.path.remove(bench)
  lengths = np.asarray(mod.tail_lengths(mod.TAIL_REQUESTS))
  median = int(np.median(lengths))
  assert lengths.max() == 16 * median and lengths.min() >= 1
  assert abs(median - mod.TAIL_MEDIAN) < 0.3 * mod.TAIL_MEDIAN
  assert (lengths == lengths.max()).mean() >= 0.05  # a tail at the cap
  assert np.mean(lengths) > 1.5 * median  # a heavy right tail


@pytest.mark.host_inputs
def test_a_call_puts_back_only_the_entries_its_steps_wrote():
  """`decode.with_rows_written` against putting the whole view back: the
  same cache when the steps wrote only their own entries, and entries past
  the view or past a slot's steps untouched."""
  rng = np.random.default_rng(0)
  B, K, Dh, S, n, steps = 3, 2, 4, 24, 8, 3
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  cache = decode.DecodeCache(kt=[f(B, K, Dh, S)], v=[f(B, K, S, Dh)])
  start_B = jnp.asarray([0, 4, 7])  # slot 2: one entry in view, two past
  view = decode.rows_prefix(cache, n)
  written = np.zeros((B, n), bool)
  for b, s in enumerate(np.asarray(start_B)):
    written[b, s:s + steps] = True
  new = lambda x, axis: jnp.where(
      jnp.expand_dims(jnp.asarray(written), [1, 2] if axis == 3 else [1, 3]),
      f(*x.shape), x)
  view = view._replace(kt=[new(view.kt[0], 3)], v=[new(view.v[0], 2)])
  got = decode.with_rows_written(cache, view, start_B, steps)
  want_kt = cache.kt[0].at[..., :n].set(view.kt[0])
  want_v = cache.v[0].at[:, :, :n].set(view.v[0])
  np.testing.assert_array_equal(np.asarray(got.kt[0]), np.asarray(want_kt))
  np.testing.assert_array_equal(np.asarray(got.v[0]), np.asarray(want_v))
