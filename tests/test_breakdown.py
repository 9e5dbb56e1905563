"""Held-out figures split by problem properties (kimi_jax/rl/breakdown.py),
against hand-computed values."""

import math

import numpy as np
import pytest

from kimi_jax.rl import breakdown as bd
from kimi_jax.rl.evaluation import EvalSamples

RECORDS = [
    {"id": "a", "metadata": {"word": "Mahri", "word_len": 5}, "tags": ["x"]},
    {"id": "b", "metadata": {"word": "cat", "word_len": 3}, "tags": ["y"]},
    {"id": "c", "metadata": {"word": "Ruth", "word_len": 4}},
    {"id": "d", "metadata": {"word": "science", "word_len": 7}, "tags": ["x"]},
]


def _samples():
  # Two draws and one greedy response (draw -1) per problem.
  correct = {0: ([1, 0], 1), 1: ([1, 1], 1), 2: ([0, 0], 0), 3: ([1, 0], 1)}
  length = {0: ([10, 20], 9), 1: ([4, 6], 5), 2: ([8, 8], 8),
            3: ([30, 10], 12)}
  problem, draw, ok, n = [], [], [], []
  for p in range(4):
    for j, (c, l) in enumerate(zip(correct[p][0], length[p][0])):
      problem.append(p), draw.append(j), ok.append(c), n.append(l)
    problem.append(p), draw.append(-1), ok.append(correct[p][1])
    n.append(length[p][1])
  return EvalSamples(problem_N=np.array(problem), draw_N=np.array(draw),
                     length_N=np.array(n), correct_N=np.array(ok, bool),
                     task_N=np.array(["t"] * len(ok), dtype=object),
                     n_problems=4)


def test_record_field_follows_dotted_paths_and_list_indices():
  assert bd.record_field(RECORDS[0], "metadata.word_len") == 5
  assert bd.record_field(RECORDS[0], "tags.0") == "x"
  with pytest.raises(KeyError, match="'metadata.size': no 'size'"):
    bd.record_field(RECORDS[0], "metadata.size")
  with pytest.raises(KeyError, match="no '3'"):
    bd.record_field(RECORDS[0], "tags.3")


def test_parse_split_forms_and_errors():
  assert bd.parse_split("metadata.word_len") == bd.Split(
      "metadata.word_len", "metadata.word_len")
  # The pattern keeps every character after the first colon.
  assert bd.parse_split("caps=metadata.word:^[A-Z]:?") == bd.Split(
      "caps", "metadata.word", "^[A-Z]:?")
  with pytest.raises(ValueError, match="NAME=FIELD:PATTERN"):
    bd.parse_split("caps=metadata.word")
  with pytest.raises(ValueError, match="bad pattern"):
    bd.parse_split("caps=metadata.word:[A-")


def test_labels_by_value_by_pattern_and_missing():
  caps = bd.parse_split("caps=metadata.word:^[A-Z]")
  assert [caps.label(r) for r in RECORDS] == ["yes", "no", "yes", "no"]
  tag = bd.parse_split("tags.0")
  assert [tag.label(r) for r in RECORDS] == ["x", "y", bd.MISSING, "x"]
  assert bd.parse_split("metadata.word_len").label(RECORDS[3]) == "7"


def test_group_rows_by_hand():
  drawn = _samples()
  tables = bd.breakdown(drawn, RECORDS,
                        [bd.parse_split("caps=metadata.word:^[A-Z]"),
                         bd.parse_split("metadata.word_len")])
  (overall,) = tables["all"]
  # Sampled draws: 1+0, 1+1, 0+0, 1+0 right of 8; greedy 3 of 4.
  assert overall["pass_at_1"] == pytest.approx(4 / 8)
  assert overall["greedy_accuracy"] == pytest.approx(3 / 4)
  assert overall["mean_length"] == pytest.approx(96 / 8)
  # Per-problem pass rates 0.5, 1, 0, 0.5: sample std / sqrt(4).
  assert overall["pass_at_1_se"] == pytest.approx(
      np.std([0.5, 1, 0, 0.5], ddof=1) / 2)
  yes, no = tables["caps"][1], tables["caps"][0]
  assert (no["group"], yes["group"]) == ("no", "yes")
  # Capitalised: problems 0 and 2 (rates 0.5, 0); the rest: 1 and 3.
  assert yes["problems"] == 2 and yes["pass_at_1"] == pytest.approx(0.25)
  assert yes["greedy_accuracy"] == pytest.approx(0.5)
  assert yes["pass_at_1_se"] == pytest.approx(0.25)
  assert yes["mean_length"] == pytest.approx((10 + 20 + 8 + 8) / 4)
  assert no["pass_at_1"] == pytest.approx(0.75)
  assert no["greedy_accuracy"] == pytest.approx(1.0)
  # Numeric labels in numeric order; a single problem has no error bar.
  lengths = tables["metadata.word_len"]
  assert [r["group"] for r in lengths] == ["3", "4", "5", "7"]
  assert math.isnan(lengths[0]["pass_at_1_se"])
  # The groups add up to the overall figure.
  assert sum(r["pass_at_1"] * r["problems"] for r in lengths) / 4 == (
      pytest.approx(overall["pass_at_1"]))


def test_group_rows_needs_one_label_per_problem():
  with pytest.raises(ValueError, match="3 labels for 4 problems"):
    bd.group_rows(_samples(), ["a", "b", "c"])


def test_format_table_names_every_group():
  text = bd.format_table("caps", bd.group_rows(
      _samples(), ["yes", "no", "yes", "no"]))
  lines = text.splitlines()
  assert lines[0].split()[:3] == ["caps", "problems", "pass@1"]
  assert lines[1].split()[:3] == ["no", "2", "0.750"]
  assert lines[2].split()[:3] == ["yes", "2", "0.250"]


def test_run_evaluator_errors_name_the_problem(tmp_path):
  # Only the run's config.json is needed to get this far.
  from kimi_jax.job import workdir
  from kimi_jax.infra.config import ConfigError, load_config
  (tmp_path / "config.json").write_text(
      load_config("experiments/tiny.py:micro",
                  ["task.val_fraction=0.0"]).to_json_best_effort())
  with pytest.raises(ConfigError, match="'pointer_chase' generates its "
                     "problems; only a jsonl task reads another file"):
    workdir.evaluator(str(tmp_path), data=str(tmp_path / "x.jsonl"))
  with pytest.raises(ConfigError, match=r"the run has no val problems "
                     r"\(task.val_fraction is 0\)$"):
    workdir.evaluator(str(tmp_path), split="val")
  with pytest.raises(ConfigError, match="samples must be >= 1"):
    workdir.evaluator(str(tmp_path), samples=0)
  with pytest.raises(ConfigError, match="split 'test'"):
    workdir.evaluator(str(tmp_path), split="test")


def test_pass_at_k_matches_enumeration():
  # Against the definition: every k-subset of n draws, c of them right.
  from itertools import combinations
  for n, c, k in [(4, 1, 2), (8, 3, 4), (5, 0, 3), (5, 5, 1), (6, 2, 5)]:
    draws = [1] * c + [0] * (n - c)
    subsets = list(combinations(range(n), k))
    want = sum(any(draws[i] for i in s) for s in subsets) / len(subsets)
    assert bd.pass_at_k(n, c, k) == pytest.approx(want), (n, c, k)
  assert bd.pass_at_k(10, 3, 1) == pytest.approx(0.3)
  with pytest.raises(ValueError, match="1 <= k <= n"):
    bd.pass_at_k(4, 1, 5)


def test_group_rows_report_pass_at_k_per_group():
  rows = bd.group_rows(_samples(), ["yes", "no", "yes", "no"], ks=(1, 2))
  no, yes = rows
  # Two draws each: pass@2 is whether either draw was right.
  assert yes["pass_at_2"] == pytest.approx((1 + 0) / 2)
  assert no["pass_at_2"] == pytest.approx((1 + 1) / 2)
  assert [r["pass_at_1"] for r in rows] == pytest.approx(
      [r["pass_at_1"] for r in bd.group_rows(_samples(),
                                             ["yes", "no", "yes", "no"])])
  header, first = bd.format_table("caps", rows, ks=(1, 2)).splitlines()[:2]
  assert header.split()[-1] == "pass@2" and first.split()[-1] == "1.000"
