"""reasoning-gym datasets as records, scored by their own `score_answer`."""

from __future__ import annotations

import json

import pytest

from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.reasoning_gym import (ReasoningGymReward, dataset_names,
                                            extract_answer, make_records)
from kimi_jax.rewards.registry import make_reward

DATASETS = [("chain_sum", {"min_terms": 2, "max_terms": 4}),
            ("word_sorting", {}),
            ("arc_agi", {})]  # arc_agi's scorer breaks on JSON-mangled entries


def _round_trip(records):
  return json.loads(json.dumps(records))


def test_extract_answer():
  assert extract_answer("<think>x</think><answer> 4 </answer>") == "4"
  assert extract_answer("<answer>1</answer> then <answer>2</answer>") == "2"
  assert extract_answer("no tags\nlast line") is None
  assert extract_answer("no tags\n last line ", fallback="last_line") == \
      "last line"
  assert extract_answer("x", answer_tag=None, fallback="full") == "x"


@pytest.mark.parametrize("name, options", DATASETS)
def test_dataset_records_score_right_and_wrong(name, options):
  records = _round_trip(make_records(name, size=4, seed=3, **options))
  assert [r["id"] for r in records] == [f"rg/{name}/3/{i}" for i in range(4)]
  for r in records:
    assert r["prompt"].startswith(r["question"]) and "<answer>" in r["prompt"]
  reward = make_reward("reasoning_gym")
  right = [f"<think>hm</think>\n<answer>{r['answer']}</answer>"
           for r in records]
  wrong = [f"<answer>{r['answer']} 1</answer>" for r in records]
  untagged = [r["answer"] for r in records]
  assert [x.score for x in score_all(reward, records, right)] == [1.0] * 4
  assert all(x.correct for x in score_all(reward, records, right))
  assert [x.score for x in score_all(reward, records, wrong)] == [0.0] * 4
  results = score_all(reward, records, untagged)
  assert [x.correct for x in results] == [False] * 4
  assert results[0].error == "no answer found"
  # With the last-line fallback the bare answer counts (single-line answers).
  if "\n" not in records[0]["answer"]:
    lenient = ReasoningGymReward(fallback="last_line")
    assert lenient(records[0], "thinking\n" + records[0]["answer"]).correct


def test_records_are_reproducible_and_checked():
  a = make_records("chain_sum", size=3, seed=11)
  assert a == make_records("chain_sum", size=3, seed=11)
  assert a != make_records("chain_sum", size=3, seed=12)
  tampered = dict(a[0], question="What is 1 + 1?")
  res = score_all(ReasoningGymReward(), [tampered], ["<answer>2</answer>"])[0]
  assert not res.correct and "differs" in res.error


def test_partial_credit_option():
  records = make_records("word_sorting", size=1, seed=0)
  response = f"<answer>{records[0]['answer']} extra</answer>"
  strict = ReasoningGymReward()(records[0], response)
  lenient = ReasoningGymReward(partial_credit=True,
                               correct_threshold=1.0)(records[0], response)
  assert strict.score == 0.0
  assert 0.0 < lenient.score < 1.0  # word_sorting gives a fractional score
  assert lenient.score == lenient.info["raw_score"]
  assert not lenient.correct


def test_every_name_is_listed():
  names = dataset_names()
  assert {"chain_sum", "word_sorting", "arc_agi"} <= set(names)


def test_check_steps_scores_a_right_answer_after_a_wrong_step_zero():
  from kimi_jax.rewards.gym_solutions import solution
  from kimi_jax.rewards.base import RewardResult
  from tests.worked import good_and_lucky
  record = make_records("chain_sum", size=3, seed=0, min_terms=3,
                        max_terms=3, min_digits=1, max_digits=1)[0]
  good, bad = good_and_lucky(record)
  checked = make_reward("reasoning_gym_steps")
  plain = make_reward("reasoning_gym")
  assert plain(record, bad).score == 1.0  # the answer alone is right
  assert plain(record, bad).verified
  result = checked(record, bad)
  assert (result.score, result.correct, result.verified) == (0.0, True,
                                                             False)
  assert result.info["wrong_step"].startswith("step 1:")
  assert checked(record, good).score == 1.0
  assert checked(record, good).verified
  assert not RewardResult(1.0, False).verified
  assert checked(record, solution(record, "direct")).score == 1.0
  wrong = good.replace(f"<answer>{record['answer']}<", "<answer>999<")
  assert checked(record, wrong).score == 0.0
  assert "wrong_step" not in checked(record, wrong).info
