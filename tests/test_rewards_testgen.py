"""Test-case generation (report 2.3.5): real CYaRon generators, sandbox."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.code import CodeReward
from kimi_jax.rewards.testgen import (ProblemFormatError, TestGenConfig,
                                      generate_tests, run_generator,
                                      scaled_threshold, validate_problem, vote)
from kimi_jax.sandbox import Sandbox

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
PROBLEMS = os.path.join(ROOT, "tests", "data", "testgen_problems.jsonl")


def _problems() -> dict[str, dict]:
  out = {}
  with open(PROBLEMS) as f:
    for line in f:
      try:
        p = json.loads(line)
        validate_problem(p)
      except (ValueError, ProblemFormatError):
        continue
      out[p["id"]] = p
  return out


@pytest.fixture(scope="module")
def sandbox():
  box = Sandbox(max_workers=2)
  yield box
  box.close()


# -- pure parts ---------------------------------------------------------------

def test_vote_needs_min_agreement():
  outputs = [["3\n", "3", "3 ", "4"],  # 3 agree after normalisation
             ["1", "2", "1", None],  # 2 agree
             [None, None, None, None]]
  assert vote(outputs, min_agree=3) == ["3", None, None]
  assert vote(outputs, min_agree=2) == ["3", "1", None]


def test_scaled_threshold():
  assert scaled_threshold(7, 10, 10) == 7
  assert scaled_threshold(7, 10, 20) == 7
  assert scaled_threshold(7, 10, 6) == 5
  assert scaled_threshold(9, 10, 1) == 1


@pytest.mark.parametrize("obj, field", [
    ([], "<line>"),
    ({"statement": "s", "generator": "g", "submissions": []}, "id"),
    ({"id": 3, "statement": "s", "generator": "g"}, "id"),
    ({"id": "a", "statement": "s", "generator": "g"}, "submissions"),
    ({"id": "a", "statement": "s", "generator": "g", "submissions": []},
     "submissions"),
    ({"id": "a", "statement": "s", "generator": "g",
      "submissions": [{"language": "go", "source": ""}]},
     "submissions[0].language"),
    ({"id": "a", "statement": "s", "generator": "g",
      "submissions": [{"language": "cpp"}]}, "submissions[0].source"),
])
def test_validate_problem_names_the_field(obj, field):
  with pytest.raises(ProblemFormatError) as info:
    validate_problem(obj)
  assert info.value.field == field


# -- with the sandbox ---------------------------------------------------------

def test_generator_runs_cyaron_in_the_sandbox_with_distinct_seeds(sandbox):
  gen = _problems()["sum"]["generator"]
  config = TestGenConfig()
  a = run_generator(sandbox, gen, [1, 2, 1], config)
  assert a[0] is not None and a[0] == a[2] and a[0] != a[1]
  n, *rest = a[0].split("\n")
  assert len(rest[0].split()) == int(n)


@pytest.mark.slow
def test_small_config_keeps_good_and_rejects_buggy(sandbox):
  problems = _problems()
  config = TestGenConfig(num_inputs=12, min_valid_cases=8)
  kept = generate_tests(problems["sum"], sandbox, config)
  assert kept.kept, kept
  assert len(kept.tests) >= 8
  # The generated tests work as a code reward and catch the buggy submission.
  record = {"id": "sum", "prompt": "", "tests": list(kept.tests)}
  subs = problems["sum"]["submissions"]
  results = score_all(CodeReward(sandbox), [record] * 2,
                      [subs[0]["source"], subs[-1]["source"]])
  assert [r.correct for r in results] == [True, False]
  buggy = generate_tests(problems["max-two-buggy"], sandbox, config)
  assert not buggy.kept and "submissions pass" in buggy.reason


@pytest.mark.slow
def test_cli_runs_file_with_report_defaults(tmp_path):
  out = tmp_path / "kept.jsonl"
  cmd = [sys.executable, os.path.join(ROOT, "launch", "testgen.py"),
         "--input", PROBLEMS, "--output", str(out), "--workers", "2"]
  proc = subprocess.run(cmd, capture_output=True, text=True, timeout=240)
  # Malformed lines make the exit status 1, after every other problem ran.
  assert proc.returncode == 1, proc.stderr
  err = proc.stderr
  assert f"{PROBLEMS}:2: malformed JSON" in err
  assert f"{PROBLEMS}:3: field 'generator': missing" in err
  assert f"{PROBLEMS}:4: field 'submissions[1].language': unknown language " \
         "'rust'" in err
  assert "max-two-buggy rejected: only 8 of 10 submissions pass" in err
  assert "sum-split-vote rejected: only" in err and "valid cases" in err
  assert "broken-generator rejected: generator produced no inputs" in err
  assert "testgen" in err and "problem" in err  # the tqdm bar
  kept = [json.loads(line) for line in out.read_text().splitlines()]
  assert [k["id"] for k in kept] == ["sum"]
  tests = kept[0]["tests"]
  assert len(tests) >= 40 and all(set(t) == {"input", "output"} for t in tests)
  assert kept[0]["testgen"]["passing_submissions"] == "9/10"
  # A rerun skips what is already in the output and appends nothing.
  again = tmp_path / "again.jsonl"
  with open(PROBLEMS) as f:
    again.write_text(f.readline())  # just "sum"
  before = out.read_text()
  rerun = [sys.executable, cmd[1], "--input", str(again), "--output",
           str(out), "--no-progress"]
  proc = subprocess.run(rerun, capture_output=True, text=True, timeout=60)
  assert proc.returncode == 0, proc.stderr
  assert out.read_text() == before
  assert "kept 0, rejected 0, skipped (already done) 1" in proc.stderr
