"""The real path end to end for the mixture-of-experts experiment
(experiments/qwen3_30b_a3b.py): a tiny random Qwen3-MoE checkpoint with a
Qwen3-style tokenizer and thinking chat template (tests/hf_dirs.py, made
here: no download), the `:cpu_smoke` command as a user runs it (packed SFT,
RL with routing replay, the export to WORKDIR/hf_export), then
`launch/sample.py --greedy`, whose continuation must be the one
transformers' greedy `generate` writes from the export through the same
chat template."""

from __future__ import annotations

import json
import os
import sys

import numpy as np
import pytest

from tests.hf_dirs import make_family_dir
from tests.test_real_path import ROOT, _data, _rows, _run, _write_jsonl
from tests.test_real_path_families import (THINKING_ROW, _greedy_sample,
                                           check_greedy_against_transformers)

pytestmark = [pytest.mark.slow, pytest.mark.host_inputs]


def test_qwen3_moe_cpu_smoke_replays_routing_exports_and_samples(tmp_path):
  from kimi_jax.model import families, hf as hf_lib
  from safetensors.numpy import load_file
  source = make_family_dir(tmp_path / "hf", "qwen3_moe",
                           max_position_embeddings=512)
  data = _data(tmp_path / "data")
  rows = open(data["sft"]).read().splitlines() + [json.dumps(THINKING_ROW)]
  _write_jsonl(data["sft"], rows)
  workdir = str(tmp_path / "run")
  proc = _run([
      sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"),
      "--config", os.path.join(ROOT, "experiments",
                               "qwen3_30b_a3b.py:cpu_smoke"),
      "--workdir", workdir, f"--config.init_from_hf={source}",
      f"--config.task.train_path={data['train']}",
      f"--config.task.eval_path={data['eval']}",
      f"--config.sft.train_path={data['sft']}"])
  assert proc.returncode == 0, proc.stderr[-4000:]
  assert [r["step"] for r in _rows(workdir, "sft")] == [1, 2]
  rl = _rows(workdir, "rl")
  assert [r["step"] for r in rl] == [1, 2]
  with open(os.path.join(workdir, "config.json")) as f:
    config = json.load(f)
  assert config["rl"]["routing_replay"] is True
  assert config["model"]["n_experts"] == 8
  # Replayed routing: the trainer's log-probs of this iteration's tokens
  # are the sampler's up to float rounding.
  for r in rl:
    if r.get("logprob_gap_tokens"):
      assert r["logprob_gap_abs"] < 1e-4, r

  export = os.path.join(workdir, "hf_export")
  ours, theirs = (hf_lib.model_config_from_hf(p) for p in (export, source))
  assert families.architecture_of(ours) == families.architecture_of(theirs)
  assert ours.n_experts == 8 and ours.n_experts_per_token == 2
  before = load_file(os.path.join(source, "model.safetensors"))
  after = load_file(os.path.join(export, "model.safetensors"))
  assert before.keys() == after.keys()
  assert any(not np.allclose(before[k], after[k]) for k in before)

  record = _greedy_sample(workdir, tmp_path / "samples.json")
  check_greedy_against_transformers(record, export,
                                    {"enable_thinking": True})
