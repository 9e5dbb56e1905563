"""The scoring arithmetic of a benchmark run (pure).

pass@1 is the mean over problems of each problem's fraction of correct
samples (with K samples per problem: the mean correctness of all K x N
responses). pass@k is the unbiased estimator of Chen et al. (2021, the
HumanEval paper): per problem with n samples of which c are correct,
1 - C(n - c, k) / C(n, k), averaged over problems.
"""

from __future__ import annotations

from typing import Sequence

import numpy as np


def pass_at_k(n: int, c: int, k: int) -> float:
  """Probability that at least one of k samples drawn without replacement
  from n (c of them correct) is correct."""
  if not 1 <= k <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n samples, got n={n}")
  if not 0 <= c <= n:
    raise ValueError(f"c={c} correct of n={n}")
  if n - c < k:
    return 1.0
  # prod_{i=n-c+1}^{n} (1 - k / i): stable for large n.
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def mean_pass_at_k(counts: Sequence[tuple[int, int]], k: int) -> float:
  """pass@k averaged over problems, each given as (n samples, c correct)."""
  if not counts:
    raise ValueError("no problems")
  return float(np.mean([pass_at_k(n, c, k) for n, c in counts]))


def token_stats(lengths: Sequence[int]) -> tuple[float | None,
                                                 float | None]:
  """(mean, 90th percentile) response tokens; (None, None) when unknown."""
  if not lengths:
    return None, None
  arr = np.asarray(lengths, dtype=np.float64)
  return float(arr.mean()), float(np.percentile(arr, 90))
