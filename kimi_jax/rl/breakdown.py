"""Held-out results split by what the problems are: where a policy fails.

A run's evaluation gives pass@1 overall and per task. To see why a figure
stops rising, split it by any property of the problems: a record field
(`metadata.word_len`), or whether a field matches a pattern (`capitalized`
= `metadata.word` matches `^[A-Z]`). Each group gets its problem count,
pass@1 with its standard error over problems, greedy accuracy and mean
sampled length, computed from the evaluator's scored responses
(`EvalSamples`) so the groups add up to the overall figures. With n draws
per problem, pass@k for k <= n is the unbiased estimate of Chen et al.
(2021, "Evaluating Large Language Models Trained on Code"): whether RL
made the policy solve more problems, or only solve the same ones more
reliably, shows as pass@k standing still while pass@1 rises.
"""

from __future__ import annotations

import dataclasses
import json
import re
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.rl.evaluation import EvalSamples

MISSING = "(missing)"


def record_field(record: Mapping[str, Any], path: str) -> Any:
  """`record["a"]["b"]` for path "a.b" (list items by index: "tags.0");
  KeyError naming the part that is missing."""
  node: Any = record
  for part in path.split("."):
    if isinstance(node, Mapping) and part in node:
      node = node[part]
    elif isinstance(node, (list, tuple)) and part.isdigit() and int(
        part) < len(node):
      node = node[int(part)]
    else:
      raise KeyError(f"{path!r}: no {part!r}")
  return node


@dataclasses.dataclass(frozen=True)
class Split:
  """One way to group problems: by a field's value, or, with `pattern`, by
  whether the field's text matches it (re.search)."""

  name: str
  field: str
  pattern: str | None = None

  def __post_init__(self):
    if not self.field:
      raise ValueError(f"split {self.name!r}: empty field path")
    if self.pattern is not None:
      try:
        re.compile(self.pattern)
      except re.error as exc:
        raise ValueError(f"split {self.name!r}: bad pattern "
                         f"{self.pattern!r} ({exc})") from None

  def label(self, record: Mapping[str, Any]) -> str:
    try:
      value = record_field(record, self.field)
    except KeyError:
      return MISSING
    text = value if isinstance(value, str) else json.dumps(value)
    if self.pattern is None:
      return text
    return "yes" if re.search(self.pattern, text) else "no"


def parse_split(spec: str) -> Split:
  """"FIELD" or "NAME=FIELD:PATTERN" (the command-line form)."""
  if "=" not in spec:
    return Split(name=spec, field=spec)
  name, rest = spec.split("=", 1)
  field, sep, pattern = rest.partition(":")
  if not name or not sep:
    raise ValueError(f"split {spec!r}: expected FIELD or NAME=FIELD:PATTERN")
  return Split(name=name, field=field, pattern=pattern)


def pass_at_k(n: int, c: int, k: int) -> float:
  """P(at least one of k draws, taken without replacement from n draws of
  which c are right, is right) = 1 - C(n - c, k) / C(n, k)."""
  if not 1 <= k <= n or not 0 <= c <= n:
    raise ValueError(f"pass@{k} needs 1 <= k <= n and 0 <= c <= n "
                     f"(n={n}, c={c})")
  if n - c < k:
    return 1.0
  return float(1.0 - np.prod(1.0 - k / np.arange(n - c + 1, n + 1)))


def _sort_key(label: str) -> tuple:
  try:
    return (0, float(label), label)
  except ValueError:
    return (1, 0.0, label)


def group_rows(samples: EvalSamples, labels_P: Sequence[str],
               ks: Sequence[int] = ()) -> list[dict[str, Any]]:
  """One row per label (numeric labels in numeric order): problems,
  pass@1, its standard error over problems, greedy accuracy, mean sampled
  length, and `pass_at_{k}` for each k > 1 in `ks` (the estimate for k = 1
  is pass@1). `labels_P[i]` is problem i's label."""
  if len(labels_P) != samples.n_problems:
    raise ValueError(f"{len(labels_P)} labels for {samples.n_problems} "
                     f"problems")
  labels_P = np.asarray(labels_P, dtype=object)
  sampled_N = samples.draw_N >= 0
  rows = []
  for label in sorted(set(labels_P.tolist()), key=_sort_key):
    problems = np.flatnonzero(labels_P == label)
    in_group_N = np.isin(samples.problem_N, problems)
    pick_N = in_group_N & sampled_N
    drawn_P = [samples.correct_N[pick_N & (samples.problem_N == p)]
               for p in problems]
    per_problem = np.array([d.mean() for d in drawn_P])
    greedy_N = in_group_N & ~sampled_N
    se = (float(per_problem.std(ddof=1) / np.sqrt(len(problems)))
          if len(problems) > 1 else float("nan"))
    rows.append(dict(
        group=label, problems=int(len(problems)),
        pass_at_1=float(samples.correct_N[pick_N].mean()),
        pass_at_1_se=se,
        greedy_accuracy=(float(samples.correct_N[greedy_N].mean())
                         if greedy_N.any() else float("nan")),
        mean_length=float(samples.length_N[pick_N].mean()),
        **{f"pass_at_{k}": float(np.mean([
            pass_at_k(len(d), int(d.sum()), k) for d in drawn_P]))
           for k in ks if k != 1}))
  return rows


def breakdown(samples: EvalSamples, records: Sequence[Mapping[str, Any]],
              splits: Sequence[Split], ks: Sequence[int] = ()
              ) -> dict[str, list[dict[str, Any]]]:
  """{"all": [one row], split name: rows by that split's labels}."""
  out = {"all": group_rows(samples, ["all"] * samples.n_problems, ks)}
  for split in splits:
    out[split.name] = group_rows(samples, [split.label(r) for r in records],
                                 ks)
  return out


def format_table(name: str, rows: Sequence[Mapping[str, Any]],
                 ks: Sequence[int] = ()) -> str:
  ks = [k for k in ks if k != 1]  # pass@1 has its own column
  lines = [f"{name:<24} {'problems':>8} {'pass@1':>8} {'± se':>7} "
           f"{'greedy':>7} {'length':>7}" + "".join(
               f" {f'pass@{k}':>8}" for k in ks)]
  for r in rows:
    lines.append(f"{str(r['group'])[:24]:<24} {r['problems']:>8} "
                 f"{r['pass_at_1']:>8.3f} {r['pass_at_1_se']:>7.3f} "
                 f"{r['greedy_accuracy']:>7.3f} {r['mean_length']:>7.1f}"
                 + "".join(f" {r[f'pass_at_{k}']:>8.3f}" for k in ks))
  return "\n".join(lines)
