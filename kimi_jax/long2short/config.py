"""The long2short sections of an experiment config, typed.

A long2short experiment is a main-job config (the long-CoT run,
experiments/long2short_tiny.py) or a gym-pipeline config (the long-CoT
model is the pipeline's RL stage, experiments/long2short_reflect.py) plus
five sections, each a frozen dataclass here whose errors name
`config.<section>.<key>`:

- `l2s`: where the long-CoT and short-only models come from, how the
  long model is sampled for shortest rejection sampling and DPO, and the
  held-out evaluation every model gets;
- `merge`: model merging (report 2.4), the interpolation weight;
- `shortest_rs`: shortest rejection sampling's SFT;
- `dpo`: DPO on shortest-correct vs long/incorrect pairs;
- `l2s_rl`: the second RL phase, what it changes in the `rl` section.

`l2s_config(config)` reads all five; `check_long2short` relates them to the
main job's typed config.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping

from kimi_jax.data.pointer_chase import PointerChaseConfig
from kimi_jax.infra.config import ConfigError, to_dataclass
from kimi_jax.train_step import AdamWConfig

SECTIONS = ("l2s", "merge", "shortest_rs", "dpo", "l2s_rl")
SHORT_STYLES = ("direct", "plain")
METHODS = ("long", "short_baseline", "merge", "shortest_rs", "dpo", "l2s_rl")


def _positive(section: str, obj: Any, *keys: str) -> None:
  for key in keys:
    if getattr(obj, key) <= 0:
      raise ValueError(f"config.{section}.{key} must be positive, got "
                       f"{getattr(obj, key)}")


def _non_negative(section: str, obj: Any, *keys: str) -> None:
  for key in keys:
    if getattr(obj, key) < 0:
      raise ValueError(f"config.{section}.{key} must be >= 0, got "
                       f"{getattr(obj, key)}")


@dataclasses.dataclass(frozen=True)
class L2SConfig:
  """`config.l2s`.

  base_sft_steps: SFT steps on plain chains from the seeded
    init that make the base model the long and short runs both start from
    (their common ancestor, which merging needs); 0: both start from the
    seeded init. base_seq_len: the base's SFT row length (short chains
    fit rows shorter than the long run's `sft.seq_len`). A gym-pipeline
    config trains no base (its vanilla SFT stage is the ancestor): 0.
  long_workdir / short_workdir: an existing run (a main-job workdir; for
    a gym-pipeline config, a finished pipeline workdir, whose `rl/` is the
    policy) to take the long-CoT / short-only model from; "" trains it in
    WORKDIR/long / WORKDIR/short_baseline.
  short_cot_style: what the short-only baseline's warm start answers
    with: "direct" (the answer alone, a short-CoT model that never saw a
    chain) or "plain" (the plain chain); the same config otherwise (seed,
    base, SFT and RL budgets). A gym-pipeline config's baseline answers
    the plain prompt (no `pipeline.cot_cue`): "plain".
  samples_per_prompt: n responses the long model draws per train prompt,
    shared by shortest rejection sampling and DPO (the report's n = 8).
  sample_prompts: how many train prompts are sampled (0: all of them).
  eval_samples: k draws per held-out problem for pass@1 and token counts.
  eval_val: also evaluate every model on the task's validation problems.
  """

  base_sft_steps: int = 500
  base_seq_len: int = 32
  long_workdir: str = ""
  short_workdir: str = ""
  short_cot_style: str = "plain"
  samples_per_prompt: int = 8
  sample_prompts: int = 0
  eval_samples: int = 8
  eval_val: bool = False

  def __post_init__(self):
    _positive("l2s", self, "samples_per_prompt", "eval_samples",
              "base_seq_len")
    _non_negative("l2s", self, "base_sft_steps", "sample_prompts")
    if self.short_cot_style not in SHORT_STYLES:
      raise ValueError(f"config.l2s.short_cot_style must be one of "
                       f"{SHORT_STYLES}, got {self.short_cot_style!r}")


@dataclasses.dataclass(frozen=True)
class MergeConfig:
  """`config.merge`: merged = alpha * long + (1 - alpha) * short, weight by
  weight (alpha = 0.5 is the report's simple average)."""

  alpha: float = 0.5

  def __post_init__(self):
    if not 0.0 <= self.alpha <= 1.0:
      raise ValueError(f"config.merge.alpha must be in [0, 1], got "
                       f"{self.alpha}")


@dataclasses.dataclass(frozen=True)
class ShortestRSConfig:
  """`config.shortest_rs`: SFT of the long model on the shortest correct of
  its `l2s.samples_per_prompt` responses per prompt."""

  steps: int = 100
  batch_size: int = 64
  learning_rate: float = 3e-4
  warmup_steps: int = 10

  def __post_init__(self):
    _positive("shortest_rs", self, "steps", "batch_size", "learning_rate")
    _non_negative("shortest_rs", self, "warmup_steps")


@dataclasses.dataclass(frozen=True, kw_only=True)
class DPOConfig(AdamWConfig):
  """`config.dpo`: pairs (shortest correct, an incorrect response or a
  correct one longer than `long_ratio` x the shortest correct), DPO loss
  with temperature `beta` against the frozen long model, `steps` AdamW
  steps over packed batches of at most `batch_pairs` pairs. `nll_weight`:
  weight of a per-token negative log-likelihood term on the chosen
  responses (0: the report's plain DPO). The optimizer's settings are
  AdamWConfig's. A checkpoint every `checkpoint_every` steps lets a rerun
  continue after a kill (`kimi_jax.step_loop`)."""

  beta: float = 0.1
  long_ratio: float = 1.5
  steps: int = 100
  batch_pairs: int = 32
  learning_rate: float = 3e-4
  warmup_steps: int = 10
  nll_weight: float = 0.0
  checkpoint_every: int = 100

  def __post_init__(self):
    _positive("dpo", self, "beta", "steps", "batch_pairs", "learning_rate",
              "grad_clip", "checkpoint_every")
    _non_negative("dpo", self, "nll_weight")
    if self.long_ratio < 1.0:
      raise ValueError(f"config.dpo.long_ratio must be >= 1, got "
                       f"{self.long_ratio}")
    _non_negative("dpo", self, "warmup_steps")


@dataclasses.dataclass(frozen=True)
class L2SRLConfig:
  """`config.l2s_rl`: the second RL phase from the long model (report
  2.4). Each key replaces the `rl` key of the same name: a larger length
  penalty weight (warm-up 0: it applies from the first iteration) and a
  shorter maximum rollout; the rest of `rl` is the long run's."""

  iterations: int = 30
  length_reward_weight: float = 1.0
  length_reward_warmup: int = 0
  max_response_len: int = 32
  token_budget: int = 16
  learning_rate: float = 2e-4

  def __post_init__(self):
    _positive("l2s_rl", self, "iterations", "max_response_len",
              "token_budget", "learning_rate")
    if self.length_reward_weight < 0 or self.length_reward_warmup < 0:
      raise ValueError("config.l2s_rl.length_reward_weight and "
                       "length_reward_warmup must be >= 0")
    if self.token_budget > self.max_response_len:
      raise ValueError(f"config.l2s_rl.token_budget ({self.token_budget}) is "
                       f"larger than config.l2s_rl.max_response_len "
                       f"({self.max_response_len})")

  def rl_overrides(self) -> dict[str, Any]:
    """The `rl` keys this phase sets."""
    return dataclasses.asdict(self)


@dataclasses.dataclass(frozen=True)
class Long2ShortConfig:
  l2s: L2SConfig
  merge: MergeConfig
  shortest_rs: ShortestRSConfig
  dpo: DPOConfig
  l2s_rl: L2SRLConfig


def l2s_config(config: Mapping[str, Any]) -> Long2ShortConfig:
  """The five long2short sections of `config`, typed."""
  missing = [s for s in SECTIONS if s not in config]
  if missing:
    raise ConfigError(f"config: missing long2short sections {missing}")
  return Long2ShortConfig(
      l2s=to_dataclass(L2SConfig, config["l2s"], "l2s"),
      merge=to_dataclass(MergeConfig, config["merge"], "merge"),
      shortest_rs=to_dataclass(ShortestRSConfig, config["shortest_rs"],
                               "shortest_rs"),
      dpo=to_dataclass(DPOConfig, config["dpo"], "dpo"),
      l2s_rl=to_dataclass(L2SRLConfig, config["l2s_rl"], "l2s_rl"))


def _check_task_models(l2s: Long2ShortConfig, job) -> None:
  """The long and short models of a main-job config: a task whose warm
  start has a style to change."""
  if not isinstance(job.task, PointerChaseConfig):
    raise ConfigError("config.task.name: long2short's short-only baseline "
                      "changes config.task.cot_style, which only the "
                      "pointer_chase task has (a gym-pipeline config, "
                      "experiments/long2short_reflect.py, changes its "
                      "warm-up rows instead)")
  if l2s.l2s.short_cot_style == job.task.cot_style:
    raise ConfigError(f"config.l2s.short_cot_style ({l2s.l2s.short_cot_style!r}"
                      f") must differ from config.task.cot_style, or the "
                      f"short-only baseline is the long model's recipe")


def _check_pipeline_models(l2s: Long2ShortConfig) -> None:
  """The long and short models of a gym-pipeline config: both from its
  vanilla model, the baseline's warm-up on the plain prompt."""
  if l2s.l2s.base_sft_steps:
    raise ConfigError(
        f"config.l2s.base_sft_steps ({l2s.l2s.base_sft_steps}) must be 0 "
        f"for a gym-pipeline config: its vanilla SFT stage "
        f"(pipeline.vanilla_sft_steps) is the common ancestor")
  if l2s.l2s.short_cot_style != "plain":
    raise ConfigError(
        f"config.l2s.short_cot_style ({l2s.l2s.short_cot_style!r}) must be "
        f"'plain' for a gym-pipeline config: its short-only baseline's "
        f"warm-up rows answer the plain prompt, without the cue")


def _has_val(task) -> bool:
  """Whether a typed task section has validation problems (a jsonl task's
  val_path, pointer chasing's val_fraction)."""
  return bool(getattr(task, "val_path", "") or
              getattr(task, "val_fraction", 0.0))


def check_long2short(l2s: Long2ShortConfig, job, *, pipeline: bool = False
                     ) -> None:
  """Rules relating the long2short sections to the main job's typed config
  (`kimi_jax.job.experiment.ExperimentConfig`; for a gym-pipeline config,
  `pipeline=True`, that of its RL stage); raises ConfigError naming
  keys."""
  if pipeline:
    _check_pipeline_models(l2s)
  else:
    _check_task_models(l2s, job)
  if l2s.l2s.eval_val and not _has_val(job.task):
    raise ConfigError("config.l2s.eval_val: the task has no validation "
                      "problems (task.val_path, task.val_fraction or "
                      "gym.val_size)")
  if l2s.l2s_rl.max_response_len >= job.rl.max_response_len:
    raise ConfigError(
        f"config.l2s_rl.max_response_len ({l2s.l2s_rl.max_response_len}) "
        f"must cut config.rl.max_response_len ({job.rl.max_response_len}): "
        f"the report's long2short RL reduces the maximum rollout length")
  if l2s.l2s_rl.length_reward_weight <= job.rl.length_reward_weight:
    raise ConfigError(
        f"config.l2s_rl.length_reward_weight "
        f"({l2s.l2s_rl.length_reward_weight}) must exceed "
        f"config.rl.length_reward_weight ({job.rl.length_reward_weight}): "
        f"the second phase raises the length penalty")
