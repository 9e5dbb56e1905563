"""The job's SFT stage: packed rows, the data position in the checkpoint's
host item, and an interrupted stage that resumes with exactly the batches
it would have seen."""

from __future__ import annotations

import dataclasses
import json
import os
import shutil

import jax
import numpy as np
import pytest

from kimi_jax import train_step as ts
from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import parse_config
from kimi_jax.rl.evaluation import EvalResult

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "tiny.py")
STEPS = 8  # checkpoints at steps 2, 4 and 6


class _Stop(Exception):
  """Stands for the process dying right after a checkpoint."""


def _config(**changes):
  config = load_config(TINY + ":micro", {"sft.steps": STEPS})
  with config.unlocked():
    config.sft.update(changes)
  return config


def _job(workdir, **changes) -> job_lib.Job:
  return job_lib.build(parse_config(_config(**changes), jax.device_count()),
                       str(workdir))


def _fresh(job: job_lib.Job):
  opt = job_lib.sft_optimizer(job.cfg)
  shardings = ts.state_shardings(opt, job.cfg.model, job.sharder)
  return (ts.create_state(job_lib.initial_params(job), opt, shardings), opt,
          shardings)


def _restored(job: job_lib.Job, step: int):
  opt = job_lib.sft_optimizer(job.cfg)
  shardings = ts.state_shardings(opt, job.cfg.model, job.sharder)
  from kimi_jax.model import transformer
  abstract = transformer.abstract_params(job.cfg.model)
  params, opt_state, host = job.checkpointer.restore(
      step, params_like=abstract, params_shardings=shardings.params,
      opt_state_like=jax.eval_shape(opt.init, abstract),
      opt_state_shardings=shardings.opt_state)
  state = ts.create_state(params, opt, shardings).replace(
      opt_state=opt_state)
  return state, opt, shardings, host


def _losses(workdir) -> dict[int, float]:
  with open(os.path.join(workdir, "metrics.jsonl")) as f:
    return {r["step"]: r["loss"] for r in map(json.loads, f)
            if r["stage"] == "sft"}


def _host_params(state) -> list[np.ndarray]:
  return [np.asarray(x) for x in jax.tree.leaves(jax.device_get(
      state.params))]


@pytest.mark.slow
def test_interrupted_sft_resumes_with_the_same_batches(tmp_path):
  whole = _job(tmp_path / "whole")
  state, opt, sh = _fresh(whole)
  want = _host_params(job_lib.run_sft(whole, state, 0, None, opt, sh))
  with open(tmp_path / "whole" / "metrics.jsonl") as f:
    examples = [r["examples"] for r in map(json.loads, f)
                if r["stage"] == "sft"]
  assert len(examples) == STEPS
  assert min(examples) > whole.cfg.sft.batch_size  # several to a row

  # Dies right after the checkpoint of step 4.
  first = _job(tmp_path / "cut")
  save = first.checkpointer.save

  def save_then_die(step, **items):
    save(step, **items)
    if step == 4:  # save() returns once the step is durable
      raise _Stop

  first.checkpointer.save = save_then_die
  state, opt, sh = _fresh(first)
  with pytest.raises(_Stop):
    job_lib.run_sft(first, state, 0, None, opt, sh)
  first.checkpointer.close()
  shutil.copytree(tmp_path / "cut", tmp_path / "cut_again")

  again = _job(tmp_path / "cut")
  assert again.checkpointer.latest_step() == 4
  state, opt, sh, host = _restored(again, 4)
  assert host["stage"] == "sft" and host["sft_step"] == 4
  assert set(host["data"]) == {"position", "seed", "size"}
  assert host["data"]["position"] > 4 * again.cfg.sft.batch_size  # packed
  got = _host_params(job_lib.run_sft(again, state, 4, host["data"], opt, sh))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  assert _losses(tmp_path / "cut") == _losses(tmp_path / "whole")
  again.checkpointer.close()

  # The data position matters: restarting the stream gives other batches.
  other = _job(tmp_path / "cut_again")
  state, opt, sh, host = _restored(other, 4)
  wrong = _host_params(job_lib.run_sft(
      other, state, 4, dict(host["data"], position=0), opt, sh))
  assert any(not np.array_equal(a, b) for a, b in zip(wrong, want))


class _ScriptedValidator:
  """Stands for the validation sampler: the pass@1 of each check in turn,
  so the stopping rule, not the model, is what is tested."""

  def __init__(self, rates, greedy=None):
    self.rates, self.calls = list(rates), 0
    self.greedy = list(greedy or [0.0] * len(self.rates))

  def __call__(self, params):
    self.calls += 1
    return EvalResult(pass_at_1=self.rates.pop(0),
                      greedy_accuracy=self.greedy.pop(0), mean_length=1.0,
                      n_problems=1)


@pytest.mark.slow  # trains and evaluates a tiny model
def test_sft_stops_at_the_first_check_that_reaches_the_target(tmp_path):
  """sft.stop_at_val: checks every 2 steps read 0.2 then 0.6 against a
  target of 0.5, so the stage ends after step 4 with the params a whole
  8-step stage had at its step-4 checkpoint (same schedule, same batches),
  that checkpoint says it stopped, and a resumed job trains no further."""
  whole = _job(tmp_path / "whole")
  state, opt, sh = _fresh(whole)
  job_lib.run_sft(whole, state, 0, None, opt, sh)
  want = _host_params(_restored(whole, 4)[0])
  whole.checkpointer.close()

  changes = dict(stop_at_val=0.5, check_every=2)
  stopped = dataclasses.replace(_job(tmp_path / "stop", **changes),
                                validator=_ScriptedValidator([0.2, 0.6]))
  state, opt, sh = _fresh(stopped)
  state = job_lib.run_sft(stopped, state, 0, None, opt, sh)
  assert job_lib.sft_steps_trained(stopped.metrics.path) == 4
  assert stopped.validator.calls == 2
  for a, b in zip(_host_params(state), want):
    np.testing.assert_array_equal(a, b)
  assert stopped.checkpointer.latest_step() == 4
  assert _restored(stopped, 4)[3]["sft_stopped"] is True
  assert sorted(_losses(tmp_path / "stop")) == [1, 2, 3, 4]
  stopped.checkpointer.close()

  # The resumed job (its validator would now read the target at once, but
  # it is never asked) takes the stopped step's params as its warm start.
  config = _config(**changes)
  config.rl.iterations = 0
  summary = job_lib.train_and_evaluate(config, str(tmp_path / "stop"))
  assert summary["sft_steps"] == 4
  assert sorted(_losses(tmp_path / "stop")) == [1, 2, 3, 4]


@pytest.mark.slow  # trains and evaluates a tiny model
def test_sft_stop_reads_the_configured_metric(tmp_path):
  """With sft.stop_metric="greedy_accuracy" a sampled pass@1 above the
  target does not stop the stage; the greedy accuracy does."""
  changes = dict(stop_at_val=0.5, check_every=2,
                 stop_metric="greedy_accuracy")
  job = dataclasses.replace(
      _job(tmp_path / "w", **changes),
      validator=_ScriptedValidator([0.9, 0.9, 0.9], greedy=[0.1, 0.2, 0.7]))
  state, opt, sh = _fresh(job)
  job_lib.run_sft(job, state, 0, None, opt, sh)
  assert job_lib.sft_steps_trained(job.metrics.path) == 6
  assert job.validator.calls == 3
  job.checkpointer.close()


def test_sft_stop_needs_a_validation_set(tmp_path):
  config = _config(stop_at_val=0.5, check_every=2)
  with config.unlocked():
    config.task.val_fraction = 0.0
  job = job_lib.build(parse_config(config, jax.device_count()),
                      str(tmp_path / "w"))
  state, opt, sh = _fresh(job)
  with pytest.raises(ConfigError, match="task.val_path"):
    job_lib.run_sft(job, state, 0, None, opt, sh)
  job.checkpointer.close()


@pytest.mark.parametrize("changes, key", [
    (dict(stop_at_val=1.5, check_every=2), "sft.stop_at_val"),
    (dict(stop_at_val=0.5, check_every=0), "sft.check_every"),
    (dict(stop_at_val=0.5, check_every=2, stop_metric="loss"),
     "sft.stop_metric")])
def test_sft_stop_config_errors_name_the_key(changes, key):
  with pytest.raises(ValueError, match=key):
    parse_config(_config(**changes), jax.device_count())
