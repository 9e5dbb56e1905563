"""`make_reward(name, **options)`: build a reward function by name.

  make_reward("math", timeout_s=5.0, num_workers=4)
  make_reward("reasoning_gym", answer_tag="answer", partial_credit=False)
  make_reward("code", executor=Sandbox(...))       # or sandbox_url="http://..."

Options are the fields of the reward's config dataclass (MathRewardConfig,
ReasoningGymRewardConfig, CodeRewardConfig); an unknown option raises
TypeError naming it.
"""

from __future__ import annotations

from typing import Any, Callable

from kimi_jax.rewards.base import RewardFn


def _math(**options: Any) -> RewardFn:
  from kimi_jax.rewards.math import MathReward
  return MathReward(**options)


def _reasoning_gym(**options: Any) -> RewardFn:
  from kimi_jax.rewards.reasoning_gym import ReasoningGymReward
  return ReasoningGymReward(**options)


def _code(executor: Any = None, sandbox_url: str | None = None,
          **options: Any) -> RewardFn:
  from kimi_jax.rewards.code import CodeReward
  if sandbox_url is not None:
    if executor is not None:
      raise ValueError("pass either executor or sandbox_url, not both")
    from kimi_jax.sandbox import SandboxClient
    executor = SandboxClient(sandbox_url)
  return CodeReward(executor=executor, **options)


REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": _math,
    "reasoning_gym": _reasoning_gym,
    "code": _code,
}


def make_reward(name: str, **options: Any) -> RewardFn:
  """The reward registered under `name`, configured by `options`."""
  try:
    factory = REWARDS[name]
  except KeyError:
    raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}"
                     ) from None
  return factory(**options)
