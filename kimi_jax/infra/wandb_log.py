"""Weights & Biases as a third metrics sink, beside JSONL and TensorBoard.

Off unless `metrics.wandb_project` names a project. Each stage's scalars go
to `<stage>/<key>` against that stage's own step (`<stage>/step`: SFT steps
and RL iterations count apart), so rows of every stage can be logged in any
order. The run id is kept in WORKDIR/wandb_run_id: a resumed job continues
the same W&B run. WANDB_MODE=offline keeps everything in WORKDIR/wandb/
(`wandb sync` uploads it later). `wandb` is an optional dependency
(requirements-wandb.txt).
"""

from __future__ import annotations

import dataclasses
import os
import secrets
from typing import Any, Mapping

from kimi_jax.infra.config import ConfigError

RUN_ID_FILE = "wandb_run_id"


@dataclasses.dataclass(frozen=True)
class MetricsConfig:
  """`config.metrics`: wandb_project ('' off), wandb_name (the run's name
  in W&B; '' lets W&B choose), wandb_entity ('' the account's default)."""

  wandb_project: str = ""
  wandb_name: str = ""
  wandb_entity: str = ""


class WandbSink:
  """One W&B run per workdir (see the module doc)."""

  def __init__(self, cfg: MetricsConfig, workdir: str,
               run_config: Mapping[str, Any] | None = None):
    try:
      import wandb
    except ImportError:
      raise ConfigError("config.metrics.wandb_project is set but the wandb "
                        "package is not installed: pip install -r "
                        "requirements-wandb.txt") from None
    path = os.path.join(workdir, RUN_ID_FILE)
    if os.path.exists(path):
      with open(path) as f:
        run_id = f.read().strip()
    else:
      run_id = secrets.token_hex(6)  # W&B ids: lowercase letters, digits
      with open(path, "w") as f:
        f.write(run_id + "\n")
    self._run = wandb.init(
        project=cfg.wandb_project, entity=cfg.wandb_entity or None,
        name=cfg.wandb_name or None, id=run_id, resume="allow",
        dir=workdir, config=dict(run_config or {}))
    self._stages: set[str] = set()

  def log(self, stage: str, step: int, scalars: Mapping[str, float]) -> None:
    if stage not in self._stages:
      self._run.define_metric(f"{stage}/step")
      self._run.define_metric(f"{stage}/*", step_metric=f"{stage}/step")
      self._stages.add(stage)
    row = {f"{stage}/{k}": v for k, v in scalars.items()}
    row[f"{stage}/step"] = int(step)
    self._run.log(row)

  def close(self) -> None:
    self._run.finish()
