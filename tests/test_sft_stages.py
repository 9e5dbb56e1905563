"""The SFT stages (report 2.5.2, 2.2): a vanilla stage on `sft.train_path`,
then the long-CoT stage on `sft.stage2_train_path` for the last
`sft.stage2_steps` steps, each stream's position in the checkpoints, so an
interrupted second stage resumes with exactly its batches."""

from __future__ import annotations

import json
import shutil

import jax
import numpy as np
import pytest

from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import parse_config
from tests.hf_dirs import make_answering_qwen2_dir
from tests.test_job_sft import _Stop, _fresh, _host_params, _restored

pytestmark = pytest.mark.slow
STEPS, STAGE2 = 4, 2  # checkpoints after every step


def _files(tmp_path):
  paths = {}
  for name, rows in (
      ("task", [{"prompt": f"What is {i} + 1?", "answer": str(i + 1)}
                for i in range(4)]),
      ("vanilla", [{"prompt": f"Say {w}.", "response": w}
                   for w in ("yes", "no", "maybe", "later")]),
      ("long_cot", [{"prompt": f"What is {i} + 2?", "response":
                     f"Plan: add 2 to {i}. Check: {i + 2} - 2 = {i}. "
                     f"\\boxed{{{i + 2}}}"} for i in range(6)])):
    path = tmp_path / f"{name}.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    paths[name] = str(path)
  return paths


def _config(tmp_path, **changes):
  hf_dir = tmp_path / "hf"
  if not hf_dir.exists():
    make_answering_qwen2_dir(hf_dir)
  paths = _files(tmp_path)
  overrides = {"init_from_hf": str(hf_dir),
               "task.train_path": paths["task"],
               "task.eval_path": paths["task"],
               "sft.steps": STEPS, "sft.stage2_steps": STAGE2,
               "sft.batch_size": 8, "sft.seq_len": 64,
               "sft.train_path": paths["vanilla"],
               "sft.stage2_train_path": paths["long_cot"]}
  overrides.update(changes)
  return load_config("experiments/qwen2_5_1_5b.py:cpu_smoke", overrides)


def _job(tmp_path, workdir):
  return job_lib.build(parse_config(_config(tmp_path), jax.device_count()),
                       str(workdir))


def test_second_stage_trains_on_its_own_data_and_resumes(tmp_path):
  whole = _job(tmp_path, tmp_path / "whole")
  state, opt, sh = _fresh(whole)
  want = _host_params(job_lib.run_sft(whole, state, 0, None, opt, sh))
  with open(tmp_path / "whole" / "metrics.jsonl") as f:
    rows = [r for r in map(json.loads, f) if r["stage"] == "sft"]
  assert [r["data_stage"] for r in rows] == [1, 1, 2, 2]
  stage1 = sum(r["examples"] for r in rows[:STEPS - STAGE2])
  stage2 = sum(r["examples"] for r in rows[STEPS - STAGE2:])
  assert whole.sft_data.batches.position == stage1
  assert whole.sft_data.stage2.position == stage2 > 0
  assert job_lib.data_metrics(whole)["sft_stage2_kept"] == 6

  # Dies right after the checkpoint of step 3, inside the second stage.
  first = _job(tmp_path, tmp_path / "cut")
  save = first.checkpointer.save

  def save_then_die(step, **items):
    save(step, **items)
    if step == 3:
      raise _Stop

  first.checkpointer.save = save_then_die
  state, opt, sh = _fresh(first)
  with pytest.raises(_Stop):
    job_lib.run_sft(first, state, 0, None, opt, sh)
  first.checkpointer.close()
  shutil.copytree(tmp_path / "cut", tmp_path / "cut_again")

  again = _job(tmp_path, tmp_path / "cut")
  state, opt, sh, host = _restored(again, 3)
  assert host["data"]["position"] == stage1
  assert 0 < host["data2"]["position"] < stage2
  got = _host_params(job_lib.run_sft(again, state, 3, host["data"], opt, sh,
                                     stage2_state=host["data2"]))
  for a, b in zip(got, want):
    np.testing.assert_array_equal(a, b)
  again.checkpointer.close()

  # The second stream's position matters.
  other = _job(tmp_path, tmp_path / "cut_again")
  state, opt, sh, host = _restored(other, 3)
  wrong = _host_params(job_lib.run_sft(
      other, state, 3, host["data"], opt, sh,
      stage2_state=dict(host["data2"], position=0)))
  assert any(not np.array_equal(a, b) for a, b in zip(wrong, want))


def test_stage2_data_config_errors_name_the_key(tmp_path):
  with pytest.raises(ConfigError, match="sft.stage2_train_path: file not "
                     "found"):
    parse_config(_config(tmp_path, **{
        "sft.stage2_train_path": str(tmp_path / "missing.jsonl")}))
  with pytest.raises(ConfigError, match="sft.stage2_train_path needs 0 < "
                     "sft.stage2_steps"):
    parse_config(_config(tmp_path, **{"sft.stage2_steps": 0}))
