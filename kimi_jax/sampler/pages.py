"""The host side of a paged KV cache: which pool pages each slot holds.

The device keeps one pool of `n_pages` pages of `page_size` cache entries
per full-attention layer (`kimi_jax.model.decode`); a slot's entries
0, 1, ... live in the pages its row of `table` names, in order. Pages are
taken from a shared free list when a slot needs them (its prompt at
insert, the tokens of the next decode call before it) and go back when
the slot is freed: the pool holds what is live, not slots x cache_len.

A page id equal to the pool's size means "none": the device drops writes
to it and masks reads of it.
"""

from __future__ import annotations

import math

import jax
import numpy as np


class PoolExhausted(RuntimeError):
  """The pool has fewer free pages than a slot needs."""


class PageTable:
  """Free lists and per-slot page lists of one decode state.

  On a mesh the pool splits into `n_shards` equal parts over the batch
  axes, as the slots do: slot b (of shard b // (n_slots / n_shards)) takes
  pages of its shard's part only, and `table` holds ids local to that part
  (0 .. n_pages / n_shards - 1; that size itself means "none").
  """

  def __init__(self, n_pages: int, page_size: int, n_slots: int,
               pages_per_slot: int, n_shards: int = 1):
    if n_pages % n_shards or n_slots % n_shards:
      raise ValueError(f"sampler.kv_pages ({n_pages}) and sampler.max_slots "
                       f"({n_slots}) must divide over the {n_shards} shards "
                       f"of the batch mesh axes")
    self.n_pages = n_pages
    self.page_size = page_size
    self.n_shards = n_shards
    self.local_pages = n_pages // n_shards
    self.shard_of = np.arange(n_slots) // (n_slots // n_shards)
    self.table = np.full((n_slots, pages_per_slot), self.local_pages,
                         np.int32)
    self.held = np.zeros((n_slots,), np.int64)
    # Stacks: the most recently freed page is reused first.
    self._free = [list(range(self.local_pages - 1, -1, -1))
                  for _ in range(n_shards)]
    self.peak = 0  # most pages held at once, all shards

  @property
  def free_pages(self) -> int:
    return sum(len(f) for f in self._free)

  def free_per_shard(self) -> np.ndarray:
    return np.asarray([len(f) for f in self._free], np.int64)

  def pages_for(self, n_tokens) -> np.ndarray | int:
    """Pages that hold n_tokens entries."""
    return -(-np.asarray(n_tokens) // self.page_size) if np.ndim(
        n_tokens) else math.ceil(n_tokens / self.page_size)

  def extra_per_shard(self, slots, n_tokens) -> np.ndarray:
    """Pages each shard's `slots` must take to hold n_tokens entries each."""
    slots = np.asarray(slots, np.int64)
    want = np.minimum(self.pages_for(np.asarray(n_tokens, np.int64)),
                      self.table.shape[1])
    need = np.maximum(want - self.held[slots], 0)
    return np.bincount(self.shard_of[slots], weights=need,
                       minlength=self.n_shards).astype(np.int64)

  def extra(self, slots, n_tokens) -> int:
    """Pages `slots` must take to hold n_tokens entries each."""
    return int(self.extra_per_shard(slots, n_tokens).sum())

  def shortfall(self, slots, n_tokens) -> int:
    """Pages missing to grow each of `slots` to hold n_tokens entries (0:
    every shard's free list suffices)."""
    short = self.extra_per_shard(slots, n_tokens) - self.free_per_shard()
    return int(np.maximum(short, 0).sum())

  def grow(self, slot: int, n_tokens: int) -> None:
    """Gives `slot` pages for n_tokens entries (at most a full row)."""
    want = min(self.pages_for(n_tokens), self.table.shape[1])
    extra = want - int(self.held[slot])
    if extra <= 0:
      return
    free = self._free[self.shard_of[slot]]
    if extra > len(free):
      raise PoolExhausted(
          f"slot {slot} needs {extra} more KV pages of {self.page_size} "
          f"entries, {len(free)} of its shard's {self.local_pages} are free "
          f"(sampler.kv_pages = {self.n_pages})")
    for j in range(int(self.held[slot]), want):
      self.table[slot, j] = free.pop()
    self.held[slot] = want
    self.peak = max(self.peak, self.n_pages - self.free_pages)

  def release(self, slot: int) -> None:
    """Returns every page of `slot` to its shard's free list."""
    n = int(self.held[slot])
    self._free[self.shard_of[slot]].extend(
        int(p) for p in self.table[slot, :n][::-1])
    self.table[slot] = self.local_pages
    self.held[slot] = 0


@jax.tree_util.register_pytree_node_class
class HostBook:
  """The host's record of one decode state: each slot's cache length,
  whether it holds a sequence, and (paged) its pages. It rides along in
  `DecodeState.host`, a pytree node without leaves, so tree functions and
  jitted calls never see it; the engine strips it before each call and
  puts it back on the state the call returns.

  Lengths after a generate call are read from the device when next needed
  (`lengths`), by then the driver has read that call's tokens; slots
  inserted or freed since keep the host's value.
  """

  def __init__(self, n_slots: int, pages: PageTable | None):
    self._len = np.zeros((n_slots,), np.int64)
    self.active = np.zeros((n_slots,), bool)
    # Slots whose request draws by rank (top-k / top-p): decode steps must
    # keep the sampling sort while any of them is active.
    self.ranked = np.zeros((n_slots,), bool)
    self.pages = pages
    self._pending = None
    self._touched = np.zeros((n_slots,), bool)

  def tree_flatten(self):
    return (), self

  @classmethod
  def tree_unflatten(cls, book, _):
    return book

  @property
  def lengths(self) -> np.ndarray:
    """Each slot's cache length (the array itself; callers must not write
    it)."""
    if self._pending is not None:
      dev = np.asarray(self._pending)
      keep = ~self._touched
      self._len[keep] = dev[keep]
      self._pending = None
    return self._len

  def after_generate(self, lengths_B) -> None:
    """Records the device lengths a generate call returned."""
    self.lengths  # noqa: B018 (settles slots touched before the call)
    self._pending = lengths_B
    self._touched[:] = False

  def reach(self, steps_left_B: np.ndarray, cache_len: int
            ) -> tuple[np.ndarray, np.ndarray]:
    """(running_B, reach_B) of a generate call in which slot b takes at
    most steps_left_B[b] steps: the slots that run, and how many cache
    entries each touches (a running slot writes len .. len + steps - 1; one
    that does not run still computes a step at position len, masked), at
    most cache_len."""
    running_B = self.active & (steps_left_B > 0)
    reach_B = np.where(running_B, self.lengths + steps_left_B,
                       self.lengths + 1)
    return running_B, np.minimum(reach_B, cache_len)

  def set(self, slot: int, length: int, ranked: bool = True) -> None:
    """Slot now holds a sequence of `length` cache entries (whose request
    draws by rank, or not)."""
    self.lengths[slot] = length
    self.active[slot] = True
    self.ranked[slot] = ranked
    self._touched[slot] = True

  def any_ranked(self) -> bool:
    """Whether an active slot draws by rank."""
    return bool(np.any(self.ranked & self.active))

  def clear(self, mask_B: np.ndarray) -> None:
    """The masked slots are free (their pages go back to the pool)."""
    self.lengths[mask_B] = 0
    self.active[mask_B] = False
    self.ranked[mask_B] = False
    self._touched[mask_B] = True
    if self.pages is not None:
      for b in np.flatnonzero(mask_B):
        self.pages.release(int(b))
