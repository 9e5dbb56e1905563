"""Reading a benchmark's published file: rows, fields and their errors.

Files are JSONL (optionally gzipped) or one JSON array; a missing or
malformed field is a `BenchmarkError` naming the file, the row (0-based)
and the field.
"""

from __future__ import annotations

import gzip
import json
from typing import Any, Mapping


class BenchmarkError(ValueError):
  """A benchmark name, file or field that cannot be read."""


def read_rows(path: str) -> list[tuple[int, Mapping[str, Any]]]:
  """(0-based line or element number, object) of a JSONL (.gz) file or of
  one JSON array."""
  opener = gzip.open if path.endswith(".gz") else open
  try:
    with opener(path, "rt", encoding="utf-8") as f:
      text = f.read()
  except FileNotFoundError:
    raise BenchmarkError(f"{path}: not found") from None
  if text.lstrip().startswith("["):
    try:
      rows = list(enumerate(json.loads(text)))
    except ValueError as exc:
      raise BenchmarkError(f"{path}: not a JSON array ({exc})") from None
  else:
    rows = []
    for i, line in enumerate(text.splitlines()):
      if not line.strip():
        continue
      try:
        rows.append((i, json.loads(line)))
      except ValueError as exc:
        raise BenchmarkError(f"{path}:{i + 1}: not JSON ({exc})") from None
  for i, row in rows:
    if not isinstance(row, dict):
      raise BenchmarkError(f"{path}: row {i}: expected a JSON object, got "
                           f"{type(row).__name__}")
  return rows


def field(path: str, i: int, row: Mapping[str, Any], name: str,
          any_case: bool = False) -> Any:
  """row[name] (any_case: the first key equal to name ignoring case), or a
  BenchmarkError naming file, row and field."""
  if name in row:
    return row[name]
  if any_case:
    for key, value in row.items():
      if key.lower() == name:
        return value
  raise BenchmarkError(f"{path}: row {i}: no field {name!r} (has "
                       f"{sorted(row)})")


def optional(row: Mapping[str, Any], name: str) -> Any:
  """row's field `name` in any case, or None."""
  for key, value in row.items():
    if key.lower() == name:
      return value
  return None


def bad(path: str, i: int, name: str, message: str) -> BenchmarkError:
  """The error of a field that is there but wrong."""
  return BenchmarkError(f"{path}: row {i}: field {name!r}: {message}")
