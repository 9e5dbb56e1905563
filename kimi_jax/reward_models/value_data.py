"""Reward-model inputs packed into rows, one score read per sequence.

A unit is one input (binary loss, scoring) or a (chosen, rejected) pair
(Bradley-Terry: both members always land in the same batch). `pack_units`
places the units' sequences first-fit, in order, into R rows of T
positions: each sequence of n tokens takes n positions (every token is an
input; its score is read at its last one), gets its own segment id and
positions restarting at 0, and packing stops at the first unit that fits
no row (it starts the next batch). `ValueBatches` streams shuffled,
repeated batches of the training units.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Iterator, Mapping, Sequence

import numpy as np

from kimi_jax.data.sources import check_state
from kimi_jax.reward_models.value_model import ValueBatch
from kimi_jax.token_rows import empty_rows


@dataclasses.dataclass(frozen=True)
class Scored:
  """One input: its ids and label (1 correct / 0 incorrect)."""

  ids: tuple[int, ...]
  label: bool


# A unit: one Scored, or two (chosen, rejected) that form a pair.
Unit = tuple[Scored, ...]


def pack_units(units: Sequence[Unit], n_rows: int, row_len: int,
               pad_id: int) -> tuple[ValueBatch, list[tuple[int, int]], int]:
  """(batch, (row, last position) of every placed sequence in order, units
  placed). Pairs get ids 1, 2, ... in this batch."""
  rows = empty_rows(n_rows, row_len, pad_id)
  label = np.zeros((n_rows, row_len), np.float32)
  pair = np.zeros((n_rows, row_len), np.int32)
  used = np.zeros(n_rows, np.int64)
  segments = np.zeros(n_rows, np.int32)
  where: list[tuple[int, int]] = []
  placed = 0
  for unit in units:
    plan, trial = [], used.copy()
    for seq in unit:
      n = len(seq.ids)
      if n > row_len:
        raise ValueError(f"an input of {n} tokens exceeds the row length "
                         f"{row_len}; raise the row length or lower the "
                         f"template's max_input_len")
      room = np.flatnonzero(trial + n <= row_len)
      if not len(room):
        break
      plan.append((room[0], trial[room[0]]))
      trial[room[0]] += n
    if len(plan) < len(unit):
      break
    placed += 1
    pair_id = placed if len(unit) == 2 else 0
    for seq, (r, start) in zip(unit, plan):
      n = len(seq.ids)
      span = slice(start, start + n)
      segments[r] += 1
      rows.tokens_RxT[r, span] = seq.ids
      rows.positions_RxT[r, span] = np.arange(n)
      rows.segment_ids_RxT[r, span] = segments[r]
      rows.mask_RxT[r, start + n - 1] = 1.0
      label[r, start + n - 1] = float(seq.label)
      pair[r, start + n - 1] = pair_id
      where.append((int(r), int(start + n - 1)))
    used = trial
  return ValueBatch(rows=rows, label_RxT=label, pair_RxT=pair), where, placed


def pairs(scored: Sequence[Scored], groups: Sequence[str], seed: int
          ) -> list[Unit]:
  """Bradley-Terry units: within each group (responses to one prompt), the
  correct and incorrect responses matched one to one in a seeded order;
  groups with only one kind give no pair."""
  rng = np.random.default_rng([seed, 3])
  by_group: dict[str, list[int]] = {}
  for i, g in enumerate(groups):
    by_group.setdefault(g, []).append(i)
  out: list[Unit] = []
  for g in sorted(by_group):
    idx = by_group[g]
    good = [i for i in idx if scored[i].label]
    bad = [i for i in idx if not scored[i].label]
    rng.shuffle(good)
    rng.shuffle(bad)
    out.extend((scored[c], scored[r]) for c, r in zip(good, bad))
  return out


class ValueBatches:
  """Batches of packed units, shuffled afresh every pass over the data."""

  def __init__(self, units: Sequence[Unit], *, n_rows: int, row_len: int,
               pad_id: int, seed: int):
    if not units:
      raise ValueError("no training units for the value model")
    self.units, self.n_rows, self.row_len, self.pad_id = (
        list(units), n_rows, row_len, pad_id)
    self.seed = seed
    self._epoch, self._order, self._pos = 0, self._shuffle(0), 0

  def _shuffle(self, epoch: int) -> list[int]:
    return list(np.random.default_rng([self.seed, epoch]).permutation(
        len(self.units)))

  def __iter__(self) -> Iterator[ValueBatch]:
    return self

  def __next__(self) -> ValueBatch:
    if self._pos >= len(self._order):
      self._epoch += 1
      self._order, self._pos = self._shuffle(self._epoch), 0
    todo = [self.units[i] for i in self._order[self._pos:]]
    batch, _, placed = pack_units(todo, self.n_rows, self.row_len,
                                  self.pad_id)
    if placed == 0:
      raise ValueError(f"a unit does not fit {self.n_rows} rows of "
                       f"{self.row_len}")
    self._pos += placed
    return batch

  @property
  def epoch(self) -> float:
    return self._epoch + self._pos / len(self._order)

  def get_state(self) -> dict[str, int]:
    """The stream's position in units drawn (an epoch is len(units)), for
    checkpoints (`kimi_jax.step_loop`)."""
    return {"position": self._epoch * len(self.units) + self._pos,
            "seed": self.seed, "size": len(self.units)}

  def set_state(self, state: Mapping[str, Any]) -> None:
    check_state(state, self.seed, len(self.units), what="value RM units")
    self._epoch, self._pos = divmod(int(state["position"]), len(self.units))
    self._order = self._shuffle(self._epoch)
