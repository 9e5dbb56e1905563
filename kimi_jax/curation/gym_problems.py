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
from typing import Any, Callable, Mapping

from kimi_jax.data import reflect
from kimi_jax.rewards.reasoning_gym import DEFAULT_PROMPT_SUFFIX, make_records
from kimi_jax.rl.breakdown import Split

# A filter matching fewer than one item in this many is an error, not a
# long loop.
_MAX_SCAN = 1000
# What GymConfig.sizes_json may set per dataset.
SIZE_KEYS = ("size", "eval_size", "val_size", "sft_problems")


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
  # Per dataset, sizes that replace the section's: {dataset: {"size",
  # "eval_size", "val_size" or "sft_problems" (the pipeline's vanilla-SFT
  # problems): int}}, e.g. a raw-pool-only task that is neither held out
  # nor validated: {"syllogism": {"eval_size": 0, "val_size": 0}}.
  sizes_json: str = "{}"

  def __post_init__(self):
    if not self.names():
      raise ValueError("gym.datasets is empty")
    self.options()
    self.where()

    for key in SIZE_KEYS[:3]:
      if getattr(self, key) < 0:
        raise ValueError(f"gym.{key} must be >= 0, got "
                         f"{getattr(self, key)}")
    self.overrides()

  def _per_dataset(self, key: str, shape: str) -> dict[str, dict]:
    """Section field `key` parsed: a JSON object of objects keyed by
    datasets of gym.datasets (`shape` describes it in the error)."""
    try:
      value = json.loads(getattr(self, key))
    except json.JSONDecodeError as exc:
      raise ValueError(f"gym.{key}: not JSON ({exc})") from None
    if not isinstance(value, dict) or not all(isinstance(v, dict)
                                              for v in value.values()):
      raise ValueError(f"gym.{key} must be {shape}")
    unknown = sorted(set(value) - set(self.names()))
    if unknown:
      raise ValueError(f"gym.{key} names datasets not in "
                       f"gym.datasets: {unknown}")
    return value

  def overrides(self) -> dict[str, dict[str, int]]:
    value = self._per_dataset(
        "sizes_json", "an object of objects ({dataset: {size key: int}})")
    for name, sizes in value.items():
      for key, n in sizes.items():
        if key not in SIZE_KEYS:
          raise ValueError(f"gym.sizes_json[{name!r}]: unknown key {key!r} "
                           f"(known: {', '.join(SIZE_KEYS)})")
        if not isinstance(n, int) or isinstance(n, bool) or n < 0:
          raise ValueError(f"gym.sizes_json[{name!r}][{key!r}] must be an "
                           f"integer >= 0, got {n!r}")
    return value

  def sizes(self, name: str, sft_problems: int = 0) -> dict[str, int]:
    """Dataset `name`'s size, eval_size, val_size and sft_problems (the
    section's, or `sft_problems`, unless sizes_json replaces them)."""
    out = {"size": self.size, "eval_size": self.eval_size,
           "val_size": self.val_size, "sft_problems": sft_problems}
    out.update(self.overrides().get(name, {}))
    return out

  def first_unused(self, name: str) -> int:
    """The first item index of generator `name` no set here uses."""
    n = self.sizes(name)
    return n["size"] + n["eval_size"] + n["val_size"]

  def has_val(self) -> bool:
    return any(self.sizes(n)["val_size"] for n in self.names())

  def names(self) -> list[str]:
    return [n.strip() for n in self.datasets.split(",") if n.strip()]

  def options(self) -> dict[str, dict[str, Any]]:
    return self._per_dataset("options_json", "an object of objects")

  def where(self) -> dict[str, dict[str, str]]:
    shape = ("an object of objects of regex strings ({dataset: "
             "{field.path: pattern}})")
    value = self._per_dataset("where_json", shape)
    if not all(isinstance(p, str) for v in value.values()
               for p in v.values()):
      raise ValueError(f"gym.where_json must be {shape}")
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
  # The table-inversion task is ours, generated alike (kimi_jax/data/
  # reflect.py); every other name is a reasoning-gym generator.
  generate = (reflect.make_records if name == reflect.DATASET else
              functools.partial(make_records, name))
  make = functools.partial(generate, seed=cfg.seed,
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
    n = cfg.sizes(name)
    rows = dataset_items(cfg, name, n["size"] + n["eval_size"])
    train += rows[:n["size"]]
    held += rows[n["size"]:]
  return train, held


def generator_items(cfg: GymConfig, span: Callable[[str], tuple[int, int]]
                    ) -> list[dict]:
  """Items [start, stop) = span(name) of each dataset's generator (matching
  items when it has a `where` filter), dataset by dataset."""
  out: list[dict] = []
  for name in cfg.names():
    start, stop = span(name)
    if stop > start:
      out += dataset_items(cfg, name, stop)[start:]
  return out


def validation_set(cfg: GymConfig) -> list[dict]:
  """Validation rows: items [size + eval_size, first_unused) of each
  dataset (none of a dataset whose `val_size` is 0)."""
  return generator_items(cfg, lambda name: (
      cfg.first_unused(name) - cfg.sizes(name)["val_size"],
      cfg.first_unused(name)))


def vanilla_problems(cfg: GymConfig, per_dataset: int) -> list[dict]:
  """`per_dataset` problems of each generator (its `sft_problems` in
  sizes_json where set) past its train, held-out and validation items."""
  return generator_items(cfg, lambda name: (
      cfg.first_unused(name),
      cfg.first_unused(name) + cfg.sizes(name, per_dataset)["sft_problems"]))
