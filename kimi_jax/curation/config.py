"""The config of the data tools (launch/gym_data.py, curate.py,
warmup_data.py): which policy to ask, which reward verifies, and the
`curate` / `warmup` / `gym` sections, typed at the boundary.

  policy.workdir: a kimi_jax run whose checkpoint answers (step -1: the
    latest); or policy.experiment: an experiment spec
    ("experiments/qwen2_5_1_5b.py:cpu_smoke") whose init_from_hf (or
    policy.init_from_hf) names a Hugging Face directory.
  reward.name / reward.options: kimi_jax.rewards.registry.make_reward.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import ml_collections

from kimi_jax.curation import policy as policy_lib
from kimi_jax.curation.curate import CurateConfig
from kimi_jax.curation.warmup import WarmupConfig
from kimi_jax.data.journal import Journal
from kimi_jax.infra.config import ConfigError, load_config, to_dataclass
from kimi_jax.rewards import registry


@dataclasses.dataclass(frozen=True)
class PolicyConfig:
  workdir: str = ""
  step: int = -1
  experiment: str = ""
  init_from_hf: str = ""

  def __post_init__(self):
    if self.workdir and self.experiment:
      raise ValueError("config.policy: set workdir or experiment, not both")


def policy_config(config: ml_collections.ConfigDict) -> PolicyConfig:
  return to_dataclass(PolicyConfig, config.policy, "policy")


def load_policy(cfg: PolicyConfig):
  """The sampler-backed policy the config names."""
  if cfg.workdir:
    return policy_lib.load_policy(
        workdir=cfg.workdir, step=None if cfg.step < 0 else cfg.step)
  if not cfg.experiment:
    raise ConfigError("config.policy: the model steps need a policy: set "
                      "policy.workdir (a kimi_jax run) or policy.experiment "
                      "(+ policy.init_from_hf)")
  overrides = ({"init_from_hf": cfg.init_from_hf} if cfg.init_from_hf
               else {})
  return policy_lib.load_policy(config=load_config(cfg.experiment,
                                                   overrides))


def make_reward(config: ml_collections.ConfigDict):
  options: dict[str, Any] = dict(config.reward.get("options", {}) or {})
  try:
    return registry.make_reward(str(config.reward.name), **options)
  except (TypeError, ValueError) as exc:
    raise ConfigError(f"config.reward: {exc}") from None


def curate_config(config: ml_collections.ConfigDict) -> CurateConfig:
  return to_dataclass(CurateConfig, config.curate, "curate")


def warmup_config(config: ml_collections.ConfigDict) -> WarmupConfig:
  return to_dataclass(WarmupConfig, config.warmup, "warmup")


def sibling_path(out: str, suffix: str) -> str:
  """OUT.jsonl -> OUT<suffix> (e.g. ".rejected.jsonl")."""
  stem = out[:-len(".jsonl")] if out.endswith(".jsonl") else out
  return stem + suffix


def model_journal(path: str, policy: Any, config: ml_collections.ConfigDict):
  """The journal of a data tool's model calls at `path`: results are keyed
  by the weights that answered and the reward that verified them, so a
  rerun with another checkpoint or verifier reuses nothing."""
  return Journal(path, context={
      "policy": getattr(policy, "identity", ""),
      "reward": config.reward.to_dict()})
