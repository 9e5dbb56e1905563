"""`make_reward(name, **options)`: build a reward function by name.

  make_reward("math", timeout_s=5.0, num_workers=4)
  make_reward("reasoning_gym", answer_tag="answer", partial_credit=False)
  make_reward("code", executor=Sandbox(...))       # or sandbox_url="http://..."

Options are the fields of the reward's config dataclass (MathRewardConfig,
ReasoningGymRewardConfig, CodeRewardConfig); an unknown option raises
TypeError naming it.

Reward models (kimi_jax/reward_models, docs/rewards.md) run on a
mesh, so they take the job's sharder and the task's rule-based verifier
(for "verifier_or_*" and the audit), and a reward-model directory or a
loaded model; other options are RewardModelConfig's fields:

  make_reward("rm_value", sharder=s, verifier=v, path="/runs/rm/value")
  make_reward("rm_cot", sharder=s, verifier=v, model=loaded_cot_model)
  make_reward("verifier_or_rm_cot", sharder=s, verifier=v, path=...)
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


def _reasoning_gym_steps(**options: Any) -> RewardFn:
  from kimi_jax.rewards.reasoning_gym import ReasoningGymReward
  return ReasoningGymReward(**dict(options, check_steps=True))


def _code(executor: Any = None, sandbox_url: str | None = None,
          **options: Any) -> RewardFn:
  from kimi_jax.rewards.code import CodeReward
  if sandbox_url is not None:
    if executor is not None:
      raise ValueError("pass either executor or sandbox_url, not both")
    from kimi_jax.sandbox import SandboxClient
    executor = SandboxClient(sandbox_url)
  return CodeReward(executor=executor, **options)


def _reward_model(name: str) -> Callable[..., RewardFn]:
  def factory(*, sharder: Any, verifier: RewardFn, model: Any = None,
              path: str = "", **options: Any) -> RewardFn:
    from kimi_jax.reward_models import serving, store
    from kimi_jax.reward_models.config import RewardModelConfig
    cfg = RewardModelConfig(path=path, **options)
    if model is None:
      if not path:
        raise ValueError(f"reward {name!r} needs a reward model: pass path "
                         f"(a directory from launch/train_rm.py) or model")
      model = store.load(path, sharder)
    return serving.reward_from_model(name, model, sharder, cfg, verifier)
  return factory


def _pointer_chase(**options: Any) -> RewardFn:
  from kimi_jax.data.pointer_chase import PointerChaseReward
  if options:
    raise TypeError(f"the pointer_chase reward takes no options, got "
                    f"{sorted(options)}")
  return PointerChaseReward()


REWARDS: dict[str, Callable[..., RewardFn]] = {
    "math": _math,
    "reasoning_gym": _reasoning_gym,
    # The same, with worked steps checked (ReasoningGymRewardConfig).
    "reasoning_gym_steps": _reasoning_gym_steps,
    "code": _code,
    # Reward models: need the job's sharder (see the module doc).
    "rm_value": _reward_model("rm_value"),
    "rm_cot": _reward_model("rm_cot"),
    "verifier_or_rm_value": _reward_model("verifier_or_rm_value"),
    "verifier_or_rm_cot": _reward_model("verifier_or_rm_cot"),
    # The tiny synthetic task's exact verifier (kimi_jax/data/pointer_chase).
    "pointer_chase": _pointer_chase,
}
# The rewards that run a model on the job's mesh (built by the job).
MODEL_REWARDS = ("rm_value", "rm_cot", "verifier_or_rm_value",
                 "verifier_or_rm_cot")


def needs_model(name: str) -> bool:
  """Whether reward `name` is a reward model the job must build."""
  return name in MODEL_REWARDS


def make_reward(name: str, **options: Any) -> RewardFn:
  """The reward registered under `name`, configured by `options`."""
  try:
    factory = REWARDS[name]
  except KeyError:
    raise ValueError(f"unknown reward {name!r}; known: {sorted(REWARDS)}"
                     ) from None
  return factory(**options)
