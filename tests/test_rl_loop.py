"""The main job end to end on the micro config: artefacts, config errors,
NaN guard, and resumption after SIGKILL without losing or repeating work."""

import json
import os
import random
import signal
import subprocess
import sys
import time

import numpy as np
import pytest

from kimi_jax import train_step as ts
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra import metrics as metrics_lib
from kimi_jax.infra.config import ConfigError, load_config
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import parse_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = os.path.join(ROOT, "experiments", "tiny.py")


def micro(**overrides):
  return load_config(TINY + ":micro", overrides)


@pytest.mark.parametrize("key,value,needle", [
    ("rl.token_budget", 100, "config.rl.token_budget"),
    ("rl.samples_per_prompt", 1, "config.rl.samples_per_prompt"),
    ("rl.tau", 0.0, "config.rl.tau"),
    ("rl.loss", "ppo", "config.rl.loss"),
    ("sampler.cache_len", 128, "config.sampler.cache_len"),
    ("rl.max_response_len", 64, "config.rl.max_response_len"),
    ("prompt_sampling.curriculum", "sideways", "curriculum"),
    # tiny trains on old segments, whose sampler log-probs are stale.
    ("rl.reference_logprobs", "sampler", "config.rl.reference_logprobs"),
    ("rl.keep_partial_kv", "yes", "config.rl.keep_partial_kv"),
])
def test_bad_config_is_rejected_naming_the_key(key, value, needle):
  with pytest.raises((ConfigError, ValueError), match=needle.replace(".", r"\.")):
    parse_config(micro(**{key: value}))


@pytest.mark.parametrize("overrides,needle", [
    ({"rl.queued_prompts": -1}, "config.rl.queued_prompts"),
    ({"rl.queued_min_tokens": 13}, "config.rl.queued_min_tokens"),
    # micro: 8 prompts x 4 samples = 32 slots; with 16 a window would leave
    # half the wave unstarted every iteration.
    ({"rl.queued_prompts": 2, "sampler.max_slots": 16},
     "config.rl.queued_prompts"),
])
def test_bad_queue_config_is_rejected_naming_the_key(overrides, needle):
  with pytest.raises((ConfigError, ValueError), match=needle.replace(".", r"\.")):
    parse_config(micro(**overrides))


@pytest.mark.slow
def test_micro_run_with_a_queue_keeps_every_group(tmp_path):
  """Queued groups take slots that free up mid-window; those never started
  wait unstarted. Every opened group is trained once or still in flight,
  and no response got more than the window per iteration."""
  cfg = micro(**{"rl.queued_prompts": 12, "rl.queued_min_tokens": 6,
                 "rl.iterations": 4, "checkpoint.every_iterations": 4})
  job_lib.train_and_evaluate(cfg, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_rows = [r for r in rows if r["stage"] == "rl"]
  assert sum(r["queued_unstarted"] for r in rl_rows) > 0
  # More responses started than one wave of prompts x K fills: the queue
  # took slots that freed up mid-window.
  wave = cfg.rl.prompts_per_iteration * cfg.rl.samples_per_prompt
  assert max(r["requests"] for r in rl_rows) > wave
  loop = ckpt_lib.Checkpointer(
      str(tmp_path / "checkpoints")).restore_host()["loop"]
  trajs = [t for g in loop["buffer"]["groups"] for t in g]
  assert_consumed_once(loop, rl_rows)
  assert any(not t["segments"] for t in trajs)  # queued, not yet started
  for t in trajs:
    assert t["waited"] <= cfg.rl.max_wait_iterations
    for start, end, _ in t["segments"]:
      assert 1 <= end - start <= cfg.rl.token_budget


@pytest.mark.slow
def test_micro_run_keeping_partial_kv_continues_in_place(tmp_path):
  """With rl.keep_partial_kv every response the budget cut is continued
  next iteration in the slot that holds its cache: no prefill for it."""
  cfg = micro(**{"rl.keep_partial_kv": True,
                 "checkpoint.every_iterations": 3})
  job_lib.train_and_evaluate(cfg, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_rows = [r for r in rows if r["stage"] == "rl"]
  assert rl_rows[0]["resumed_in_slot"] == 0
  for before, row in zip(rl_rows, rl_rows[1:]):
    cut = round(before["frac_budget_stopped"] * before["requests"])
    assert cut > 0 and row["resumed_in_slot"] == cut
    # Only the new groups' prompts are prefilled.
    assert row["prefill_tokens"] <= (row["requests"] - cut) * (
        cfg.rl.max_response_len + 64)
    assert np.isfinite(row["logprob_gap_abs"])
  assert_consumed_once(ckpt_lib.Checkpointer(
      str(tmp_path / "checkpoints")).restore_host()["loop"], rl_rows)


def test_rest_counts_only_the_groups_it_trains(tmp_path):
  """ReST skips groups with no verified response: those are scored but not
  trained, and the per-task trained counts must leave them out. Enough SFT
  that some groups, not all, have one."""
  cfg = micro(**{"rl.loss": "rest", "rl.iterations": 2, "sft.steps": 120,
                 "checkpoint.every_iterations": 2})
  job_lib.train_and_evaluate(cfg, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_rows = [r for r in rows if r["stage"] == "rl"]
  assert any(0 < r.get("groups_trained", 0) < r["groups_scored"]
             for r in rl_rows)
  for r in rl_rows:
    assert r.get("groups_trained", 0) == (r["groups_scored"]
                                          - r["groups_uninformative"])
  loop = ckpt_lib.Checkpointer(
      str(tmp_path / "checkpoints")).restore_host()["loop"]
  assert_consumed_once(loop, rl_rows)


def assert_consumed_once(loop: dict, rl_rows: list[dict]) -> None:
  """Every group ever opened was consumed exactly once or is in flight.

  The buffer numbers groups 0, 1, ...; the counters and the logged rows
  (one per iteration) must both account for every id below next_group_id
  that is no longer in flight.
  """
  in_flight = {t["group_id"] for g in loop["buffer"]["groups"] for t in g}
  opened = loop["buffer"]["next_group_id"]
  assert in_flight <= set(range(opened))
  consumed = loop["counters"]["groups_consumed"]
  assert consumed == opened - len(in_flight)
  assert consumed == sum(r.get("groups_scored", 0) for r in rl_rows)
  # Each iteration's per-task group counts add up to its scored groups.
  for r in rl_rows:
    assert sum(r["groups_by_task"].values()) == r["groups_scored"]
    assert sum(r.get("groups_trained_by_task", {}).values()) == r.get(
        "groups_trained", 0)
    assert all(r.get("groups_trained_by_task", {}).get(t, 0) <= n
               for t, n in r["groups_by_task"].items())
  assert loop["counters"]["groups_trained"] == sum(
      r.get("groups_trained", 0) for r in rl_rows)


def test_unknown_and_mistyped_overrides_are_rejected():
  with pytest.raises(ConfigError, match="rl.iteratoins"):
    micro(**{"rl.iteratoins": 3})
  with pytest.raises(ConfigError, match="rl.iterations"):
    load_config(TINY, ["--config.rl.iterations=many"])


@pytest.mark.slow
@pytest.mark.parametrize("override,needle", [
    ("--config.rl.iteratoins=3", "--config.rl.iteratoins: unknown key "
     "'rl.iteratoins' (did you mean 'rl.iterations'?)"),
    ("--config.rl.iterations=many", "--config.rl.iterations: expected int"),
    ("--config.rl.tau=0", "config.rl.tau: must be > 0"),
    ("--config.rl.warmup_steps=-1", "config.rl.warmup_steps: must be >= 0"),
])
def test_launcher_config_errors_name_the_key(tmp_path, override, needle):
  """Through the real command line (ml_collections.config_flags): one clear
  line naming the key, a non-zero exit, nothing run."""
  out = subprocess.run(
      [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"), "--config",
       TINY + ":micro", "--workdir", str(tmp_path / "w"), override],
      capture_output=True, text=True, env=dict(os.environ, JAX_PLATFORMS="cpu"))
  assert out.returncode != 0
  assert needle in out.stderr, out.stderr[-2000:]
  assert "Traceback" not in out.stderr
  assert not (tmp_path / "w").exists()


@pytest.mark.slow
def test_micro_run_writes_metrics_plots_and_bounded_compiles(tmp_path):
  cfg = micro(**{"log.plots": True})
  summary = job_lib.train_and_evaluate(cfg, str(tmp_path))
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_rows = [r for r in rows if r["stage"] == "rl"]
  assert [r["step"] for r in rl_rows] == [1, 2, 3]
  trained = [r for r in rl_rows if "loss" in r]
  assert trained, "no iteration trained on a finished group"
  for key in ("reward", "accuracy", "length_mean", "length_p95",
              "frac_partial", "length_reward_weight", "grad_norm",
              "rollout_tokens_per_s", "train_tokens_per_s", "handoff_s"):
    assert key in trained[-1], key
  # Length-reward weight: 0 during the 1-iteration warm-up, then constant.
  weights = {r["step"]: r["length_reward_weight"] for r in trained}
  assert all(w == (0.0 if s == 1 else 0.1) for s, w in weights.items())
  assert any(r["stage"] == "eval" for r in rows)
  for png in ("rl_curves.png", "eval_curves.png", "sft_curves.png"):
    assert (tmp_path / png).stat().st_size > 1000, png
  events = [f for f in os.listdir(tmp_path / "tensorboard")
            if f.startswith("events.out.tfevents")]
  assert events
  # Shapes are bucketed: the train step compiles at most once per (length
  # bucket, packed row-count bucket) pair; 8 fake devices shard the rows.
  import jax
  from kimi_jax.rl import batching
  rows = batching.row_buckets(
      cfg.rl.minibatch_prompts * cfg.rl.samples_per_prompt, jax.device_count())
  assert 1 <= summary["compiles"]["train_step"] <= len(
      cfg.rl.train_len_buckets) * len(rows)
  # Handoff used the trainer's arrays directly.
  assert all(r["handoff_shared"] == 1.0 for r in rl_rows)
  # launch/sample.py's logic prints completions from this run's workdir.
  from kimi_jax.job import workdir
  records, lines = workdir.complete(str(tmp_path), ["37 c2 =", "05 c1 ="],
                                    num_samples=2, greedy=True)
  assert [(r["prompt"], r["sample"]) for r in records] == [
      ("37 c2 =", 0), ("37 c2 =", 1), ("05 c1 =", 0), ("05 c1 =", 1)]
  assert lines[0].startswith("[prompt 0 sample 0]") and "37 c2 = ->" in lines[0]
  assert records[0]["tokens"] == records[1]["tokens"]  # greedy: seed-free
  assert all(r["finish"] in ("stop", "length", "repeat") and r["tokens"] and
             len(r["logp"]) == len(r["tokens"]) for r in records)
  # The word tokenizer's task prompts: bos, then the words.
  tok = workdir.tokenizer(workdir.load_run(str(tmp_path))[1])
  assert records[0]["prompt_tokens"] == [tok.bos_id] + tok.encode("37 c2 =")


@pytest.mark.slow
def test_sft_only_run_keeps_its_evaluation_when_rerun(tmp_path):
  # rl.iterations=0: the warm-start evaluation is the final one; a rerun
  # finds the run finished and must not drop that row from the metrics.
  workdir = str(tmp_path / "w")
  config = micro(**{"rl.iterations": 0, "sft.steps": 5})
  first = job_lib.train_and_evaluate(config, workdir)
  assert first["final_eval"] == first["warmstart_eval"]
  assert first["iterations"] == 0
  again = job_lib.train_and_evaluate(
      micro(**{"rl.iterations": 0, "sft.steps": 5}), workdir)
  assert again["final_eval"] == first["final_eval"]
  evals = [r for r in metrics_lib.read_jsonl(
      os.path.join(workdir, "metrics.jsonl")) if r["stage"] == "eval"]
  assert [r["step"] for r in evals] == [0]
  assert evals[0]["pass_at_1"] == first["final_eval"]["pass_at_1"]


def test_train_step_skips_non_finite_update():
  import jax
  import jax.numpy as jnp
  from kimi_jax.model import transformer
  from kimi_jax.model.config import ModelConfig
  from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
  cfg = ModelConfig(vocab_size=16, d_model=16, n_layers=1, n_heads=2,
                    n_kv_heads=1, head_dim=8, mlp_dim=32)
  sharder = Sharder(make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  opt = ts.make_optimizer(ts.OptimizerConfig(learning_rate=0.1))
  shardings = ts.state_shardings(opt, cfg, sharder)
  params = transformer.init_sharded(cfg, 0, sharder)
  state = ts.create_state(params, opt, shardings)
  before = jax.device_get(state.params)
  batch = {"x": jax.device_put(np.ones((2,), np.float32))}

  def nan_loss(p, b):
    return jnp.sum(p["embed"]) * jnp.nan + b["x"].sum(), {}

  step, _ = ts.jit_train_step(nan_loss, opt, shardings,
                              {"x": sharder.replicated()})
  state, m = step(state, batch)
  assert float(m["finite"]) == 0.0
  np.testing.assert_array_equal(jax.device_get(state.params["embed"]),
                                before["embed"])
  assert int(state.step) == 0


@pytest.mark.slow
def test_divergence_stops_run_and_keeps_last_good_checkpoint(tmp_path):
  cfg = micro(**{"rl.learning_rate": 1e30, "rl.iterations": 4})
  with pytest.raises(ts.NonFiniteError, match="not finite"):
    job_lib.train_and_evaluate(cfg, str(tmp_path))
  ckpt = ckpt_lib.Checkpointer(str(tmp_path / "checkpoints"))
  host = ckpt.restore_host()
  assert host["stage"] == "rl"
  # The kept checkpoint holds finite params.
  from kimi_jax.model import transformer
  model_cfg = parse_config(cfg).model
  import jax
  from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
  sharder = Sharder(make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  params, _, _ = ckpt.restore(
      params_like=transformer.abstract_params(model_cfg),
      params_shardings=transformer.param_shardings(model_cfg, sharder))
  assert all(np.isfinite(np.asarray(x)).all()
             for x in jax.tree.leaves(params))


def _launch(workdir, extra=()):
  cmd = [sys.executable, os.path.join(ROOT, "launch", "tpu_run.py"),
         "--config", TINY + ":micro", "--workdir", str(workdir),
         "--config.rl.iterations=6", "--config.checkpoint.every_iterations=1",
         *extra]
  env = dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="")
  return subprocess.Popen(cmd, env=env, stdout=subprocess.PIPE,
                          stderr=subprocess.STDOUT, text=True)


def _rl_rows_logged(workdir) -> int:
  path = os.path.join(workdir, "metrics.jsonl")
  if not os.path.exists(path):
    return 0
  with open(path) as f:
    return sum('"stage": "rl"' in line for line in f)


@pytest.mark.slow
def test_sigkill_resume_loses_nothing_and_trains_nothing_twice(tmp_path):
  rng = random.Random(1234)
  kills = 0
  for attempt in range(3):
    # Kill mid-run, at a point tied to progress rather than the clock (a
    # warm compilation cache makes the run several times faster): once one
    # or two more RL iterations have been logged, plus a random fraction of
    # an iteration, and never after the fifth of six.
    target = min(5, _rl_rows_logged(tmp_path) + rng.randint(1, 2))
    proc = _launch(tmp_path)
    while proc.poll() is None and _rl_rows_logged(tmp_path) < target:
      time.sleep(0.05)
    time.sleep(rng.uniform(0.0, 0.5))
    if proc.poll() is None:
      proc.send_signal(signal.SIGKILL)
      proc.wait()
      kills += 1
  proc = _launch(tmp_path)
  out, _ = proc.communicate(timeout=600)
  assert proc.returncode == 0, out[-3000:]
  assert kills >= 1
  loop = ckpt_lib.Checkpointer(
      str(tmp_path / "checkpoints")).restore_host()["loop"]
  assert loop["iteration"] == 6
  assert os.path.exists(tmp_path / "summary.json")
  # Resuming dropped the log rows past the checkpoint: each iteration once.
  rows = [json.loads(l) for l in open(tmp_path / "metrics.jsonl")]
  rl_rows = [r for r in rows if r["stage"] == "rl"]
  assert [r["step"] for r in rl_rows] == list(range(1, 7))
  # Nothing lost, nothing trained twice.
  assert_consumed_once(loop, rl_rows)


@pytest.mark.slow
def test_resume_restores_the_optimizer_state(tmp_path):
  """Without the per-iteration reset, a resumed run continues Adam's moments:
  it ends with the same params as an uninterrupted run."""
  common = {"rl.reset_optimizer": False, "rl.iterations": 4}
  job_lib.train_and_evaluate(micro(**common), str(tmp_path / "a"))
  job_lib.train_and_evaluate(micro(**dict(common, **{"rl.iterations": 2})),
                             str(tmp_path / "b"))
  job_lib.train_and_evaluate(micro(**common), str(tmp_path / "b"))
  rows = [json.loads(l) for l in open(tmp_path / "a" / "metrics.jsonl")]
  trained = {r["step"] for r in rows if r["stage"] == "rl" and "loss" in r}
  # Adam had moments to carry over, and used them after the resume.
  assert trained & {1, 2} and trained & {3, 4}, trained
  import jax
  from kimi_jax.model import transformer
  model_cfg = parse_config(micro(**common)).model
  from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
  sharder = Sharder(make_mesh(MeshConfig(data=1), jax.devices()[:1]))
  like = transformer.abstract_params(model_cfg)
  shardings = transformer.param_shardings(model_cfg, sharder)
  pa = ckpt_lib.Checkpointer(str(tmp_path / "a" / "checkpoints")).restore(
      params_like=like, params_shardings=shardings)[0]
  pb = ckpt_lib.Checkpointer(str(tmp_path / "b" / "checkpoints")).restore(
      params_like=like, params_shardings=shardings)[0]
  for x, y in zip(jax.tree.leaves(pa), jax.tree.leaves(pb)):
    np.testing.assert_allclose(np.asarray(x), np.asarray(y), rtol=1e-5,
                               atol=1e-6)


def test_score_gives_a_lucky_answer_no_bonus_for_being_short(tmp_path):
  """A right answer that the reward scores 0 (a step check's veto) counts
  for accuracy but not as correct for the length reward."""
  import dataclasses
  from kimi_jax.rewards.base import RewardResult
  from kimi_jax.rl import replay_buffer
  cfg = parse_config(micro(), 8)
  job = job_lib.build(cfg, str(tmp_path))
  loop = job.rl_loop()
  K = cfg.rl.samples_per_prompt
  verdicts = [RewardResult(1.0, True), RewardResult(0.0, True)] + [
      RewardResult(0.0, False)] * (K - 2)
  answers = iter(verdicts)
  loop.task = dataclasses.replace(job.task,
                                  reward=lambda record, text: next(answers))
  lengths = [12, 8] + [20] * (K - 2)  # the lucky answer is the shortest
  buffer = replay_buffer.RolloutBuffer(group_size=K, max_wait_iterations=0)
  gid = buffer.new_group(0)
  for j, n in enumerate(lengths):
    buffer.add_segment(gid, j, [5] * n, [0.0] * n, version=0,
                       finish_reason="stop")
  after_warmup = cfg.rl.length_reward_warmup + 1
  scores, stats = loop.score(after_warmup, buffer.complete_groups())
  w = cfg.rl.length_reward_weight
  assert w > 0
  # lambda = 0.5 - (len - 8) / 12: 1/6 for the verified answer; the lucky
  # one's +0.5 is cut to min(0, 0.5) = 0; the wrong ones get -0.5.
  np.testing.assert_allclose(
      scores.reward_PxK, [[1 + w / 6, 0.0] + [-0.5 * w] * (K - 2)],
      rtol=1e-6)
  assert stats["accuracy"] == 2 / K
  np.testing.assert_array_equal(scores.verified_PxK[0],
                                [True] + [False] * (K - 1))


def test_training_accuracy_by_task_counts_each_tasks_groups():
  from kimi_jax.rl.loop import by_task
  correct_PxK = np.array([[1, 1, 0, 0], [1, 1, 1, 1], [0, 0, 0, 1]], bool)
  acc, groups = by_task(["rg/syllogism", "rg/spell", "rg/syllogism"],
                        correct_PxK)
  assert acc == {"rg/spell": 1.0, "rg/syllogism": 3 / 8}
  assert groups == {"rg/spell": 1, "rg/syllogism": 2}
