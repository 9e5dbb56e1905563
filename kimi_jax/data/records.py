"""Prompt and SFT records from JSONL files, validated row by row.

A record is a dict with canonical keys, whatever the file calls them:

- prompt sets (RL train / eval): `prompt` (str), `answer` (str; numbers are
  turned into their text) for kind "math", `tests` (a non-empty list of
  {"input", "output"}) or `test` + `entry_point` (function tests) for kind
  "code", nothing more for kind "open" (the reward reads its own fields);
  optional `difficulty` (a number) and `tags` (a list of strings). Other
  fields of the row are kept (a code task's `language`, `time_limit_s`, ...).
- SFT sets: `prompt` + `response` (strings), or `messages` (a list of
  {"role", "content"} with at least one assistant turn).

Every record gets an `id` ("<file name>:<line>") unless the row has one.
Which file field holds each canonical key is configurable (`PromptFields`,
`SFTFields`). A row that is not JSON, not an object, or has a missing or
mistyped field is a `BadRow` naming the file, line and field; `on_bad_row`
says what happens: "error" rejects the file up front (listing the first bad
rows and how many there are), "skip" drops the rows and counts them in the
source's `LoadReport`, which the job logs. Blank lines are not rows. An empty
file, or one with no valid row, is always an error.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import math
import os
from typing import Any, Callable, Mapping

import numpy as np

ON_BAD_ROW = ("error", "skip")
PROMPT_KINDS = ("math", "code", "open")
# Bad rows quoted in an error message or a report.
_EXAMPLES = 5

Record = dict[str, Any]
Validator = Callable[[Mapping[str, Any]], Record]


class DataError(ValueError):
  """A data file is unusable; the message names the file (and row, field)."""


class RowError(ValueError):
  """One row is invalid: `field` (None for the row as a whole) and why."""

  def __init__(self, field: str | None, reason: str):
    super().__init__(reason)
    self.field = field
    self.reason = reason


@dataclasses.dataclass(frozen=True)
class BadRow:
  path: str
  line: int
  field: str | None
  reason: str

  def __str__(self) -> str:
    where = f"{self.path}:{self.line}"
    return (f"{where}: field {self.field!r}: {self.reason}" if self.field
            else f"{where}: {self.reason}")


@dataclasses.dataclass(frozen=True)
class LoadReport:
  """What loading one file did: rows read, kept and skipped."""

  path: str
  rows: int
  kept: int
  skipped: int
  examples: tuple[BadRow, ...] = ()

  def as_metrics(self) -> dict[str, int]:
    return {"rows": self.rows, "kept": self.kept, "skipped": self.skipped}

  def __str__(self) -> str:
    text = (f"{self.path}: {self.kept} of {self.rows} rows kept, "
            f"{self.skipped} skipped")
    if self.examples:
      text += "; e.g. " + "; ".join(str(b) for b in self.examples)
    return text


# ---------------------------------------------------------------------------
# Field checks


def text_field(row: Mapping[str, Any], field: str) -> str:
  if field not in row or row[field] is None:
    raise RowError(field, "missing")
  value = row[field]
  if not isinstance(value, str):
    raise RowError(field, f"expected a string, got {type(value).__name__}")
  if not value.strip():
    raise RowError(field, "empty")
  return value


def _answer(row: Mapping[str, Any], field: str) -> str:
  if field not in row or row[field] is None:
    raise RowError(field, "missing")
  value = row[field]
  if isinstance(value, bool) or not isinstance(value, (str, int, float)):
    raise RowError(field, f"expected a string or a number, got "
                   f"{type(value).__name__}")
  text = str(value)
  if not text.strip():
    raise RowError(field, "empty")
  return text


def _number(row: Mapping[str, Any], field: str) -> float | None:
  value = row.get(field)
  if value is None:
    return None
  if isinstance(value, bool) or not isinstance(value, (int, float)) or \
      not math.isfinite(value):
    raise RowError(field, f"expected a finite number, got {value!r}")
  return float(value)


def tags_field(row: Mapping[str, Any], field: str) -> list[str] | None:
  value = row.get(field)
  if value is None:
    return None
  if not isinstance(value, list) or not all(isinstance(t, str)
                                            for t in value):
    raise RowError(field, f"expected a list of strings, got {value!r}"[:200])
  return list(value)


def _io_tests(row: Mapping[str, Any], field: str) -> list[dict[str, str]]:
  value = row[field]
  if not isinstance(value, list) or not value:
    raise RowError(field, "expected a non-empty list of {input, output}")
  out = []
  for i, case in enumerate(value):
    if not isinstance(case, dict):
      raise RowError(field, f"case {i}: expected an object")
    for key in ("input", "output"):
      v = case.get(key)
      if isinstance(v, bool) or not isinstance(v, (str, int, float)):
        raise RowError(field, f"case {i}: {key!r} missing or not a string")
    out.append(dict(case, input=str(case["input"]),
                    output=str(case["output"])))
  return out


def _messages(row: Mapping[str, Any], field: str) -> list[dict[str, str]]:
  value = row[field]
  if not isinstance(value, list) or not value:
    raise RowError(field, "expected a non-empty list of {role, content}")
  out = []
  for i, message in enumerate(value):
    if not isinstance(message, dict) or not isinstance(
        message.get("role"), str) or not isinstance(message.get("content"),
                                                    str):
      raise RowError(field, f"message {i}: expected {{'role': str, "
                     f"'content': str}}")
    out.append(dict(message))
  if not any(m["role"] == "assistant" for m in out):
    raise RowError(field, "no assistant message to train on")
  return out


# ---------------------------------------------------------------------------
# Schemas


@dataclasses.dataclass(frozen=True)
class PromptFields:
  """Where a prompt set's fields are, and what a row must have.

  kind: "math" (needs an answer), "code" (needs tests, or test +
  entry_point), "open" (needs only the prompt; the reward checks the rest).
  An answer present in a row of any kind is checked and made canonical.
  """

  kind: str = "math"
  prompt: str = "prompt"
  answer: str = "answer"
  difficulty: str = "difficulty"
  tags: str = "tags"
  tests: str = "tests"

  def __post_init__(self):
    if self.kind not in PROMPT_KINDS:
      raise ValueError(f"prompt set kind must be one of {PROMPT_KINDS}, got "
                       f"{self.kind!r}")

  def validate(self, row: Mapping[str, Any]) -> Record:
    """The canonical record of one row; raises RowError naming the field."""
    record = dict(row)
    record["prompt"] = text_field(row, self.prompt)
    if self.kind == "math" or row.get(self.answer) is not None:
      record["answer"] = _answer(row, self.answer)
    elif self.kind == "code":
      if row.get(self.tests) is not None:
        record["tests"] = _io_tests(row, self.tests)
      elif row.get("test") is not None or row.get("entry_point") is not None:
        record["test"] = text_field(row, "test")
        record["entry_point"] = text_field(row, "entry_point")
      else:
        raise RowError(self.tests, "missing (a code task needs stdin/stdout "
                       "tests, or 'test' + 'entry_point')")
    for key, field, check in (("difficulty", self.difficulty, _number),
                              ("tags", self.tags, tags_field)):
      value = check(row, field)
      record.pop(field, None)
      if value is not None:
        record[key] = value
    return record


@dataclasses.dataclass(frozen=True)
class SFTFields:
  """Where an SFT set's fields are: prompt + response, or chat messages."""

  prompt: str = "prompt"
  response: str = "response"
  messages: str = "messages"

  def validate(self, row: Mapping[str, Any]) -> Record:
    record = dict(row)
    if row.get(self.messages) is not None:
      record["messages"] = _messages(row, self.messages)
      return record
    if self.prompt not in row and self.response not in row:
      raise RowError(None, f"needs {self.prompt!r} + {self.response!r} or "
                     f"{self.messages!r}")
    record["prompt"] = text_field(row, self.prompt)
    record["response"] = text_field(row, self.response)
    return record


# ---------------------------------------------------------------------------
# JSONL data source


def _parse(raw: bytes) -> dict[str, Any]:
  try:
    row = json.loads(raw)
  except UnicodeDecodeError:
    raise RowError(None, "not valid UTF-8") from None
  except json.JSONDecodeError as exc:
    raise RowError(None, f"not valid JSON ({exc.msg} at column "
                   f"{exc.colno})") from None
  if not isinstance(row, dict):
    raise RowError(None, f"expected a JSON object, got "
                   f"{type(row).__name__}")
  return row


class JsonlSource:
  """Random access to the valid rows of a JSONL file: a Grain data source
  (`len`, `__getitem__`), usable as `grain.MapDataset.source(JsonlSource(...))`.

  The constructor reads the file once, validating every row, and keeps only
  the byte ranges of the good ones; `__getitem__` reads and validates one row
  again. `admit(record)`, if given, is a further check run once per row at
  load time only (e.g. that the prompt fits the sampler once tokenized); it
  raises RowError like `validate`. `report` says how many rows were read,
  kept and skipped.
  """

  def __init__(self, path: str, validate: Validator, *,
               on_bad_row: str = "error",
               admit: Callable[[Record], None] | None = None):
    if on_bad_row not in ON_BAD_ROW:
      raise ValueError(f"on_bad_row must be one of {ON_BAD_ROW}, got "
                       f"{on_bad_row!r}")
    if path.endswith(".parquet"):
      raise DataError(f"{path}: Parquet is not supported (it would need "
                      f"pyarrow); convert it to JSONL, one object per line")
    if not os.path.isfile(path):
      raise DataError(f"{path}: file not found")
    self.path = path
    self._validate = validate
    self._name = os.path.basename(path)
    starts, lines, bad, n_rows = [], [], [], 0
    with open(path, "rb") as f:
      offset = 0
      for line_no, raw in enumerate(f, 1):
        begin, offset = offset, offset + len(raw)
        if not raw.strip():
          continue
        n_rows += 1
        try:
          record = validate(_parse(raw))
          if admit is not None:
            admit(record)
        except RowError as exc:
          bad.append(BadRow(path, line_no, exc.field, exc.reason))
          continue
        starts.append(begin)
        lines.append(line_no)
    if n_rows == 0:
      raise DataError(f"{path}: empty file (no rows)")
    if bad and on_bad_row == "error":
      raise DataError(
          f"{path}: {len(bad)} bad row(s) of {n_rows} (set on_bad_row="
          f"'skip' to drop and count them): " +
          "; ".join(str(b) for b in bad[:_EXAMPLES]))
    if not starts:
      raise DataError(f"{path}: no valid rows ({len(bad)} skipped): " +
                      "; ".join(str(b) for b in bad[:_EXAMPLES]))
    self.report = LoadReport(path, n_rows, len(starts), len(bad),
                             tuple(bad[:_EXAMPLES]))
    if bad:
      logging.warning("%s", self.report)
    self._starts = np.asarray(starts, np.int64)
    self._lines = np.asarray(lines, np.int64)

  def __len__(self) -> int:
    return len(self._starts)

  def line(self, index: int) -> int:
    """The file line of valid row `index`."""
    return int(self._lines[index])

  def __getitem__(self, index: int) -> Record:
    index = int(index)
    if not 0 <= index < len(self):
      raise IndexError(f"{self.path}: row index {index} out of range "
                       f"[0, {len(self)})")
    with open(self.path, "rb") as f:
      f.seek(int(self._starts[index]))
      raw = f.readline()
    record = self._validate(_parse(raw))
    record.setdefault("id", f"{self._name}:{self.line(index)}")
    return record

  def __iter__(self):
    return (self[i] for i in range(len(self)))

  def __repr__(self) -> str:
    return f"JsonlSource({self.path!r}, {len(self)} rows)"


def load_prompt_source(path: str, fields: PromptFields = PromptFields(), *,
                       on_bad_row: str = "error",
                       admit: Callable[[Record], None] | None = None
                       ) -> JsonlSource:
  """A prompt set (RL train or eval) as a Grain data source; `admit`: see
  JsonlSource."""
  return JsonlSource(path, fields.validate, on_bad_row=on_bad_row,
                     admit=admit)


def load_sft_source(path: str, fields: SFTFields = SFTFields(), *,
                    on_bad_row: str = "error") -> JsonlSource:
  """An SFT set as a Grain data source."""
  return JsonlSource(path, fields.validate, on_bad_row=on_bad_row)
