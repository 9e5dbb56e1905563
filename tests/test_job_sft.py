"""The job's SFT stage: packed rows, the data position in the checkpoint's
host item, and an interrupted stage that resumes with exactly the batches
it would have seen."""

from __future__ import annotations

import json
import os
import shutil

import jax
import numpy as np
import pytest

from kimi_jax import job as job_lib
from kimi_jax import train_step as ts
from kimi_jax.config import load_config
from kimi_jax.experiment import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "tiny.py")
STEPS = 8  # checkpoints at steps 2, 4 and 6


class _Stop(Exception):
  """Stands for the process dying right after a checkpoint."""


def _job(workdir) -> job_lib.Job:
  config = load_config(TINY + ":micro", {"sft.steps": STEPS})
  return job_lib.build(parse_config(config, jax.device_count()),
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
