"""Statistics over seeds: mean, sample standard deviation and the standard
error of the mean."""

from __future__ import annotations

from typing import Any, Sequence

import numpy as np


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
  """Mean and sample standard deviation (ddof=1; None for one value)."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("mean_std of no values")
  return float(x.mean()), (float(x.std(ddof=1)) if x.size > 1 else None)


def stat(values: Sequence[float]) -> dict[str, Any]:
  """{"mean", "std", "sem", "values"} of per-seed values; sem = std /
  sqrt(seeds), what says whether a paired difference is resolved."""
  mean, std = mean_std(values)
  sem = std / float(np.sqrt(len(values))) if std is not None else None
  return {"mean": mean, "std": std, "sem": sem,
          "values": [float(v) for v in values]}
