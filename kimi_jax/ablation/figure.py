"""The figure of an ablation's results: its curves per arm, mean over seeds
with a band of one standard deviation."""

from __future__ import annotations

from typing import Any, Mapping

import numpy as np

# (panel title, curve key) of the figure; the validation panel only when
# the runs have a validation set (their periodic evaluations read it).
PANELS = (("held-out pass@1", "eval/pass_at_1"),
          ("held-out greedy accuracy", "eval/greedy_accuracy"),
          ("training accuracy", "rl/accuracy"),
          ("training response length (tokens)", "rl/length_mean"))
VAL_PANEL = ("validation pass@1", "val/pass_at_1")


def plot(results: Mapping[str, Any], path: str, *,
         smooth: int = 5) -> str | None:
  """Curves per arm, mean over seeds with a ±1 std band; training curves
  averaged over a trailing window of `smooth` iterations (both the mean and
  the band), evaluation curves as measured."""
  arms = {a: d for a, d in results["arms"].items() if d["n_seeds"]}
  if not arms:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = PANELS + ((VAL_PANEL,) if any(
      VAL_PANEL[1] in d["curves"] for d in arms.values()) else ())
  fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6),
                           squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, (title, key) in zip(axes.flat, panels):
    for i, (arm, data) in enumerate(arms.items()):
      band(ax, data["curves"].get(key), colors[i % len(colors)],
           label=f"{arm} (n={data['n_seeds']})",
           smooth=smooth if key.startswith("rl/") else 1)
    ax.set_title(title + (f" ({smooth}-iter mean)" if key.startswith("rl/")
                          and smooth > 1 else ""), fontsize=10)
    ax.set_xlabel("RL iteration")
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=8)
  fig.suptitle(f"ablation: {results['ablation']} (mean ± 1 std over seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def band(ax: Any, curve: Mapping[str, Any] | None, color: Any, *,
         label: str, smooth: int = 1, alpha: float = 0.2) -> None:
  """One aggregated curve ({"steps", "mean", "std"}) on `ax`: its mean and
  a ±1 std band, both averaged over a trailing window of `smooth` points;
  nothing for a missing or empty curve."""
  if not curve or not curve["steps"]:
    return
  x = np.asarray(curve["steps"], np.float64)
  mean = np.asarray(curve["mean"], np.float64)
  std = np.asarray([s if s is not None else 0.0 for s in curve["std"]],
                   np.float64)
  if smooth > 1:
    mean, std = _trailing_mean(mean, smooth), _trailing_mean(std, smooth)
  ax.plot(x, mean, color=color, marker="." if len(x) < 20 else None,
          label=label)
  ax.fill_between(x, mean - std, mean + std, color=color, alpha=alpha,
                  linewidth=0)


def _trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
  c = np.cumsum(np.concatenate([[0.0], x]))
  idx = np.arange(1, x.size + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)
