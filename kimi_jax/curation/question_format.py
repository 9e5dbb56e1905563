"""Rule-based detector of question formats that invite reward hacking
(report 2.1, "Accurate Evaluability"): multiple-choice, true/false and
proof-style problems, whose answers can be guessed or not checked against
a reference, are excluded from the RL prompt set.

`detect(question, answer)` returns "multiple_choice", "true_false", "proof"
or None. The rules, in this order (the first match wins):

- multiple_choice: the answer is a lone option letter (A-J, with optional
  brackets) and the question lists options; or the question has at least
  two consecutive lettered options ("A) ..", "(B) ..", "C. ..", "D: ..")
  at line starts or after whitespace; or it says "which of the following" /
  "choose (one of) the ... option(s)/answer" / "select the correct".
- true_false: the answer is true/false/yes/no/t/f (any case); or the
  question asks "true or false", "true/false", "(T/F)", "yes or no".
- proof: the question asks to prove / show / demonstrate / justify that
  something holds ("prove that", "show that", "prove:", "give a proof",
  "demonstrate that"), or the answer is empty-ish ("proof", "QED").

These are deliberately conservative text rules (ours); a model-based
detector can replace them through `FormatDetector`.
"""

from __future__ import annotations

import re
from typing import Callable, Optional

FORMATS = ("multiple_choice", "true_false", "proof")
FormatDetector = Callable[[str, Optional[str]], Optional[str]]

_OPTION = r"(?:^|\s)[\(\[]?([A-J])[\)\].:]\s+\S"
_MC_PHRASES = re.compile(
    r"which of the following|choose (?:one of )?the (?:correct|best|right) "
    r"(?:option|answer|choice)|select the correct|answer choices|"
    r"options?:\s*$", re.IGNORECASE | re.MULTILINE)
_LETTER_ANSWER = re.compile(r"^\s*[\(\[]?([A-J])[\)\]]?\s*\.?\s*$")
_TF_ANSWER = re.compile(r"^\s*(true|false|yes|no|t|f)\s*\.?\s*$",
                        re.IGNORECASE)
_TF_PHRASES = re.compile(
    r"true or false|true/false|\(t/f\)|\bt/f\b|yes or no|yes/no|"
    r"\bis (?:the following|this|it) (?:statement )?true\b",
    re.IGNORECASE)
_PROOF_PHRASES = re.compile(
    r"\bprove\b|\bproof\b|\bshow that\b|\bdemonstrate that\b|"
    r"\bjustify (?:that|why)\b", re.IGNORECASE)
_PROOF_ANSWER = re.compile(r"^\s*(proof|q\.?e\.?d\.?|see proof)\s*\.?\s*$",
                           re.IGNORECASE)


def _option_letters(question: str) -> list[str]:
  return [m.group(1) for m in re.finditer(_OPTION, question)]


def _has_option_run(question: str) -> bool:
  """At least two consecutive option letters (A then B, B then C, ...)."""
  letters = _option_letters(question)
  return any(ord(b) == ord(a) + 1 for a, b in zip(letters, letters[1:]))


def detect(question: str, answer: str | None = None) -> str | None:
  """The hack-prone format of a problem, or None (see the module doc)."""
  answer = "" if answer is None else str(answer)
  if _has_option_run(question) or _MC_PHRASES.search(question):
    return "multiple_choice"
  if _LETTER_ANSWER.match(answer) and _option_letters(question):
    return "multiple_choice"
  if _TF_ANSWER.match(answer) or _TF_PHRASES.search(question):
    return "true_false"
  if _PROOF_PHRASES.search(question) or _PROOF_ANSWER.match(answer):
    return "proof"
  return None
