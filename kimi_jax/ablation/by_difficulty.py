"""Results per difficulty level, for runs whose evaluations split by level
(`by_difficulty` in summary.json and in metrics.jsonl's evaluation rows):
the report's Figure 5 in miniature, pass@1 and response length through RL
per level, and per level the change RL made, mean ± std over seeds.
"""

from __future__ import annotations

from typing import Any, Iterable, Mapping, Sequence

import numpy as np

from kimi_jax.ablation.figure import band
from kimi_jax.ablation.stats import stat

# The two quantities Figure 5 follows through training.
LEVEL_METRICS = ("pass_at_1", "mean_length")
# summary.json's evaluations before and after RL: held out, then validation.
SPLITS = {"held_out": ("warmstart_eval", "final_eval"),
          "validation": ("warmstart_val", "final_val")}


def level_order(levels: Iterable[str]) -> list[str]:
  """Levels from easiest to hardest: numerically where they are numbers."""
  def key(level: str) -> tuple[int, float, str]:
    try:
      return (0, float(level), level)
    except ValueError:
      return (1, 0.0, level)
  return sorted(set(levels), key=key)


def curve_key(stage: str, level: str, metric: str) -> str:
  return f"{stage}/level{level}/{metric}"


def level_curves(rows: Sequence[Mapping[str, Any]],
                 stages: Sequence[str] = ("eval", "val")
                 ) -> dict[str, dict[int, float]]:
  """Per-level curves of the evaluation rows, keyed by `curve_key`."""
  curves: dict[str, dict[int, float]] = {}
  for r in rows:
    if r.get("stage") not in stages or not r.get("by_difficulty"):
      continue
    for level, m in r["by_difficulty"].items():
      for metric in LEVEL_METRICS:
        if isinstance(m.get(metric), (int, float)):
          curves.setdefault(curve_key(r["stage"], level, metric), {})[
              int(r["step"])] = float(m[metric])
  return curves


def run_levels(summary: Mapping[str, Any]
               ) -> dict[str, dict[str, Mapping[str, Any]]] | None:
  """{split: {"before"|"after": by_difficulty}} of one run's summary; None
  when its evaluations do not split by level."""
  out = {}
  for split, (before, after) in SPLITS.items():
    pair = [(summary.get(k) or {}).get("by_difficulty") for k in (before,
                                                                  after)]
    if all(pair):
      out[split] = {"before": pair[0], "after": pair[1]}
  return out or None


def aggregate_levels(runs: Sequence[Mapping[str, Any]]
                     ) -> dict[str, Any] | None:
  """Over seeds (`runs`: `run_levels` of each), per split and level: the
  metrics before and after RL and the change per seed, mean ± std. Levels
  that every seed evaluated, easiest first; None unless every run has
  levels."""
  if not runs or not all(runs):
    return None
  out: dict[str, Any] = {}
  for split in SPLITS:
    if not all(split in r for r in runs):
      continue
    levels = level_order(set.intersection(*(
        set(r[split]["before"]) & set(r[split]["after"]) for r in runs)))
    out[split] = {}
    for level in levels:
      row: dict[str, Any] = {}
      for metric in LEVEL_METRICS:
        before = [r[split]["before"][level][metric] for r in runs]
        after = [r[split]["after"][level][metric] for r in runs]
        row[metric] = {"before": stat(before), "after": stat(after),
                       "change": stat(np.subtract(after, before))}
      out[split][level] = row
  return out or None


def plot_levels(curves: Mapping[str, Mapping[str, Any]], path: str, *,
                stage: str = "val", title: str = "") -> str | None:
  """Figure 5 in miniature: pass@1 (left) and mean response tokens (right)
  per level through RL, mean over seeds with a ±1 std band. `curves`: an
  arm's aggregated curves ({key: {"steps", "mean", "std"}})."""
  levels = level_order(k.split("/")[1][len("level"):] for k in curves
                       if k.startswith(f"{stage}/level"))
  if not levels:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  fig, axes = plt.subplots(1, 2, figsize=(9.6, 3.8))
  colors = plt.get_cmap("viridis")(np.linspace(0.0, 0.85, len(levels)))
  names = {"val": "validation", "eval": "held-out"}
  for ax, metric, label in zip(axes, LEVEL_METRICS,
                               ("pass@1", "mean response tokens")):
    for color, level in zip(colors, levels):
      band(ax, curves.get(curve_key(stage, level, metric)), color,
           label=f"level {level}", alpha=0.15)
    ax.set_title(f"{names.get(stage, stage)} {label}", fontsize=10)
    ax.set_xlabel("RL iteration")
    ax.grid(alpha=0.3)
  axes[0].legend(fontsize=8)
  if title:
    fig.suptitle(title, fontsize=10)
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path
