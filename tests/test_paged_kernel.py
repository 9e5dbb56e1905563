"""Pallas's TPU paged attention kernel as the decode's paged attention.

Off a TPU the kernel runs in Pallas's TPU interpreter, which emulates the
chip, down to its float32 matmuls rounding their inputs through bfloat16:
so the kernel is held to the XLA pages within bfloat16 rounding, and to
exactly the same pool writes. Under the TPU compiler (libtpu, on this
host) the decode call must lower to one Mosaic kernel per full layer.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from kimi_jax.infra import aot
from kimi_jax.infra.config import load_config, to_dataclass
from kimi_jax.job import plan
from kimi_jax.model import decode
from kimi_jax.sampler import handoff
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sharding import (MeshConfig, Sharder, make_mesh,
                               rules_from_config)
from test_aot import TINY
from test_paged_cache import (CFG, NO_REPEAT, ROWS_WHOLE, _params, _requests,
                              _run)

B, H, K, Dh, PAGE, N_PAGES = 4, 4, 2, 16, 8, 16
KERNEL = dict(ROWS_WHOLE, page_size=8, min_view=16,
              attention_kernel="pallas_tpu")
# One decode step's paged attention: the XLA gather, and the TPU kernel in
# its interpreter; (out, k pool, v pool).
xla_attend = jax.jit(functools.partial(decode._paged_attend, cfg=CFG))
kernel_attend = jax.jit(functools.partial(decode._kernel_attend, cfg=CFG,
                                          interpret=True))


def _layer_inputs(seed: int = 0, none_past_length: bool = True):
  """One decode step's inputs: the pool (XLA layout) and 3 pages in view
  per slot; slots 0 and 2 reach only their first, and name "none" (id
  N_PAGES) for the others, or real pages when not none_past_length."""
  rng = np.random.default_rng(seed)
  f = lambda *shape: jnp.asarray(rng.normal(size=shape), jnp.float32)
  pages_BxV = np.asarray(rng.permutation(N_PAGES)[:B * 3].reshape(B, 3),
                         np.int32)
  pos_B = np.asarray([4, 17, 0, 23], np.int32)  # this token's position
  if none_past_length:
    pages_BxV[[0, 2], 1:] = N_PAGES
  kt_pool, v_pool = f(N_PAGES, K, Dh, PAGE), f(N_PAGES, K, PAGE, Dh)
  return (f(B, 1, H, Dh), f(B, 1, K, Dh), f(B, 1, K, Dh), kt_pool, v_pool,
          jnp.asarray(pages_BxV), jnp.asarray(pos_B))


def _kernel_layout(kt_PxKxDhxN, v_PxKxNxDh):
  return (kt_PxKxDhxN.transpose(1, 0, 3, 2),
          v_PxKxNxDh.transpose(1, 0, 2, 3))


@pytest.mark.host_inputs
@pytest.mark.tpu_interpreter
def test_kernel_attends_and_writes_as_the_xla_pages():
  q, k_new, v_new, kt_pool, v_pool, pages_BxV, pos_B = _layer_inputs()
  out, kt_x, v_x = xla_attend(q, k_new, v_new, kt_pool, v_pool, pages_BxV,
                              pos_B)
  got, k_t, v_t = kernel_attend(q, k_new, v_new,
                                *_kernel_layout(kt_pool, v_pool), pages_BxV,
                                pos_B)
  # The same entries written, in the kernel's layout.
  want_k, want_v = _kernel_layout(kt_x, v_x)
  np.testing.assert_array_equal(np.asarray(k_t), np.asarray(want_k))
  np.testing.assert_array_equal(np.asarray(v_t), np.asarray(want_v))
  # The same attention up to bfloat16 rounding of the values and weights
  # (a wrong page or length is off by O(1)).
  assert got.shape == out.shape == (B, 1, H, Dh)
  np.testing.assert_allclose(np.asarray(got), np.asarray(out), atol=3e-2)
  assert np.abs(np.asarray(got - out)).max() > 0  # not the XLA path


@pytest.mark.host_inputs
@pytest.mark.tpu_interpreter
def test_kernel_never_reads_pages_past_a_slots_length():
  """The pages slots 0 and 2 name but have not reached, and the pages no
  slot names, full of NaN: the kernel's output is unchanged (the XLA
  gather reads every page in view)."""
  q, k_new, v_new, kt_pool, v_pool, pages_BxV, pos_B = _layer_inputs(
      1, none_past_length=False)
  k_t, v_t = _kernel_layout(kt_pool, v_pool)
  live = {int(p) for b in range(B) for p in
          np.asarray(pages_BxV)[b, :int(pos_B[b]) // PAGE + 1]}
  dead = np.asarray([p not in live for p in range(N_PAGES)])
  assert dead.sum() == N_PAGES - (1 + 3 + 1 + 3)
  poison = lambda pool: jnp.where(dead[None, :, None, None], jnp.nan, pool)
  attend = lambda k, v: kernel_attend(q, k_new, v_new, k, v, pages_BxV,
                                     pos_B)[0]
  got, ref = attend(poison(k_t), poison(v_t)), attend(k_t, v_t)
  np.testing.assert_array_equal(np.asarray(got), np.asarray(ref))
  xla = xla_attend(q, k_new, v_new, *[
      jnp.where(dead[:, None, None, None], jnp.nan, x)
      for x in (kt_pool, v_pool)], pages_BxV, pos_B)[0]
  assert np.isnan(np.asarray(xla)).any()


def _greedy_requests():
  """Greedy requests (the interpreter is slow: few and short), crossing
  page boundaries (prompts 5 .. 13 tokens, pages of 8)."""
  reqs = [r for r in _requests(7) if r.sampling.greedy]
  return [dataclasses.replace(r, max_new_tokens=n)
          for r, n in zip(reqs, (9, 6, 4))]


def _same_greedy(got, ref):
  """The same tokens, log-probs within the kernel's bfloat16 rounding."""
  assert [r.tokens for r in got] == [r.tokens for r in ref]
  for a, b in zip(got, ref):
    np.testing.assert_allclose(a.logprobs, b.logprobs, atol=5e-2)


@pytest.fixture(scope="module")
def rows_greedy():
  return _run(CFG, ROWS_WHOLE, _greedy_requests())[0]


@pytest.mark.slow
@pytest.mark.tpu_interpreter
def test_engine_with_the_kernel_samples_greedy_tokens_as_rows_do(
    rows_greedy):
  """A model with peaked next-token distributions: the row cache's tokens."""
  _same_greedy(_run(CFG, KERNEL, _greedy_requests())[0], rows_greedy)


@pytest.mark.slow
@pytest.mark.tpu_interpreter
def test_kernel_on_a_mesh_samples_what_one_device_samples(rows_greedy):
  """Slots and pages over data x fsdp, heads over tensor: the kernel runs
  per shard inside shard_map, on its shard's part of the pool."""
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  engine = Engine(CFG, EngineConfig(**dict(KERNEL, max_slots=8,
                                           kv_pages=48)), sharder=sharder)
  state = engine.init_decode_state()
  assert state.cache.kt[0].sharding.spec == P("tensor", ("data", "fsdp"),
                                             None, None)
  params = handoff.place_params(_params(CFG), engine.param_shardings)[0]
  got, _ = Sampler(engine, NO_REPEAT, steps_per_call=4).generate(
      params, _greedy_requests())
  _same_greedy(got, rows_greedy)


def test_kernel_config_errors_name_the_key():
  with pytest.raises(ValueError, match="sampler.attention_kernel"):
    EngineConfig(max_slots=2, cache_len=64, page_size=8,
                 attention_kernel="triton")
  with pytest.raises(ValueError, match="sampler.page_size"):
    EngineConfig(max_slots=2, cache_len=64, attention_kernel="pallas_tpu")
  # On TPU devices the kernel needs 128-lane heads.
  sharder = Sharder(make_mesh(MeshConfig(), aot.topology_devices("v5e:2x2")))
  with pytest.raises(ValueError, match="model.head_dim"):
    Engine(CFG, EngineConfig(**KERNEL), sharder=sharder)


@pytest.mark.slow
def test_decode_call_lowers_to_the_tpu_kernel_under_the_tpu_compiler():
  def generate_hlo(kernel: str) -> str:
    config = load_config(TINY, [f"sampler.attention_kernel={kernel}",
                                "sampler.page_size=16", "model.head_dim=128",
                                "rl.train_len_buckets=(48,)"])
    devices = aot.topology_devices("v5e:2x2")
    sharder = Sharder(make_mesh(to_dataclass(MeshConfig, config.mesh,
                                             "mesh"), devices),
                      rules_from_config(config.sharding.rules))
    fn, args = plan.main_job_functions(config, sharder)["sampler_generate"]
    return aot.compile_for_topology(fn, args).as_text()

  n_full = load_config(TINY, []).model.n_layers
  assert generate_hlo("pallas_tpu").count("tpu_custom_call") == n_full
  assert generate_hlo("xla").count("tpu_custom_call") == 0
  assert jax.devices()[0].platform == "cpu"
