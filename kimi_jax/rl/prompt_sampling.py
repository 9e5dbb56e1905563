"""Which problems each RL iteration trains on (report section 2.3.4).

Two independent knobs, applied in this order:

1. Curriculum: filters the eligible set by the `difficulty` label of each
   record.
   - "none": every problem is eligible.
   - "warmup_then_hard": all problems for the first `warmup_iterations`
     iterations, then only those with difficulty >= `hard_threshold`.
   - "stages": `stages = ((start_iteration, max_difficulty), ...)`, starts
     strictly increasing and the first at 0; at iteration i the stage with
     the largest start <= i applies and problems with
     difficulty <= max_difficulty are eligible.
2. Prioritisation: within the eligible set, problem i is drawn with weight

     w_i = max(1 - s_i, priority_floor)      (prioritized=True)
     w_i = 1                                 (prioritized=False)

   where s_i is its tracked success rate. The floor keeps solved problems
   from being starved.

Success rates (per-iteration pass rates fed to `update`) are tracked as
  ema:  s <- ema_decay * s + (1 - ema_decay) * x, starting from `initial_success`
  mean: s = mean of all x seen so far (`initial_success` until the first x)
(or, with `initial_success_field`, from the record's measured pass rate,
e.g. curation's `pass_rate`) and are part of `state_dict()`, so a resumed run samples the same problems
given the same numpy Generator state.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Literal, Mapping, Sequence

import numpy as np

_CURRICULA = ("none", "warmup_then_hard", "stages")
_TRACKING = ("ema", "mean")
_STATE_VERSION = 1


@dataclasses.dataclass(frozen=True)
class PromptSamplingConfig:
  """How problems are chosen; see the module docstring for the rules."""

  curriculum: Literal["none", "warmup_then_hard", "stages"] = "none"
  warmup_iterations: int = 0
  hard_threshold: float = 0.0
  stages: tuple[tuple[int, float], ...] = ()
  prioritized: bool = False
  priority_floor: float = 0.05
  success_tracking: Literal["ema", "mean"] = "ema"
  ema_decay: float = 0.9
  # Unseen problems count as never solved: they get the highest priority.
  initial_success: float = 0.0
  # A record field holding a measured pass rate (curation's `pass_rate`,
  # kimi_jax/curation/curate.py) that unseen problems start from instead of
  # initial_success; records without it use initial_success. "" : off.
  initial_success_field: str = ""

  def __post_init__(self):
    if self.curriculum not in _CURRICULA:
      raise ValueError(f"curriculum must be one of {_CURRICULA}, got "
                       f"{self.curriculum!r}")
    if self.success_tracking not in _TRACKING:
      raise ValueError(f"success_tracking must be one of {_TRACKING}, got "
                       f"{self.success_tracking!r}")
    if self.warmup_iterations < 0:
      raise ValueError(f"warmup_iterations must be >= 0, got "
                       f"{self.warmup_iterations}")
    if not 0.0 < self.priority_floor <= 1.0:
      raise ValueError(f"priority_floor must be in (0, 1], got "
                       f"{self.priority_floor}")
    if not 0.0 <= self.ema_decay < 1.0:
      raise ValueError(f"ema_decay must be in [0, 1), got {self.ema_decay}")
    if not 0.0 <= self.initial_success <= 1.0:
      raise ValueError(f"initial_success must be in [0, 1], got "
                       f"{self.initial_success}")
    if self.curriculum == "stages":
      starts = [int(s) for s, _ in self.stages]
      if not starts or starts[0] != 0:
        raise ValueError("curriculum 'stages' needs stages whose first "
                         f"start_iteration is 0, got {self.stages!r}")
      if any(b <= a for a, b in zip(starts, starts[1:])):
        raise ValueError("stages start_iterations must be strictly "
                         f"increasing, got {starts}")

  @property
  def needs_difficulty(self) -> bool:
    return self.curriculum != "none"


def priority_weights(success_N: np.ndarray, floor: float) -> np.ndarray:
  """w_i = max(1 - s_i, floor)."""
  return np.maximum(1.0 - success_N, floor)


class PromptSampler:
  """Draws problem indices per iteration and tracks per-problem success.

  records: the problem set, each a mapping with an `id` (unique, any JSON
    scalar) and, when a curriculum is used, a numeric `difficulty`.
  Indices returned by `sample` are positions in `records`.
  """

  def __init__(self, records: Sequence[Mapping[str, Any]],
               config: PromptSamplingConfig):
    if not records:
      raise ValueError("PromptSampler needs at least one record")
    self.config = config
    ids = []
    for i, rec in enumerate(records):
      if "id" not in rec:
        raise ValueError(f"records[{i}] has no field 'id'")
      ids.append(rec["id"])
    if len(set(ids)) != len(ids):
      seen, dup = set(), None
      for x in ids:
        if x in seen:
          dup = x
          break
        seen.add(x)
      raise ValueError(f"record ids must be unique; {dup!r} repeats")
    self._ids = ids
    self._index_of = {x: i for i, x in enumerate(ids)}
    self._difficulty_N = None
    if config.needs_difficulty:
      diff = []
      for i, rec in enumerate(records):
        value = rec.get("difficulty")
        if value is None:
          raise ValueError(
              f"records[{i}] (id {rec['id']!r}) has no field 'difficulty', "
              f"which curriculum {config.curriculum!r} needs")
        diff.append(float(value))
      self._difficulty_N = np.asarray(diff, np.float64)
    n = len(records)
    self._initial_N = np.full(n, config.initial_success, np.float64)
    if config.initial_success_field:
      for i, rec in enumerate(records):
        value = rec.get(config.initial_success_field)
        if value is None:
          continue
        if isinstance(value, bool) or not isinstance(
            value, (int, float)) or not 0.0 <= value <= 1.0:
          raise ValueError(
              f"records[{i}] (id {rec['id']!r}): field "
              f"{config.initial_success_field!r} must be a success rate in "
              f"[0, 1], got {value!r}")
        self._initial_N[i] = float(value)
    self._success_N = self._initial_N.copy()
    self._count_N = np.zeros(n, np.int64)

  def copy(self) -> "PromptSampler":
    """An independent sampler with the same statistics (records shared)."""
    out = object.__new__(PromptSampler)
    out.__dict__.update(self.__dict__)
    out._success_N = self._success_N.copy()
    out._count_N = self._count_N.copy()
    return out

  @property
  def num_problems(self) -> int:
    return len(self._ids)

  def success_rates(self) -> np.ndarray:
    """Tracked s_i for every record (a copy)."""
    return self._success_N.copy()

  def eligible(self, iteration: int) -> np.ndarray:
    """Sorted indices the curriculum allows at `iteration`."""
    cfg = self.config
    all_idx = np.arange(self.num_problems)
    if cfg.curriculum == "none":
      return all_idx
    if cfg.curriculum == "warmup_then_hard":
      if iteration < cfg.warmup_iterations:
        return all_idx
      keep = self._difficulty_N >= cfg.hard_threshold
      rule = f"difficulty >= {cfg.hard_threshold}"
    else:
      max_difficulty = [d for s, d in cfg.stages if s <= iteration][-1]
      keep = self._difficulty_N <= max_difficulty
      rule = f"difficulty <= {max_difficulty}"
    idx = all_idx[keep]
    if idx.size == 0:
      raise ValueError(f"no problem satisfies the curriculum rule {rule} at "
                       f"iteration {iteration}")
    return idx

  def probabilities(self, iteration: int) -> tuple[np.ndarray, np.ndarray]:
    """(eligible indices, their per-draw probabilities)."""
    idx = self.eligible(iteration)
    if self.config.prioritized:
      w = priority_weights(self._success_N[idx], self.config.priority_floor)
    else:
      w = np.ones(idx.size)
    return idx, w / w.sum()

  def sample(self, iteration: int, n: int,
             rng: np.random.Generator) -> list[int]:
    """n problem indices for `iteration`.

    Draws without replacement, each successive draw proportional to the
    weights of the problems not yet drawn. When n exceeds the m eligible
    problems, every eligible problem is taken n // m times and the remaining
    n % m are drawn as above. Deterministic given the sampler state and the
    generator state.
    """
    if n < 0:
      raise ValueError(f"n must be >= 0, got {n}")
    idx, p = self.probabilities(iteration)
    repeats, rest = divmod(n, idx.size)
    chosen = list(np.tile(idx, repeats))
    if rest:
      chosen.extend(rng.choice(idx, size=rest, replace=False, p=p))
    return [int(i) for i in chosen]

  def update(self, indices: Sequence[int], successes: Sequence[float]) -> None:
    """Records one iteration's pass rate x in [0, 1] for each problem index.

    Typically x = (correct responses) / K for the problem's group. Repeated
    indices are applied in order.
    """
    if len(indices) != len(successes):
      raise ValueError(f"update got {len(indices)} indices but "
                       f"{len(successes)} successes")
    decay = self.config.ema_decay
    for i, x in zip(indices, successes):
      i, x = int(i), float(x)
      if not 0 <= i < self.num_problems:
        raise IndexError(f"problem index {i} out of range "
                         f"[0, {self.num_problems})")
      if not 0.0 <= x <= 1.0:
        raise ValueError(f"success rate must be in [0, 1], got {x} for "
                         f"problem {i}")
      count = self._count_N[i] + 1
      if self.config.success_tracking == "ema":
        self._success_N[i] = decay * self._success_N[i] + (1 - decay) * x
      elif count == 1:
        self._success_N[i] = x
      else:
        self._success_N[i] += (x - self._success_N[i]) / count
      self._count_N[i] = count

  def state_dict(self) -> dict[str, Any]:
    """Plain JSON data: [id, success, count] for every problem seen so far."""
    seen = np.nonzero(self._count_N)[0]
    return {
        "version": _STATE_VERSION,
        "stats": [[self._ids[i], float(self._success_N[i]),
                   int(self._count_N[i])] for i in seen],
    }

  def load_state_dict(self, state: Mapping[str, Any]) -> None:
    """Restores success statistics by record id; others start unseen.

    Raises if the state names an id that is not in the records (a checkpoint
    from another problem set).
    """
    if state.get("version") != _STATE_VERSION:
      raise ValueError(f"unsupported prompt sampler state version "
                       f"{state.get('version')!r}")
    success = self._initial_N.copy()
    count = np.zeros(self.num_problems, np.int64)
    for rid, s, c in state["stats"]:
      if rid not in self._index_of:
        raise ValueError(f"sampler state has problem id {rid!r}, which is "
                         "not in the records")
      i = self._index_of[rid]
      success[i], count[i] = float(s), int(c)
    self._success_N, self._count_N = success, count
