"""Seeded, resumable record order over a Grain data source.

`RecordIterator` walks `grain.MapDataset.source(src).shuffle(seed).repeat()`:
every epoch is a fresh permutation of the source (Grain seeds epoch e with
seed + e), and item i of the stream is a pure function of (seed, i). So the
iterator's whole state is its position, saved as JSON in the checkpoint's
host state (`get_state`) and restored with `set_state`; a restored iterator
continues exactly where the saved one was. The state also records the seed
and the source size, so resuming against a different file is an error
rather than a silent reshuffle.
"""

from __future__ import annotations

from typing import Any, Mapping

import grain

from kimi_jax.data.records import DataError


def shuffled(source: Any, seed: int) -> grain.MapDataset:
  """The source reshuffled every epoch, repeated forever (random access)."""
  if len(source) == 0:
    raise DataError(f"{source!r}: no records to shuffle")
  return grain.MapDataset.source(source).shuffle(seed=seed).repeat()


class RecordIterator:
  """Records of `source` in a seeded, per-epoch shuffled order, resumable."""

  def __init__(self, source: Any, seed: int):
    self.source = source
    self.seed = int(seed)
    self.size = len(source)
    self._dataset = shuffled(source, self.seed)
    self.position = 0

  def __iter__(self) -> "RecordIterator":
    return self

  def __next__(self) -> Any:
    item = self._dataset[self.position]
    self.position += 1
    return item

  @property
  def epoch(self) -> int:
    return self.position // self.size

  def get_state(self) -> dict[str, int]:
    """JSON-serialisable state for the checkpoint."""
    return {"position": self.position, "seed": self.seed, "size": self.size}

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(state, self.seed, self.size, what=repr(self.source))
    self.position = int(state["position"])


def check_state(state: Mapping[str, Any], seed: int, size: int, *,
                what: str) -> None:
  """Raises DataError unless `state` was saved for this seed and size."""
  missing = sorted({"position", "seed", "size"} - set(state))
  if missing:
    raise DataError(f"{what}: iterator state lacks {missing}: {dict(state)}")
  if int(state["seed"]) != seed or int(state["size"]) != size:
    raise DataError(
        f"{what}: the checkpoint's data iterator was saved for seed "
        f"{state['seed']} over {state['size']} records, but this run has seed "
        f"{seed} over {size}; the data or the seed changed since the "
        f"checkpoint")
  if int(state["position"]) < 0:
    raise DataError(f"{what}: negative iterator position {state['position']}")
