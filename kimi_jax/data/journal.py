"""Resumable model calls for the data tools (curation, rejection sampling).

Asking a policy for 10 answers to each of 100k prompts takes hours; a run
killed at 90% must not start over. `map_chunks` cuts the work into chunks
of prompts, and a `Journal` appends each finished chunk's results to a
JSONL file as soon as they exist (flushed and fsynced). A rerun with the
same inputs finds them there and asks the model only for the chunks that
are missing, so the results are those of an uninterrupted run.

A chunk is found by a digest of everything its results depend on: the
journal's `context` (which policy and checkpoint, which reward), the step
and its settings (`key`), the chunk's first index (sampling seeds are keyed
by prompt index) and each item's own key (its prompt text and answer). Any
change to them is a different digest, so a stale result is never reused; it
is simply not looked up. A torn last line (killed mid-write) is ignored.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
from typing import Any, Callable, Sequence

from absl import flags

from kimi_jax.infra import console

# Flags defined by define_flags belong to the launcher that calls it.
flags.disclaim_key_flags()

# Prompts per model call of the data tools and stages that journal (ours:
# minutes of work per chunk for a large model, so a kill loses little).
CHUNK_PROMPTS = 256


def digest(*parts: Any) -> str:
  """sha256 of the parts as sorted-key JSON (dataclasses and other objects
  by their str): equal inputs, equal digest, across processes and runs."""
  text = json.dumps(list(parts), sort_keys=True, default=str)
  return hashlib.sha256(text.encode()).hexdigest()


class Journal:
  """Finished chunks, by digest; `path=None` keeps them in memory only."""

  def __init__(self, path: str | None, context: Any = ""):
    self.path = path
    self.context = context
    self.reused = 0  # chunks found here rather than computed
    self._done: dict[str, Any] = {}
    self._torn = False
    if path and os.path.exists(path):
      line = ""
      with open(path) as f:
        for line in f:
          try:
            entry = json.loads(line)
            self._done[entry["digest"]] = entry["value"]
          except (json.JSONDecodeError, KeyError, TypeError):
            continue  # a torn last line
      # The next entry must not be glued onto a line cut short by a kill.
      self._torn = bool(line) and not line.endswith("\n")

  def digest(self, *parts: Any) -> str:
    return digest(self.context, *parts)

  def get(self, digest: str) -> Any:
    return self._done.get(digest)

  def __contains__(self, digest: str) -> bool:
    return digest in self._done

  def put(self, digest: str, value: Any) -> None:
    self._done[digest] = value
    if not self.path:
      return
    os.makedirs(os.path.dirname(os.path.abspath(self.path)), exist_ok=True)
    with open(self.path, "a") as f:
      if self._torn:
        f.write("\n")
        self._torn = False
      f.write(json.dumps({"digest": digest, "value": value}) + "\n")
      f.flush()
      os.fsync(f.fileno())


def map_chunks(items: Sequence[Any], item_keys: Sequence[Any],
               fn: Callable[[Sequence[Any], int], list], *, chunk: int,
               journal: Journal | None = None, key: Any = "",
               desc: str = "", progress: bool = False) -> list:
  """`fn(items[s:s + chunk], s)` for each chunk start s, concatenated (one
  JSON-serialisable result per item); chunks the journal holds are not
  recomputed, and each computed one is journaled before the next starts."""
  if len(items) != len(item_keys):
    raise ValueError("map_chunks: one key per item")
  if chunk < 1:
    raise ValueError(f"map_chunks: chunk must be >= 1, got {chunk}")
  import jax
  if journal is None or jax.process_count() > 1:
    # Several processes sample together (SPMD): one that skipped a chunk
    # its peers recompute would hang them, so multi-process runs compute
    # every chunk.
    journal = Journal(None)
  starts = range(0, len(items), chunk)
  digests = [journal.digest(key, s, list(item_keys[s:s + chunk]))
             for s in starts]
  out: list = []
  bar = console.progress(zip(starts, digests), len(digests), desc,
                         progress and len(digests) > 1)
  for start, digest in bar:
    if digest in journal:
      journal.reused += 1
      out.extend(journal.get(digest))
      continue
    part = list(fn(items[start:start + chunk], start))
    if len(part) != len(items[start:start + chunk]):
      raise ValueError(f"map_chunks: {desc or 'fn'} returned {len(part)} "
                       f"results for {len(items[start:start + chunk])} items")
    journal.put(digest, part)
    out.extend(part)
  return out


@dataclasses.dataclass(frozen=True)
class ModelCalls:
  """How a data tool's model step asks the policy: `chunk` prompts per
  call (0: all at once), each finished chunk kept in `journal`, with a
  progress bar or not."""

  chunk: int = 0
  journal: Journal | None = None
  progress: bool = False

  def map(self, items: Sequence[Any], item_keys: Sequence[Any],
          fn: Callable[[Sequence[Any], int], list], *, key: Any,
          desc: str) -> list:
    return map_chunks(items, item_keys, fn,
                      chunk=self.chunk or max(len(items), 1),
                      journal=self.journal, key=key, desc=desc,
                      progress=self.progress)


def define_flags(section: str):
  """The --journal and --progress flags of a data tool whose chunk size is
  --config.<section>.chunk_prompts (listed in the tool's --help: this
  module disclaims the flags it defines)."""
  journal = flags.DEFINE_string(
      "journal", None, "finished chunks of the model's answers (JSONL; "
      "default: OUT with .journal.jsonl): a rerun of a killed run asks the "
      f"model only for the chunks left (--config.{section}.chunk_prompts "
      "prompts per chunk)")
  progress = flags.DEFINE_bool("progress", True,
                               "progress bars of the model calls on stderr")
  return journal, progress
