"""The reward-model study of experiments/rm_tiny.py (launch/rm_study.py).

  WORKDIR/warm/        the main job with one RL iteration: the
                       warm-started policy is its checkpoint rl_step(0)
                       (the iteration only makes the run complete)
  WORKDIR/rm/          launch/train_rm.py's outputs on that policy
  WORKDIR/rl_<arm>/    the main job per arm (task.reward = arm), resumed
                       from a copy of the warm start's checkpoint, so every
                       arm starts from the same policy
  WORKDIR/rm_study.json the comparison (`summarise`)

Each step is skipped when its output exists, so a rerun resumes (an arm's
job resumes by itself).
"""

from __future__ import annotations

import copy
import json
import os
import shutil
import time
from typing import Any

import ml_collections
import numpy as np

from kimi_jax.infra import workdir_lock
from kimi_jax.infra.console import log
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import parse_config
from kimi_jax.reward_models import train as train_lib
from kimi_jax.reward_models.config import rm_kind

STUDY_FILE = "rm_study.json"
_EXTRA_SECTIONS = ("rm_data", "rm_value", "rm_cot", "study")


def job_config(config: ml_collections.ConfigDict, **overrides: Any
               ) -> ml_collections.ConfigDict:
  """The main job's config: the study's without its own sections, with
  `overrides` ({"rl.iterations": 1, ...})."""
  out = ml_collections.ConfigDict()
  for key, value in config.items():
    if key not in _EXTRA_SECTIONS:
      out[key] = copy.deepcopy(value)
  for key, value in overrides.items():
    node = out
    *parents, leaf = key.split(".")
    for p in parents:
      node = node[p]
    node[leaf] = value
  return out


def seed_from_warm_start(warm: str, target: str, step: int) -> None:
  """`target` as a run interrupted right after the warm start: the warm
  run's checkpoint `step` and its log rows up to it."""
  if os.path.isdir(os.path.join(target, "checkpoints")):
    return  # started before: the job resumes by itself
  os.makedirs(os.path.join(target, "checkpoints"))
  shutil.copytree(os.path.join(warm, "checkpoints", str(step)),
                  os.path.join(target, "checkpoints", str(step)))
  src = os.path.join(warm, "metrics.jsonl")
  if os.path.isfile(src):
    with open(src) as f:
      rows = [json.loads(line) for line in f]
    warm_eval = [r for r in rows if r["stage"] == "eval"][:1]
    with open(os.path.join(target, "metrics.jsonl"), "w") as g:
      for row in [r for r in rows if r["stage"] == "sft"] + warm_eval:
        g.write(json.dumps(row) + "\n")


def _rows(workdir: str, stage: str) -> list[dict]:
  path = os.path.join(workdir, "metrics.jsonl")
  with open(path) as f:
    return [r for r in map(json.loads, f) if r["stage"] == stage]


def _thirds(values: list[float]) -> tuple[float, float]:
  """Means of the first and last third of a curve."""
  k = max(1, len(values) // 3)
  return float(np.mean(values[:k])), float(np.mean(values[-k:]))


def arm_summary(workdir: str, arm: str) -> dict[str, Any]:
  """Held-out pass@1 (exact verifier) and the training curves of one arm;
  for a reward-model arm, its audited agreement and the reward-hacking
  check: the training accuracy the reward claims against the exact
  verifier's, first third vs last third of the run."""
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  rl = [r for r in _rows(workdir, "rl") if "accuracy" in r]
  out: dict[str, Any] = {
      "warm_pass_at_1": summary["warmstart_eval"]["pass_at_1"],
      "final_pass_at_1": summary["final_eval"]["pass_at_1"],
      "final_greedy_accuracy": summary["final_eval"]["greedy_accuracy"],
      "eval_curve": [(r["step"], r["pass_at_1"])
                     for r in _rows(workdir, "eval")],
      "iterations": summary["iterations"]}
  if rm_kind(arm) and rl:
    claimed = [r["accuracy"] for r in rl]
    true = [r["rm_verifier_accuracy"] for r in rl
            if "rm_verifier_accuracy" in r]
    agree = [r["rm_agreement"] for r in rl if "rm_agreement" in r]
    c0, c1 = _thirds(claimed)
    t0, t1 = _thirds(true) if true else (float("nan"), float("nan"))
    out.update(
        rl_agreement=float(np.mean(agree)) if agree else None,
        claimed_accuracy_first_last=(c0, c1),
        true_accuracy_first_last=(t0, t1),
        # Reward hacking: what the reward model pays rises clearly more
        # than what is really right.
        hacking_sign=bool((c1 - c0) - (t1 - t0) > 0.1),
        rm_calls=sum(r.get("rm_calls", 0) for r in rl),
        rm_seconds=sum(r.get("rm_seconds", 0.0) for r in rl),
        rm_malformed=sum(r.get("rm_malformed", 0) for r in rl),
        rm_missing=sum(r.get("rm_missing", 0) for r in rl))
  return out


def summarise(workdir: str, config: ml_collections.ConfigDict
              ) -> dict[str, Any]:
  study = config.study
  with open(os.path.join(workdir, "rm", train_lib.EVAL_FILE)) as f:
    rm_eval = json.load(f)
  arms = {arm: arm_summary(os.path.join(workdir, f"rl_{arm}"), arm)
          for arm in study.arms}
  out: dict[str, Any] = {
      "reward_models_vs_exact_verifier": {
          k: {m: rm_eval[k][m] for m in ("accuracy", "precision", "recall",
                                         "n")}
          for k in ("value", "cot") if k in rm_eval},
      "cot_malformed": rm_eval.get("cot", {}).get("malformed"),
      "cot_missing": rm_eval.get("cot", {}).get("missing"),
      "arms": arms}
  exact = arms.get("pointer_chase")
  for arm in ("rm_cot", "rm_value"):
    if exact and arm in arms:
      gap = arms[arm]["final_pass_at_1"] - exact["final_pass_at_1"]
      out[f"{arm}_minus_exact_pass_at_1"] = gap
      out[f"{arm}_within_tolerance"] = bool(abs(gap) <= study.tolerance)
  out["tolerance"] = study.tolerance
  return out


def table(summary: dict[str, Any]) -> str:
  lines = ["reward model vs exact verifier (held-out responses):",
           "  model   accuracy  precision  recall     n"]
  for k, m in summary["reward_models_vs_exact_verifier"].items():
    fmt = lambda x: "  n/a " if x is None else f"{x:.4f}"
    lines.append(f"  {k:6s}  {fmt(m['accuracy'])}    {fmt(m['precision'])}"
                 f"     {fmt(m['recall'])}  {m['n']}")
  lines += ["RL arms (held-out pass@1 by the exact verifier):",
            "  arm             warm    final   rl agreement  hacking sign"]
  for arm, a in summary["arms"].items():
    agree = a.get("rl_agreement")
    lines.append(
        f"  {arm:14s}  {a['warm_pass_at_1']:.3f}   {a['final_pass_at_1']:.3f}"
        f"   {'-' if agree is None else f'{agree:.4f}':>12s}  "
        f"{a.get('hacking_sign', '-')}")
  for arm in ("rm_cot", "rm_value"):
    key = f"{arm}_minus_exact_pass_at_1"
    if key in summary:
      lines.append(f"  {arm} - exact = {summary[key]:+.3f} (within "
                   f"{summary['tolerance']}: "
                   f"{summary[f'{arm}_within_tolerance']})")
  return "\n".join(lines)


@workdir_lock.exclusive
def run_study(config: ml_collections.ConfigDict, workdir: str
              ) -> dict[str, Any]:
  """The study (module doc); returns and writes rm_study.json."""
  t0 = time.perf_counter()
  study = config.study
  warm = os.path.join(workdir, "warm")
  if not os.path.isfile(os.path.join(warm, "summary.json")):
    log("rm study: warm start")
    job_lib.train_and_evaluate(job_config(config, **{
        "rl.iterations": 1, "checkpoint.max_to_keep": 3}), warm)
  step = job_lib.rl_step(parse_config(job_config(config)), 0)
  rm_dir = os.path.join(workdir, "rm")
  if not os.path.isfile(os.path.join(rm_dir, train_lib.EVAL_FILE)):
    log("rm study: reward models")
    train_lib.train_reward_models(config, rm_dir, policy_workdir=warm,
                                  policy_step=step)
  timings = {"warm_and_rm_s": time.perf_counter() - t0}
  for arm in study.arms:
    target = os.path.join(workdir, f"rl_{arm}")
    if os.path.isfile(os.path.join(target, "summary.json")):
      continue
    kind = rm_kind(arm)
    log(f"rm study: RL with reward {arm}")
    seed_from_warm_start(warm, target, step)
    t_arm = time.perf_counter()
    job_lib.train_and_evaluate(job_config(config, **{
        "task.reward": arm,
        "reward_model.path": os.path.join(rm_dir, kind) if kind else "",
        "rl.iterations": study.rl_iterations,
        "rl.eval_every": study.eval_every}), target)
    timings[f"rl_{arm}_s"] = time.perf_counter() - t_arm
  summary = summarise(workdir, config)
  summary["seconds"] = timings
  with open(os.path.join(workdir, STUDY_FILE), "w") as f:
    json.dump(summary, f, indent=2)
  log(table(summary))
  return summary
