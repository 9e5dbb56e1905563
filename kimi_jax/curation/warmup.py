"""Long-CoT warm-up data by rejection sampling (report 2.2).

"With the refined RL prompt set, we employ prompt engineering to construct
a small yet high-quality long-CoT warmup dataset, containing accurately
verified reasoning paths." For every curated prompt the model answers K
times through a prompt template that asks for the four behaviours the
report names (planning, evaluation, reflection, exploration); each response
is verified with the task's reward and only correct ones are kept: all of
them up to `max_per_prompt`, or the shortest (`keep="shortest"`). With
`accept="score"` a response also needs a positive score, so a reward that
checks the reasoning as well as the answer (reasoning_gym_steps) keeps
only verified paths, not lucky answers after a wrong step.

The SFT rows pair the *plain* prompt (as RL will pose it) with the response
written under the engineered template: the model learns to reason that way
without being told to. Rows are `{"prompt", "response", "id", "tags"}`,
what `config.sft.train_path` reads (records.SFTFields).
"""

from __future__ import annotations

import collections
import dataclasses
from typing import Any, Mapping, Sequence

from kimi_jax.curation.policy import ACCEPT, Policy, sample_verified
from kimi_jax.data import journal as journal_lib
from kimi_jax.rewards.base import RewardFn

LONG_COT_TEMPLATE = (
    "{prompt}\n\n"
    "Solve this carefully and show all of your thinking:\n"
    "1. Plan: outline the steps before you start.\n"
    "2. Work through each step, and evaluate every intermediate result.\n"
    "3. Reflect: check the result; if something is wrong, say so and fix "
    "it.\n"
    "4. Explore: consider another way to reach the answer and compare.\n"
    "Finish with the final answer between <answer> and </answer> tags.")
KEEP = ("all", "shortest")


@dataclasses.dataclass(frozen=True)
class WarmupConfig:
  """The `warmup` config section."""

  template: str = LONG_COT_TEMPLATE
  samples: int = 8  # K responses per prompt (ours)
  temperature: float = 1.0  # ours
  max_new_tokens: int = 1024  # ours
  keep: str = "all"  # "all" (up to max_per_prompt) | "shortest"
  max_per_prompt: int = 1  # ours
  prompt_field: str = "prompt"
  tags_field: str = "tags"
  seed: int = 0
  # "answer": keep responses whose answer is right; "score": also need a
  # positive score, which a process check withholds from a right answer
  # after a wrong step (ours; report 2.2 asks for "accurately verified
  # reasoning paths").
  accept: str = "answer"
  # Prompts per model call; each finished chunk is kept in the journal, so
  # a killed run resumes there (ours).
  chunk_prompts: int = journal_lib.CHUNK_PROMPTS

  def __post_init__(self):
    if "{prompt}" not in self.template:
      raise ValueError("warmup.template must contain {prompt}")
    if self.accept not in ACCEPT:
      raise ValueError(f"warmup.accept must be one of {ACCEPT}, got "
                       f"{self.accept!r}")
    if self.keep not in KEEP:
      raise ValueError(f"warmup.keep must be one of {KEEP}, got "
                       f"{self.keep!r}")
    if min(self.samples, self.max_per_prompt, self.max_new_tokens,
           self.chunk_prompts) < 1:
      raise ValueError("warmup.samples, max_per_prompt, max_new_tokens and "
                       "chunk_prompts must be >= 1")


@dataclasses.dataclass(frozen=True)
class WarmupResult:
  rows: list[dict]
  # Per prompt: (record, responses, correct flags).
  samples: list[tuple[Mapping[str, Any], list[str], list[bool]]]
  skipped: list[tuple[Mapping[str, Any], str]]

  def report(self, examples: int = 3) -> dict:
    by_tag: dict[str, list[int]] = collections.defaultdict(lambda: [0, 0])
    for record, _, correct in self.samples:
      for tag in (record.get("tags") or ["untagged"])[:1]:
        by_tag[tag][0] += sum(correct)
        by_tag[tag][1] += len(correct)
    n_correct = sum(c for c, _ in by_tag.values())
    n_total = sum(t for _, t in by_tag.values())
    solved = sum(any(c) for _, _, c in self.samples)
    return {
        "prompts": len(self.samples) + len(self.skipped),
        "prompts_sampled": len(self.samples),
        "prompts_skipped": len(self.skipped),
        "prompts_with_a_correct_response": solved,
        "responses": n_total, "correct": n_correct,
        "acceptance_rate": n_correct / n_total if n_total else 0.0,
        "acceptance_rate_by_tag": {t: c / n if n else 0.0
                                   for t, (c, n) in sorted(by_tag.items())},
        "rows": len(self.rows),
        "examples": self.rows[:examples],
        "skipped_examples": [{"id": r.get("id"), "reason": why}
                             for r, why in self.skipped[:examples]]}


def select(responses: Sequence[str], correct: Sequence[bool],
           cfg: WarmupConfig) -> list[str]:
  """The verified responses kept for one prompt (see WarmupConfig.keep)."""
  good = [r for r, ok in zip(responses, correct) if ok]
  if cfg.keep == "shortest":
    return sorted(good, key=len)[:1]
  return good[:cfg.max_per_prompt]


def rejection_sample(records: Sequence[Mapping[str, Any]], cfg: WarmupConfig,
                     *, policy: Policy, reward: RewardFn,
                     journal: journal_lib.Journal | None = None,
                     progress: bool = False) -> WarmupResult:
  """K templated responses per record, verified; correct ones become SFT
  rows (plain prompt + response). `journal` keeps finished chunks of
  prompts (a rerun after a kill samples only the rest)."""
  runnable, skipped, prompts = [], [], []
  for record in records:
    prompt = cfg.template.format(prompt=record["prompt"])
    problem = policy.prompt_problem(prompt)
    if problem is None:
      runnable.append(record)
      prompts.append(prompt)
    else:
      skipped.append((record, problem))

  def verified(chunk: Sequence[tuple[Mapping[str, Any], str]], start: int
               ) -> list[tuple[list[str], list[bool]]]:
    return sample_verified(policy, reward, chunk, cfg.samples,
                           accept=cfg.accept, temperature=cfg.temperature,
                           max_new_tokens=cfg.max_new_tokens, seed=cfg.seed,
                           first_index=start)

  items = list(zip(runnable, prompts))
  settings = dict(step="warmup", samples=cfg.samples,
                  temperature=cfg.temperature,
                  max_new_tokens=cfg.max_new_tokens, seed=cfg.seed)
  if cfg.accept != "answer":  # journals written before the option still match
    settings["accept"] = cfg.accept
  calls = journal_lib.ModelCalls(cfg.chunk_prompts, journal, progress)
  answers = calls.map(items, items, verified, key=settings,
                      desc="warm-up")
  rows, samples = [], []
  for record, (responses, correct) in zip(runnable, answers):
    responses, correct = list(responses), [bool(c) for c in correct]
    samples.append((record, responses, correct))
    for j, response in enumerate(select(responses, correct, cfg)):
      rows.append({"id": f"{record.get('id', '?')}#warmup{j}",
                   "prompt": record["prompt"], "response": response,
                   "tags": list(record.get("tags") or [])})
  return WarmupResult(rows, samples, skipped)
