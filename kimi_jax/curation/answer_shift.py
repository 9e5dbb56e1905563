"""How curation moves each tag's answer distribution, with a warning when it
all but removes an answer that the input is full of.

The easy-to-hack step (report 2.1) drops every prompt that a no-CoT guesser
answers right. When a tag's answers come from a small set (counts, small
sums, yes/no), the guesser's favourite answer is often also the most
common one, and the step drops nearly every prompt that has it. RL on what
is left then teaches the policy that this answer is rare, and it loses
accuracy wherever the evaluation set is full of it. Measured
(docs/curation.md, "Answer shift"): 42 of 50 held-out
letter-counting problems have the answer 1, against 4 of the 147 curated
ones, and answer-only RL on the curated set took counting from 0.685 to
0.145.

Answers are compared as stripped, lower-cased strings; rows without an
answer (code tasks judged by tests) are left out.
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Iterable, Sequence

TOP = 3  # answers listed per tag in the report


@dataclasses.dataclass(frozen=True)
class ShiftRule:
  """An answer is flagged when it is at least `min_share` of a tag's input
  rows but less than `keep_ratio` times that share of the tag's kept rows;
  tags with fewer than `min_rows` input rows are not judged (ours)."""

  min_share: float = 0.25
  keep_ratio: float = 0.25
  min_rows: int = 20

  def __post_init__(self):
    if not 0 < self.min_share <= 1:
      raise ValueError(f"min_share must be in (0, 1], got "
                       f"{self.min_share}")
    if not 0 < self.keep_ratio <= 1:
      raise ValueError(f"keep_ratio must be in (0, 1], got "
                       f"{self.keep_ratio}")
    if self.min_rows < 1:
      raise ValueError(f"min_rows must be >= 1, got "
                       f"{self.min_rows}")


def answer_key(answer: Any) -> str | None:
  """The compared form of an answer; None when there is none."""
  if answer is None:
    return None
  key = " ".join(str(answer).split()).lower()
  return key or None


def counts_by_tag(tagged_answers: Iterable[tuple[str, Any]]
                  ) -> dict[str, collections.Counter]:
  """(tag, answer) pairs -> answer counts per tag (answerless rows out)."""
  out: dict[str, collections.Counter] = {}
  for tag, answer in tagged_answers:
    key = answer_key(answer)
    if key is not None:
      out.setdefault(tag, collections.Counter())[key] += 1
  return out


def _top(counts: collections.Counter) -> dict[str, float]:
  total = sum(counts.values())
  return {a: round(n / total, 4) for a, n in counts.most_common(TOP)}


def answer_shift(before: Sequence[tuple[str, Any]],
                 after: Sequence[tuple[str, Any]],
                 rule: ShiftRule = ShiftRule()) -> dict:
  """Per tag, the most common answers' shares in the input (`before`) and in
  the kept rows (`after`), and warnings for answers curation all but
  removed (see `ShiftRule`)."""
  counts_in, counts_kept = counts_by_tag(before), counts_by_tag(after)
  by_tag, warnings = {}, []
  for tag in sorted(counts_in):
    c_in = counts_in[tag]
    c_kept = counts_kept.get(tag, collections.Counter())
    n_in, n_kept = sum(c_in.values()), sum(c_kept.values())
    by_tag[tag] = {"rows_in": n_in, "kept": n_kept, "top_in": _top(c_in),
                   "top_kept": _top(c_kept) if n_kept else {}}
    if n_in < rule.min_rows or not n_kept:
      continue
    for answer, n in c_in.most_common():
      share_in = n / n_in
      if share_in < rule.min_share:
        break
      share_kept = c_kept[answer] / n_kept
      if share_kept < rule.keep_ratio * share_in:
        warnings.append(
            f"{tag}: answer {answer!r} is {share_in:.0%} of the {n_in} input "
            f"rows but {share_kept:.0%} of the {n_kept} kept; RL on the kept "
            f"rows learns that it is rare (docs/curation.md, answer shift)")
  return {"by_tag": by_tag, "warnings": warnings}
