"""The table-inversion task (kimi_jax/data/reflect.py), its verifier, its
place in the gym pipeline, `by_difficulty` in evaluations, and
experiments/reflect_tiny.py:micro end to end."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import numpy as np
import pytest

from experiments import reflect_tiny
from kimi_jax.curation import gym_pipeline, text_tokenizer
from kimi_jax.curation.gym_problems import (GymConfig, problem_sets,
                                            validation_set, vanilla_problems)
from kimi_jax.data import reflect
from kimi_jax.rewards.registry import make_reward
from kimi_jax.rl import evaluation

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

# f on {0, 2, 5, 8}: 0 -> 5 -> 8 -> 2 -> 0, listed 82 05 20 58. Two steps
# to 8: f(f(x)) = 8 means f(x) = 5, so x = 0, the second candidate.
TABLE = ((8, 2), (0, 5), (2, 0), (5, 8))
PROBLEM = reflect.Problem(table=TABLE, steps=2, target=8, level=2)


def _record(problem=PROBLEM, plain_budget=2):
  return reflect.to_record(problem, 0, 0, plain_budget=plain_budget)


def test_hand_computed_problem_prompt_answer_and_search():
  assert PROBLEM.prompt() == "82 05 20 58 ?>>8"
  assert PROBLEM.chain(8) == [2, 0] and PROBLEM.chain(0) == [5, 8]
  assert PROBLEM.answer() == 0
  assert reflect.attempt(PROBLEM, 8) == "820:8-"
  assert reflect.full_search(PROBLEM) == "820:8- 058:8+ =0"
  assert reflect.search(PROBLEM, 1) == "820:8- =0"
  assert reflect.search(PROBLEM, 0) == "=0"
  record = _record()
  assert record["answer"] == "0" and record["difficulty"] == 2.0
  assert record["tags"] == ["level2"]
  assert reflect.problem_of(record) == PROBLEM


def test_worked_solutions_by_style():
  rng = np.random.default_rng(0)
  record = _record()
  assert reflect.worked_solution(record, "direct", rng) == "=0"
  assert reflect.worked_solution(record, "cued", rng) == "820:8- 058:8+ =0"
  plain = {reflect.worked_solution(record, "plain", rng) for _ in range(50)}
  assert plain == {"820:8- =0", "820:8- 058:8+ =0"}
  assert reflect.worked_solution(_record(plain_budget=0), "plain",
                                 rng) == "=0"
  with pytest.raises(ValueError, match="style"):
    reflect.worked_solution(record, "cot", rng)


@pytest.mark.parametrize("response, correct, verified, why", [
    ("820:8- 058:8+ =0", True, True, None),
    ("058:8+ =0", True, True, None),  # the shortest checked response
    ("=0", True, False, "not checked"),  # a lucky bare answer
    ("820:8- =0", True, False, "not checked"),
    ("821:8- 058:8+ =0", True, False, "attempt 1"),  # a wrong lookup
    ("820:8+ 058:8+ =0", True, False, "attempt 1"),  # a wrong verdict
    ("820:0+ 058:8+ =0", True, False, "attempt 1"),  # a wrong target
    ("820:8- 058:8+ =8", False, False, None),
    ("820:8- 058:8+", False, False, None),  # no answer
    ("820- 058+ =0", True, False, "malformed"),  # no target copied
    ("920:8- 058:8+ =0", True, False, "not in the table"),
])
def test_rewards_on_hand_written_responses(response, correct, verified, why):
  record = _record()
  plain = make_reward("reflect")(record, response)
  steps = make_reward("reflect_steps")(record, response)
  assert plain.correct == steps.correct == correct
  assert plain.score == float(correct)
  assert steps.score == float(verified)
  if why is not None:
    assert why in steps.info["wrong_step"]


def test_records_are_distinct_seeded_balanced_and_right():
  records = reflect.make_records(400, seed=3)
  assert records == reflect.make_records(400, seed=3)
  assert records != reflect.make_records(400, seed=4)
  assert len({r["prompt"] for r in records}) == 400
  assert [r["difficulty"] for r in records[:8]] == [1, 2, 3, 4] * 2
  for r in records:
    spec = r[reflect.DATASET]
    f = {s: t for s, t in spec["table"]}
    size, steps = reflect.LEVELS[spec["level"]]
    assert len(f) == size and sorted(f) == sorted(f.values())
    assert all(s != t for s, t in f.items())  # no fixed point

    def power(x):
      for _ in range(steps):
        x = f[x]
      return x
    # Exactly one source reaches the target, and it is the answer.
    assert [x for x in f if power(x) == spec["target"]] == [int(r["answer"])]
  with pytest.raises(ValueError, match="levels"):
    reflect.make_records(4, levels=[5])


def test_gym_sets_of_the_task_do_not_overlap():
  cfg = GymConfig(datasets=reflect.DATASET, size=300, eval_size=100,
                  val_size=100, prompt_suffix="", options_json=json.dumps(
                      reflect_tiny.OPTIONS))
  train, held = problem_sets(cfg)
  val, sft = validation_set(cfg), vanilla_problems(cfg, 500)
  sets = [{r["prompt"] for r in rows} for rows in (train, held, val, sft)]
  assert [len(s) for s in sets] == [300, 100, 100, 500]
  assert len(set().union(*sets)) == 1000
  for rows in (held, val):
    levels = [r["difficulty"] for r in rows]
    assert {l: levels.count(l) for l in set(levels)} == {
        1.0: 25, 2.0: 25, 3.0: 25, 4.0: 25}


def test_vanilla_rows_mix_bare_short_and_cued_full_searches():
  pipe = gym_pipeline.PipelineConfig(direct_fraction=0.2, cued_fraction=0.5,
                                     cot_cue=reflect_tiny.COT_CUE)
  records = reflect.make_records(400, seed=0)
  rows = gym_pipeline.sft_rows(records, pipe, seed=0)
  by_id = {r["id"]: r for r in records}
  kinds = {"bare": 0, "cued": 0, "plain": 0}
  for row in rows:
    problem = reflect.problem_of(by_id[row["id"]])
    assert make_reward("reflect")(by_id[row["id"]], row["response"]).correct
    if row["prompt"].endswith(reflect_tiny.COT_CUE):
      assert row["response"] == reflect.full_search(problem)
      kinds["cued"] += 1
    elif row["response"].startswith("="):
      kinds["bare"] += 1
    else:
      assert row["response"] in {reflect.search(problem, 1),
                                 reflect.search(problem, 2)}
      kinds["plain"] += 1
  assert 50 <= kinds["bare"] <= 110 and 120 <= kinds["cued"] <= 200


def test_pipeline_tokenizer_gives_each_character_one_token():
  """Digits, `+`, `-`, `=` and `>` are single tokens, and the cue's words
  cannot swallow any piece of a response (responses have no letters)."""
  records = reflect.make_records(40, seed=0)
  groups = {reflect.DATASET: [r["prompt"] for r in records],
            "vanilla_sft": [r["prompt"] + reflect_tiny.COT_CUE
                            for r in records]}
  tok = text_tokenizer.build(text_tokenizer.frequent_words(groups, 0.1))
  assert {" every", " candidate", "Check"} <= set(tok.get_vocab())
  response = reflect.full_search(reflect.problem_of(records[3]))
  ids = tok.encode(records[3]["prompt"] + response,
                   add_special_tokens=False).ids
  assert len(ids) == len(records[3]["prompt"]) + len(response)
  assert len(tok.get_vocab()) <= reflect_tiny.get_config().model.vocab_size
  cue = tok.encode(reflect_tiny.COT_CUE, add_special_tokens=False).ids
  assert len(cue) == 5


def test_by_difficulty_hand_computed():
  # Problems 0, 1 at level 1; problem 2 at level 10; problem 3 has none.
  difficulty = np.array([1, 1, 1, 1, 10, 10, np.nan, np.nan], np.float64)
  correct = np.array([1, 0, 1, 1, 0, 1, 1, 1], bool)
  length = np.array([4, 6, 8, 10, 20, 30, 1, 1])
  problem = np.array([0, 0, 1, 1, 2, 2, 3, 3])
  got = evaluation.by_difficulty(difficulty, correct, length, problem)
  assert list(got) == ["1", "10"]  # numeric order, not "1" < "10" by luck
  assert got["1"] == {"pass_at_1": 0.75, "mean_length": 7.0,
                      "n_problems": 2}
  assert got["10"] == {"pass_at_1": 0.5, "mean_length": 25.0,
                       "n_problems": 1}
  assert evaluation.by_difficulty(np.full(2, np.nan), correct[:2],
                                  length[:2], problem[:2]) == {}
  assert evaluation.difficulty_of({"difficulty": "3"}) == 3.0
  assert np.isnan(evaluation.difficulty_of({}))


def test_micro_config_validates():
  gym_pipeline.check(reflect_tiny.get_config("micro"))
  gym_pipeline.check(reflect_tiny.get_config())
  with pytest.raises(ValueError, match="unknown variant"):
    reflect_tiny.get_config("huge")


@pytest.mark.slow
def test_micro_end_to_end_summary_by_difficulty(tmp_path):
  workdir = str(tmp_path / "w")
  cmd = [sys.executable, "launch/tpu_run.py", "--config",
         "experiments/reflect_tiny.py:micro", "--workdir", workdir]
  env = dict(os.environ, JAX_PLATFORMS="cpu")
  done = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True,
                        text=True, timeout=900)
  assert done.returncode == 0, done.stderr[-3000:]
  with open(os.path.join(workdir, "summary.json")) as f:
    summary = json.load(f)
  micro = reflect_tiny.get_config("micro")
  levels = json.loads(micro.gym.options_json)[reflect.DATASET]["levels"]
  for key in ("vanilla_eval", "warmstart_eval", "final_eval", "vanilla_val",
              "warmstart_val", "final_val"):
    split = summary[key]
    by_level = split["by_difficulty"]
    # Levels as strings, listed and sortable from easiest to hardest.
    assert list(by_level) == sorted(by_level, key=float) == sorted(by_level)
    assert list(by_level) == [str(l) for l in levels]
    for level in by_level.values():
      assert set(level) == {"pass_at_1", "mean_length", "n_problems"}
      assert 0 <= level["pass_at_1"] <= 1 and level["mean_length"] > 0
    # Every problem counted once, and the levels' shares add up to the
    # overall figures (each level has as many problems as the next).
    assert sum(l["n_problems"] for l in by_level.values()) == split[
        "n_problems"]
    assert np.mean([l["pass_at_1"] for l in by_level.values()]) == \
        pytest.approx(split["pass_at_1"])
    assert np.mean([l["mean_length"] for l in by_level.values()]) == \
        pytest.approx(split["mean_length"])
  # The held-out and validation problems are the task's, by level.
  paths = gym_pipeline.Paths(workdir)
  held = [json.loads(l) for l in open(paths.eval)]
  assert all(reflect.DATASET in r for r in held)
  assert summary["warmup"]["rows"] > 0
