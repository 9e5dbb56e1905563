"""Prompt sampling: prioritisation frequencies, curriculum phases, state."""

import json

import numpy as np
import pytest

from kimi_jax.rl.prompt_sampling import PromptSampler, PromptSamplingConfig

# df = 4 chi-square critical value at p = 0.001.
CHI2_CRIT_DF4 = 18.47


def _records(difficulties):
  return [{"id": f"p{i}", "difficulty": d} for i, d in enumerate(difficulties)]


def _counts(sampler, rng, draws, iteration=0):
  counts = np.zeros(sampler.num_problems)
  for _ in range(draws):
    for i in sampler.sample(iteration, 1, rng):
      counts[i] += 1
  return counts


def test_prioritized_frequencies_follow_one_minus_success_with_floor():
  cfg = PromptSamplingConfig(prioritized=True, priority_floor=0.1,
                             success_tracking="mean")
  sampler = PromptSampler(_records([0] * 5), cfg)
  # With running means the tracked rates are exactly these pass rates.
  sampler.update([0, 1, 2, 3, 4], [0.0, 0.5, 0.8, 1.0, 0.95])
  np.testing.assert_allclose(sampler.success_rates(),
                             [0.0, 0.5, 0.8, 1.0, 0.95])
  # Weights by hand: 1, 0.5, 0.2, floor 0.1, floor 0.1 (sum 1.9).
  want_p = np.array([1.0, 0.5, 0.2, 0.1, 0.1]) / 1.9
  draws = 20000
  counts = _counts(sampler, np.random.default_rng(0), draws)
  expected = want_p * draws
  chi2 = float(np.sum((counts - expected) ** 2 / expected))
  assert chi2 < CHI2_CRIT_DF4, (counts, expected)


def test_uniform_without_prioritization():
  sampler = PromptSampler(_records([0] * 5), PromptSamplingConfig())
  sampler.update([0, 1], [1.0, 1.0])       # ignored for weighting
  counts = _counts(sampler, np.random.default_rng(1), 10000)
  expected = np.full(5, 2000.0)
  assert float(np.sum((counts - expected) ** 2 / expected)) < CHI2_CRIT_DF4


def test_success_tracking_ema_and_mean_by_hand():
  ema = PromptSampler(_records([0, 0]), PromptSamplingConfig(
      success_tracking="ema", ema_decay=0.5, initial_success=0.2))
  ema.update([0, 0, 0], [1.0, 0.0, 0.5])
  # 0.2 -> 0.5*0.2+0.5*1 = 0.6 -> 0.3 -> 0.5*0.3+0.5*0.5 = 0.4
  np.testing.assert_allclose(ema.success_rates(), [0.4, 0.2])
  mean = PromptSampler(_records([0, 0]), PromptSamplingConfig(
      success_tracking="mean", initial_success=0.2))
  mean.update([1, 1, 1], [1.0, 0.0, 0.5])
  np.testing.assert_allclose(mean.success_rates(), [0.2, 0.5])


def test_without_replacement_and_overflow():
  sampler = PromptSampler(_records([0] * 4), PromptSamplingConfig(
      prioritized=True))
  rng = np.random.default_rng(2)
  for _ in range(20):
    got = sampler.sample(0, 4, rng)
    assert sorted(got) == [0, 1, 2, 3]
  got = sampler.sample(0, 10, rng)           # 2 full passes + 2 distinct
  counts = np.bincount(got, minlength=4)
  assert sorted(counts.tolist()) == [2, 2, 3, 3]


def test_curriculum_warmup_then_hard():
  diffs = [1, 5, 2, 8, 5]
  sampler = PromptSampler(_records(diffs), PromptSamplingConfig(
      curriculum="warmup_then_hard", warmup_iterations=3, hard_threshold=5))
  rng = np.random.default_rng(3)
  for it in range(3):
    assert sorted(sampler.sample(it, 5, rng)) == [0, 1, 2, 3, 4]
  for it in (3, 4, 10):
    got = sampler.sample(it, 3, rng)
    assert sorted(got) == [1, 3, 4]
  # Hard problems only even when asking for more than exist.
  assert set(sampler.sample(3, 7, rng)) == {1, 3, 4}


def test_curriculum_stages_easy_to_hard_with_priorities():
  diffs = [1, 2, 3, 1, 2, 3]
  cfg = PromptSamplingConfig(curriculum="stages",
                             stages=((0, 1), (2, 2), (5, 3)),
                             prioritized=True)
  sampler = PromptSampler(_records(diffs), cfg)
  rng = np.random.default_rng(4)
  table = {0: [0, 3], 1: [0, 3], 2: [0, 1, 3, 4], 4: [0, 1, 3, 4],
           5: [0, 1, 2, 3, 4, 5], 99: [0, 1, 2, 3, 4, 5]}
  for it, want in table.items():
    assert sorted(sampler.sample(it, len(want), rng)) == want
  # Prioritization acts within the stage: a solved easy problem is drawn
  # rarely (weight floor 0.05 against 1).
  sampler.update([0], [1.0])
  sampler.update([0], [1.0])
  counts = _counts(sampler, rng, 2000, iteration=0)
  s0 = sampler.success_rates()[0]          # EMA: 0.19 after two passes
  p0 = (1 - s0) / ((1 - s0) + 1.0)
  assert abs(counts[0] / 2000 - p0) < 0.04
  assert counts[[1, 2, 4, 5]].sum() == 0


def test_missing_difficulty_names_record_and_field():
  records = _records([1, 2, 3])
  del records[2]["difficulty"]
  with pytest.raises(ValueError, match=r"records\[2\].*'difficulty'"):
    PromptSampler(records, PromptSamplingConfig(
        curriculum="warmup_then_hard", hard_threshold=2))
  # Without a curriculum the label is not needed.
  PromptSampler(records, PromptSamplingConfig(prioritized=True))


def test_record_ids_must_be_unique():
  with pytest.raises(ValueError, match="'b' repeats"):
    PromptSampler([{"id": "a"}, {"id": "b"}, {"id": "b"}],
                  PromptSamplingConfig())
  with pytest.raises(ValueError, match=r"records\[1\] has no field 'id'"):
    PromptSampler([{"id": "a"}, {"name": "b"}], PromptSamplingConfig())


def test_config_validation():
  with pytest.raises(ValueError, match="first start_iteration is 0"):
    PromptSamplingConfig(curriculum="stages", stages=((1, 2),))
  with pytest.raises(ValueError, match="strictly increasing"):
    PromptSamplingConfig(curriculum="stages", stages=((0, 1), (0, 2)))
  with pytest.raises(ValueError, match="priority_floor"):
    PromptSamplingConfig(priority_floor=0.0)


@pytest.mark.parametrize("tracking", ["ema", "mean"])
def test_state_round_trip_gives_identical_samples(tracking):
  cfg = PromptSamplingConfig(prioritized=True, ema_decay=0.7,
                             success_tracking=tracking)
  records = [{"id": 100 + i} for i in range(12)]
  a = PromptSampler(records, cfg)
  rng = np.random.default_rng(5)
  for it in range(3):
    idx = a.sample(it, 4, rng)
    a.update(idx, [(i % 3) / 3 for i in idx])
  state = json.loads(json.dumps(a.state_dict()))
  b = PromptSampler(records, cfg)
  b.load_state_dict(state)
  np.testing.assert_array_equal(a.success_rates(), b.success_rates())
  rng_a = np.random.default_rng(6)
  rng_b = np.random.default_rng(6)
  fresh = PromptSampler(records, cfg)
  rng_f = np.random.default_rng(6)
  diverged = False
  for it in range(3, 8):
    ia, ib = a.sample(it, 4, rng_a), b.sample(it, 4, rng_b)
    assert ia == ib
    diverged |= ia != fresh.sample(it, 4, rng_f)
    a.update(ia, [0.5] * 4)
    b.update(ib, [0.5] * 4)
  # The statistics matter: an unrestored sampler chooses differently.
  assert diverged


def test_state_from_another_problem_set_raises():
  a = PromptSampler([{"id": "x"}, {"id": "y"}], PromptSamplingConfig())
  a.update([1], [1.0])
  b = PromptSampler([{"id": "x"}, {"id": "z"}], PromptSamplingConfig())
  with pytest.raises(ValueError, match="'y'"):
    b.load_state_dict(a.state_dict())
