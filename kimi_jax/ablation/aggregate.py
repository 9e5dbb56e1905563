"""Aggregation: every finished run of a sweep read back, and the mean and
sample standard deviation over seeds, per arm, of the final held-out
metrics and of the per-iteration curves; each arm after the first also gets
its paired difference to the first, and every arm its gain, final minus
warm-start held-out pass@1 per seed, mean ± std. Runs whose evaluations
split by difficulty level also get per-level curves and per-level changes
(kimi_jax/ablation/by_difficulty.py).
"""

from __future__ import annotations

import json
import os
from typing import Any, Mapping, Sequence

from kimi_jax.ablation.by_difficulty import (aggregate_levels, level_curves,
                                             plot_levels, run_levels)
from kimi_jax.ablation.figure import plot
from kimi_jax.ablation.spec import (FIGURE, LEVELS_FIGURE, RESULTS, SUMMARY,
                                    TIMING, Ablation, Run)
from kimi_jax.ablation.stats import mean_std, stat
from kimi_jax.infra.files import write_json
from kimi_jax.infra.metrics import read_jsonl

# Held-out metrics of `summary.json`'s final evaluation, reported per arm.
FINAL_METRICS = ("pass_at_1", "greedy_accuracy", "mean_length")
# Per-iteration keys of the RL rows and the evaluation rows of metrics.jsonl.
RL_CURVES = ("accuracy", "reward", "length_mean")
EVAL_CURVES = ("pass_at_1", "greedy_accuracy", "mean_length")


def _curve(series: Sequence[Mapping[int, float]]) -> dict[str, Any]:
  """Mean and std per step over the steps every seed has."""
  steps = sorted(set.intersection(*(set(s) for s in series)))
  stats = [mean_std([s[t] for s in series]) for t in steps]
  return {"steps": steps, "mean": [m for m, _ in stats],
          "std": [s for _, s in stats]}


def task_totals(rows: Sequence[Mapping[str, Any]], key: str
                ) -> dict[str, int]:
  """A per-task count of the RL rows (`groups_by_task`,
  `groups_trained_by_task`) summed over iterations; a step logged twice
  (a resumed run) counts once, its last row."""
  last = {int(r["step"]): r.get(key) or {} for r in rows
          if r.get("stage") == "rl"}
  totals: dict[str, int] = {}
  for counts in last.values():
    for task, n in counts.items():
      totals[task] = totals.get(task, 0) + int(n)
  return totals


def _task_stats(counts: Sequence[Mapping[str, int]]) -> dict[str, Any]:
  """Mean ± std over seeds of each task's count (0 where a run has none)."""
  tasks = sorted(set().union(*counts))
  return {t: stat([c.get(t, 0) for c in counts]) for t in tasks}


def read_run(run: Run, metrics_path: str) -> dict[str, Any]:
  """A finished run's final evaluation and per-iteration curves (from
  `metrics_path`: `Ablation.metrics_path(run)`)."""
  with open(os.path.join(run.workdir, SUMMARY)) as f:
    summary = json.load(f)
  rows = read_jsonl(metrics_path)
  curves = {}
  for stage, keys in (("rl", RL_CURVES), ("eval", EVAL_CURVES),
                      ("val", EVAL_CURVES)):
    for key in keys:
      curves[f"{stage}/{key}"] = {
          int(r["step"]): float(r[key]) for r in rows
          if r.get("stage") == stage and isinstance(r.get(key), (int, float))}
  curves.update(level_curves(rows))
  timing_path = os.path.join(run.workdir, TIMING)
  seconds = None
  if os.path.exists(timing_path):
    with open(timing_path) as f:
      seconds = json.load(f)["seconds"]
  return {"final": summary["final_eval"],
          "warm_start": summary.get("warmstart_eval"),
          # Runs with a validation set (task.val_path, gym.val_size).
          "final_val": summary.get("final_val"),
          "iterations": summary.get("iterations"), "curves": curves,
          "levels": run_levels(summary),
          "groups_by_task": {
              "scored": task_totals(rows, "groups_by_task"),
              "trained": task_totals(rows, "groups_trained_by_task")},
          "seconds": seconds}


def aggregate(ablation: Ablation, plan: Sequence[Run]) -> dict[str, Any]:
  """Per arm, over its finished seeds: mean ± std of the final held-out
  pass@1, greedy accuracy and mean response tokens (and of the final
  validation ones, `final_val`, when the runs have a validation set), and
  of every curve.

  The arms of one seed share the task, the initial weights and the warm
  start, so each arm after the first also gets `vs_reference`: mean ± std
  over the seeds both finished of (this arm - the first arm) per seed, a
  paired difference, less noisy than comparing the two means."""
  arms = {}
  finals: dict[str, dict[int, Mapping[str, float]]] = {}
  for arm in ablation.arm_names:
    runs = [r for r in plan if r.arm == arm and r.finished]
    if not runs:
      arms[arm] = {"seeds": [], "n_seeds": 0}
      continue
    data = [read_run(r, ablation.metrics_path(r)) for r in runs]
    finals[arm] = {r.seed: d["final"] for r, d in zip(runs, data)}
    keys = sorted(set.intersection(*(set(d["curves"]) for d in data)))
    arms[arm] = {
        "overrides": ablation.overrides(arm),
        "seeds": [r.seed for r in runs], "n_seeds": len(runs),
        "final": {k: stat([d["final"][k] for d in data])
                  for k in FINAL_METRICS},
        "warm_start": ({k: stat([d["warm_start"][k] for d in data])
                        for k in FINAL_METRICS}
                       if all(d["warm_start"] for d in data) else None),
        # After RL minus before it, per seed: what RL added.
        "gain": (stat([d["final"]["pass_at_1"] -
                        d["warm_start"]["pass_at_1"] for d in data])
                 if all(d["warm_start"] for d in data) else None),
        "final_val": ({k: stat([d["final_val"][k] for d in data])
                       for k in FINAL_METRICS}
                      if all(d["final_val"] for d in data) else None),
        "curves": {k: _curve([d["curves"][k] for d in data]) for k in keys
                   if all(d["curves"][k] for d in data)},
        "run_seconds": [d["seconds"] for d in data],
        # RL groups per task over the run: where the rollouts and the
        # updates went (a mixed prompt set spends some on each task).
        "groups_by_task": {
            kind: _task_stats([d["groups_by_task"][kind] for d in data])
            for kind in ("scored", "trained")},
        "by_difficulty": aggregate_levels([d["levels"] for d in data]),
    }
  reference = ablation.arm_names[0]
  for arm in ablation.arm_names[1:]:
    seeds = sorted(set(finals.get(arm, {})) & set(finals.get(reference, {})))
    if seeds:
      arms[arm]["vs_reference"] = {
          "reference": reference, "seeds": seeds,
          **{k: stat([finals[arm][s][k] - finals[reference][s][k]
                       for s in seeds]) for k in FINAL_METRICS}}
  return {"ablation": ablation.name, "description": ablation.description,
          "seed_key": ablation.seed_key, "std": "sample (ddof=1) over seeds",
          "arms": arms}


def write_results(ablation: Ablation, workdir: str, plan: Sequence[Run]
                  ) -> dict[str, Any]:
  """`workdir/ablation.json` and `workdir/ablation.png` (and, for runs
  that evaluate by level, one `LEVELS_FIGURE` per arm); returns the
  results."""
  results = aggregate(ablation, plan)
  write_json(os.path.join(workdir, RESULTS), results)
  plot(results, os.path.join(workdir, FIGURE))
  for arm, data in results["arms"].items():
    if data.get("by_difficulty"):
      stage = "val" if "validation" in data["by_difficulty"] else "eval"
      plot_levels(data["curves"], os.path.join(
          workdir, LEVELS_FIGURE.format(arm=arm)), stage=stage,
          title=f"{results['ablation']}, {arm}: mean ± 1 std over "
          f"{data['n_seeds']} seeds")
  return results
