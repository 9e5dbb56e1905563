"""The ablation spec: an ablation config parsed and checked, its runs, and
the file names of a sweep directory.

An ablation config (`experiments/ablations.py`) holds a `base` experiment,
its `arms` (name -> the keys that arm changes, as a nested section that
mirrors the base, e.g. `arms.rest.rl.loss = "rest"`) and the `seed_key` that
tells seeds apart. `Ablation.plan(workdir, seeds)` lists one run per arm and
seed, seeds `first_seed` .. `first_seed + seeds - 1`, in
`workdir/<arm>/seed<seed>/`.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
from typing import Any, Iterable, Mapping

import ml_collections

from kimi_jax.infra.config import ConfigError, load_config, set_key

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
RESULTS = "ablation.json"
FIGURE = "ablation.png"
# Per arm, for runs that evaluate by difficulty level.
LEVELS_FIGURE = "by_difficulty_{arm}.png"
SPEC = "ablation_config.json"
TIMING = "ablation_run.json"
WARM_START_DIR = "warm_start"

# Keys that neither stage one nor the warm-start evaluation reads: arms that
# change only these can share one warm start per seed. The evaluation reads
# rl.eval_samples and rl.max_response_len; the replay buffer saved with the
# warm start is shaped by rl.samples_per_prompt and rl.max_wait_iterations.
_SHAREABLE_PREFIXES = ("rl.", "prompt_sampling.")
_NOT_SHAREABLE = ("rl.eval_samples", "rl.max_response_len",
                  "rl.samples_per_prompt", "rl.max_wait_iterations")
# Keys of a pipeline config that its data and vanilla-SFT stages do not
# read (they are read by curation, the warm-up data and the main job), or
# read only to pad the prompts of the vanilla model's evaluation, never
# what it trains on (the prefill buckets).
_PIPELINE_SHAREABLE = ("curate.", "warmup.", "pipeline.curate",
                       "pipeline.warmup_from", "pipeline.long_cot_",
                       "sampler.prefill_buckets")
_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def flatten(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested section as {dotted.key: value}, in insertion order."""
  out = {}
  for key, value in section.items():
    if isinstance(value, (ml_collections.ConfigDict, Mapping)):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def nest(overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """{dotted.key: value} as a nested ConfigDict (the inverse of flatten),
  keys in the given order."""
  out = ml_collections.ConfigDict(sort_keys=False)
  for dotted, value in overrides.items():
    node = out
    *parents, leaf = dotted.split(".")
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict(sort_keys=False)
      node = node[part]
    node[leaf] = value
  return out


@dataclasses.dataclass(frozen=True)
class Run:
  """One main-job run: an arm with one seed."""

  arm: str
  seed: int  # the value given to the seed key; the directory seed<seed>
  workdir: str

  @property
  def finished(self) -> bool:
    return os.path.exists(os.path.join(self.workdir, SUMMARY))


@dataclasses.dataclass(frozen=True)
class Ablation:
  """An ablation config, checked: every arm's keys exist in the base."""

  name: str
  description: str
  base: ml_collections.ConfigDict
  arms: tuple[tuple[str, dict[str, Any]], ...]
  seed_key: str
  first_seed: int

  @property
  def arm_names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.arms)

  def overrides(self, arm: str) -> dict[str, Any]:
    for name, overrides in self.arms:
      if name == arm:
        return dict(overrides)
    raise KeyError(f"ablation {self.name!r} has no arm {arm!r} (arms: "
                   f"{list(self.arm_names)})")

  def plan(self, workdir: str, seeds: int) -> list[Run]:
    """Every (arm, seed) run, seed-major: after the first len(arms) runs
    each arm has one seed, so a partial sweep already compares arms."""
    if seeds < 1:
      raise ValueError(f"--seeds must be >= 1, got {seeds}")
    return [Run(arm, seed, os.path.join(workdir, arm, f"seed{seed}"))
            for seed in range(self.first_seed, self.first_seed + seeds)
            for arm in self.arm_names]

  def run_config(self, run: Run) -> ml_collections.ConfigDict:
    """The base config with the arm's keys and the seed set."""
    return self._config(self.overrides(run.arm), run.seed, f"arms.{run.arm}")

  def _config(self, overrides: Mapping[str, Any], seed: int, where: str
              ) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(self.base.to_dict())
    config.lock()
    for key, value in overrides.items():
      try:
        set_key(config, key, value)
      except ConfigError as exc:
        raise ConfigError(f"ablation {self.name!r}, {where}.{key}: {exc}"
                          ) from exc
    set_key(config, self.seed_key, seed)
    return config

  @property
  def pipeline(self) -> bool:
    """Whether each run is the whole gym pipeline, not the main job."""
    return "pipeline" in self.base

  @property
  def shares_warm_start(self) -> bool:
    """True when no arm changes a key that the shared part reads: stage
    one and its evaluation, or a pipeline's data and vanilla stages (see
    kimi_jax/ablation/sweep.py)."""
    extra = _PIPELINE_SHAREABLE if self.pipeline else ()
    return all(k.startswith(extra) or
               (k.startswith(_SHAREABLE_PREFIXES) and k not in _NOT_SHAREABLE)
               for _, overrides in self.arms for k in overrides)

  def metrics_path(self, run: Run) -> str:
    """The run's per-iteration metrics (a pipeline's: its main job's)."""
    return os.path.join(run.workdir, *(("rl",) if self.pipeline else ()),
                        METRICS)

  def warm_start_config(self, seed: int) -> ml_collections.ConfigDict:
    """The base config for a shared warm start: one RL iteration (the main
    job always runs some), no plots. (A pipeline's shared data and vanilla
    stages run no RL; these keys leave them as they are.)"""
    return self._config({"rl.iterations": 1, "rl.eval_every": 0,
                         "log.plots": False}, seed, "warm_start")

  def to_json(self) -> dict[str, Any]:
    """What defines the sweep's runs (first_seed only picks which)."""
    return {"name": self.name, "description": self.description,
            "seed_key": self.seed_key,
            "arms": {name: overrides for name, overrides in self.arms},
            "base": json.loads(self.base.to_json_best_effort())}


def parse_ablation(config: ml_collections.ConfigDict) -> Ablation:
  """The typed ablation; errors name the config key."""
  for key in ("name", "base", "arms", "seed_key"):
    if key not in config:
      raise ConfigError(f"ablation config: missing key {key!r}")
  arms = tuple((str(name), flatten(section))
               for name, section in config.arms.items())
  if len(arms) < 2:
    raise ConfigError(f"config.arms: an ablation needs at least two arms, "
                      f"got {[a for a, _ in arms]}")
  for name, _ in arms:
    if not _ARM_NAME.match(name) or name == WARM_START_DIR:
      raise ConfigError(f"config.arms.{name}: an arm name must be a plain "
                        f"directory name (letters, digits, _ -), not "
                        f"{WARM_START_DIR!r}")
  seen = {}
  for name, overrides in arms:
    key = json.dumps(overrides, sort_keys=True, default=str)
    if key in seen:
      raise ConfigError(f"config.arms.{name}: same settings as arm "
                        f"{seen[key]!r}")
    seen[key] = name
  ablation = Ablation(
      name=str(config.name), description=str(config.get("description", "")),
      base=config.base, arms=arms, seed_key=str(config.seed_key),
      first_seed=int(config.get("first_seed", 0)))
  # Every arm's keys exist in the base and have its types (errors name
  # config.arms.<arm>.<key>).
  for name, _ in arms:
    ablation.run_config(Run(name, ablation.first_seed, ""))
  return ablation


def load_ablation(spec: str, overrides: Iterable[str] | Mapping[str, Any] = ()
                  ) -> Ablation:
  """`experiments/ablations.py:loss` (and overrides such as
  `{"base.rl.iterations": 10}`), parsed."""
  return parse_ablation(load_config(spec, overrides))
