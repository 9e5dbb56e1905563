"""Benchmarks during training (rl.eval_benchmarks) and Weights & Biases
logging (metrics.wandb_project), read back from what was written:
metrics.jsonl, the TensorBoard event file and W&B's offline run file
(through wandb's own `wandb leet inspect --json`)."""

from __future__ import annotations

import json
import os
import struct
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def wandb_history(workdir) -> list[dict]:
  """The history rows of every offline W&B run under workdir/wandb, read
  by wandb's own inspector."""
  runs = sorted((workdir / "wandb").glob("offline-run-*/run-*.wandb"))
  assert runs, list((workdir / "wandb").iterdir())
  wandb_cli = os.path.join(os.path.dirname(sys.executable), "wandb")
  rows = []
  for path in runs:
    out = subprocess.run([wandb_cli, "leet", "inspect", "--json", str(path)],
                         capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    for line in out.stdout.splitlines():
      record = json.loads(line) if line.startswith("{") else {}
      if record.get("type") == "history":
        rows.append(record["history"]["item"])
  return rows


def tensorboard_scalars(directory) -> dict[str, list[tuple[int, float]]]:
  """tag -> [(step, value)] of the TFRecord event files in directory."""
  from tensorboardX.proto import event_pb2
  out: dict[str, list[tuple[int, float]]] = {}
  for name in sorted(os.listdir(directory)):
    with open(os.path.join(directory, name), "rb") as f:
      data = f.read()
    pos = 0
    while pos + 12 <= len(data):
      (length,) = struct.unpack("<Q", data[pos:pos + 8])
      event = event_pb2.Event.FromString(data[pos + 12:pos + 12 + length])
      pos += 12 + length + 4
      for value in event.summary.value:
        out.setdefault(value.tag, []).append((event.step,
                                              value.simple_value))
  return out


@pytest.mark.slow  # starts W&B's service
def test_metrics_go_to_wandb_offline_and_a_rerun_continues_the_run(
    tmp_path, monkeypatch):
  pytest.importorskip("wandb")
  from kimi_jax.infra.metrics import MetricsWriter
  from kimi_jax.infra.wandb_log import MetricsConfig
  monkeypatch.setenv("WANDB_MODE", "offline")
  monkeypatch.setenv("WANDB_SILENT", "true")
  cfg = MetricsConfig(wandb_project="kimi-test", wandb_name="unit")
  writer = MetricsWriter(str(tmp_path), wandb=cfg, run_config={"seed": 3})
  writer.write(1, "sft", {"loss": 2.5})
  writer.write(2, "sft", {"loss": 2.0})
  writer.write(1, "rl", {"accuracy": 0.25, "note": "text is not logged",
                         "nan": float("nan")})
  writer.close()
  run_id = (tmp_path / "wandb_run_id").read_text().strip()
  # A resumed job: same workdir, same W&B run.
  again = MetricsWriter(str(tmp_path), wandb=cfg)
  again.write(2, "rl", {"accuracy": 0.5})
  again.close()
  assert (tmp_path / "wandb_run_id").read_text().strip() == run_id
  assert all(p.name.endswith(run_id) for p in
             (tmp_path / "wandb").glob("offline-run-*"))
  rows = wandb_history(tmp_path)
  sft = [(r["sft/step"], r["sft/loss"]) for r in rows if "sft/loss" in r]
  rl = [(r["rl/step"], r["rl/accuracy"]) for r in rows
        if "rl/accuracy" in r]
  assert sft == [(1, 2.5), (2, 2.0)]
  assert rl == [(1, 0.25), (2, 0.5)]
  assert not any("rl/note" in r or "rl/nan" in r for r in rows)


@pytest.mark.slow  # a two-iteration RL run of a tiny checkpoint
def test_rl_logs_benchmark_pass_at_1_at_its_evaluations(tmp_path):
  pytest.importorskip("wandb")
  sys.path.insert(0, os.path.join(ROOT, "tests"))
  from hf_dirs import make_answering_qwen2_dir
  hf_dir = make_answering_qwen2_dir(tmp_path / "hf")

  def jsonl(name, rows):
    path = tmp_path / name
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return str(path)

  task = jsonl("task.jsonl", [dict(prompt=f"Problem {i}: compute it.",
                                   answer=a)
                              for i, a in enumerate(["4", "7", "4", "7"])])
  sft = jsonl("sft.jsonl", [dict(prompt=f"Problem {i}: compute it.",
                                 response="\\boxed{4}") for i in range(4)])
  # The model answers only 4 or 7: every GSM8K answer here is 5, so its
  # pass@1 is exactly 0; MATH-500's answers are 4 and 7 (0 < pass@1 < 1).
  math500 = jsonl("math500.jsonl", [
      dict(problem=f"What is {a}?", solution="", answer=a, subject="x",
           level=1, unique_id=f"t/{i}.json")
      for i, a in enumerate(["4", "7"])])
  gsm8k = jsonl("gsm8k.jsonl", [dict(question="What is 2 + 3?",
                                     answer="2 + 3 = 5\n#### 5")])
  workdir = tmp_path / "run"
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="",
             PYTHONPATH=ROOT, WANDB_MODE="offline", WANDB_SILENT="true")
  base = [sys.executable, "launch/tpu_run.py", "--config",
          "experiments/qwen2_5_1_5b.py:cpu_smoke", f"--workdir={workdir}",
          f"--config.init_from_hf={hf_dir}",
          f"--config.task.train_path={task}",
          f"--config.task.eval_path={task}", f"--config.sft.train_path={sft}",
          "--config.rl.eval_every=1"]
  # A misspelt benchmark stops the run before it starts, naming the key.
  bad = subprocess.run(
      base + ["--config.rl.eval_benchmarks=('math5000=x.jsonl',)"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=600)
  assert bad.returncode != 0
  assert ("config.rl.eval_benchmarks: unknown benchmark 'math5000'"
          in bad.stderr), bad.stderr[-3000:]
  assert not (workdir / "checkpoints").exists()

  proc = subprocess.run(
      base + [f"--config.rl.eval_benchmarks=('math500={math500}', "
              f"'gsm8k={gsm8k}')",
              "--config.metrics.wandb_project=kimi-test"],
      cwd=ROOT, env=env, capture_output=True, text=True, timeout=900)
  assert proc.returncode == 0, proc.stderr[-3000:]
  rows = [json.loads(x) for x in
          (workdir / "metrics.jsonl").read_text().splitlines()]
  bench = [r for r in rows if r["stage"] == "benchmarks"]
  evals = [r for r in rows if r["stage"] == "eval"]
  # After the warm start (0), at iteration 1 (rl.eval_every=1) and at the
  # end (2): the same steps as the held-out evaluation.
  assert [r["step"] for r in bench] == [0, 1, 2]
  assert [r["step"] for r in evals] == [0, 1, 2]
  for r in bench:
    assert r["gsm8k_pass_at_1"] == 0.0
    assert 0.0 <= r["math500_pass_at_1"] <= 1.0
    assert set(r) == {"stage", "step", "math500_pass_at_1",
                      "gsm8k_pass_at_1"}
  scalars = tensorboard_scalars(workdir / "tensorboard")
  assert [(s, pytest.approx(v)) for s, v in
          scalars["benchmarks/math500_pass_at_1"]] == [
              (r["step"], r["math500_pass_at_1"]) for r in bench]
  history = wandb_history(workdir)
  logged = [(h["benchmarks/step"], h["benchmarks/math500_pass_at_1"])
            for h in history if "benchmarks/math500_pass_at_1" in h]
  assert logged == [(r["step"], pytest.approx(r["math500_pass_at_1"]))
                    for r in bench]
  assert any("rl/accuracy" in h for h in history)
