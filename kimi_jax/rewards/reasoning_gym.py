"""reasoning-gym tasks as RL problem records, scored by the dataset itself.

`make_records("chain_sum", size=100, seed=0, min_terms=2)` turns any
registered reasoning-gym dataset into JSON-serialisable records:

  {"id": "rg/chain_sum/0/17", "prompt": <question + answer-format hint>,
   "question": ..., "answer": ..., "metadata": {...},
   "rg": {"dataset": "chain_sum", "options": {...}, "size": 100, "seed": 0,
          "index": 17}}

`ReasoningGymReward` extracts the answer from a response (by default the last
`<answer>...</answer>` span, which is what reasoning-gym's own prompts ask for
and what `reasoning_gym.utils.extract_answer` reads) and calls that dataset's
`score_answer(answer, entry)`.

Scoring regenerates the entry from the `rg` spec (the datasets are
deterministic per seed and index) rather than trusting the stored copy: a
JSON round trip turns tuples into lists and int keys into strings, which
silently breaks some scorers (arc_agi, rearc). The regenerated question must
equal the stored one, so a reasoning-gym version that generates different
problems is caught instead of mis-scored.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import re
from typing import Any, Mapping, Sequence

from kimi_jax.rewards.base import RewardResult
from kimi_jax.rewards.gym_solutions import wrong_step

DEFAULT_PROMPT_SUFFIX = ("\n\nThink step by step, then give only the final "
                         "answer between <answer> and </answer> tags.")


def _options_key(options: Mapping[str, Any]) -> str:
  return json.dumps(dict(options), sort_keys=True)


@functools.lru_cache(maxsize=64)
def _dataset(name: str, options_key: str, size: int, seed: int) -> Any:
  import reasoning_gym
  options = json.loads(options_key)
  return reasoning_gym.create_dataset(name, size=size, seed=seed, **options)


def dataset_names() -> list[str]:
  """Names of every registered reasoning-gym dataset."""
  import reasoning_gym  # noqa: F401 - registers the datasets
  from reasoning_gym.factory import DATASETS
  return sorted(DATASETS)


def make_records(dataset: str, size: int = 100, seed: int = 0,
                 prompt_suffix: str = DEFAULT_PROMPT_SUFFIX,
                 difficulty: float | None = None,
                 **options: Any) -> list[dict[str, Any]]:
  """Problem records for `size` entries of a reasoning-gym dataset.

  `options` are the dataset's config fields (e.g. `min_terms` for
  chain_sum); they must be JSON-serialisable since they travel in the record.
  `difficulty`, when given, is stored for curriculum sampling.
  """
  ds = _dataset(dataset, _options_key(options), size, seed)
  records = []
  for index in range(size):
    entry = ds[index]
    record = {
        "id": f"rg/{dataset}/{seed}/{index}",
        "prompt": entry["question"] + prompt_suffix,
        "question": entry["question"],
        "answer": entry.get("answer"),
        "metadata": json.loads(json.dumps(entry.get("metadata", {}),
                                          default=str)),
        "rg": {"dataset": dataset, "options": dict(options), "size": size,
               "seed": seed, "index": index},
    }
    if difficulty is not None:
      record["difficulty"] = float(difficulty)
    records.append(record)
  return records


@dataclasses.dataclass(frozen=True)
class ReasoningGymRewardConfig:
  """Options of the reasoning-gym reward.

  answer_tag: the answer is the content of the last <tag>...</tag> span;
    None disables tag extraction.
  fallback: what to score when no tag is found: "none" (score 0, the
    default, so the model learns the format), "last_line" or "full".
  partial_credit: keep the dataset's fractional scores (some scorers give
    e.g. 0.05 for a near miss); when False the score is 1 or 0.
  correct_threshold: a score at or above this counts as correct.
  check_steps: a right answer reached through a wrong worked step scores 0
    (process verification against the false positives of answer-only
    checking that report 2.1 warns about; ours). Only datasets whose
    worked-solution format kimi_jax/rewards/gym_solutions.py knows are checked,
    and a response without step lines (a direct answer) is scored on its
    answer. `correct` stays the answer's verdict, so evaluation and
    curation still measure answers; `info["wrong_step"]` says where.
  """

  answer_tag: str | None = "answer"
  fallback: str = "none"
  partial_credit: bool = False
  correct_threshold: float = 1.0
  check_steps: bool = False


def extract_answer(response: str, answer_tag: str | None = "answer",
                   fallback: str = "none") -> str | None:
  """The answer inside the last <answer_tag> span, else per `fallback`."""
  if answer_tag:
    tag = re.escape(answer_tag)
    matches = re.findall(rf"<{tag}>(.*?)</{tag}>", response, flags=re.DOTALL)
    if matches:
      return matches[-1].strip()
  if fallback == "last_line":
    lines = [line.strip() for line in response.strip().splitlines()]
    return lines[-1] if lines else None
  if fallback == "full":
    return response.strip()
  if fallback != "none":
    raise ValueError(f"unknown fallback {fallback!r}")
  return None


def entry_for(record: Mapping[str, Any]) -> tuple[Any, dict[str, Any]]:
  """The dataset object and the original (not JSON-mangled) entry."""
  spec = record["rg"]
  ds = _dataset(spec["dataset"], _options_key(spec.get("options", {})),
                int(spec["size"]), int(spec["seed"]))
  entry = ds[int(spec["index"])]
  if "question" in record and entry["question"] != record["question"]:
    raise ValueError(f"record {record.get('id')!r}: regenerated question "
                     "differs (reasoning-gym version changed?)")
  return ds, entry


class ReasoningGymReward:
  """Scores a response with the record's dataset's own `score_answer`."""

  def __init__(self, config: ReasoningGymRewardConfig | None = None,
               **options: Any):
    self.config = config or ReasoningGymRewardConfig(**options)

  def __call__(self, record: Mapping[str, Any], response: str) -> RewardResult:
    ds, entry = entry_for(record)
    answer = extract_answer(response, self.config.answer_tag,
                            self.config.fallback)
    if answer is None:
      return RewardResult(0.0, False, error="no answer found",
                          info={"answer": None})
    raw = float(ds.score_answer(answer, entry))
    correct = raw >= self.config.correct_threshold
    score = raw if self.config.partial_credit else float(correct)
    info = {"answer": answer[:200], "raw_score": raw}
    if self.config.check_steps and score > 0:
      where = wrong_step(record, response)
      if where is not None:
        score = 0.0
        info["wrong_step"] = where
    return RewardResult(score, correct, info=info)

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    out = []
    for record, response in zip(records, responses):
      try:
        out.append(self(record, response))
      except Exception as exc:  # noqa: BLE001 - one bad item scores 0
        out.append(RewardResult(0.0, False,
                                error=f"{type(exc).__name__}: {exc}"))
    return out
