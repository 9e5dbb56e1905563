"""Shortest rejection sampling (report 2.4).

"This method samples the same question n times (in our experiments, n=8)
and selects the shortest correct response for supervised fine-tuning."
A prompt none of whose n responses is correct contributes nothing.
"""

from __future__ import annotations

import numpy as np

from kimi_jax.long2short.samples import Samples


def shortest_correct(lengths_N: np.ndarray, correct_N: np.ndarray
                     ) -> int | None:
  """Index of the shortest correct response (the first of equally short
  ones), or None when no response is correct."""
  lengths_N = np.asarray(lengths_N, np.int64)
  correct_N = np.asarray(correct_N, bool)
  if lengths_N.shape != correct_N.shape or lengths_N.ndim != 1:
    raise ValueError(f"lengths {lengths_N.shape} and correct "
                     f"{correct_N.shape} must be equal 1-d shapes")
  if not correct_N.any():
    return None
  masked = np.where(correct_N, lengths_N, np.iinfo(np.int64).max)  # int64
  return int(np.argmin(masked))


def select(samples: Samples) -> list[tuple[int, int]]:
  """(prompt, response) indices of each prompt's shortest correct response;
  prompts without a correct response are skipped."""
  out = []
  for p in range(samples.n_prompts):
    j = shortest_correct(samples.lengths_PxN[p], samples.correct_PxN[p])
    if j is not None:
      out.append((p, j))
  return out


def sft_rows(samples: Samples, tokenizer) -> list[dict]:
  """The selected responses as SFT rows: {"id", "prompt", "response"}
  (texts), what `config.sft.train_path` reads."""
  return [{"id": samples.records[p]["id"],
           "prompt": samples.records[p]["prompt"],
           "response": samples.text(p, j, tokenizer)}
          for p, j in select(samples)]
