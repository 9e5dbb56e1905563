"""Raw problem sets from reasoning-gym's generators (the demonstration of
the data tools on tasks no one here wrote): train and held-out rows per
dataset, each with its own verifier spec (`rg`, see
kimi_jax/rewards/reasoning_gym.py).

Train rows are items [0, size) of a dataset's generator at `seed`; held-out
rows are items [size, size + eval_size) of the same generator, and
validation rows (optional, ours) the next `val_size` items, so all come
from one distribution and never share an item index (a small generator can
still produce the same text twice; curation's dedup drops repeats). With a
`where` filter (GymConfig.where_json), "item k" means the k-th item that
passes it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Mapping

from kimi_jax.rewards.reasoning_gym import DEFAULT_PROMPT_SUFFIX, make_records
from kimi_jax.rl.breakdown import Split

# A filter matching fewer than one item in this many is an error, not a
# long loop.
_MAX_SCAN = 1000


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
  # Per dataset, {record field path: regex}: only items whose every named
  # field matches (re.search) are used, so a generator's distribution can
  # be narrowed where its own options cannot (e.g. spell_backward's word
  # list without proper nouns: {"spell_backward": {"metadata.word":
  # "^[a-z]+$"}}). Item k of a set is then the k-th matching item.
  where_json: str = "{}"

  def __post_init__(self):
    if not self.names():
      raise ValueError("gym.datasets is empty")
    opts = self.options()
    unknown = sorted(set(opts) - set(self.names()))
    if unknown:
      raise ValueError(f"gym.options_json names datasets not in "
                       f"gym.datasets: {unknown}")
    self.where()

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

  def where(self) -> dict[str, dict[str, str]]:
    try:
      value = json.loads(self.where_json)
    except json.JSONDecodeError as exc:
      raise ValueError(f"gym.where_json: not JSON ({exc})") from None
    if not isinstance(value, dict) or not all(
        isinstance(v, dict) and all(isinstance(p, str) for p in v.values())
        for v in value.values()):
      raise ValueError("gym.where_json must be an object of objects of "
                       "regex strings ({dataset: {field.path: pattern}})")
    unknown = sorted(set(value) - set(self.names()))
    if unknown:
      raise ValueError(f"gym.where_json names datasets not in "
                       f"gym.datasets: {unknown}")
    for name, fields in value.items():
      for path, pattern in fields.items():
        try:
          re.compile(pattern)
        except re.error as exc:
          raise ValueError(f"gym.where_json[{name!r}][{path!r}]: bad "
                           f"pattern {pattern!r} ({exc})") from None
    return value


def _matches(record: Mapping[str, Any], fields: Mapping[str, str]) -> bool:
  """Whether every field's text matches its pattern (a missing field does
  not), as launch/evaluate.py's --by NAME=FIELD:PATTERN groups read it."""
  return all(Split(path, path, pattern).label(record) == "yes"
             for path, pattern in fields.items())


def dataset_items(cfg: GymConfig, name: str, stop: int) -> list[dict]:
  """The first `stop` items of one generator that pass its `where` filter
  (all items when it has none)."""
  make = functools.partial(make_records, name, seed=cfg.seed,
                           prompt_suffix=cfg.prompt_suffix,
                           **cfg.options().get(name, {}))
  fields = cfg.where().get(name)
  if not fields:
    return make(size=stop)
  size = stop
  while True:
    kept = [r for r in make(size=size) if _matches(r, fields)]
    if len(kept) >= stop:
      return kept[:stop]
    if size >= _MAX_SCAN * stop:
      raise ValueError(
          f"gym.where_json[{name!r}]: only {len(kept)} of {size} items "
          f"match, {stop} are needed")
    # Grow by the observed match rate (tenfold while nothing matches).
    size = (int(size * stop / len(kept) * 1.1) + 16 if kept
            else 10 * size)


def problem_sets(cfg: GymConfig) -> tuple[list[dict], list[dict]]:
  """(train rows, held-out rows) over every dataset of `cfg`."""
  train, held = [], []
  for name in cfg.names():
    rows = dataset_items(cfg, name, cfg.size + cfg.eval_size)
    train += rows[:cfg.size]
    held += rows[cfg.size:]
  return train, held


def generator_items(cfg: GymConfig, start: int, stop: int) -> list[dict]:
  """Items [start, stop) of each dataset's generator (matching items when
  it has a `where` filter), dataset by dataset."""
  out: list[dict] = []
  for name in cfg.names():
    out += dataset_items(cfg, name, stop)[start:]
  return out


def validation_set(cfg: GymConfig) -> list[dict]:
  """Validation rows: items [size + eval_size, first_unused) of each
  dataset (empty when `val_size` is 0)."""
  if not cfg.val_size:
    return []
  return generator_items(cfg, cfg.size + cfg.eval_size, cfg.first_unused())
