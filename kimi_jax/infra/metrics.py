"""Run metrics: JSONL and TensorBoard event files (and Weights & Biases,
when `metrics.wandb_project` is set: wandb_log.py) while running, PNG plots
at the end. Only process 0 writes; other processes get a writer that does
nothing, so callers need no `if process_index == 0` branches.
"""

from __future__ import annotations

import dataclasses
import json
import math
import os
from typing import Any, Iterable, Mapping, Sequence

import numpy as np


@dataclasses.dataclass(frozen=True)
class LogConfig:
  """`config.log`: progress bars on stderr; PNG plots at the end of a run."""

  progress: bool = True
  plots: bool = True


# (panel title, metric keys) of each stage's plot.
RL_PANELS = (
    ("reward", ("reward", "task_reward")),
    ("accuracy", ("accuracy",)),
    ("response length (tokens)", ("length_mean", "length_p95")),
    ("partial rollouts", ("frac_partial", "frac_budget_stopped")),
    ("length-reward weight", ("length_reward_weight",)),
    ("loss", ("loss",)),
    ("grad norm", ("grad_norm",)),
    ("tokens/s", ("rollout_tokens_per_s", "train_tokens_per_s")),
    ("handoff seconds", ("handoff_s",)),
)
EVAL_PANELS = (("pass@1 and greedy accuracy",
                ("pass_at_1", "greedy_accuracy")),
               ("response length", ("mean_length",)))
SFT_PANELS = (("loss", ("loss",)),)


def _scalar(v) -> float | None:
  try:
    f = float(np.asarray(v))
  except (TypeError, ValueError):
    return None
  return f


class MetricsWriter:
  """Appends one JSON line per record and mirrors scalars to TensorBoard."""

  def __init__(self, workdir: str, *, enabled: bool = True,
               filename: str = "metrics.jsonl", wandb: Any = None,
               run_config: Mapping[str, Any] | None = None):
    """wandb: a `wandb_log.MetricsConfig`; with a project, scalars go to
    that W&B project too (run_config: the experiment, shown there)."""
    self.enabled = enabled
    self.path = os.path.join(workdir, filename)
    self._tb = None
    self._wandb = None
    if enabled:
      os.makedirs(workdir, exist_ok=True)
      from tensorboardX import SummaryWriter  # lazy: heavy import
      self._tb = SummaryWriter(os.path.join(workdir, "tensorboard"))
      if wandb is not None and wandb.wandb_project:
        from kimi_jax.infra.wandb_log import WandbSink  # optional wandb
        self._wandb = WandbSink(wandb, workdir, run_config)

  def write(self, step: int, stage: str, values: Mapping[str, object]
            ) -> dict:
    record = {"stage": stage, "step": int(step)}
    for k, v in values.items():
      f = _scalar(v)
      record[k] = v if f is None else f
    if not self.enabled:
      return record
    with open(self.path, "a") as f:
      f.write(json.dumps(record, allow_nan=True) + "\n")
      f.flush()
    scalars = {k: v for k, v in record.items()
               if isinstance(v, float) and math.isfinite(v)}
    for k, v in scalars.items():
      self._tb.add_scalar(f"{stage}/{k}", v, step)
    self._tb.flush()
    if self._wandb is not None:
      self._wandb.log(stage, step, scalars)
    return record

  def close(self) -> None:
    if self._tb is not None:
      self._tb.close()
    if self._wandb is not None:
      self._wandb.close()
      self._wandb = None


def drop_after(path: str, stage_limits: Mapping[str, int]) -> int:
  """Rewrites the JSONL without rows past a resumed checkpoint.

  stage_limits maps a stage to the last step the checkpoint covers; rows of
  that stage with a larger step (and rows of stages not listed, which came
  after the checkpoint) are dropped so a resumed run does not log them
  twice. Returns how many rows were dropped.
  """
  rows = read_jsonl(path)
  keep = [r for r in rows if r.get("stage") in stage_limits and
          r.get("step", 0) <= stage_limits[r["stage"]]]
  if len(keep) != len(rows):
    with open(path + ".tmp", "w") as f:
      for r in keep:
        f.write(json.dumps(r, allow_nan=True) + "\n")
    os.replace(path + ".tmp", path)
  return len(rows) - len(keep)


def read_jsonl(path: str) -> list[dict]:
  """Reads metrics back; a torn last line (killed mid-write) is skipped."""
  if not os.path.exists(path):
    return []
  out = []
  with open(path) as f:
    for line in f:
      try:
        out.append(json.loads(line))
      except json.JSONDecodeError:
        continue
  return out


def plot_curves(records: Sequence[dict], stage: str,
                panels: Iterable[tuple[str, Sequence[str]]], path: str,
                title: str = "") -> str | None:
  """One PNG with a subplot per (title, metric keys) panel."""
  rows = [r for r in records if r.get("stage") == stage]
  panels = [(t, [k for k in keys if any(k in r for r in rows)])
            for t, keys in panels]
  panels = [(t, keys) for t, keys in panels if keys]
  if not rows or not panels:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  cols = min(3, len(panels))
  nrows = math.ceil(len(panels) / cols)
  fig, axes = plt.subplots(nrows, cols, figsize=(5 * cols, 3.4 * nrows),
                           squeeze=False)
  for ax, (panel_title, keys) in zip(axes.flat, panels):
    for k in keys:
      pts = [(r["step"], r[k]) for r in rows
             if isinstance(r.get(k), (int, float))]
      if pts:
        xs, ys = zip(*pts)
        ax.plot(xs, ys, marker="." if len(xs) < 40 else None, label=k)
    ax.set_title(panel_title)
    ax.set_xlabel("iteration" if stage == "rl" else "step")
    ax.grid(alpha=0.3)
    if len(keys) > 1:
      ax.legend(fontsize=8)
  for ax in list(axes.flat)[len(panels):]:
    ax.axis("off")
  if title:
    fig.suptitle(title)
  fig.tight_layout()
  fig.savefig(path, dpi=110)
  plt.close(fig)
  return path


def with_task_keys(records: Sequence[dict], limit: int = 8
                   ) -> tuple[list[dict], tuple[str, ...]]:
  """Records with each `pass_at_1_by_task` entry also as a flat key
  `pass_at_1[task]` (plots take scalars), and those keys: the `limit` tasks
  seen first, so a set with many tags keeps a readable panel."""
  keys: list[str] = []
  out = []
  for r in records:
    tasks = r.get("pass_at_1_by_task")
    if isinstance(tasks, dict):
      r = dict(r, **{f"pass_at_1[{t}]": v for t, v in tasks.items()})
      keys += [f"pass_at_1[{t}]" for t in tasks
               if f"pass_at_1[{t}]" not in keys]
    out.append(r)
  return out, tuple(keys[:limit])


def plot_run(metrics_path: str, out_dir: str) -> list[str]:
  """rl_curves.png, eval_curves.png, val_curves.png and sft_curves.png of a
  run's JSONL; returns the paths written (a stage with no rows has no
  plot)."""
  records, by_task = with_task_keys(read_jsonl(metrics_path))
  eval_panels = EVAL_PANELS + ((("pass@1 by task", by_task),) if by_task
                               else ())
  plots = (("rl", RL_PANELS, "rl_curves.png", "Kimi k1.5 RL"),
           ("eval", eval_panels, "eval_curves.png", "held-out evaluation"),
           ("val", eval_panels, "val_curves.png", "validation"),
           ("sft", SFT_PANELS, "sft_curves.png", "warm start"))
  written = [plot_curves(records, stage, panels, os.path.join(out_dir, name),
                         title) for stage, panels, name, title in plots]
  return [p for p in written if p]
