"""Raw problem sets from reasoning-gym's generators (the demonstration of
the data tools on tasks no one here wrote): train and held-out rows per
dataset, each with its own verifier spec (`rg`, see
kimi_jax/rewards/reasoning_gym.py).

Train rows are items [0, size) of a dataset's generator at `seed`; held-out
rows are items [size, size + eval_size) of the same generator, and
validation rows (optional, ours) the next `val_size` items, so all come
from one distribution and never share an item index (a small generator can
still produce the same text twice; curation's dedup drops repeats).
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any, Mapping

from kimi_jax.rewards.reasoning_gym import DEFAULT_PROMPT_SUFFIX, make_records


@dataclasses.dataclass(frozen=True)
class GymConfig:
  """`gym` section: datasets (comma-separated names), rows per dataset,
  and per-dataset generator options as a JSON object of objects."""

  datasets: str = "chain_sum"
  size: int = 100
  eval_size: int = 20
  # Validation problems per dataset (0: none): for choosing settings
  # without reading the held-out set.
  val_size: int = 0
  seed: int = 0
  options_json: str = "{}"
  # Appended to every question to make the prompt (the format instruction).
  prompt_suffix: str = DEFAULT_PROMPT_SUFFIX

  def __post_init__(self):
    if not self.names():
      raise ValueError("gym.datasets is empty")
    opts = self.options()
    unknown = sorted(set(opts) - set(self.names()))
    if unknown:
      raise ValueError(f"gym.options_json names datasets not in "
                       f"gym.datasets: {unknown}")

    for key in ("size", "eval_size", "val_size"):
      if getattr(self, key) < 0:
        raise ValueError(f"gym.{key} must be >= 0, got "
                         f"{getattr(self, key)}")

  def first_unused(self) -> int:
    """The first item index of each generator no set here uses."""
    return self.size + self.eval_size + self.val_size

  def names(self) -> list[str]:
    return [n.strip() for n in self.datasets.split(",") if n.strip()]

  def options(self) -> dict[str, dict[str, Any]]:
    try:
      value = json.loads(self.options_json)
    except json.JSONDecodeError as exc:
      raise ValueError(f"gym.options_json: not JSON ({exc})") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict)
                                              for v in value.values()):
      raise ValueError("gym.options_json must be an object of objects")
    return value


def problem_sets(cfg: GymConfig) -> tuple[list[dict], list[dict]]:
  """(train rows, held-out rows) over every dataset of `cfg`."""
  train, held = [], []
  options: Mapping[str, dict] = cfg.options()
  for name in cfg.names():
    rows = make_records(name, size=cfg.size + cfg.eval_size, seed=cfg.seed,
                        prompt_suffix=cfg.prompt_suffix,
                        **options.get(name, {}))
    train += rows[:cfg.size]
    held += rows[cfg.size:]
  return train, held


def generator_items(cfg: GymConfig, start: int, stop: int) -> list[dict]:
  """Items [start, stop) of each dataset's generator, dataset by dataset."""
  options: Mapping[str, dict] = cfg.options()
  out: list[dict] = []
  for name in cfg.names():
    out += make_records(name, size=stop, seed=cfg.seed,
                        prompt_suffix=cfg.prompt_suffix,
                        **options.get(name, {}))[start:]
  return out


def validation_set(cfg: GymConfig) -> list[dict]:
  """Validation rows: items [size + eval_size, first_unused) of each
  dataset (empty when `val_size` is 0)."""
  if not cfg.val_size:
    return []
  return generator_items(cfg, cfg.size + cfg.eval_size, cfg.first_unused())
