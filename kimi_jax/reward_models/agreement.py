"""How well a judge agrees with a reference labelling (the verifier's, or a
human's): accuracy, and precision / recall of the "correct" class.

precision = P(reference correct | judge says correct): how much of the
  reward the judge hands out is deserved (low precision is what a policy
  can exploit: reward hacking);
recall = P(judge says correct | reference correct): how much deserved
  reward it finds.
Either is None when its denominator is empty.
"""

from __future__ import annotations

from typing import Sequence


def agreement(predicted: Sequence[bool], reference: Sequence[bool]
              ) -> dict[str, float | int | None]:
  if len(predicted) != len(reference):
    raise ValueError(f"{len(predicted)} predictions for {len(reference)} "
                     f"reference labels")
  predicted = [bool(p) for p in predicted]
  reference = [bool(r) for r in reference]
  tp = sum(p and r for p, r in zip(predicted, reference))
  fp = sum(p and not r for p, r in zip(predicted, reference))
  fn = sum(r and not p for p, r in zip(predicted, reference))
  n = len(reference)
  return {
      "n": n,
      "accuracy": (n - fp - fn) / n if n else None,
      "precision": tp / (tp + fp) if tp + fp else None,
      "recall": tp / (tp + fn) if tp + fn else None,
      "reference_correct": tp + fn,
      "predicted_correct": tp + fp,
  }
