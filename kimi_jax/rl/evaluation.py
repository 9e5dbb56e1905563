"""Held-out evaluation of a policy: pass@1, greedy accuracy, tokens.

pass@1 is the mean correctness of `samples` temperature draws per problem
(the sampling settings of RL); greedy accuracy takes the argmax response.
Response tokens (mean and 90th percentile) are those of the sampled draws,
the stop token included. Seeds depend only on (seed, problem, draw), so two
evaluations of the same params give the same numbers. `Evaluator.sample`
returns every scored response (`EvalSamples`) for finer statistics (by
difficulty, shortest correct per problem; see kimi_jax/long2short).
`pass_at_1_by_task` splits pass@1 by task: a record's first tag, else its
reasoning-gym dataset (`rg/<name>`), else "all". `by_difficulty` splits
pass@1 and mean response tokens by the records' `difficulty` (levels as
strings, in increasing order of the number; records without one are left
out, and a set without any gives {}).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.data import tagging
from kimi_jax.data.tasks import Task, prompt_images
from kimi_jax.rewards.base import score_all
from kimi_jax.rl import rollout
from kimi_jax.sampler import handoff
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import Sampler, SampleRequest
from kimi_jax.sampler.sampling import SamplingParams


# The record sets of a Task an Evaluator may read.
SPLITS = ("eval", "val")


@dataclasses.dataclass(frozen=True)
class EvalResult:
  pass_at_1: float  # mean correctness of sampled responses
  greedy_accuracy: float
  mean_length: float  # response tokens of the sampled draws
  n_problems: int
  p90_length: float = 0.0
  pass_at_1_by_task: Mapping[str, float] = dataclasses.field(
      default_factory=dict)
  # {level: {"pass_at_1", "mean_length", "n_problems"}}, easiest first.
  by_difficulty: Mapping[str, Mapping[str, float]] = dataclasses.field(
      default_factory=dict)


def difficulty_of(record: Mapping[str, Any]) -> float:
  """A record's numeric `difficulty`, NaN when it has none."""
  value = record.get("difficulty")
  try:
    return float(value)
  except (TypeError, ValueError):
    return float("nan")


def level_name(difficulty: float) -> str:
  """A difficulty as a level key: 2.0 -> "2", 0.5 -> "0.5"."""
  return f"{difficulty:g}"


def by_difficulty(difficulty_N: np.ndarray, correct_N: np.ndarray,
                  length_N: np.ndarray, problem_N: np.ndarray
                  ) -> dict[str, dict[str, float]]:
  """pass@1, mean response tokens and problem count per difficulty level
  over scored draws (the caller passes the sampled ones), in increasing
  order of the level; NaN difficulties are left out."""
  out = {}
  for level in sorted(set(difficulty_N[~np.isnan(difficulty_N)].tolist())):
    at = difficulty_N == level
    out[level_name(level)] = {
        "pass_at_1": float(np.mean(correct_N[at])),
        "mean_length": float(np.mean(length_N[at])),
        "n_problems": int(len(set(problem_N[at].tolist())))}
  return out


def task_of(record: Mapping[str, Any]) -> str:
  """The task a held-out record counts under (see the module doc)."""
  return (tagging.record_tags(record) or tagging.reasoning_gym_tags(record)
          or ["all"])[0]


@dataclasses.dataclass(frozen=True)
class EvalSamples:
  """Every scored held-out response: problem index into the evaluated
  records (`Evaluator.records`), draw
  index (-1: the greedy response), response tokens, correctness, the
  problem's task (`task_of`) and the response text."""

  problem_N: np.ndarray
  draw_N: np.ndarray
  length_N: np.ndarray
  correct_N: np.ndarray
  task_N: np.ndarray
  n_problems: int
  text_N: np.ndarray | None = None  # response texts, when kept
  # The problems' difficulties (NaN: none), when known.
  difficulty_N: np.ndarray | None = None

  def summary(self) -> EvalResult:
    sampled = self.draw_N >= 0
    lengths = self.length_N[sampled]
    tasks = self.task_N[sampled]
    levels = ({} if self.difficulty_N is None else by_difficulty(
        self.difficulty_N[sampled], self.correct_N[sampled], lengths,
        self.problem_N[sampled]))
    return EvalResult(
        pass_at_1=float(np.mean(self.correct_N[sampled])),
        greedy_accuracy=float(np.mean(self.correct_N[~sampled])),
        mean_length=float(np.mean(lengths)), n_problems=self.n_problems,
        p90_length=float(np.percentile(lengths, 90)),
        pass_at_1_by_task={
            t: float(np.mean(self.correct_N[sampled][tasks == t]))
            for t in sorted(set(tasks.tolist()))},
        by_difficulty=levels)


@dataclasses.dataclass(frozen=True)
class Evaluator:
  """`evaluator(params) -> EvalResult` on the task's held-out records
  (`split="eval"`) or its validation records (`split="val"`)."""

  sampler: Sampler
  task: Task
  samples: int
  max_response_len: int
  seed: int
  settings: SamplingSettings
  split: str = "eval"

  def __post_init__(self):
    if self.split not in SPLITS:
      raise ValueError(f"unknown split {self.split!r} (known: {SPLITS})")

  @property
  def records(self) -> Sequence[Mapping[str, Any]]:
    return getattr(self.task, self.split)

  def requests(self) -> list[SampleRequest]:
    stop = rollout.stop_tokens(self.task.tokenizer)
    s = self.settings
    out = []
    for i, record in enumerate(self.records):
      prompt = tuple(self.task.encode_prompt(record))
      pixels = prompt_images(record)
      for j in range(self.samples):
        out.append(SampleRequest(
            id=("s", i, j), prompt=prompt,
            max_new_tokens=self.max_response_len, stop_tokens=stop,
            sampling=SamplingParams(
                temperature=s.temperature, top_k=s.top_k, top_p=s.top_p,
                seed=rollout.request_seed(self.seed, i, j)), images=pixels))
      out.append(SampleRequest(id=("g", i, 0), prompt=prompt,
                               max_new_tokens=self.max_response_len,
                               stop_tokens=stop,
                               sampling=SamplingParams(greedy=True),
                               images=pixels))
    return out

  def sample(self, params) -> EvalSamples:
    """Every held-out response of `params`, scored."""
    sampler_params, _ = handoff.place_params(
        params, self.sampler.engine.param_shardings)
    results, _ = self.sampler.generate(sampler_params, self.requests())
    held = self.records
    records = [held[r.id[1]] for r in results]
    texts = [rollout.response_text(r.tokens, self.task.tokenizer)
             for r in results]
    scored = score_all(self.task.reward, records, texts)
    return EvalSamples(
        problem_N=np.array([r.id[1] for r in results], np.int32),
        draw_N=np.array([r.id[2] if r.id[0] == "s" else -1
                         for r in results], np.int32),
        length_N=np.array([len(r.tokens) for r in results], np.int32),
        correct_N=np.array([s.correct for s in scored], bool),
        task_N=np.array([task_of(r) for r in records], dtype=object),
        n_problems=len(held), text_N=np.array(texts, dtype=object),
        difficulty_N=np.array([difficulty_of(r) for r in records],
                              np.float64))

  def __call__(self, params) -> EvalResult:
    return self.sample(params).summary()
