"""make_reward: the name -> reward factory."""

from __future__ import annotations

import pytest

from kimi_jax.rewards.base import BatchRewardFn, RewardFn
from kimi_jax.rewards.code import CodeReward
from kimi_jax.rewards.math import MathReward
from kimi_jax.rewards.reasoning_gym import ReasoningGymReward
from kimi_jax.rewards.registry import REWARDS, make_reward


@pytest.mark.parametrize("name, cls", [("math", MathReward),
                                       ("reasoning_gym", ReasoningGymReward),
                                       ("code", CodeReward)])
def test_make_reward_builds_each_reward(name, cls):
  reward = make_reward(name)
  assert isinstance(reward, cls)
  assert isinstance(reward, RewardFn) and isinstance(reward, BatchRewardFn)
  assert name in REWARDS


def test_options_reach_the_config():
  assert make_reward("math", timeout_s=1.5).config.timeout_s == 1.5
  assert make_reward("reasoning_gym", fallback="last_line").config.fallback \
      == "last_line"
  assert make_reward("code", time_limit_s=3.0).config.time_limit_s == 3.0


def test_bad_names_and_options_are_reported():
  with pytest.raises(ValueError, match="unknown reward 'maths'"):
    make_reward("maths")
  with pytest.raises(TypeError, match="timeout"):
    make_reward("code", timeout=3)
  with pytest.raises(ValueError, match="either executor or sandbox_url"):
    make_reward("code", executor=object(), sandbox_url="http://x")
