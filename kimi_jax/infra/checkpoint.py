"""Orbax checkpoints: everything a resumed run needs, in one atomic step.

A step holds three items: `params` and `opt_state` (sharded arrays, restored
straight into the shardings the caller asks for) and `host` (JSON: iteration,
RNG seeds, prompt-sampler statistics, the replay buffer, the ledger of
trained groups). Orbax writes a step to a temporary directory and renames it
when complete, so a run killed mid-save leaves the previous step intact.
Paths may be local or `gs://...` (tensorstore).
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any

import jax
import orbax.checkpoint as ocp
from absl import logging as absl_logging


@dataclasses.dataclass(frozen=True)
class CheckpointConfig:
  """`config.checkpoint`: save every N RL iterations (and at the end),
  keep the newest `max_to_keep` steps."""

  every_iterations: int = 1
  max_to_keep: int = 2

  def __post_init__(self):
    if self.every_iterations <= 0:
      raise ValueError(f"config.checkpoint.every_iterations must be "
                       f"positive, got {self.every_iterations}")
    if self.max_to_keep <= 0:
      raise ValueError(f"config.checkpoint.max_to_keep must be positive, got "
                       f"{self.max_to_keep}")


def _abstract(tree: Any, shardings: Any) -> Any:
  return jax.tree.map(
      lambda x, s: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=s), tree,
      shardings)


class Checkpointer:
  """Saves and restores (params, opt_state, host_state) steps."""

  def __init__(self, directory: str, *, max_to_keep: int | None = 2):
    if "://" not in directory:
      directory = os.path.abspath(directory)
    self.directory = directory
    self._manager = ocp.CheckpointManager(
        directory,
        options=ocp.CheckpointManagerOptions(max_to_keep=max_to_keep,
                                             create=True),
        item_names=("params", "opt_state", "host"))

  def latest_step(self) -> int | None:
    return self._manager.latest_step()

  def all_steps(self) -> list[int]:
    return list(self._manager.all_steps())

  def save(self, step: int, *, params: Any, host: dict,
           opt_state: Any = None) -> None:
    """Blocks until the step is durable (a kill after this loses nothing)."""
    items = {"params": ocp.args.StandardSave(params),
             "host": ocp.args.JsonSave(host)}
    if opt_state is not None:
      items["opt_state"] = ocp.args.StandardSave(opt_state)
    self._manager.save(step, args=ocp.args.Composite(**items), force=True)
    self._manager.wait_until_finished()

  def restore(self, step: int | None = None, *, params_like: Any,
              params_shardings: Any, opt_state_like: Any = None,
              opt_state_shardings: Any = None
              ) -> tuple[Any, Any, dict]:
    """Restores into the given shardings. `*_like` may be abstract arrays."""
    step = self.latest_step() if step is None else step
    if step is None:
      raise FileNotFoundError(f"no checkpoint in {self.directory}")
    items = {"params": ocp.args.StandardRestore(
        _abstract(params_like, params_shardings)),
             "host": ocp.args.JsonRestore()}
    want_opt = opt_state_like is not None and "opt_state" in (
        self._item_names(step))
    if want_opt:
      items["opt_state"] = ocp.args.StandardRestore(
          _abstract(opt_state_like, opt_state_shardings))
    out = self._manager.restore(step, args=ocp.args.Composite(**items))
    return out["params"], (out["opt_state"] if want_opt else None), dict(
        out["host"])

  def _item_names(self, step: int) -> set[str]:
    """The items saved at `step`. Orbax warns that each array item "could
    not be restored" when only its metadata is read; that is all we ask,
    so the warnings are held back."""
    level = absl_logging.get_verbosity()
    absl_logging.set_verbosity(absl_logging.ERROR)
    try:
      return set(self._manager.item_metadata(step) or {})
    finally:
      absl_logging.set_verbosity(level)

  def restore_host(self, step: int | None = None) -> dict:
    step = self.latest_step() if step is None else step
    out = self._manager.restore(
        step, args=ocp.args.Composite(host=ocp.args.JsonRestore()))
    return dict(out["host"])

  def close(self) -> None:
    self._manager.close()
