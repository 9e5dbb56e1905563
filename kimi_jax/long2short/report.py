"""Token efficiency (report 3.4, Figure 7): every model's held-out pass@1
against the tokens it spends, the token-efficiency targets, and the figure.

A method's record: pass@1 over k draws per problem, greedy accuracy, mean
and p90 response tokens of the draws, the mean over problems of the
shortest correct draw, and the same by difficulty.
"""

from __future__ import annotations

from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.rl.evaluation import EvalSamples

# The token-efficiency targets (docs/long2short.md, "Evaluation").
LONG_OVER_SHORTEST = 1.5  # long mean tokens >= 1.5 x the shortest solution
PASS_GAP = 0.02  # best method's pass@1 within this of the long model's
TOKEN_RATIO = 0.6  # ... with at most this share of its mean tokens


def method_record(samples: EvalSamples, records: Sequence[Mapping[str, Any]]
                  ) -> dict[str, Any]:
  summary = samples.summary()
  drawn = samples.draw_N >= 0
  shortest = []
  for i in range(samples.n_problems):
    ok = drawn & (samples.problem_N == i) & samples.correct_N
    if ok.any():
      shortest.append(int(samples.length_N[ok].min()))
  difficulty = np.array([records[i].get("difficulty", 0.0)
                         for i in samples.problem_N])
  by_difficulty = {}
  for d in sorted(set(difficulty[drawn].tolist())):
    m = drawn & (difficulty == d)
    by_difficulty[f"{d:g}"] = {
        "pass_at_1": float(samples.correct_N[m].mean()),
        "mean_tokens": float(samples.length_N[m].mean())}
  return {
      "pass_at_1": summary.pass_at_1,
      "greedy_accuracy": summary.greedy_accuracy,
      "mean_tokens": summary.mean_length,
      "p90_tokens": summary.p90_length,
      "shortest_correct_tokens": (float(np.mean(shortest)) if shortest
                                  else None),
      "problems_solved": len(shortest),
      "by_difficulty": by_difficulty,
  }


def targets(methods: Mapping[str, Mapping[str, Any]],
            shortest_solution_tokens: float) -> dict[str, Any]:
  """The token-efficiency targets on `methods` (records keyed by method
  name)."""
  long, short = methods["long"], methods["short_baseline"]
  candidates = {k: v for k, v in methods.items()
                if k not in ("long", "short_baseline")}

  def token_ratio(rec):
    return rec["mean_tokens"] / long["mean_tokens"]

  def meets(rec):
    return (rec["pass_at_1"] >= long["pass_at_1"] - PASS_GAP and
            token_ratio(rec) <= TOKEN_RATIO and
            rec["pass_at_1"] > short["pass_at_1"])

  # Best: among those meeting the pass@1 and token targets, the most
  # accurate; if none, the most token-efficient by pass@1 per token.
  meeting = [k for k, v in candidates.items() if meets(v)]
  best = (max(meeting, key=lambda k: candidates[k]["pass_at_1"]) if meeting
          else max(candidates, key=lambda k: candidates[k]["pass_at_1"] /
                   candidates[k]["mean_tokens"]))
  rec = candidates[best]
  ratio = long["mean_tokens"] / shortest_solution_tokens
  return {
      "long_over_shortest_solution": ratio,
      "long_over_shortest_solution_met": ratio >= LONG_OVER_SHORTEST,
      "best_method": best,
      "best_pass_at_1_gap": long["pass_at_1"] - rec["pass_at_1"],
      "best_token_ratio": token_ratio(rec),
      "best_beats_short_baseline": rec["pass_at_1"] > short["pass_at_1"],
      "methods_meeting": sorted(meeting),
      "met": ratio >= LONG_OVER_SHORTEST and bool(meeting),
  }


_LABELS = {"long": "long-CoT", "short_baseline": "short-only baseline",
           "merge": "merge", "shortest_rs": "shortest RS", "dpo": "DPO",
           "l2s_rl": "long2short RL"}


def label_offsets(points: Mapping[str, tuple[float, float]],
                  xlim: tuple[float, float], ylim: tuple[float, float]
                  ) -> dict[str, tuple[float, float]]:
  """Text offsets (points) for point labels, so close methods (e.g. three
  at the same pass@1 and length) stay readable: right of the point, else
  left of it (a negative x offset: right-aligned text), else further down
  in 12-point steps. Highest pass@1 first."""
  span_x, span_y = xlim[1] - xlim[0], ylim[1] - ylim[0]
  # Boxes in axes fractions: the axes are about 400 x 250 points, a label
  # about 90 x 11.
  placed: list[tuple[float, float, float, float]] = []

  dots = [((x - xlim[0]) / span_x, (y - ylim[0]) / span_y)
          for x, y in points.values()]

  def free(x0: float, y0: float, own: tuple[float, float]) -> bool:
    """No placed label and no other point inside the box at (x0, y0)."""
    return all(abs(x0 - px) > 0.22 or abs(y0 - py) > 0.045
               for px, py, _, _ in placed) and all(
                   not (0 < qx - x0 < 0.22 and abs(qy - y0) < 0.03)
                   for qx, qy in dots if (qx, qy) != own)

  out = {}
  for name, (x, y) in sorted(points.items(), key=lambda kv: -kv[1][1]):
    here = ((x - xlim[0]) / span_x, (y - ylim[0]) / span_y)
    for dy in (4.0, -8.0, -20.0, -32.0):
      right = (here[0] + 6 / 400, here[1] + dy / 250)
      left = (here[0] - 6 / 400 - 0.22, here[1] + dy / 250)
      if free(*right, here):
        offset, box = (6.0, dy), right
        break
      if free(*left, here):
        offset, box = (-6.0, dy), left
        break
    else:
      offset, box = (6.0, 4.0), right
    placed.append((*box, *offset))
    out[name] = offset
  return out


def plot_token_efficiency(methods: Mapping[str, Mapping[str, Any]],
                          path: str, *, title: str = "") -> str:
  """Pass@1 against mean response tokens, one point per method (the shape
  of the report's Figure 7); the long model and the short-only baseline
  are drawn apart, the target region (pass@1 within 0.02 of the long
  model, at most 0.6x its tokens) shaded."""
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt

  fig, ax = plt.subplots(figsize=(6.4, 4.4))
  long = methods["long"]
  ax.fill_between([0, TOKEN_RATIO * long["mean_tokens"]],
                  long["pass_at_1"] - PASS_GAP, 1.0, color="tab:green",
                  alpha=0.08, label="target region")
  for name, rec in methods.items():
    x, y = rec["mean_tokens"], rec["pass_at_1"]
    if name == "long":
      style = dict(marker="s", s=90, color="tab:blue", zorder=3)
    elif name == "short_baseline":
      style = dict(marker="^", s=90, color="tab:gray", zorder=3)
    else:
      style = dict(marker="o", s=60, color="tab:orange", zorder=3)
    ax.scatter([x], [y], **style)
  xs = [r["mean_tokens"] for r in methods.values()]
  ys = [r["pass_at_1"] for r in methods.values()]
  ax.set_xlim(0, max(xs) * 1.15)
  ax.set_ylim(max(0.0, min(ys) - 0.05), max(ys) + 0.06)
  points = {name: (rec["mean_tokens"], rec["pass_at_1"])
            for name, rec in methods.items()}
  for name, offset in label_offsets(points, ax.get_xlim(),
                                    ax.get_ylim()).items():
    ax.annotate(_LABELS.get(name, name), points[name],
                textcoords="offset points", xytext=offset, fontsize=9,
                ha="left" if offset[0] > 0 else "right",
                arrowprops=(dict(arrowstyle="-", lw=0.5, color="0.5")
                            if offset[1] < 0 else None))
  ax.set_xlabel("mean response tokens (held-out)")
  ax.set_ylabel("pass@1 (held-out)")
  ax.set_title(title or "token efficiency of long2short methods")
  ax.grid(alpha=0.3)
  ax.legend(loc="lower right", fontsize=8)
  fig.tight_layout()
  fig.savefig(path, dpi=120)
  plt.close(fig)
  return path
