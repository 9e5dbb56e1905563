"""`make_reward(name, **options)`: build a reward function by name.

  make_reward("math", timeout_s=5.0, num_workers=4)
  make_reward("reasoning_gym", answer_tag="answer", partial_credit=False)
  make_reward("code", executor=Sandbox(...))       # or sandbox_url="http://..."

Options are the fields of the reward's config dataclass (MathRewardConfig,
ReasoningGymRewardConfig, CodeRewardConfig); an unknown option raises
TypeError naming it.

The reward-model rewards (`MODEL_REWARDS`) run a model on the job's mesh,
so they are built one layer up, by
`kimi_jax.reward_models.serving.make_model_reward`; this registry only knows
their names, which the task and config checks need.
"""

from __future__ import annotations

import functools
from typing import Any, Callable

from kimi_jax.rewards.base import RewardFn
from kimi_jax.rewards.code import CodeReward
from kimi_jax.rewards.math import MathReward
from kimi_jax.rewards.pointer_chase import PointerChaseReward
from kimi_jax.rewards.reasoning_gym import ReasoningGymReward
from kimi_jax.rewards.reflect import ReflectReward
from kimi_jax.sandbox import SandboxClient


def _math(**options: Any) -> RewardFn:
  return MathReward(**options)


def _reasoning_gym(**options: Any) -> RewardFn:
  return ReasoningGymReward(**options)


def _reasoning_gym_steps(**options: Any) -> RewardFn:
  return ReasoningGymReward(**dict(options, check_steps=True))


def _code(executor: Any = None, sandbox_url: str | None = None,
          **options: Any) -> RewardFn:
  if sandbox_url is not None:
    if executor is not None:
      raise ValueError("pass either executor or sandbox_url, not both")
    executor = SandboxClient(sandbox_url)
  return CodeReward(executor=executor, **options)


def _without_options(name: str, make: Callable[[], RewardFn]
                     ) -> Callable[..., RewardFn]:
  """The factory of a reward that takes no options (one is an error)."""
  def factory(**options: Any) -> RewardFn:
    if options:
      raise TypeError(f"the {name} reward takes no options, got "
                      f"{sorted(options)}")
    return make()
  return factory


_pointer_chase = _without_options("pointer_chase", PointerChaseReward)
_reflect = _without_options("reflect", ReflectReward)
_reflect_steps = _without_options(
    "reflect_steps", functools.partial(ReflectReward, check_steps=True))


REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": _math,
    "reasoning_gym": _reasoning_gym,
    # The same, with worked steps checked (ReasoningGymRewardConfig).
    "reasoning_gym_steps": _reasoning_gym_steps,
    "code": _code,
    # The tiny synthetic task's exact verifier.
    "pointer_chase": _pointer_chase,
    # Table inversion by trying and checking candidates
    # (kimi_jax/data/reflect.py): the answer, or the answer and every
    # attempt's lookups.
    "reflect": _reflect,
    "reflect_steps": _reflect_steps,
}
# The rewards that run a model on the job's mesh (built by the job).
MODEL_REWARDS = ("rm_value", "rm_cot", "verifier_or_rm_value",
                 "verifier_or_rm_cot")


def needs_model(name: str) -> bool:
  """Whether reward `name` is a reward model the job must build."""
  return name in MODEL_REWARDS


def make_reward(name: str, **options: Any) -> RewardFn:
  """The reward registered under `name`, configured by `options`."""
  if name in MODEL_REWARDS:
    raise ValueError(f"reward {name!r} runs a reward model: build it with "
                     f"kimi_jax.reward_models.serving.make_model_reward")
  try:
    factory = REWARDS[name]
  except KeyError:
    raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)} "
                     f"and the reward models {list(MODEL_REWARDS)}"
                     ) from None
  return factory(**options)
