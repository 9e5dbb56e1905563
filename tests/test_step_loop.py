"""The reward models' training loops continue after a crash
(`kimi_jax.step_loop`): a run stopped mid-way and rerun ends at the
parameters of an uninterrupted run, and checkpoints of other inputs are
not reused."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from kimi_jax import step_loop
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.reward_models import cot_train, value_data, value_model
from kimi_jax.reward_models import value_train
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from tests.kill import kill_at_placement

CFG = ModelConfig(vocab_size=40, d_model=16, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=32, qkv_bias=True,
                  max_seq_len=64)
STEPS = 6


class Crash(RuntimeError):
  pass


def _sharder() -> Sharder:
  return Sharder(make_mesh(MeshConfig(), jax.devices()[:1]))


def _value(sharder, progress):
  """value_train.train for STEPS steps from fixed params and units."""
  base = transformer.init_sharded(CFG, 0, sharder, std=0.2)
  rng = np.random.default_rng(0)
  units = [(value_data.Scored(tuple(int(t) for t in rng.integers(3, 40, n)),
                              bool(n % 2)),) for n in rng.integers(3, 9, 24)]
  cfg = value_train.ValueTrainConfig(steps=STEPS, batch_rows=2, row_len=16,
                                     learning_rate=1e-2, warmup_steps=1)
  return value_train.train(value_model.init_params(base, CFG), units,
                           model_cfg=CFG, cfg=cfg, sharder=sharder, pad_id=0,
                           seed=1, progress=progress)


def _cot(sharder, progress):
  """cot_train.sft for STEPS steps from fixed params and pairs."""
  base = transformer.init_sharded(CFG, 0, sharder, std=0.2)
  rng = np.random.default_rng(0)
  pairs = [([int(t) for t in rng.integers(3, 40, n)],
            [int(t) for t in rng.integers(3, 40, 4)])
           for n in rng.integers(3, 9, 24)]
  cfg = cot_train.CotTrainConfig(steps=STEPS, batch_rows=2, row_len=16,
                                 learning_rate=1e-2, warmup_steps=1)
  return cot_train.sft(base, pairs, model_cfg=CFG, cfg=cfg, steps=STEPS,
                       sharder=sharder, pad_id=0, seed=1, what="test SFT",
                       progress=progress)


def _leaves(params):
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(params))]


@pytest.mark.slow  # compiles two small transformers' train steps
@pytest.mark.parametrize("train", [_value, _cot], ids=["value", "cot_sft"])
def test_a_crashed_training_resumes_to_the_uninterrupted_params(
    tmp_path, monkeypatch, train):
  sharder = _sharder()
  whole, whole_hist = train(sharder, None)
  assert [h["step"] for h in whole_hist] == list(range(1, STEPS + 1))

  progress = step_loop.Progress(str(tmp_path / "p"), key="inputs A", every=2)
  with monkeypatch.context() as m:
    # Steps 1-5 ran; the last checkpoint is step 4's.
    kill_at_placement(m, 6, Crash)
    with pytest.raises(Crash):
      train(sharder, progress)
  resumed, hist = train(sharder, progress)
  assert [h["step"] for h in hist] == [5, 6]
  for got, want in zip(_leaves(resumed), _leaves(whole)):
    np.testing.assert_array_equal(got, want)

  # Finished: a rerun runs no step and returns the same parameters.
  again, hist = train(sharder, progress)
  assert hist == []
  for got, want in zip(_leaves(again), _leaves(whole)):
    np.testing.assert_array_equal(got, want)

  # Other inputs: the checkpoints are dropped and training starts over.
  other = step_loop.Progress(progress.directory, key="inputs B", every=2)
  fresh, hist = train(sharder, other)
  assert [h["step"] for h in hist] == list(range(1, STEPS + 1))
  for got, want in zip(_leaves(fresh), _leaves(whole)):
    np.testing.assert_array_equal(got, want)


def test_value_batches_state_round_trips_across_epochs():
  """A stream restored from its state draws what the original draws next,
  across an epoch boundary."""
  units = [(value_data.Scored(tuple(range(3, 3 + n)), bool(n % 2)),)
           for n in (3, 5, 4, 6, 3, 7, 2)]
  make = lambda: value_data.ValueBatches(units, n_rows=1, row_len=8,
                                         pad_id=0, seed=4)
  a = make()
  while a.get_state()["position"] <= len(units):  # into the second epoch
    next(a)
  state = a.get_state()
  b = make()
  b.set_state(state)
  assert b.epoch == a.epoch
  for _ in range(6):
    x, y = next(a), next(b)
    np.testing.assert_array_equal(x.rows.tokens_RxT, y.rows.tokens_RxT)
  with pytest.raises(Exception, match="seed"):
    value_data.ValueBatches(units, n_rows=1, row_len=8, pad_id=0,
                            seed=5).set_state(state)


def test_cycle_state_round_trips():
  a = step_loop.Cycle(["x", "y", "z"])
  assert [next(a) for _ in range(4)] == ["x", "y", "z", "x"]
  b = step_loop.Cycle(["x", "y", "z"])
  b.set_state(a.get_state())
  assert [next(b) for _ in range(3)] == ["y", "z", "x"]
  with pytest.raises(ValueError, match="3 batches"):
    step_loop.Cycle(["x"]).set_state(a.get_state())


def test_checkpoint_restore_is_quiet_and_finds_the_optimizer_state(
    tmp_path, caplog):
  """Restoring asks Orbax which items a step holds; that must not log its
  "could not be restored" warnings, and a step saved without an optimizer
  state restores none."""
  import logging
  from kimi_jax.infra.checkpoint import Checkpointer
  device = jax.devices()[0]
  put = lambda x: jax.device_put(np.asarray(x, np.float32), device)
  params, opt = {"w": put([1.0, 2.0])}, {"m": put([3.0, 4.0])}
  shardings = {"w": params["w"].sharding}
  saver = Checkpointer(str(tmp_path / "c"), max_to_keep=2)
  saver.save(1, params=params, host={"n": 1}, opt_state=opt)
  saver.save(2, params=params, host={"n": 2})
  saver.close()
  reader = Checkpointer(str(tmp_path / "c"))
  with caplog.at_level(logging.WARNING):
    got_p, got_o, host = reader.restore(
        1, params_like=params, params_shardings=shardings,
        opt_state_like=opt, opt_state_shardings={"m": shardings["w"]})
    _, none, host2 = reader.restore(
        2, params_like=params, params_shardings=shardings,
        opt_state_like=opt, opt_state_shardings={"m": shardings["w"]})
  reader.close()
  assert "could not be restored" not in caplog.text
  np.testing.assert_array_equal(np.asarray(got_o["m"]), [3.0, 4.0])
  np.testing.assert_array_equal(np.asarray(got_p["w"]), [1.0, 2.0])
  assert none is None and host == {"n": 1} and host2 == {"n": 2}
