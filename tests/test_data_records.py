"""Prompt and SFT sets from JSONL: canonical records, bad rows named by file,
line and field (rejected or skipped and counted), Grain sources, and a
seeded shuffled order that resumes exactly from its JSON state."""

from __future__ import annotations

import json

import grain
import pytest

from kimi_jax.data import records as rec
from kimi_jax.data.sources import RecordIterator


def _jsonl(path, rows) -> str:
  with open(path, "w") as f:
    for row in rows:
      f.write(row if isinstance(row, str) else json.dumps(row))
      f.write("\n")
  return str(path)


MATH_ROWS = [
    {"question": "1 + 1?", "solution": 2, "level": 1, "topics": ["add"]},
    {"question": "6 x 7?", "solution": "42"},
    {"question": "half of 1?", "solution": 0.5, "level": 3.5, "id": "p3"},
]
FIELDS = rec.PromptFields(prompt="question", answer="solution",
                          difficulty="level", tags="topics")


def test_prompt_set_with_configured_field_names(tmp_path):
  path = _jsonl(tmp_path / "train.jsonl", [MATH_ROWS[0], "", MATH_ROWS[1],
                                           MATH_ROWS[2]])
  src = rec.load_prompt_source(path, FIELDS)
  assert len(src) == 3
  assert src.report.as_metrics() == {"rows": 3, "kept": 3, "skipped": 0}
  r0, r1, r2 = src[0], src[1], src[2]
  assert (r0["prompt"], r0["answer"], r0["difficulty"], r0["tags"],
          r0["id"]) == ("1 + 1?", "2", 1.0, ["add"], "train.jsonl:1")
  assert "level" not in r0 and "topics" not in r0
  # Line numbers count the blank line; a row's own id wins.
  assert (r1["id"], r1["answer"], "difficulty" in r1) == ("train.jsonl:3",
                                                          "42", False)
  assert (r2["id"], r2["answer"], r2["difficulty"]) == ("p3", "0.5", 3.5)
  # A Grain data source: random access through a MapDataset.
  ds = grain.MapDataset.source(src).map(lambda r: r["answer"])
  assert [ds[i] for i in range(3)] == ["2", "42", "0.5"]


BAD = [
    ('{"question": "ok", "solution": 1}', None, None),
    ('{"question": "broken", "solution": ', None, "not valid JSON"),
    ('{"solution": 3}', "question", "missing"),
    ('{"question": 7, "solution": 3}', "question", "expected a string"),
    ('{"question": "q", "solution": [1]}', "solution",
     "expected a string or a number"),
    ('{"question": "q", "solution": 1, "level": "hard"}', "level",
     "expected a finite number"),
    ('{"question": "q", "solution": 1, "topics": "algebra"}', "topics",
     "expected a list of strings"),
    ('[1, 2]', None, "expected a JSON object"),
    ('{"question": "  ", "solution": 1}', "question", "empty"),
]


def test_bad_rows_are_rejected_naming_file_line_field(tmp_path):
  path = _jsonl(tmp_path / "bad.jsonl", [row for row, _, _ in BAD])
  with pytest.raises(rec.DataError) as info:
    rec.load_prompt_source(path, FIELDS)
  msg = str(info.value)
  assert "8 bad row(s) of 9" in msg and "on_bad_row='skip'" in msg
  assert f"{path}:2: not valid JSON" in msg
  assert f"{path}:3: field 'question': missing" in msg
  assert f"{path}:4: field 'question': expected a string, got int" in msg


def test_bad_rows_skipped_and_counted(tmp_path, caplog):
  path = _jsonl(tmp_path / "bad.jsonl", [row for row, _, _ in BAD])
  src = rec.load_prompt_source(path, FIELDS, on_bad_row="skip")
  assert len(src) == 1 and src[0]["prompt"] == "ok"
  assert src.report.as_metrics() == {"rows": 9, "kept": 1, "skipped": 8}
  got = [(b.line, b.field) for b in src.report.examples]
  assert got == [(i + 1, field) for i, (_, field, reason) in enumerate(BAD)
                 if reason][:5]
  for bad, (_, _, reason) in zip(src.report.examples, BAD[1:]):
    assert reason in bad.reason
  assert "1 of 9 rows kept, 8 skipped" in caplog.text


@pytest.mark.parametrize("content, pattern", [
    ("", r"empty file"), ("\n  \n", r"empty file"),
    ('{"x": 1}\n', r"1 bad row\(s\) of 1.*field 'question': missing"),
])
def test_unusable_files_always_raise(tmp_path, content, pattern):
  path = tmp_path / "p.jsonl"
  path.write_text(content)
  with pytest.raises(rec.DataError, match=pattern):
    rec.load_prompt_source(str(path), FIELDS)
  if "bad row" in pattern:
    with pytest.raises(rec.DataError, match="no valid rows"):
      rec.load_prompt_source(str(path), FIELDS, on_bad_row="skip")


def test_missing_and_parquet_files_are_named(tmp_path):
  with pytest.raises(rec.DataError, match=r"nope\.jsonl: file not found"):
    rec.load_prompt_source(str(tmp_path / "nope.jsonl"))
  with pytest.raises(rec.DataError, match=r"p\.parquet: Parquet is not"):
    rec.load_prompt_source(str(tmp_path / "p.parquet"))
  with pytest.raises(ValueError, match="on_bad_row"):
    rec.load_prompt_source(str(tmp_path / "x.jsonl"), on_bad_row="ignore")


def test_code_tasks_need_their_tests(tmp_path):
  rows = [
      {"prompt": "echo", "tests": [{"input": "1\n", "output": "1\n"},
                                   {"input": 2, "output": 2}],
       "language": "python"},
      {"prompt": "f", "test": "def check(f): assert f(1) == 2",
       "entry_point": "f"},
      {"prompt": "no tests"},
      {"prompt": "empty", "tests": []},
      {"prompt": "half", "tests": [{"input": "1"}]},
      {"prompt": "fn", "test": "def check(f): pass"},
  ]
  path = _jsonl(tmp_path / "code.jsonl", rows)
  src = rec.load_prompt_source(path, rec.PromptFields(kind="code"),
                               on_bad_row="skip")
  assert len(src) == 2
  assert src[0]["tests"][1] == {"input": "2", "output": "2"}
  assert src[0]["language"] == "python"
  assert src[1]["entry_point"] == "f"
  assert [(b.line, b.field) for b in src.report.examples] == [
      (3, "tests"), (4, "tests"), (5, "tests"), (6, "entry_point")]
  assert "'output' missing" in src.report.examples[2].reason


def test_open_prompts_need_only_a_prompt(tmp_path):
  path = _jsonl(tmp_path / "rg.jsonl", [{"prompt": "p", "rg": {"x": 1}},
                                        {"prompt": "q", "sol": 3}])
  src = rec.load_prompt_source(path, rec.PromptFields(kind="open",
                                                      answer="sol"))
  assert src[0]["rg"] == {"x": 1} and "answer" not in src[0]
  assert src[1]["answer"] == "3"
  with pytest.raises(ValueError, match="kind"):
    rec.PromptFields(kind="chess")


def test_sft_rows(tmp_path):
  chat = [{"role": "user", "content": "hi"},
          {"role": "assistant", "content": "hello"}]
  rows = [
      {"q": "1+1?", "a": "2"},
      {"conv": chat},
      {"conv": chat[:1]},
      {"conv": [{"role": "user"}]},
      {"q": "no answer"},
      {"other": 1},
  ]
  path = _jsonl(tmp_path / "sft.jsonl", rows)
  fields = rec.SFTFields(prompt="q", response="a", messages="conv")
  src = rec.load_sft_source(path, fields, on_bad_row="skip")
  assert len(src) == 2
  assert (src[0]["prompt"], src[0]["response"]) == ("1+1?", "2")
  assert src[1]["messages"] == chat
  assert [(b.line, b.field) for b in src.report.examples] == [
      (3, "conv"), (4, "conv"), (5, "a"), (6, None)]
  assert "no assistant message" in src.report.examples[0].reason


def _values(it, n):
  return [next(it)["prompt"] for _ in range(n)]


def test_shuffled_order_resumes_from_json_state(tmp_path):
  rows = [{"prompt": f"p{i}", "answer": i} for i in range(5)]
  src = rec.load_prompt_source(_jsonl(tmp_path / "t.jsonl", rows))
  it = RecordIterator(src, seed=7)
  first = _values(it, 7)  # crosses into the second epoch
  state = json.loads(json.dumps(it.get_state()))
  assert state == {"position": 7, "seed": 7, "size": 5}
  rest = _values(it, 13)
  resumed = RecordIterator(src, seed=7)
  resumed.set_state(state)
  assert _values(resumed, 13) == rest
  stream = first + rest
  # Every epoch is a permutation; epochs and seeds differ.
  epochs = [stream[i:i + 5] for i in range(0, 20, 5)]
  assert all(sorted(e) == [f"p{i}" for i in range(5)] for e in epochs)
  assert len({tuple(e) for e in epochs}) > 1
  assert _values(RecordIterator(src, seed=8), 20) != stream
  assert _values(RecordIterator(src, seed=7), 20) == stream


def test_state_from_other_data_is_rejected(tmp_path):
  src = rec.load_prompt_source(_jsonl(tmp_path / "t.jsonl",
                                      [{"prompt": "a", "answer": 1}] * 3))
  it = RecordIterator(src, seed=1)
  with pytest.raises(rec.DataError, match=r"seed 1 over 4 records.*seed 1 "
                     r"over 3"):
    it.set_state({"position": 2, "seed": 1, "size": 4})
  with pytest.raises(rec.DataError, match=r"lacks \['seed'\]"):
    it.set_state({"position": 2, "size": 3})
