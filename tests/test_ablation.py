"""Ablation sweeps (kimi_jax/ablation/, experiments/ablations.py,
launch/ablate.py): arm planning and overrides, mean ± std against hand
computations, skipping finished runs, and a micro ablation end to end."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys

import ml_collections
import pytest

from kimi_jax import ablation as ab
from kimi_jax.infra.config import ConfigError, load_config

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
ABLATIONS = os.path.join(ROOT, "experiments", "ablations.py")
TINY = os.path.join(ROOT, "experiments", "tiny.py")
NAMES = ("loss", "sampling", "length_penalty", "partial_segments", "baseline",
         "curation", "curation_spelling", "curation_guessable", "recipe",
         "reflect_lr", "reflect_loss", "reflect_sampling",
         "reflect_length_penalty", "reflect_segments", "reflect_baseline",
         "reflect_warmup")


def _toy(arms=None, **extra) -> ml_collections.ConfigDict:
  """An ablation config over the tiny experiment."""
  c = ml_collections.ConfigDict()
  c.name = "toy"
  c.description = "a test"
  c.base = load_config(TINY + ":micro")
  arms = arms or {"a": {"rl.tau": 0.5}, "b": {"rl.tau": 2.0,
                                               "rl.baseline": "soft"}}
  c.arms = ml_collections.ConfigDict(
      {k: ab.nest(v) for k, v in arms.items()}, sort_keys=False)
  c.seed_key = "seed"
  c.first_seed = 10
  c.update(extra)
  return c


# ---- planning and overrides ---------------------------------------------------


def test_plan_is_one_run_per_arm_and_seed_seed_major(tmp_path):
  a = ab.parse_ablation(_toy())
  plan = a.plan(str(tmp_path), 3)
  assert [(r.arm, r.seed) for r in plan] == [
      ("a", 10), ("b", 10), ("a", 11), ("b", 11), ("a", 12), ("b", 12)]
  assert plan[3].workdir == os.path.join(str(tmp_path), "b", "seed11")
  with pytest.raises(ValueError, match="--seeds"):
    a.plan(str(tmp_path), 0)


def test_run_config_applies_the_arm_and_the_seed_only():
  config = _toy()
  a = ab.parse_ablation(config)
  run = a.plan("/w", 2)[3]  # arm b, seed 11
  got = a.run_config(run)
  assert (got.rl.tau, got.rl.baseline, got.seed) == (2.0, "soft", 11)
  # Everything else is the base, and the base itself is unchanged.
  flat_got, flat_base = ab.flatten(got), ab.flatten(config.base)
  changed = {k for k in flat_base if flat_got[k] != flat_base[k]}
  assert changed == {"rl.tau", "rl.baseline", "seed"}
  assert (config.base.rl.tau, config.base.seed) == (1.0, 0)
  # The config is locked: the job cannot grow keys by accident.
  with pytest.raises(AttributeError):
    got.rl.new_key = 1


def test_nest_and_flatten_are_inverse_and_keep_order():
  flat = {"rl.tau": 0.5, "prompt_sampling.prioritized": False, "seed": 3}
  nested = ab.nest(flat)
  assert nested.rl.tau == 0.5 and not nested.prompt_sampling.prioritized
  assert ab.flatten(nested) == flat
  assert list(ab.flatten(nested)) == list(flat)


@pytest.mark.parametrize("arms,needle", [
    ({"a": {"rl.tua": 0.5}, "b": {}}, r"arms\.a\.rl\.tua"),
    ({"a": {"rl.tau": "big"}, "b": {}}, r"arms\.a\.rl\.tau"),
    ({"a": {"rl": {"tau": 0.5}}, "b": {"rl": {"tau": 0.5}}},
     "same settings as arm 'a'"),
    ({"warm_start": {"rl.tau": 0.5}, "b": {}}, r"arms\.warm_start"),
    ({"only": {"rl.tau": 0.5}}, "at least two arms"),
])
def test_bad_arms_are_rejected_naming_them(arms, needle):
  c = _toy()
  c.arms = ml_collections.ConfigDict(
      {k: (ab.nest(v) if v and "." in next(iter(v)) else v)
       for k, v in arms.items()})
  with pytest.raises(ConfigError, match=needle):
    ab.parse_ablation(c)


def test_missing_section_is_rejected():
  c = _toy()
  del c["seed_key"]
  with pytest.raises(ConfigError, match="seed_key"):
    ab.parse_ablation(c)


def test_warm_start_is_shared_only_when_no_arm_changes_what_it_reads():
  assert ab.parse_ablation(_toy()).shares_warm_start
  for key, value in (("sft.steps", 5), ("rl.eval_samples", 2),
                     ("task.max_steps", 2), ("rl.samples_per_prompt", 2)):
    a = ab.parse_ablation(_toy({"a": {key: value}, "b": {"rl.tau": 2.0}}))
    assert not a.shares_warm_start, key
    with pytest.raises(ConfigError, match="cannot be shared"):
      ab.run_sweep(a, "/nonexistent", 1, run_fn=None, share_warm_start=True)
  warm = ab.parse_ablation(_toy()).warm_start_config(11)
  assert (warm.seed, warm.rl.iterations, warm.rl.tau) == (11, 1, 1.0)


def test_pipeline_ablation_shares_only_the_stages_no_arm_changes(tmp_path):
  """A gym-pipeline base: arms that change curation, the warm-up data, the
  long-CoT stage or RL share the data and vanilla-SFT stages; one that
  changes what vanilla SFT reads does not. Metrics are the main job's."""
  a = ab.load_ablation(ABLATIONS + ":curation,micro")
  assert a.pipeline and a.shares_warm_start
  assert a.metrics_path(a.plan(str(tmp_path), 1)[0]) == str(
      tmp_path / "curated" / "seed0" / "rl" / "metrics.jsonl")
  for arms, shared in (
      ({"curate.hack_guesses": 3, "warmup.samples": 4,
        "pipeline.long_cot_sft_steps": 2, "rl.tau": 0.5}, True),
      ({"pipeline.vanilla_sft_steps": 3}, False),
      ({"gym.size": 5}, False),
      ({"rl.eval_samples": 2}, False)):
    c = _toy({"a": arms, "b": {"pipeline.curate": False}})
    c.base = a.base
    assert ab.parse_ablation(c).shares_warm_start == shared, arms
  assert not ab.parse_ablation(_toy()).pipeline
  assert ab.parse_ablation(_toy()).metrics_path(ab.Run("a", 0, "/r")) == (
      "/r/metrics.jsonl")


@pytest.mark.parametrize("name", NAMES)
def test_every_ablation_loads_with_its_micro_variant(name):
  full = ab.load_ablation(f"{ABLATIONS}:{name}")
  micro = ab.load_ablation(f"{ABLATIONS}:{name},micro")
  assert full.arm_names == micro.arm_names and len(full.arms) >= 2
  assert full.shares_warm_start  # the arms change RL keys only
  assert full.description and full.seed_key == "seed"
  assert micro.base.rl.iterations <= 3 < full.base.rl.iterations
  for a in (full, micro):
    for run in a.plan("/w", 1):
      cfg = a.run_config(run)  # every override exists and type-checks
      if run.arm == a.arm_names[0]:
        continue
      assert ab.flatten(cfg) != ab.flatten(a.run_config(a.plan("/w", 1)[0]))


def test_curation_ablations_run_the_gym_configs_they_name():
  """curation compares on gym_tiny.py:three_tasks, curation_spelling on
  gym_tiny.py:spelling, curation_guessable on gym_tiny.py's default (the
  spelling task with syllogisms in the raw prompts)."""
  from experiments import gym_tiny
  for name, variant in (("curation", "three_tasks"),
                        ("curation_spelling", "spelling"),
                        ("curation_guessable", None)):
    base = ab.load_ablation(f"{ABLATIONS}:{name}").base
    want = gym_tiny.get_config(variant)
    assert (base.gym.datasets, base.pipeline.vanilla_stop_at_val,
            base.curate.easy_to_hack) == (
                want.gym.datasets, want.pipeline.vanilla_stop_at_val,
                want.curate.easy_to_hack), name


def test_ablation_variants_cite_the_report_and_reject_unknown_names():
  text = {n: ab.load_ablation(f"{ABLATIONS}:{n}").description for n in NAMES}
  assert "Figure 10" in text["loss"] and "Figure 9" in text["sampling"]
  assert "2.3.3" in text["length_penalty"] and "2.6.2" in text[
      "partial_segments"] and "2.3.2" in text["baseline"]
  assert all("2.1" in text[n] for n in NAMES if n.startswith("curation"))
  with pytest.raises(ConfigError, match="unknown ablation"):
    load_config(ABLATIONS + ":lossy")
  with pytest.raises(ConfigError, match="unknown modifier"):
    load_config(ABLATIONS + ":loss,huge")
  # Overrides reach the base and an arm's own keys (the config is locked:
  # an arm gains no new key from the command line).
  a = ab.load_ablation(ABLATIONS + ":sampling", {
      "base.rl.iterations": 7,
      "arms.curriculum.prompt_sampling.hard_threshold": 6.0})
  cfg = a.run_config(a.plan("/w", 1)[1])
  assert a.plan("/w", 1)[1].arm == "curriculum"
  assert (cfg.rl.iterations, cfg.prompt_sampling.curriculum,
          cfg.prompt_sampling.hard_threshold) == (7, "warmup_then_hard", 6.0)
  with pytest.raises(ConfigError, match=r"arms\.rest\.rl\.tau"):
    load_config(ABLATIONS + ":loss", {"arms.rest.rl.tau": 0.5})


# ---- aggregation ----------------------------------------------------------------


def _fake_run(workdir, final, warm, rl_acc, eval_p1, seconds=None,
              val_p1=None):
  """A finished run's files as the job writes them (summary.json,
  metrics.jsonl), with given numbers; `val_p1`: validation pass@1 by step
  (the last is the final one)."""
  os.makedirs(workdir, exist_ok=True)
  summary = {"final_eval": final, "warmstart_eval": warm,
             "iterations": len(rl_acc)}
  if val_p1:
    summary["final_val"] = _evals(val_p1[max(val_p1)], 0.0, 1.0)
  with open(os.path.join(workdir, "summary.json"), "w") as f:
    json.dump(summary, f)
  with open(os.path.join(workdir, "metrics.jsonl"), "w") as f:
    f.write(json.dumps({"stage": "sft", "step": 10, "loss": 1.0}) + "\n")
    for stage, points in (("eval", eval_p1), ("val", val_p1 or {})):
      for step, p1 in points.items():
        f.write(json.dumps({"stage": stage, "step": step, "pass_at_1": p1,
                            "greedy_accuracy": p1, "mean_length": 3.0})
                + "\n")
    for step, acc in rl_acc.items():
      f.write(json.dumps({"stage": "rl", "step": step, "accuracy": acc,
                          "reward": acc, "length_mean": 4.0 + step}) + "\n")
  if seconds is not None:
    with open(os.path.join(workdir, ab.TIMING), "w") as f:
      json.dump({"seconds": seconds}, f)


def _evals(p1, greedy, length):
  return {"pass_at_1": p1, "greedy_accuracy": greedy, "mean_length": length,
          "n_problems": 10}


def test_validation_figures_are_aggregated_beside_the_held_out_ones(
    tmp_path):
  a = ab.parse_ablation(_toy())
  plan = a.plan(str(tmp_path), 2)
  by = {(r.arm, r.seed - 10): r.workdir for r in plan}
  # Arm a: final validation pass@1 0.4 and 0.8 -> mean 0.6, sample std
  # sqrt(2 * 0.2^2) = 0.283; at step 1, 0.2 and 0.3 -> 0.25.
  for k, (mid, last) in enumerate([(0.2, 0.4), (0.3, 0.8)]):
    _fake_run(by["a", k], _evals(0.5, 0.5, 4.0), _evals(0.1, 0.0, 4.0),
              {1: 0.5, 2: 0.5}, {0: 0.1, 2: 0.5},
              val_p1={0: 0.0, 1: mid, 2: last})
  # Arm b ran without a validation set.
  _fake_run(by["b", 0], _evals(0.25, 0.5, 8.0), None, {1: 0.5}, {0: 0.1})
  res = ab.aggregate(a, plan)
  arm = res["arms"]["a"]
  assert arm["final_val"]["pass_at_1"]["mean"] == pytest.approx(0.6)
  assert arm["final_val"]["pass_at_1"]["std"] == pytest.approx(
      math.sqrt(0.08))
  curve = arm["curves"]["val/pass_at_1"]
  assert curve["steps"] == [0, 1, 2]
  assert curve["mean"] == pytest.approx([0.0, 0.25, 0.6])
  assert res["arms"]["b"]["final_val"] is None
  table = ab.markdown_table(res, early_step=1)
  head = table.splitlines()[0]
  assert head.endswith("| final validation pass@1 |")
  assert "| validation pass@1 at iteration 1 |" in head
  # Validation pass@1 at iteration 1, then the final one, in a's row.
  row = next(l for l in table.splitlines() if l.startswith("| a |"))
  assert row.startswith("| a | `rl.tau=0.5` | 2 | 0.250 ± 0.071 |")
  assert row.endswith("| 0.600 ± 0.283 |")
  # No run evaluated at iteration 7: no column for it (not an empty one).
  late = ab.markdown_table(res, early_step=7).splitlines()
  assert "at iteration" not in late[0]
  assert late[0].count("|") == head.count("|") - 1
  assert ab.plot(res, str(tmp_path / "f.png")) == str(tmp_path / "f.png")


def test_aggregate_mean_and_sample_std_by_hand(tmp_path):
  a = ab.parse_ablation(_toy())
  plan = a.plan(str(tmp_path), 3)
  by = {(r.arm, r.seed - 10): r.workdir for r in plan}
  # Arm a: pass@1 0.5, 0.7, 0.9 -> mean 0.7, sample std
  # sqrt((0.2^2 + 0 + 0.2^2) / 2) = 0.2. Greedy 1, 0, 0 -> mean 1/3, std
  # sqrt(((2/3)^2 + 2 (1/3)^2) / 2) = sqrt(1/3). Lengths 10, 12, 17 ->
  # mean 13, std sqrt((9 + 1 + 16) / 2) = sqrt(13).
  for k, (p1, g, n) in enumerate([(0.5, 1.0, 10.0), (0.7, 0.0, 12.0),
                                  (0.9, 0.0, 17.0)]):
    _fake_run(by["a", k], _evals(p1, g, n), _evals(0.1 * k, 0.0, 5.0),
              rl_acc={1: 0.1 * k, 2: 0.2 * k, 3: 0.3},
              eval_p1={0: 0.1, 2: p1} if k < 2 else {0: 0.1, 2: p1, 4: 1.0},
              seconds=60.0 + k)
  # Arm b: only seed 0 finished (std undefined).
  _fake_run(by["b", 0], _evals(0.25, 0.5, 8.0), None, {1: 0.5}, {0: 0.1})
  res = ab.aggregate(a, plan)
  arm = res["arms"]["a"]
  assert arm["n_seeds"] == 3 and arm["seeds"] == [10, 11, 12]
  assert arm["overrides"] == {"rl.tau": 0.5}
  f = arm["final"]
  assert f["pass_at_1"]["mean"] == pytest.approx(0.7)
  assert f["pass_at_1"]["std"] == pytest.approx(0.2)
  assert f["greedy_accuracy"]["mean"] == pytest.approx(1 / 3)
  assert f["greedy_accuracy"]["std"] == pytest.approx(math.sqrt(1 / 3))
  assert f["mean_length"]["mean"] == pytest.approx(13.0)
  assert f["mean_length"]["std"] == pytest.approx(math.sqrt(13.0))
  assert f["pass_at_1"]["values"] == [0.5, 0.7, 0.9]
  assert arm["warm_start"]["pass_at_1"]["mean"] == pytest.approx(0.1)
  # Curves: per step over seeds; only steps every seed has (4 is in one).
  acc = arm["curves"]["rl/accuracy"]
  assert acc["steps"] == [1, 2, 3]
  assert acc["mean"] == pytest.approx([0.1, 0.2, 0.3])
  # iteration 1: 0, 0.1, 0.2 -> std 0.1; iteration 3: all 0.3 -> std 0.
  assert acc["std"] == pytest.approx([0.1, 0.2, 0.0])
  p1 = arm["curves"]["eval/pass_at_1"]
  assert p1["steps"] == [0, 2] and p1["mean"] == pytest.approx([0.1, 0.7])
  assert arm["run_seconds"] == [60.0, 61.0, 62.0]
  b = res["arms"]["b"]
  assert b["n_seeds"] == 1 and b["final"]["pass_at_1"]["std"] is None
  assert b["warm_start"] is None
  # Paired with arm a on the seeds both finished (10 only): 0.25 - 0.5.
  paired = b["vs_reference"]
  assert paired["reference"] == "a" and paired["seeds"] == [10]
  assert paired["pass_at_1"]["mean"] == pytest.approx(-0.25)
  assert paired["mean_length"]["mean"] == pytest.approx(-2.0)
  assert "vs_reference" not in arm
  table = ab.markdown_table(res, early_step=2)
  # Gain per seed: 0.5 - 0, 0.7 - 0.1, 0.9 - 0.2 -> mean 0.6, std 0.1.
  assert arm["gain"]["values"] == pytest.approx([0.5, 0.6, 0.7])
  assert arm["gain"]["mean"] == pytest.approx(0.6)
  assert arm["gain"]["std"] == pytest.approx(0.1)
  assert b["gain"] is None
  assert "| a | `rl.tau=0.5` | 3 | 0.700 ± 0.200 | 0.100 ± 0.100 | " \
         "0.700 ± 0.200 | +0.600 ± 0.100 | — | 0.333 ± 0.577 | " \
         "13.0 ± 3.6 |" in table
  assert "| b | `rl.tau=2.0`, `rl.baseline=soft` | 1 |  |  | 0.250 |  | " \
         "-0.250 | 0.500 | 8.0 |" in table
  png = ab.plot(res, str(tmp_path / "fig.png"))
  with open(png, "rb") as fh:
    assert fh.read(8) == b"\x89PNG\r\n\x1a\n"


def test_groups_per_task_are_summed_over_iterations_by_hand(tmp_path):
  """What each arm spent on each task: per-task groups scored and trained,
  summed over a run's RL rows (a step logged twice, as after a resume,
  counts once, its last row), then mean ± std over seeds."""
  a = ab.parse_ablation(_toy())
  plan = a.plan(str(tmp_path), 2)
  by = {(r.arm, r.seed - 10): r.workdir for r in plan}
  rows = {0: [(1, {"spell": 3, "syl": 5}, {"spell": 2, "syl": 1}),
              (2, {"spell": 9}, {"spell": 9}),  # replaced below
              (2, {"spell": 4, "syl": 4}, {"spell": 4}),
              (3, {"syl": 8}, None)],
          1: [(1, {"spell": 8}, {"spell": 6}),
              (2, {"spell": 6, "syl": 2}, {"spell": 5, "syl": 2})]}
  for k, its in rows.items():
    _fake_run(by["a", k], _evals(0.5, 0.5, 4.0), None, {1: 0.1},
              {0: 0.1})
    with open(os.path.join(by["a", k], "metrics.jsonl"), "a") as f:
      for step, scored, trained in its:
        row = {"stage": "rl", "step": step, "groups_by_task": scored}
        if trained is not None:
          row["groups_trained_by_task"] = trained
        f.write(json.dumps(row) + "\n")
  # Seed 10: scored spell 3 + 4 = 7, syl 5 + 4 + 8 = 17; trained spell
  # 2 + 4 = 6, syl 1. Seed 11: scored spell 14, syl 2; trained spell 11,
  # syl 2.
  got = ab.aggregate(a, plan)["arms"]["a"]["groups_by_task"]
  assert got["scored"]["spell"]["values"] == [7, 14]
  assert got["scored"]["syl"]["values"] == [17, 2]
  assert got["trained"]["spell"]["values"] == [6, 11]
  assert got["trained"]["syl"]["values"] == [1, 2]
  assert got["trained"]["spell"]["mean"] == pytest.approx(8.5)
  assert got["scored"]["syl"]["std"] == pytest.approx(
      math.sqrt(2 * 7.5 ** 2))


def test_mean_std_by_hand():
  mean, std = ab.mean_std([1.0, 2.0, 4.0])
  assert mean == pytest.approx(7 / 3)
  assert std == pytest.approx(math.sqrt(((-4 / 3) ** 2 + (-1 / 3) ** 2 +
                                         (5 / 3) ** 2) / 2))
  assert ab.mean_std([3.0]) == (3.0, None)
  with pytest.raises(ValueError):
    ab.mean_std([])


def test_paired_difference_is_shown_with_its_standard_error():
  """stat's sem is std / sqrt(seeds); the table's paired column prints it,
  the other columns the std."""
  from kimi_jax.ablation.stats import stat
  # Differences 0.1, 0.2, 0.6: mean 0.3, std sqrt((0.04 + 0.01 + 0.09) / 2)
  # = sqrt(0.07), sem sqrt(0.07 / 3) = 0.1528.
  d = stat([0.1, 0.2, 0.6])
  assert d["sem"] == pytest.approx(math.sqrt(0.07 / 3))
  assert stat([0.5])["sem"] is None

  def arm(p1, paired=None):
    return {"n_seeds": 3, "overrides": {}, "curves": {},
            "final": {"pass_at_1": stat(p1),
                      "greedy_accuracy": stat([0.5, 0.5, 0.5]),
                      "mean_length": stat([10.0, 10.0, 10.0])},
            **({"vs_reference": {"pass_at_1": paired}} if paired else {})}
  res = {"arms": {"a": arm([0.2, 0.4, 0.6]),
                  "b": arm([0.3, 0.6, 1.2], stat([0.1, 0.2, 0.6]))}}
  table = ab.markdown_table(res).splitlines()
  assert "Δ pass@1 vs a (paired, ± s.e.)" in table[0]
  assert table[3] == ("| b | (base) | 3 | 0.700 ± 0.458 | +0.300 ± 0.153 | "
                      "0.500 ± 0.000 | 10.0 ± 0.0 |")


# ---- resuming a sweep -------------------------------------------------------------


class _Recorder:
  """A stand-in for the main job that writes a summary and records calls;
  `stop_after` calls, it raises as a kill would interrupt the sweep."""

  def __init__(self, stop_after=None):
    self.calls = []
    self.stop_after = stop_after

  def __call__(self, config, workdir):
    if self.stop_after is not None and len(self.calls) == self.stop_after:
      raise KeyboardInterrupt
    self.calls.append((workdir, config.rl.tau, config.seed))
    _fake_run(workdir, _evals(config.rl.tau / 4, 0.0, 1.0), None, {1: 0.0},
              {0: 0.0})


def test_a_killed_sweep_reruns_only_unfinished_runs(tmp_path):
  a = ab.parse_ablation(_toy())
  w = str(tmp_path)
  first = _Recorder(stop_after=2)
  with pytest.raises(KeyboardInterrupt):
    ab.run_sweep(a, w, 2, run_fn=first, log=lambda _: None,
                 share_warm_start=False)
  assert [c[0] for c in first.calls] == [os.path.join(w, "a", "seed10"),
                                         os.path.join(w, "b", "seed10")]
  # A run whose summary is missing (interrupted mid-run) runs again.
  os.remove(os.path.join(w, "a", "seed10", "summary.json"))
  second = _Recorder()
  plan = ab.run_sweep(a, w, 2, run_fn=second, log=lambda _: None,
                      share_warm_start=False)
  assert second.calls == [(os.path.join(w, "a", "seed10"), 0.5, 10),
                          (os.path.join(w, "a", "seed11"), 0.5, 11),
                          (os.path.join(w, "b", "seed11"), 2.0, 11)]
  assert all(r.finished for r in plan)
  third = _Recorder()
  ab.run_sweep(a, w, 2, run_fn=third, log=lambda _: None,
               share_warm_start=False)
  assert third.calls == []
  # More seeds later: only the new ones run.
  ab.run_sweep(a, w, 3, run_fn=third, log=lambda _: None,
               share_warm_start=False)
  assert [c[2] for c in third.calls] == [12, 12]


def test_sweeps_over_disjoint_seeds_share_a_directory(tmp_path):
  """One process per seed (first_seed), then one aggregation of all."""
  w = str(tmp_path)
  calls = _Recorder()
  for first in (11, 10):
    a = ab.parse_ablation(_toy(first_seed=first))
    ab.run_sweep(a, w, 1, run_fn=calls, log=lambda _: None,
                 share_warm_start=False)
  assert sorted(c[2] for c in calls.calls) == [10, 10, 11, 11]
  a = ab.parse_ablation(_toy())  # first_seed 10
  res = ab.aggregate(a, a.plan(w, 2))
  assert res["arms"]["b"]["seeds"] == [10, 11]
  # tau / 4 of arm b (2.0) in both seeds.
  assert res["arms"]["b"]["final"]["pass_at_1"]["mean"] == 0.5
  # Paired over both seeds: (0.5 - 0.125) each time, std 0.
  assert res["arms"]["b"]["vs_reference"]["pass_at_1"]["mean"] == 0.375
  assert res["arms"]["b"]["vs_reference"]["pass_at_1"]["std"] == 0.0


def test_run_sweep_runs_only_the_arms_asked_for(tmp_path):
  a = ab.parse_ablation(_toy())
  calls, logged = _Recorder(), []
  ab.run_sweep(a, str(tmp_path), 2, run_fn=calls, log=logged.append,
               share_warm_start=False, arms=["b"])
  assert [(c[1], c[2]) for c in calls.calls] == [(2.0, 10), (2.0, 11)]
  assert "4 runs (2 arms x 2 seeds), 0 finished, 2 to run (arms b only)" in (
      logged[0])
  with pytest.raises(KeyError, match="no arm 'c'"):
    ab.run_sweep(a, str(tmp_path), 1, run_fn=calls, log=lambda _: None,
                 share_warm_start=False, arms=["c"])


def test_a_sweep_directory_refuses_a_different_ablation(tmp_path):
  ab.run_sweep(ab.parse_ablation(_toy()), str(tmp_path), 1,
               run_fn=_Recorder(), log=lambda _: None, share_warm_start=False)
  other = ab.parse_ablation(_toy({"a": {"rl.tau": 0.25},
                                  "b": {"rl.tau": 2.0}}))
  with pytest.raises(ConfigError, match="ablation_config.json.*arms"):
    ab.run_sweep(other, str(tmp_path), 1, run_fn=_Recorder(),
                 log=lambda _: None, share_warm_start=False)


# ---- end to end -------------------------------------------------------------------


def _rows(workdir, stage):
  from kimi_jax.infra.metrics import read_jsonl
  return [r for r in read_jsonl(os.path.join(workdir, "metrics.jsonl"))
          if r["stage"] == stage]


def _cpu_env() -> dict:
  return dict(os.environ, JAX_PLATFORMS="cpu", XLA_FLAGS="", PYTHONPATH=ROOT)


def _ablate(workdir, spec: str, *flags: str) -> subprocess.CompletedProcess:
  """launch/ablate.py with one seed on `experiments/ablations.py:spec`; it
  must succeed."""
  cmd = [sys.executable, os.path.join(ROOT, "launch", "ablate.py"),
         "--config", f"{ABLATIONS}:{spec}", "--workdir", str(workdir),
         "--seeds", "1", "--compilation_cache=none", *flags]
  out = subprocess.run(cmd, env=_cpu_env(), capture_output=True, text=True,
                       timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  return out


@pytest.mark.slow
def test_micro_ablation_end_to_end_resumes_and_matches_unshared_run(tmp_path):
  """launch/ablate.py on the micro loss ablation (shared warm start); then a
  run's summary is removed and the sweep rerun: only that run resumes from
  its own checkpoint. A run of the same arm without the shared warm start
  gives the same metrics."""
  w = tmp_path / "sweep"
  env = _cpu_env()
  out = _ablate(w, "loss,micro", "--config.base.rl.iterations=2")
  assert "shared warm start" in out.stdout
  results = json.loads((w / "ablation.json").read_text())
  assert set(results["arms"]) == {"mirror_descent", "rest"}
  for arm in ("mirror_descent", "rest"):
    a = results["arms"][arm]
    assert a["n_seeds"] == 1
    summary = json.loads((w / arm / "seed0" / "summary.json").read_text())
    assert a["final"]["pass_at_1"]["mean"] == summary["final_eval"][
        "pass_at_1"]
    assert a["curves"]["rl/accuracy"]["steps"] == [1, 2]
    # The warm start came from the shared run: same evaluation, same SFT
    # rows, and no SFT stage in the arm's own log.
    warm = json.loads((w / "warm_start" / "seed0" / "summary.json"
                       ).read_text())["warmstart_eval"]
    assert summary["warmstart_eval"] == warm
    assert "warm start:" not in out.stdout.split(arm + " seed=0")[1].split(
        "final held-out")[0]
  assert (w / "ablation.png").read_bytes()[:4] == b"\x89PNG"
  assert "| mirror_descent |" in out.stdout

  # Interrupted after its last checkpoint: only rest/seed0 runs again.
  md = w / "mirror_descent" / "seed0" / "summary.json"
  md_mtime = md.stat().st_mtime_ns
  rest = w / "rest" / "seed0"
  rest_rl = _rows(rest, "rl")
  os.remove(rest / "summary.json")
  again = _ablate(w, "loss,micro", "--config.base.rl.iterations=2")
  assert "1 finished, 1 to run" in again.stdout
  assert f"resuming {rest}" in again.stdout
  assert "warm start:" not in again.stdout  # no SFT stage, nothing redone
  assert md.stat().st_mtime_ns == md_mtime
  assert (rest / "summary.json").exists()
  assert _rows(rest, "rl") == rest_rl  # no iteration ran twice

  # The same arm without the shared warm start: the same run.
  # (In a subprocess too: the same single CPU device.)
  alone = tmp_path / "alone"
  script = (
      "import sys; from kimi_jax import ablation as ab; "
      "from kimi_jax.job.run import train_and_evaluate; "
      "a = ab.load_ablation(sys.argv[1], {'base.rl.iterations': 2}); "
      "train_and_evaluate(a.run_config(a.plan(sys.argv[2], 1)[0]), "
      "sys.argv[3])")
  out = subprocess.run([sys.executable, "-c", script, ABLATIONS + ":loss,micro",
                        str(w), str(alone)], env=env, capture_output=True,
                       text=True, timeout=900)
  assert out.returncode == 0, out.stdout[-3000:] + out.stderr[-3000:]
  assert "warm start:" in out.stdout  # this one ran its own stage one
  shared = w / "mirror_descent" / "seed0"
  for stage, keys in (("rl", ("accuracy", "length_mean", "reward")),
                      ("eval", ("pass_at_1", "greedy_accuracy",
                                "mean_length"))):
    got = [[r[k] for k in keys] for r in _rows(shared, stage)]
    want = [[r[k] for k in keys] for r in _rows(alone, stage)]
    assert got == want, stage
  def losses(workdir):  # iterations that trained
    return [(r["step"], r["loss"]) for r in _rows(workdir, "rl")
            if "loss" in r]
  got, want = losses(shared), losses(alone)
  assert got and [s for s, _ in got] == [s for s, _ in want]
  assert [x for _, x in got] == pytest.approx([x for _, x in want], rel=1e-5)


@pytest.mark.slow
def test_micro_curation_ablation_runs_the_pipeline_per_arm(tmp_path):
  """launch/ablate.py on the micro curation ablation: the data and vanilla
  stages run once for the seed and both arms start from copies of them;
  each arm runs the rest of the pipeline (curation only in the curated
  arm); results carry warm start, gain and the paired difference read
  from the pipelines' summaries; a rerun runs nothing."""
  w = tmp_path / "sweep"
  out = _ablate(w, "curation,micro")
  assert "shared data and vanilla SFT per seed" in out.stdout
  # One vanilla SFT run, in the shared directory.
  assert out.stdout.count("new run in") == 3
  assert f"new run in {w / 'warm_start' / 'seed0' / 'vanilla'}" in out.stdout
  shared_vanilla = (w / "warm_start" / "seed0" / "vanilla" / "stage.json"
                    ).read_text()
  results = json.loads((w / "ablation.json").read_text())
  summaries = {}
  for arm in ("curated", "uncurated"):
    run = w / arm / "seed0"
    assert (run / "vanilla" / "stage.json").read_text() == shared_vanilla
    # Its vanilla run names its own copies (the shared ones may go).
    assert json.loads((run / "vanilla" / "config.json").read_text())[
        "task"]["tokenizer"] == str(run / "tokenizer")
    assert (run / "data" / "train.jsonl").read_bytes() == (
        w / "warm_start" / "seed0" / "data" / "train.jsonl").read_bytes()
    s = summaries[arm] = json.loads((run / "summary.json").read_text())
    a = results["arms"][arm]
    assert a["final"]["pass_at_1"]["values"] == [
        s["final_eval"]["pass_at_1"]]
    assert a["warm_start"]["pass_at_1"]["values"] == [
        s["warmstart_eval"]["pass_at_1"]]
    assert a["gain"]["values"] == [pytest.approx(s["gain"])]
    # Curves from the main job's metrics: RL iterations 1 and 2.
    assert a["curves"]["rl/accuracy"]["steps"] == [1, 2]
  assert summaries["curated"]["curation"]["enabled"]
  assert not summaries["uncurated"]["curation"]["enabled"]
  assert not (w / "uncurated" / "seed0" / "data" / "curated.jsonl").exists()
  # Both arms sample their warm-up rows for the same clean problems in the
  # same order, so they share the warm start and differ only in RL prompts.
  warmup_rows = [(w / arm / "seed0" / "data" / "warmup.jsonl").read_bytes()
                 for arm in ("curated", "uncurated")]
  assert warmup_rows[0] and warmup_rows[0] == warmup_rows[1]
  assert summaries["curated"]["warmstart_eval"] == summaries["uncurated"][
      "warmstart_eval"]
  paired = results["arms"]["uncurated"]["vs_reference"]["pass_at_1"]
  assert paired["values"] == [pytest.approx(
      summaries["uncurated"]["final_eval"]["pass_at_1"] -
      summaries["curated"]["final_eval"]["pass_at_1"])]
  assert "gain (final - warm start)" in out.stdout
  again = _ablate(w, "curation,micro")
  assert "2 finished, 0 to run" in again.stdout
  assert "new run in" not in again.stdout


def _levels(p1_by_level, tokens_by_level):
  return {level: {"pass_at_1": p, "mean_length": n, "n_problems": 5}
          for (level, p), n in zip(p1_by_level.items(), tokens_by_level)}


def test_results_by_difficulty_level_by_hand(tmp_path):
  """Runs whose evaluations split by level: per level, pass@1 and length
  before and after RL and the change per seed, mean ± sample std; per-level
  curves from the evaluation rows; a table easiest level first (10 after
  2); one Figure-5 plot per arm."""
  a = ab.parse_ablation(_toy())
  plan = a.plan(str(tmp_path), 2)
  by = {(r.arm, r.seed - 10): r.workdir for r in plan}
  # Level 2: pass@1 0.2 -> 0.5 and 0.4 -> 0.5: changes +0.3 and +0.1, mean
  # +0.2, std sqrt(2 * 0.1^2) = 0.1414. Level 10: tokens 20 -> 30 and
  # 20 -> 40: change mean +15, std sqrt(2 * 5^2) = 7.071.
  for k, (p_before, n_after) in enumerate([(0.2, 30.0), (0.4, 40.0)]):
    w = by["a", k]
    _fake_run(w, _evals(0.5, 0.5, 4.0), _evals(0.1, 0.0, 4.0),
              {1: 0.5}, {0: 0.1, 1: 0.5})
    with open(os.path.join(w, "summary.json")) as f:
      summary = json.load(f)
    summary["warmstart_eval"]["by_difficulty"] = _levels(
        {"10": 0.1, "2": p_before}, (20.0, 10.0))
    summary["final_eval"]["by_difficulty"] = _levels(
        {"10": 0.1, "2": 0.5}, (n_after, 10.0))
    with open(os.path.join(w, "summary.json"), "w") as f:
      json.dump(summary, f)
    with open(os.path.join(w, "metrics.jsonl"), "a") as f:
      for step, n in ((0, 20.0), (1, n_after)):
        f.write(json.dumps({"stage": "eval", "step": step, "pass_at_1": 0.1,
                            "by_difficulty": _levels({"10": 0.1}, (n,))})
                + "\n")
  _fake_run(by["b", 0], _evals(0.25, 0.5, 8.0), None, {1: 0.5}, {0: 0.1})
  res = ab.write_results(a, str(tmp_path), plan)
  levels = res["arms"]["a"]["by_difficulty"]
  assert list(levels) == ["held_out"]  # the fake runs have no validation
  assert list(levels["held_out"]) == ["2", "10"]
  p2 = levels["held_out"]["2"]["pass_at_1"]
  assert p2["before"]["mean"] == pytest.approx(0.3)
  assert p2["change"]["values"] == pytest.approx([0.3, 0.1])
  assert p2["change"]["std"] == pytest.approx(math.sqrt(0.02))
  n10 = levels["held_out"]["10"]["mean_length"]
  assert n10["change"]["mean"] == pytest.approx(15.0)
  assert n10["change"]["std"] == pytest.approx(math.sqrt(50.0))
  curve = res["arms"]["a"]["curves"]["eval/level10/mean_length"]
  assert curve["steps"] == [0, 1]
  assert curve["mean"] == pytest.approx([20.0, 35.0])
  assert res["arms"]["b"]["by_difficulty"] is None
  rows = ab.markdown_levels(levels).splitlines()
  assert rows[2] == ("| 2 | 0.300 ± 0.141 | 0.500 ± 0.000 | +0.200 ± 0.141 "
                     "| 10.0 ± 0.0 | 10.0 ± 0.0 | +0.0 ± 0.0 |")
  assert rows[3].startswith("| 10 | 0.100 ± 0.000 |")
  assert rows[3].endswith("| 20.0 ± 0.0 | 35.0 ± 7.1 | +15.0 ± 7.1 |")
  assert (tmp_path / ab.LEVELS_FIGURE.format(arm="a")).stat().st_size > 0
  assert not (tmp_path / ab.LEVELS_FIGURE.format(arm="b")).exists()


def test_reflect_segment_arms_can_prefill_every_continued_segment():
  """A continued segment prefills its prompt and the response so far: the
  largest prefill bucket must hold the longest prompt the sequence allows
  plus all but the last budget of the longest response."""
  from experiments import reflect_tiny
  a = ab.load_ablation(f"{ABLATIONS}:reflect_segments")
  longest_prompt = reflect_tiny.SEQ_LEN - reflect_tiny.MAX_RESPONSE
  for run in a.plan("/w", 1):
    cfg = a.run_config(run)
    rl = cfg.rl
    if rl.token_budget < rl.max_response_len:
      need = longest_prompt + rl.max_response_len - rl.token_budget
      assert max(cfg.sampler.prefill_buckets) >= need, run.arm
