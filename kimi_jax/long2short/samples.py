"""n scored responses per prompt from one policy: the data of shortest
rejection sampling and DPO (report 2.4: "we utilize the Long CoT model to
generate multiple response samples").

Responses are drawn with the RL sampling settings, one request per (prompt,
draw) seeded by (seed, prompt, draw), so the same policy gives the same
samples.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Mapping, Sequence

import numpy as np

from kimi_jax.data.journal import ModelCalls
from kimi_jax.data.tasks import Task
from kimi_jax.rewards.base import score_all
from kimi_jax.rl import rollout
from kimi_jax.sampler import handoff
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.sampling import SamplingParams


@dataclasses.dataclass(frozen=True)
class Samples:
  """P prompts x N responses. tokens[p][j] holds response j of prompt p
  (its stop token included); lengths_PxN counts them."""

  records: Sequence[Mapping[str, Any]]
  prompts: Sequence[list[int]]
  tokens: Sequence[Sequence[list[int]]]
  lengths_PxN: np.ndarray
  correct_PxN: np.ndarray

  @property
  def n_prompts(self) -> int:
    return len(self.records)

  def text(self, p: int, j: int, tokenizer) -> str:
    return rollout.response_text(self.tokens[p][j], tokenizer)


def sample(sampler: Sampler, params, task: Task,
           records: Sequence[Mapping[str, Any]], *, n: int,
           max_response_len: int, settings: SamplingSettings, seed: int,
           calls: ModelCalls = ModelCalls()) -> Samples:
  """`n` responses of `params` to each record's prompt, scored by the
  task's reward; asked `calls.chunk` records at a time (each finished chunk
  kept in `calls.journal`), with the same draws as one call."""
  stop = rollout.stop_tokens(task.tokenizer)
  prompts = [task.encode_prompt(r) for r in records]
  sampler_params, _ = handoff.place_params(params,
                                           sampler.engine.param_shardings)

  def draw(chunk: Sequence[tuple[Mapping[str, Any], list[int]]], start: int
           ) -> list[dict[str, list]]:
    requests = [
        SampleRequest(
            id=(p, j), prompt=tuple(prompt), max_new_tokens=max_response_len,
            stop_tokens=stop,
            sampling=SamplingParams(
                temperature=settings.temperature, top_k=settings.top_k,
                top_p=settings.top_p,
                seed=rollout.request_seed(seed, p, j)))
        for p, (_, prompt) in enumerate(chunk, start) for j in range(n)]
    results, _ = sampler.generate(sampler_params, requests)
    by_id = {r.id: r for r in results}
    tokens = [[list(by_id[(p, j)].tokens) for j in range(n)]
              for p in range(start, start + len(chunk))]
    texts = [rollout.response_text(t, task.tokenizer) for ts in tokens
             for t in ts]
    scored = score_all(task.reward, [r for r, _ in chunk for _ in range(n)],
                       texts)
    return [{"tokens": ts, "correct": [s.correct for s in
                                       scored[k * n:(k + 1) * n]]}
            for k, ts in enumerate(tokens)]

  items = list(zip(records, prompts))
  key = dict(step="long2short_samples", n=n,
             max_response_len=max_response_len,
             settings=dataclasses.asdict(settings), seed=seed)
  drawn = calls.map(items, items, draw, key=key, desc="samples")
  tokens = [d["tokens"] for d in drawn]
  P = len(records)
  return Samples(
      records=list(records), prompts=prompts, tokens=tokens,
      lengths_PxN=np.array([[len(t) for t in ts] for ts in tokens],
                           np.int32).reshape(P, n),
      correct_PxN=np.array([d["correct"] for d in drawn],
                           bool).reshape(P, n))
