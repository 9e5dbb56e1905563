"""The RL loop's host state: one value an iteration returns and a checkpoint
saves as is.

  iteration        RL iterations finished
  buffer           in-flight groups (partial rollouts, report 2.6.2)
  prompts          per-problem success statistics (prioritized sampling)
  counters         totals since the start of RL
  warmstart_eval   held-out evaluation before RL
  last_eval        the latest periodic evaluation (on the validation set
                   when the task has one, else held out)
  warmstart_val    validation evaluation before RL (None without one)

Its size does not grow with the number of iterations. The exactly-once
guarantee needs no ledger of ids: the buffer hands out group ids
0, 1, 2, ...; an id below `buffer.next_group_id` that is not in flight was
consumed (trained on, or skipped as uninformative) exactly once, and
`counters.groups_consumed == buffer.next_group_id - len(buffer)` holds after
every iteration. An iteration works on copies, so an earlier state (the one
a checkpoint holds) is never changed by a later iteration.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

from kimi_jax.rl.prompt_sampling import PromptSampler, PromptSamplingConfig
from kimi_jax.rl.replay_buffer import RolloutBuffer

_STATE_VERSION = 2


@dataclasses.dataclass(frozen=True)
class Counters:
  """Totals since RL started. groups_consumed: finished groups taken out of
  the buffer (trained on or not); groups_uninformative: those left out of
  training (all rewards equal and one step per iteration, or no group of
  the iteration with a signal; see loop.Scores.trained_P);
  responses_trained: responses of the groups actually trained on."""

  groups_consumed: int = 0
  groups_trained: int = 0
  groups_uninformative: int = 0
  responses_trained: int = 0

  def add(self, **deltas: int) -> "Counters":
    return dataclasses.replace(self, **{k: getattr(self, k) + int(v)
                                        for k, v in deltas.items()})


@dataclasses.dataclass(frozen=True)
class LoopState:
  iteration: int
  buffer: RolloutBuffer
  prompts: PromptSampler
  counters: Counters = Counters()
  warmstart_eval: Mapping[str, float] | None = None
  last_eval: Mapping[str, float] | None = None
  warmstart_val: Mapping[str, float] | None = None

  @classmethod
  def initial(cls, *, group_size: int, max_wait_iterations: int,
              records: Sequence[Mapping[str, Any]],
              prompt_sampling: PromptSamplingConfig,
              warmstart_eval: Mapping[str, float] | None = None,
              warmstart_val: Mapping[str, float] | None = None
              ) -> "LoopState":
    return cls(iteration=0,
               buffer=RolloutBuffer(group_size=group_size,
                                    max_wait_iterations=max_wait_iterations),
               prompts=PromptSampler(records, prompt_sampling),
               warmstart_eval=warmstart_eval, warmstart_val=warmstart_val)

  def copy(self) -> "LoopState":
    """The same state with its own buffer and statistics, to change."""
    return dataclasses.replace(self, buffer=self.buffer.copy(),
                               prompts=self.prompts.copy())

  def to_json(self) -> dict[str, Any]:
    return {"version": _STATE_VERSION, "iteration": self.iteration,
            "buffer": self.buffer.state_dict(),
            "prompts": self.prompts.state_dict(),
            "counters": dataclasses.asdict(self.counters),
            "warmstart_eval": self.warmstart_eval,
            "last_eval": self.last_eval,
            "warmstart_val": self.warmstart_val}

  @classmethod
  def from_json(cls, data: Mapping[str, Any], *, group_size: int,
                max_wait_iterations: int,
                records: Sequence[Mapping[str, Any]],
                prompt_sampling: PromptSamplingConfig) -> "LoopState":
    """Restores `to_json()` output against this run's records and config."""
    if data.get("version") != _STATE_VERSION:
      raise ValueError(f"unsupported RL loop state version "
                       f"{data.get('version')!r} (this code writes "
                       f"{_STATE_VERSION})")
    state = cls.initial(group_size=group_size,
                        max_wait_iterations=max_wait_iterations,
                        records=records, prompt_sampling=prompt_sampling)
    state.buffer.load_state_dict(data["buffer"])
    state.prompts.load_state_dict(data["prompts"])
    return dataclasses.replace(
        state, iteration=int(data["iteration"]),
        counters=Counters(**data["counters"]),
        warmstart_eval=data.get("warmstart_eval"),
        last_eval=data.get("last_eval"),
        warmstart_val=data.get("warmstart_val"))
