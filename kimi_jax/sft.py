"""Supervised warm start: next-token training on (prompt, solution) pairs.

The loss counts only solution tokens (and the closing eos). Rows come from a
Grain `MapDataset` (shuffled, repeated, random access), so batch i is a pure
function of (seed, i): the data-iterator state a checkpoint needs is the step.
In a multi-process run each process reads only the rows its devices hold.
"""

from __future__ import annotations

import dataclasses
from typing import Callable, Sequence

import grain
import numpy as np


@dataclasses.dataclass(frozen=True)
class SFTConfig:
  steps: int
  batch_size: int
  seq_len: int
  learning_rate: float
  warmup_steps: int = 0
  weight_decay: float = 0.0
  grad_clip: float = 1.0

  def __post_init__(self):
    if self.steps < 0:
      raise ValueError(f"sft.steps must be >= 0, got {self.steps}")
    if self.batch_size <= 0 or self.seq_len <= 1:
      raise ValueError("sft.batch_size must be > 0 and sft.seq_len > 1")


def encode_pair(prompt_ids: Sequence[int], solution_ids: Sequence[int],
                seq_len: int, pad_id: int) -> dict[str, np.ndarray]:
  """One row: inputs, shifted targets, and a mask over solution targets."""
  ids = list(prompt_ids) + list(solution_ids)
  if len(ids) > seq_len + 1:
    raise ValueError(f"example of {len(ids)} tokens exceeds sft.seq_len+1 = "
                     f"{seq_len + 1}")
  n = len(ids) - 1
  tokens = np.full(seq_len, pad_id, np.int32)
  targets = np.full(seq_len, pad_id, np.int32)
  mask = np.zeros(seq_len, np.float32)
  tokens[:n] = ids[:-1]
  targets[:n] = ids[1:]
  mask[len(prompt_ids) - 1:n] = 1.0
  segment_ids = np.zeros(seq_len, np.int32)
  segment_ids[:n] = 1
  positions = np.arange(seq_len, dtype=np.int32)
  return dict(tokens=tokens, targets=targets, mask=mask,
              segment_ids=segment_ids, positions=positions)


def make_dataset(pairs: Sequence[tuple[list[int], list[int]]], cfg: SFTConfig,
                 pad_id: int, seed: int) -> grain.MapDataset:
  """Shuffled, repeated encoded rows; row i of batch b is `ds[b*B + i]`."""
  return (grain.MapDataset.source(list(pairs)).shuffle(seed=seed).repeat()
          .map(lambda p: encode_pair(p[0], p[1], cfg.seq_len, pad_id)))


def load_rows(dataset: grain.MapDataset, step: int, batch_size: int,
              rows: range) -> dict[str, np.ndarray]:
  """Rows `rows` of batch `step`: each process loads only its own rows."""
  items = [dataset[step * batch_size + r] for r in rows]
  return {k: np.stack([it[k] for it in items]) for k in items[0]}


def encode_texts(texts: Sequence[tuple[str, str]], tokenizer,
                 encode_prompt: Callable[[dict], list[int]]
                 ) -> list[tuple[list[int], list[int]]]:
  return [(encode_prompt({"prompt": p}),
           tokenizer.encode(s) + [tokenizer.eos_id]) for p, s in texts]
