"""The markdown tables of an ablation's results: one row per arm, and per
difficulty level for runs that evaluate by level; mean ± std over seeds,
and paired differences as mean ± standard error."""

from __future__ import annotations

from typing import Any, Mapping


def fmt_stat(stat: Mapping[str, Any], digits: int, spread: str = "std") -> str:
  std = stat.get(spread)
  return (f"{stat['mean']:.{digits}f} ± {std:.{digits}f}" if std is not None
          else f"{stat['mean']:.{digits}f}")


def fmt_signed(stat: Mapping[str, Any], digits: int, spread: str = "std"
            ) -> str:
  return ("+" if stat["mean"] >= 0 else "") + fmt_stat(stat, digits, spread)


def _curve_at(curve: Mapping[str, Any] | None, step: int
              ) -> Mapping[str, Any] | None:
  if not curve or step not in curve["steps"]:
    return None
  i = curve["steps"].index(step)
  return {"mean": curve["mean"][i], "std": curve["std"][i]}


def markdown_table(results: Mapping[str, Any], early_step: int | None = None
                   ) -> str:
  """One row per arm: its settings and the final metrics, mean ± std;
  `early_step` adds pass@1 at that iteration (how fast it learns): held
  out, or validation when the runs have it (their periodic evaluations
  read it); left out when no run evaluated there. The paired difference
  to the first arm, mean ± standard error, follows the final pass@1."""
  arms = results["arms"]
  reference = next(iter(arms))
  val = any(a.get("final_val") for a in arms.values())
  early_key = "val/pass_at_1" if val else "eval/pass_at_1"
  early = ({arm: _curve_at(a["curves"].get(early_key), early_step)
            for arm, a in arms.items() if a["n_seeds"]}
           if early_step is not None else {})
  if not any(early.values()):
    early_step = None  # no run evaluated at that iteration: no empty column
  head = ["arm", "settings", "seeds"]
  if early_step is not None:
    head.append(f"{'validation ' if val else ''}pass@1 at iteration "
                f"{early_step}")
  warm = any(a.get("gain") for a in arms.values())
  if warm:
    head.append("warm-start pass@1")
  head.append("final held-out pass@1")
  if warm:
    head.append("gain (final - warm start)")
  head += [f"Δ pass@1 vs {reference} (paired, ± s.e.)", "greedy accuracy",
           "mean response tokens"]
  if val:
    head.append("final validation pass@1")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for arm, a in arms.items():
    if not a["n_seeds"]:
      lines.append(f"| {arm} | | 0 |" + " |" * (len(head) - 3))
      continue
    settings = ", ".join(f"`{k}={v}`" for k, v in a["overrides"].items()
                         ) or "(base)"
    f = a["final"]
    cells = [arm, settings, str(a["n_seeds"])]
    if early_step is not None:
      cells.append(fmt_stat(early[arm], 3) if early[arm] else "")
    paired = a.get("vs_reference")
    if warm:
      cells.append(fmt_stat(a["warm_start"]["pass_at_1"], 3)
                   if a.get("gain") else "")
    cells.append(fmt_stat(f["pass_at_1"], 3))
    if warm:
      cells.append(fmt_signed(a["gain"], 3) if a.get("gain") else "")
    cells += [fmt_signed(paired["pass_at_1"], 3, "sem") if paired else "—",
              fmt_stat(f["greedy_accuracy"], 3), fmt_stat(f["mean_length"], 1)]
    if val:
      cells.append(fmt_stat(a["final_val"]["pass_at_1"], 3)
                   if a.get("final_val") else "")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


def markdown_levels(levels: Mapping[str, Any], split: str = "held_out"
                    ) -> str:
  """One row per level (an arm's `by_difficulty`): pass@1 and mean
  response tokens before and after RL with their per-seed changes."""
  head = ("level", "pass@1 before RL", "after", "change",
          "mean tokens before RL", "after", "change")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for level, row in levels[split].items():
    p, n = row["pass_at_1"], row["mean_length"]
    lines.append("| " + " | ".join((
        level, fmt_stat(p["before"], 3), fmt_stat(p["after"], 3),
        fmt_signed(p["change"], 3), fmt_stat(n["before"], 1),
        fmt_stat(n["after"], 1),
        fmt_signed(n["change"], 1))) + " |")
  return "\n".join(lines)
