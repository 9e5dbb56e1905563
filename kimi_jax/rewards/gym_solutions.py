"""Worked solutions for a few reasoning-gym datasets: the vanilla SFT data of
experiments/gym_tiny.py.

The report's vanilla SFT corpus is human-written (2.5.2); a model trained
from scratch has nothing of the kind, so these functions write one from
each problem's own metadata: a step-by-step solution ("cot") or the bare
answer ("direct"), both ending in the answer tags the reasoning-gym reward
reads. They are ours, written for a small character-level model: one short
line per step, with what each step needs to copy close by. Tests check
every solution against reasoning-gym's own scorer.
"""

from __future__ import annotations

from typing import Any, Callable, Mapping

STYLES = ("cot", "direct")


def _tagged(answer: str) -> str:
  return f"<answer>{answer}</answer>"


def chain_sum_steps(record: Mapping[str, Any]) -> tuple[list[str], str]:
  """Left to right, one partial result per line: "4 - 7 = -3"."""
  terms = record["metadata"]["expression"].split()
  value, lines = int(terms[0]), []
  for op, term in zip(terms[1::2], terms[2::2]):
    if op not in "+-":
      raise ValueError(f"chain_sum: operator {op!r} is not + or -")
    new = value + int(term) if op == "+" else value - int(term)
    lines.append(f"{value} {op} {term} = {new}")
    value = new
  return lines, str(value)


def spell_backward_steps(record: Mapping[str, Any]) -> tuple[list[str], str]:
  """The letters numbered, then the numbers counted down: "1c 2a 3t" /
  "3t 2a 1c", so each reversed letter sits right after its number."""
  word = record["metadata"]["word"]
  numbered = [f"{i + 1}{ch}" for i, ch in enumerate(word)]
  return [" ".join(numbered), " ".join(reversed(numbered))], word[::-1]


def letter_counting_steps(record: Mapping[str, Any]
                          ) -> tuple[list[str], str]:
  """One line per word, copied letter by letter with the running count
  written after each occurrence of the letter: "Ba1na2na3" / "ca4t".

  Each count sits next to the letter it counts, so a step is a copy, a
  comparison with the target letter and a +1 on the number last written
  (an earlier format, the word then its count and total, asked the model to
  count the letters of a word it had just copied, which ours never learned:
  docs/gym_pipeline.md)."""
  meta = record["metadata"]
  letter, total, lines = meta["target_letter"].lower(), 0, []
  for word in meta["span"]:
    line = []
    for ch in word:
      line.append(ch)
      if ch.lower() == letter:
        total += 1
        line.append(str(total))
    lines.append("".join(line))
  return lines, str(total)


def syllogism_verdict(record: Mapping[str, Any]) -> tuple[list[str], str]:
  """No steps: the verdict alone ("Yes" or "No"). Syllogism is the guessable
  task of experiments/gym_tiny.py's raw pool (most of its answers are
  "Yes"), taught as a bare answer so that the model can reply to it."""
  return [], str(record["answer"])


SOLVERS: dict[str, Callable[[Mapping[str, Any]], tuple[list[str], str]]] = {
    "chain_sum": chain_sum_steps,
    "spell_backward": spell_backward_steps,
    "letter_counting": letter_counting_steps,
    "syllogism": syllogism_verdict,
}


def solution(record: Mapping[str, Any], style: str) -> str:
  """The response text of `record` (a kimi_jax reasoning-gym row) in
  `style`: "cot" (steps, then the tagged answer) or "direct"."""
  if style not in STYLES:
    raise ValueError(f"style must be one of {STYLES}, got {style!r}")
  dataset = record["rg"]["dataset"]
  if dataset not in SOLVERS:
    raise ValueError(f"no worked solutions for reasoning-gym dataset "
                     f"{dataset!r} (known: {sorted(SOLVERS)})")
  lines, answer = SOLVERS[dataset](record)
  return "\n".join((lines if style == "cot" else []) + [_tagged(answer)])


def wrong_step(record: Mapping[str, Any], response: str) -> str | None:
  """Where `response`'s worked steps leave the record's worked solution:
  the first step line that differs from it, or a note that the steps stop
  early; None when every step is right, when there are no step lines (a
  direct answer) or when the dataset has no worked format here. The steps
  are the non-empty lines before the first `<answer>`. In these formats the
  right steps are unique (each line follows from the problem and the line
  before), so comparing with the solution checks each step's copying and
  arithmetic, not its wording."""
  dataset = record.get("rg", {}).get("dataset")
  if dataset not in SOLVERS:
    return None
  body = response.split("<answer>", 1)[0]
  lines = [line.strip() for line in body.splitlines() if line.strip()]
  if not lines:
    return None
  expected, _ = SOLVERS[dataset](record)
  if not expected:  # an answer-only format: no steps to check
    return None
  for i, line in enumerate(lines):
    if i >= len(expected) or line != expected[i]:
      return f"step {i + 1}: {line[:80]!r}"
  if len(lines) < len(expected):
    return f"steps stop after {len(lines)} of {len(expected)}"
  return None
