"""The chain-of-thought reward model's verdict: the last JSON object it wrote.

The model reasons in free text and ends with `{"correct": true}` or
`{"correct": false}`. Reading it back:

- every top-level JSON object in the text is decoded (`json.JSONDecoder.
  raw_decode` at each `{` not inside an object already read); the verdict is
  the LAST one, so a reasoning that quotes `{"correct": true}` before
  concluding otherwise is read by its conclusion;
- that object must have a boolean `correct` (strings such as "true" and
  numbers are malformed: a verdict is not guessed);
- a `{"correct"` after the last decodable object (a final verdict cut off or
  broken) makes the output malformed rather than falling back to an earlier
  object;
- no object at all: the verdict is missing.

Malformed and missing verdicts score incorrect; the status says which, so
the serving code counts them.
"""

from __future__ import annotations

import dataclasses
import json
import re

STATUSES = ("ok", "malformed", "missing")
# Only the end of a long output is searched (the verdict closes it); this
# also bounds the decoding work on hostile text.
MAX_CHARS = 4096
_VERDICT_START = re.compile(r'\{\s*"correct"')


@dataclasses.dataclass(frozen=True)
class Verdict:
  """correct: the judgment (False unless status is "ok" and it says true).
  status: "ok", "malformed" or "missing"."""

  correct: bool
  status: str


def json_objects(text: str) -> list[tuple[int, int, object]]:
  """(start, end, value) of every top-level JSON object in `text`."""
  decoder = json.JSONDecoder()
  out = []
  i = text.find("{")
  while i != -1:
    try:
      value, end = decoder.raw_decode(text, i)
    except json.JSONDecodeError:
      i = text.find("{", i + 1)
      continue
    if isinstance(value, dict):
      out.append((i, end, value))
    i = text.find("{", end)
  return out


def parse_verdict(text: str) -> Verdict:
  """The verdict of a CoT reward model's output (see the module doc)."""
  text = text[-MAX_CHARS:]
  objects = json_objects(text)
  if not objects:
    broken = _VERDICT_START.search(text) is not None
    return Verdict(False, "malformed" if broken else "missing")
  _, end, last = objects[-1]
  if _VERDICT_START.search(text, end) is not None:
    return Verdict(False, "malformed")
  value = last.get("correct")
  if not isinstance(value, bool):
    return Verdict(False, "malformed")
  return Verdict(value, "ok")


def verdict_text(correct: bool) -> str:
  """The verdict as the model is trained to write it."""
  return json.dumps({"correct": bool(correct)})
