"""The `config.reward_model` section: which trained reward model an RL job
scores with, and how it runs (kimi_jax/reward_models/serving.py)."""

from __future__ import annotations

import dataclasses

from kimi_jax.rewards.registry import MODEL_REWARDS


def rm_kind(reward: str) -> str | None:
  """"value" / "cot" for a reward-model reward name, None otherwise."""
  if reward not in MODEL_REWARDS:
    return None
  return "value" if reward.endswith("value") else "cot"


@dataclasses.dataclass(frozen=True)
class RewardModelConfig:
  """`config.reward_model`: the reward model an RL job scores with when
  `task.reward` is one of registry.MODEL_REWARDS.

  path: a reward-model directory (launch/train_rm.py). threshold: the value
    model's P(correct) cut. max_slots / steps_per_call: the CoT model's
    sampler. batch_rows: rows per value forward (a row holds
    template.max_input_len tokens). audit: also run the task's verifier on
    every scored response and log agreement (costs the verifier's time).
  """

  path: str = ""
  threshold: float = 0.5
  max_slots: int = 64
  steps_per_call: int = 16
  batch_rows: int = 16
  audit: bool = False

  def __post_init__(self):
    if not 0.0 < self.threshold < 1.0:
      raise ValueError(f"config.reward_model.threshold must be in (0, 1), "
                       f"got {self.threshold}")
    if self.max_slots < 1 or self.batch_rows < 1 or self.steps_per_call < 1:
      raise ValueError("config.reward_model: max_slots, batch_rows and "
                       "steps_per_call must be >= 1")
