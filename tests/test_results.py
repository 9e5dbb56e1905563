"""The figures in the docs' results tables are the figures in their JSON.

A results table is a Markdown table in README.md or docs/*.md whose nearest
non-blank line above is an HTML comment naming the JSON it quotes:

  <!-- results: docs/results/tiny.json -->

Several files may be named, separated by spaces, and a name may be a glob
(`docs/results/aot/*.json`); a name that matches no file fails the test.
Every number in the table's body cells (the header row and the separator
are left out) must then appear in one of those files:

- Text in backticks is not read (commands, config keys, commit hashes,
  model names such as `Qwen2.5-7B`), nor the targets of Markdown links.
- A number written with d decimals (d may be 0) matches a JSON number x
  when x rounds to it at d decimals: |x / scale - n| <= 0.5 * 10^-d.
- scale is 1, or 1e3 / 1e6 / 1e9 / 1e12 for a number written with a
  prefix k (or K) / M / G / T right after it, alone or before B or FLOP
  (`52k`, `1.2M`, `95 GB`, `449.9 GFLOP/s`), and for every number of a
  column whose header ends in such a prefix in brackets: `(GB)`, `(M)`.
  A number written with ms after it, or in a column headed `(ms)`, is
  scaled by 1e-3 (JSON holds seconds).
- A number followed by % also matches 100 x.
- A leading + or - (or the minus sign, U+2212) is the number's sign, unless
  a digit stands right before it (`0.50-0.56` is a range); thousands
  commas (`125,257`) are read as one number. Other units and marks (x, ×,
  s, ms, ±, **) are ignored.
"""

from __future__ import annotations

import glob
import json
import math
import os
import re
from typing import Any, Iterator

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
COMMENT = re.compile(r"^\s*<!--\s*results:\s*(.+?)\s*-->\s*$")
FENCE = re.compile(r"^\s*(```|~~~)")
SCALES = {"k": 1e3, "K": 1e3, "M": 1e6, "G": 1e9, "T": 1e12, "ms": 1e-3}
NUMBER = re.compile(
    r"(?P<sign>[-+\u2212]?)"
    r"(?P<num>\d{1,3}(?:,\d{3})+(?:\.\d+)?|\d+(?:\.\d+)?)"
    r"(?:\s?(?P<unit>ms|[kKMGT])(?:B|FLOP)?(?![A-Za-z]))?"
    r"(?P<pct>\s?%)?")
HEADER_SCALE = re.compile(r"\((ms|[kKMGT])(?:B|FLOP/s)?\)\s*$")


def markdown_files(root: str = ROOT) -> list[str]:
  docs = os.path.join(root, "docs")
  names = sorted(n for n in os.listdir(docs) if n.endswith(".md"))
  return ["README.md"] + [os.path.join("docs", n) for n in names]


def _cells(line: str) -> list[str]:
  return [c.strip() for c in line.strip().strip("|").split("|")]


def results_tables(text: str) -> Iterator[tuple[int, str, list[str],
                                                list[list[str]]]]:
  """(line number, the comment's file names, header cells, body rows) of
  every results table outside fenced code."""
  lines, fenced, cited, i = text.splitlines(), False, None, 0
  while i < len(lines):
    line = lines[i]
    if FENCE.match(line):
      fenced, cited = not fenced, None
    elif not fenced:
      match = COMMENT.match(line)
      if match:
        cited = (i + 1, match.group(1))
      elif line.strip().startswith("|") and cited:
        start = i
        while i < len(lines) and lines[i].strip().startswith("|"):
          i += 1
        rows = [_cells(l) for l in lines[start:i]]
        yield cited[0], cited[1], rows[0], rows[2:]
        cited = None
        continue
      elif line.strip():
        cited = None
    i += 1


def json_numbers(value: Any) -> list[float]:
  """Every number in a JSON value (bools are not numbers)."""
  if isinstance(value, bool):
    return []
  if isinstance(value, (int, float)):
    return [float(value)] if math.isfinite(value) else []
  if isinstance(value, dict):
    return [x for v in value.values() for x in json_numbers(v)]
  if isinstance(value, list):
    return [x for v in value for x in json_numbers(v)]
  return []


def cell_numbers(cell: str, column_scale: float = 1.0
                 ) -> list[tuple[str, float, int, float, bool]]:
  """(text, value, decimals, scale, percent) of every number in a cell."""
  text = re.sub(r"`[^`]*`", " ", cell)
  text = re.sub(r"\]\([^)]*\)", "]", text)
  out = []
  for m in NUMBER.finditer(text):
    start = m.start()
    if start and (text[start - 1].isalnum() or text[start - 1] in "._"):
      continue  # inside a word or a longer number: v5p, x2, 1.2.3
    sign = m.group("sign")
    num = m.group("num").replace(",", "")
    value = float(num) * (-1 if sign in ("-", "\u2212") else 1)
    decimals = len(num.partition(".")[2])
    unit = m.group("unit")
    scale = SCALES[unit] if unit else column_scale
    out.append((m.group(0).strip(), value, decimals, scale,
                bool(m.group("pct"))))
  return out


def _signed(text: str) -> str:
  """A '-' right after a digit is a range dash, not a sign."""
  return re.sub(r"(?<=\d)[-\u2212]", " ", text)


def matches(value: float, decimals: int, scale: float, percent: bool,
            pool: list[float]) -> bool:
  tol = 0.5 * 10.0 ** -decimals + 1e-9
  for x in pool:
    if abs(x / scale - value) <= tol:
      return True
    if percent and abs(100 * x - value) <= tol:
      return True
  return False


def check_text(text: str, root: str) -> list[str]:
  """Every problem with the results tables of one Markdown text."""
  problems = []
  for line, names, header, rows in results_tables(text):
    paths = []
    for name in names.split():
      found = sorted(glob.glob(os.path.join(root, name)))
      if not found:
        problems.append(f"line {line}: cited {name} does not exist")
      paths += found
    pool = []
    for path in paths:
      with open(path) as f:
        pool += json_numbers(json.load(f))
    scales = []
    for head in header:
      m = HEADER_SCALE.search(head)
      scales.append(SCALES[m.group(1)] if m else 1.0)
    for row in rows:
      for col, cell in enumerate(row):
        scale = scales[col] if col < len(scales) else 1.0
        for shown, value, dec, sc, pct in cell_numbers(_signed(cell), scale):
          if paths and not matches(value, dec, sc, pct, pool):
            problems.append(f"line {line}: {shown!r} in {cell!r} is in "
                            f"none of {names}")
  return problems


def test_a_results_table_exists():
  with open(os.path.join(ROOT, "README.md")) as f:
    assert list(results_tables(f.read())), "README.md has no results table"


@pytest.mark.parametrize("path", markdown_files())
def test_results_tables_match_their_json(path):
  with open(os.path.join(ROOT, path)) as f:
    problems = check_text(f.read(), ROOT)
  assert not problems, f"{path}: " + "; ".join(problems)


def _write(tmp_path, figures: dict) -> None:
  os.makedirs(tmp_path / "docs" / "results")
  with open(tmp_path / "docs" / "results" / "run.json", "w") as f:
    json.dump(figures, f)


TABLE = """Intro text with 0.123 outside any table.

<!-- results: docs/results/run.json -->

| run (seeds) | pass@1 | gain | tok/s | mem (GB) | note |
|---|---|---|---|---|---|
| a (3) | **0.917** | +0.396 | 52k | 1.2 | `cmd --seed 77` 58% |
"""


def test_a_made_up_table_passes_and_a_drifted_one_fails(tmp_path):
  figures = {"seeds": 3, "pass_at_1": 0.91666, "gain": 0.3958,
             "tok_s": 51_904.2, "mem_bytes": 1_187_597_880,
             "partial": 0.5833}
  _write(tmp_path, figures)
  assert check_text(TABLE, str(tmp_path)) == []
  drifted = TABLE.replace("**0.917**", "**0.932**")
  problems = check_text(drifted, str(tmp_path))
  assert len(problems) == 1 and "0.932" in problems[0]


@pytest.mark.parametrize("old,new", [("+0.396", "-0.396"), ("52k", "53k"),
                                     ("| 1.2 |", "| 1.3 |"), ("58%", "59%"),
                                     ("a (3)", "a (4)")])
def test_each_rule_catches_a_change(tmp_path, old, new):
  _write(tmp_path, {"seeds": 3, "pass_at_1": 0.91666, "gain": 0.3958,
                    "tok_s": 51_904.2, "mem_bytes": 1_187_597_880,
                    "partial": 0.5833})
  assert check_text(TABLE, str(tmp_path)) == []
  assert check_text(TABLE.replace(old, new), str(tmp_path))


def test_a_missing_json_fails(tmp_path):
  os.makedirs(tmp_path / "docs")
  problems = check_text(TABLE, str(tmp_path))
  assert problems and "does not exist" in problems[0]


def test_only_commented_tables_are_read(tmp_path):
  _write(tmp_path, {"x": 1})
  text = TABLE.replace("<!-- results: docs/results/run.json -->\n",
                       "some prose\n")
  assert list(results_tables(text)) == []
  assert check_text(text, str(tmp_path)) == []


def test_number_reading():
  got = [(v, d, s, p) for _, v, d, s, p in
         cell_numbers(_signed("0.50-0.56 s, −0.044, 125,257 tok/s, 17.9 GB, "
                              "v5p 8x, 95%"))]
  assert got == [(0.5, 2, 1.0, False), (0.56, 2, 1.0, False),
                 (-0.044, 3, 1.0, False), (125257.0, 0, 1.0, False),
                 (17.9, 1, 1e9, False), (8.0, 0, 1.0, False),
                 (95.0, 0, 1.0, True)]
  got = [(v, s) for _, v, _, s, _ in
         cell_numbers("449.9 GFLOP/s, 16.6 ms, 3.94M params, 2 GiB")]
  assert got == [(449.9, 1e9), (16.6, 1e-3), (3.94, 1e6), (2.0, 1.0)]
