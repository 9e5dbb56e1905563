"""Backend compiler options of the train steps
(kimi_jax/infra/compile_options.py):
what each backend gets, the fallback for a jaxlib without the option, that
jit_train_step really compiles with them, and that they leave the step's
result unchanged up to float rounding."""

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax import train_step as ts
from kimi_jax.infra import compile_options
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import (MeshConfig, Sharder, batch_shardings,
                               make_mesh, place_batch)
from kimi_jax.token_rows import TokenRows

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True)
BOGUS = {"xla_cpu_experimental_ynn_fusion_type": "LIBRARY_FUSION_TYPE_BOGUS"}


def test_cpu_gets_the_fusion_option_and_other_backends_nothing():
  assert compile_options.train_step_options("cpu") == dict(
      compile_options.CPU_TRAIN_OPTIONS)
  assert compile_options.train_step_options("tpu") == {}
  assert compile_options.train_step_options("gpu") == {}
  # Bfloat16 matmul inputs: XLA:CPU's fused dot would round the float32
  # product (tests/test_rl_gap.py sees that as a sampler-trainer gap).
  assert compile_options.train_step_options("cpu", jnp.bfloat16) == {}
  assert compile_options.train_step_options("cpu", jnp.float32) == dict(
      compile_options.CPU_TRAIN_OPTIONS)


def test_an_option_this_jaxlib_rejects_is_dropped(monkeypatch):
  assert not compile_options.accepted(tuple(BOGUS.items()))
  assert not compile_options.accepted((("xla_cpu_no_such_option", "1"),))
  monkeypatch.setattr(compile_options, "CPU_TRAIN_OPTIONS", BOGUS)
  assert compile_options.train_step_options("cpu") == {}


def _step_and_batch(options):
  sharder = Sharder(make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  opt = ts.make_optimizer(ts.OptimizerConfig(learning_rate=1e-2))
  shardings = ts.state_shardings(opt, CFG, sharder)
  state = ts.create_state(transformer.init_sharded(CFG, 0, sharder), opt,
                          shardings)
  toks = np.random.default_rng(0).integers(3, CFG.vocab_size, (4, 17))
  toks = toks.astype(np.int32)
  batch = TokenRows(tokens_RxT=toks[:, :-1], targets_RxT=toks[:, 1:],
                    mask_RxT=np.ones((4, 16), np.float32),
                    positions_RxT=np.tile(np.arange(16, dtype=np.int32),
                                          (4, 1)),
                    segment_ids_RxT=np.ones((4, 16), np.int32))
  loss_fn = functools.partial(ts.cross_entropy_loss, cfg=CFG,
                              sharder=sharder)
  step, _ = ts.jit_train_step(loss_fn, opt, shardings,
                              batch_shardings(sharder, batch),
                              compiler_options=options)
  return step, state, place_batch(sharder, batch)


@pytest.mark.host_inputs
def test_jit_train_step_compiles_with_the_options_it_is_given():
  step, state, batch = _step_and_batch(BOGUS)
  with pytest.raises(jax.errors.JaxRuntimeError, match="BOGUS"):
    step(state, batch)


@pytest.mark.host_inputs
def test_shipped_options_change_the_step_only_by_rounding():
  results = []
  for options in (None, {}):  # the backend's options, then XLA's defaults
    step, state, batch = _step_and_batch(options)
    for _ in range(3):
      state, metrics = step(state, batch)
    results.append((jax.device_get(state.params), float(metrics["loss"])))
  (fused, loss_fused), (plain, loss_plain) = results
  np.testing.assert_allclose(loss_fused, loss_plain, rtol=1e-5)
  jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-4,
                                                       atol=1e-6),
               fused, plain)
