"""Finding the final answer in a math response (pure, linear time).

The answer is the argument of the last complete `\\boxed{...}` (or another
boxing command), else group 1 of the last match of an "Answer: ..." line
pattern. Every function here is linear in the length of its input: brace
matching is one pass with a stack, so 50k unclosed `\\boxed{` cost no more
than 50k characters of prose.
"""

from __future__ import annotations

import re
from typing import Sequence

# A final "Answer: ..." / "Final answer: ..." line. Greedy `.+` (not lazy with
# a trailing `\s*$`) keeps matching linear on long lines.
DEFAULT_ANSWER_PATTERNS = (
    r"(?im)^[ \t*#]*(?:the[ \t]+)?(?:final[ \t]+)?answer[ \t*]*(?:is)?"
    r"[ \t]*[:：][ \t*]*(.+)$",
)
DEFAULT_BOXED_COMMANDS = ("boxed", "fbox")


def matching_braces(text: str) -> dict[int, int]:
  """Index of each `{` -> index of its closing `}` (unclosed ones absent).

  Escaped braces (`\\{`, `\\}`) are literal characters, not grouping.
  """
  closes: dict[int, int] = {}
  stack: list[int] = []
  i, n = 0, len(text)
  while i < n:
    ch = text[i]
    if ch == "\\":
      i += 2
      continue
    if ch == "{":
      stack.append(i)
    elif ch == "}" and stack:
      closes[stack.pop()] = i
    i += 1
  return closes


def extract_boxed(text: str,
                  commands: Sequence[str] = DEFAULT_BOXED_COMMANDS
                  ) -> str | None:
  """Returns the argument of the last `\\boxed{...}` (balanced braces).

  `\\boxed 5` (argument without braces) is accepted too. A boxed group that
  never closes is skipped in favour of an earlier complete one.
  """
  if not commands:
    return None
  names = "|".join(re.escape(c) for c in commands)
  starts = list(re.finditer(rf"\\(?:{names})(?![a-zA-Z])", text))
  if not starts:
    return None
  closes = matching_braces(text)
  for m in reversed(starts):
    j = m.end()
    while j < len(text) and text[j] in " \t":
      j += 1
    if j < len(text) and text[j] == "{":
      end = closes.get(j)
      if end is not None:
        return text[j + 1:end].strip()
    elif j > m.end():
      token = re.match(r"[^\s$]+", text[j:j + 1000])
      if token:
        return token.group(0)
  return None


def _strip_period(answer: str) -> str:
  """Drops a sentence-ending period, but not an ellipsis (`0.333...`)."""
  answer = answer.strip()
  if answer.endswith(".") and not answer.endswith(".."):
    answer = answer[:-1].rstrip()
  return answer


def clean_answer(answer: str) -> str:
  """Strips math delimiters and trailing punctuation around an answer."""
  answer = _strip_period(answer.strip().strip("*"))
  for left, right in (("$$", "$$"), ("$", "$"), ("\\(", "\\)"), ("\\[", "\\]")):
    if (len(answer) >= len(left) + len(right) and answer.startswith(left) and
        answer.endswith(right)):
      answer = answer[len(left):len(answer) - len(right)].strip()
  return _strip_period(answer)


THINK_OPEN, THINK_CLOSE = "<think>", "</think>"


def after_thinking(response: str) -> str:
  """The part of a response its final answer may come from: what follows
  the last `</think>` (a reasoning model's thinking block; the template may
  have opened it in the prompt, as DeepSeek-R1's does). A response that
  opens a block and never closes it stopped mid-thought: it has no answer
  (""). A response without thinking tags is returned whole."""
  end = response.rfind(THINK_CLOSE)
  if end >= 0:
    return response[end + len(THINK_CLOSE):]
  return "" if THINK_OPEN in response else response


def extract_answer(response: str,
                   boxed_commands: Sequence[str] = DEFAULT_BOXED_COMMANDS,
                   answer_patterns: Sequence[str] = DEFAULT_ANSWER_PATTERNS
                   ) -> str | None:
  """The final answer of a response: last boxed group, else last answer line."""
  boxed = extract_boxed(response, boxed_commands)
  if boxed is not None:
    return clean_answer(boxed)
  for pattern in answer_patterns:
    last = None
    for last in re.finditer(pattern, response):
      pass
    if last is not None:
      line = last.group(1)
      inner = extract_boxed(line, boxed_commands)
      return clean_answer(inner if inner is not None else line)
  return None
