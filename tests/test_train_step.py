"""The jitted, sharded, donated train step: memorises a batch, compiles once
for equal shapes, keeps its shardings, and its loss masks what it should."""

import functools

import chex
import jax
import numpy as np
import optax
import pytest

from kimi_jax import train_step as ts
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import (MeshConfig, Sharder, batch_shardings,
                               make_mesh, place_batch)
from kimi_jax.token_rows import TokenRows

CFG = ModelConfig(vocab_size=32, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, qkv_bias=True)


def _batch(rng, B=8, T=12) -> TokenRows:
  toks = rng.integers(3, CFG.vocab_size, (B, T + 1)).astype(np.int32)
  return TokenRows(tokens_RxT=toks[:, :-1], targets_RxT=toks[:, 1:],
                   mask_RxT=np.ones((B, T), np.float32),
                   positions_RxT=np.tile(np.arange(T, dtype=np.int32),
                                         (B, 1)),
                   segment_ids_RxT=np.ones((B, T), np.int32))


def _setup(mesh_cfg, devices=None):
  sharder = Sharder(make_mesh(mesh_cfg, devices))
  opt = ts.make_optimizer(ts.OptimizerConfig(learning_rate=1e-2))
  shardings = ts.state_shardings(opt, CFG, sharder)
  params = transformer.init_sharded(CFG, 0, sharder)
  return sharder, opt, shardings, ts.create_state(params, opt, shardings)


def test_memorises_batch_without_recompiling_and_stays_sharded():
  sharder, opt, shardings, state = _setup(MeshConfig(data=2, fsdp=2,
                                                     tensor=2))
  batch = _batch(np.random.default_rng(0))
  batch_sh = batch_shardings(sharder, batch)
  loss_fn = functools.partial(ts.cross_entropy_loss, cfg=CFG, sharder=sharder)
  step, counter = ts.jit_train_step(loss_fn, opt, shardings, batch_sh)
  losses = []
  for i in range(60):
    # Freshly placed arrays each step with equal shapes: no recompilation.
    state, m = step(state, place_batch(sharder, batch))
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
    state, _ = step(state, jax.device_put(_batch(rng), jax.devices()[0]))


def test_masked_targets_do_not_contribute():
  """Changing a target under mask 0 changes neither loss nor gradient."""
  params = jax.jit(lambda: transformer.init_params(CFG, jax.random.key(1)))()
  host = _batch(np.random.default_rng(2))
  host.mask_RxT[:, :5] = 0.0
  targets = host.targets_RxT.copy()
  targets[:, :5] = (targets[:, :5] + 7) % CFG.vocab_size
  batch = jax.device_put(host)
  other = jax.device_put(host.replace(targets_RxT=targets))
  grad = jax.jit(jax.grad(
      lambda p, b: ts.cross_entropy_loss(p, b, cfg=CFG)[0]))
  g1, g2 = grad(params, batch), grad(params, other)
  chex.assert_trees_all_close(g1, g2, atol=1e-7)
  # And the loss equals a by-hand mean of -log p over the unmasked targets.
  logits, _ = jax.jit(functools.partial(transformer.forward, cfg=CFG))(
      params, batch.tokens_RxT, batch.positions_RxT, batch.segment_ids_RxT)
  logp = np.asarray(logits, np.float64)
  logp = logp - np.log(np.exp(logp).sum(-1, keepdims=True))
  B, T = host.targets_RxT.shape
  nll = [-logp[b, t, host.targets_RxT[b, t]] for b in range(B)
         for t in range(5, T)]
  loss, _ = jax.jit(functools.partial(ts.cross_entropy_loss, cfg=CFG))(
      params, batch)
  np.testing.assert_allclose(float(loss), np.mean(nll), rtol=1e-5)


def test_opt_state_moments_take_their_param_sharding():
  sharder, opt, shardings, state = _setup(MeshConfig(data=2, fsdp=2,
                                                     tensor=2))
  adam = state.opt_state[1][0]
  assert isinstance(adam, optax.ScaleByAdamState)
  assert adam.mu["layers"]["w_up"].sharding.spec == shardings.params[
      "layers"]["w_up"].spec


def test_two_stage_learning_rate_schedule_by_hand():
  cfg = ts.OptimizerConfig(
      learning_rate=2e-5, warmup_steps=10, decay="cosine", decay_steps=100,
      final_learning_rate=2e-6, stage2_learning_rate=1e-5,
      stage2_warmup_steps=5, stage2_decay_steps=50,
      stage2_final_learning_rate=1e-6)
  lr = ts.learning_rate_schedule(cfg)
  cos_quarter = 2e-6 + 1.8e-5 * 0.5 * (1 + np.cos(np.pi / 4))
  want = {0: 0.0, 5: 1e-5, 10: 2e-5, 35: cos_quarter, 60: 1.1e-5,
          110: 2e-6,                     # floor of stage 1 = start of 2
          115: 1e-5, 140: 5.5e-6, 165: 1e-6, 10_000: 1e-6}
  np.testing.assert_allclose(_at(lr, list(want)), list(want.values()),
                             rtol=1e-5, atol=1e-12)
  linear = ts.learning_rate_schedule(ts.OptimizerConfig(
      learning_rate=2e-5, warmup_steps=10, decay="linear", decay_steps=100,
      final_learning_rate=2e-6))
  np.testing.assert_allclose(_at(linear, [35, 500]),
                             [2e-5 - 1.8e-5 / 4, 2e-6], rtol=1e-5)
  # The old fields alone: warm-up then constant.
  old = ts.learning_rate_schedule(ts.OptimizerConfig(learning_rate=1e-3,
                                                     warmup_steps=4))
  np.testing.assert_allclose(_at(old, [0, 2, 4, 99]),
                             [0.0, 5e-4, 1e-3, 1e-3], rtol=1e-6)


def _at(schedule, steps) -> np.ndarray:
  """schedule(step) for each step, evaluated on device (no implicit
  host-to-device transfers)."""
  steps = jax.device_put(np.asarray(steps, np.int32))
  return np.asarray(jax.jit(jax.vmap(schedule))(steps))


def test_optimizer_steps_follow_the_schedule():
  # With a constant gradient Adam's normalised step is 1, so each update is
  # -lr(step) exactly (up to eps): the schedule is what the optimizer uses.
  cfg = ts.OptimizerConfig(learning_rate=1e-2, warmup_steps=2,
                           decay="linear", decay_steps=4,
                           final_learning_rate=1e-3, b1=0.9, b2=0.95)
  opt = ts.make_optimizer(cfg)
  params = jax.device_put({"w": np.zeros(3, np.float32)})
  grads = jax.device_put({"w": np.full(3, 0.01, np.float32)})
  state = jax.jit(opt.init)(params)
  update = jax.jit(opt.update)
  got = []
  for _ in range(8):
    updates, state = update(grads, state, params)
    got.append(np.asarray(updates["w"]))
  want = -_at(ts.learning_rate_schedule(cfg), range(8))
  np.testing.assert_allclose(np.stack(got), np.repeat(want[:, None], 3, 1),
                             rtol=1e-4, atol=1e-9)


@pytest.mark.parametrize("kwargs, pattern", [
    (dict(decay="step"), "decay must be one of"),
    (dict(decay="cosine"), "needs decay_steps > 0"),
    (dict(decay="linear", decay_steps=5, final_learning_rate=1.0),
     "final_learning_rate must be in"),
    (dict(stage2_learning_rate=1e-4), "second stage"),
])
def test_bad_schedules_are_named(kwargs, pattern):
  with pytest.raises(ValueError, match=pattern):
    ts.OptimizerConfig(learning_rate=1e-3, **kwargs)


def test_every_training_section_builds_its_optimizer_from_its_own_keys():
  from kimi_jax.long2short.config import DPOConfig
  from kimi_jax.reward_models.cot_train import CotTrainConfig
  from kimi_jax.reward_models.value_train import ValueTrainConfig
  from kimi_jax.rl.config import RLConfig
  from kimi_jax.sft import SFTConfig
  adamw = dict(learning_rate=0.5, warmup_steps=3, weight_decay=0.25,
               grad_clip=2.0)
  sections = [
      SFTConfig(steps=10, batch_size=2, seq_len=8, **adamw),
      RLConfig(iterations=1, prompts_per_iteration=2, samples_per_prompt=2,
               minibatch_prompts=2, **adamw),
      DPOConfig(**adamw), ValueTrainConfig(**adamw), CotTrainConfig(**adamw)]
  for section in sections:
    opt = section.optimizer()
    assert {k: getattr(opt, k) for k in adamw} == adamw, section
    assert (opt.decay, opt.b1, opt.b2) == ("constant", 0.9, 0.95)
  # Each section keeps its own defaults for the keys it does not set.
  assert RLConfig(iterations=1, prompts_per_iteration=2,
                  samples_per_prompt=2,
                  minibatch_prompts=2).optimizer().learning_rate == 1e-6
  assert ValueTrainConfig().optimizer().warmup_steps == 10


def test_sft_schedule_splits_its_steps_between_the_stages():
  from kimi_jax.sft import SFTConfig
  opt = SFTConfig(steps=100, batch_size=2, seq_len=8, learning_rate=1e-3,
                  warmup_steps=10, decay="cosine", final_learning_rate=1e-4,
                  stage2_steps=20, stage2_warmup_steps=5,
                  stage2_learning_rate=5e-4).optimizer()
  assert (opt.decay_steps, opt.stage2_warmup_steps,
          opt.stage2_decay_steps) == (70, 5, 15)
  assert opt.stage2_learning_rate == 5e-4
