"""The jitted, sharded, donated train step: memorises a batch, compiles once
for equal shapes, keeps its shardings, and its loss masks what it should."""

import functools

import chex
import jax
import numpy as np
import optax

from kimi_jax import train_step as ts
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True)


def _batch(rng, B=8, T=12):
  toks = rng.integers(3, CFG.vocab_size, (B, T + 1)).astype(np.int32)
  return dict(tokens=toks[:, :-1], targets=toks[:, 1:],
              mask=np.ones((B, T), np.float32),
              positions=np.tile(np.arange(T, dtype=np.int32), (B, 1)),
              segment_ids=np.ones((B, T), np.int32))


def _setup(mesh_cfg, devices=None):
  sharder = Sharder(make_mesh(mesh_cfg, devices))
  opt = ts.make_optimizer(ts.OptimizerConfig(learning_rate=1e-2))
  shardings = ts.state_shardings(opt, CFG, sharder)
  params = transformer.init_sharded(CFG, jax.random.key(0), sharder)
  return sharder, opt, shardings, ts.create_state(params, opt, shardings)


def test_memorises_batch_without_recompiling_and_stays_sharded():
  sharder, opt, shardings, state = _setup(MeshConfig(data=2, fsdp=2,
                                                     tensor=2))
  batch = _batch(np.random.default_rng(0))
  batch_sh = ts.batch_shardings(sharder, {k: v.shape
                                          for k, v in batch.items()})
  loss_fn = functools.partial(ts.cross_entropy_loss, cfg=CFG, sharder=sharder)
  step, counter = ts.jit_train_step(loss_fn, opt, shardings, batch_sh)
  losses = []
  for i in range(60):
    # Fresh host arrays each step with equal shapes: no recompilation.
    state, m = step(state, {k: v.copy() for k, v in batch.items()})
    losses.append(float(m["loss"]))
  assert counter.count == 1
  assert losses[-1] < 0.2 * losses[0], losses[::10]
  assert int(state.step) == 60
  wq = state.params["layers"]["wq"]
  assert wq.sharding.spec == shardings.params["layers"]["wq"].spec
  assert wq.addressable_shards[0].data.shape == (2, 16, 2, 8)


def test_assert_max_traces_guard_holds_for_the_step():
  sharder, opt, shardings, state = _setup(MeshConfig(data=1),
                                          jax.devices()[:1])
  loss_fn = functools.partial(ts.cross_entropy_loss, cfg=CFG)
  traced = chex.assert_max_traces(
      lambda s, b: ts.train_step(s, b, loss_fn=loss_fn, optimizer=opt),
      n=1)
  step = jax.jit(traced, donate_argnums=(0,))
  rng = np.random.default_rng(1)
  for _ in range(3):
    state, _ = step(state, _batch(rng))


def test_masked_targets_do_not_contribute():
  """Changing a target under mask 0 changes neither loss nor gradient."""
  params = transformer.init_params(CFG, jax.random.key(1))
  batch = _batch(np.random.default_rng(2))
  batch["mask"][:, :5] = 0.0
  other = dict(batch, targets=batch["targets"].copy())
  other["targets"][:, :5] = (other["targets"][:, :5] + 7) % CFG.vocab_size
  grad = jax.grad(lambda p, b: ts.cross_entropy_loss(p, b, cfg=CFG)[0])
  g1, g2 = grad(params, batch), grad(params, other)
  chex.assert_trees_all_close(g1, g2, atol=1e-7)
  # And the loss equals a by-hand mean of -log p over the unmasked targets.
  logits, _ = transformer.forward(params, batch["tokens"], batch["positions"],
                                  batch["segment_ids"], cfg=CFG)
  logp = np.asarray(jax.nn.log_softmax(logits))
  B, T = batch["targets"].shape
  nll = [-logp[b, t, batch["targets"][b, t]] for b in range(B)
         for t in range(5, T)]
  loss, _ = ts.cross_entropy_loss(params, batch, cfg=CFG)
  np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)


def test_opt_state_moments_take_their_param_sharding():
  sharder, opt, shardings, state = _setup(MeshConfig(data=2, fsdp=2,
                                                     tensor=2))
  adam = state.opt_state[1][0]
  assert isinstance(adam, optax.ScaleByAdamState)
  assert adam.mu["layers"]["w_up"].sharding.spec == shardings.params[
      "layers"]["w_up"].spec
