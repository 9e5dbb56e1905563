"""A loop of jitted train steps that a rerun continues after a kill.

The reward models' trainings (value head, CoT SFT) are plain loops: draw a
batch, place it, step. `run_steps` is that loop, with the step's metrics
read one step late (the host builds the next batch while the device
works), and, given a `Progress`, an Orbax checkpoint of the parameters, the
optimizer state and the batch stream's position every `every` steps and at
the last. A rerun with the same `Progress.key` (a digest of everything the
training depends on) restores the newest checkpoint and continues from its
step, so it ends at the parameters of an uninterrupted run; a checkpoint of
another key is deleted and training starts over.

The batch stream must offer `get_state()` / `set_state(state)` (JSON);
`Cycle` makes one of a list of batches.
"""

from __future__ import annotations

import dataclasses
import shutil
from typing import Any, Callable, Iterator

import jax
import numpy as np

from kimi_jax import train_step as ts
from kimi_jax.infra import console
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra.console import log
from kimi_jax.sharding import Sharder, place_batch


@dataclasses.dataclass(frozen=True)
class Progress:
  """Where a loop keeps its checkpoints, and for which inputs."""

  directory: str
  key: str
  every: int = 100

  def __post_init__(self):
    if self.every < 1:
      raise ValueError(f"Progress.every must be >= 1, got {self.every}")


class Cycle:
  """The batches of a list, round and round; its state is the count drawn."""

  def __init__(self, batches: list[Any]):
    if not batches:
      raise ValueError("Cycle needs at least one batch")
    self.batches, self.position = batches, 0

  def __iter__(self):
    return self

  def __next__(self) -> Any:
    batch = self.batches[self.position % len(self.batches)]
    self.position += 1
    return batch

  def get_state(self) -> dict[str, int]:
    return {"position": self.position, "size": len(self.batches)}

  def set_state(self, state: dict[str, int]) -> None:
    if int(state["size"]) != len(self.batches):
      raise ValueError(f"the checkpoint's stream had {state['size']} "
                       f"batches, this one {len(self.batches)}")
    self.position = int(state["position"])


def peek(batches: Any) -> Any:
  """The stream's next batch, the stream left where it was (the step is
  compiled for that batch's shape before the loop draws it)."""
  start = batches.get_state()
  first = next(batches)
  batches.set_state(start)
  return first


def settings_key(section: Any) -> dict[str, Any]:
  """A config section (dataclass) for a `Progress.key`, without its
  `checkpoint_every`: that says where progress is saved, not what."""
  out = dataclasses.asdict(section)
  del out["checkpoint_every"]
  return out


def final_loss(history: list[dict[str, float]]) -> float | None:
  """The last step's loss in a loop's metrics; None when a rerun found
  every step done and ran none."""
  return history[-1]["loss"] if history else None


def discard(directory: str) -> None:
  """Removes a loop's checkpoints. Every process calls it: process 0
  deletes (they share the path) and the others wait for it, so none opens
  the directory while it goes."""
  if jax.process_index() == 0:
    shutil.rmtree(directory, ignore_errors=True)
  if jax.process_count() > 1:
    from jax.experimental import multihost_utils
    multihost_utils.sync_global_devices(f"discard {directory}")


def _restore(progress: Progress, state: ts.TrainState, shardings: ts.TrainState,
             batches: Any, what: str) -> tuple[ts.TrainState, int]:
  """(state, first step): the newest checkpoint of `progress.key`, else the
  given state at step 0 (a stale directory is removed)."""
  checkpointer = ckpt_lib.Checkpointer(progress.directory, max_to_keep=1)
  try:
    step = checkpointer.latest_step()
    host = checkpointer.restore_host(step) if step is not None else {}
    if step is not None and host.get("key") == progress.key:
      params, opt_state, _ = checkpointer.restore(
          step, params_like=state.params, params_shardings=shardings.params,
          opt_state_like=state.opt_state,
          opt_state_shardings=shardings.opt_state)
      batches.set_state(host["batches"])
      log(f"{what}: resumed at step {step} from {progress.directory}")
      return state.replace(
          step=jax.device_put(np.int32(step), shardings.step),
          params=params, opt_state=opt_state), step
  finally:
    checkpointer.close()
  discard(progress.directory)  # another run's progress, if any
  return state, 0


def run_steps(step_fn: Callable, state: ts.TrainState, batches: Iterator,
              steps: int, *, sharder: Sharder, shardings: ts.TrainState,
              read: Callable[[int, Any, Any], None],
              progress: Progress | None = None, what: str = "train",
              convert: Callable[[Any], Any] = lambda batch: batch,
              bar: bool = False) -> ts.TrainState:
  """`steps` steps of `step_fn(state, placed batch)` over `batches`, each
  batch passed through `convert` before it is placed; `bar`: a progress
  bar on stderr.

  read(step, device metrics, info) is called for every step in order, one
  step late; info is the stream's `epoch` attribute at that step, if it has
  one. With `progress`, resumes from and saves checkpoints (module doc).
  """
  start = 0
  if progress is not None:
    state, start = _restore(progress, state, shardings, batches, what)
  checkpointer = (ckpt_lib.Checkpointer(progress.directory, max_to_keep=1)
                  if progress is not None else None)
  pending = None
  try:
    for step in console.progress(range(start, steps), steps, what, bar,
                                 initial=start):
      state, metrics = step_fn(state, place_batch(sharder,
                                                  convert(next(batches))))
      if pending is not None:
        read(*pending)
      pending = (step, metrics, getattr(batches, "epoch", None))
      done = step + 1
      if checkpointer is not None and (done % progress.every == 0
                                       or done == steps):
        # Read first: a step whose loss is not finite raises before its
        # state can be saved as progress.
        read(*pending)
        pending = None
        checkpointer.save(done, params=state.params,
                          opt_state=state.opt_state,
                          host={"key": progress.key,
                                "batches": batches.get_state()})
    if pending is not None:
      read(*pending)
  finally:
    if checkpointer is not None:
      checkpointer.close()
  return state
