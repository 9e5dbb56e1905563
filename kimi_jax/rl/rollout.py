"""The rollout phase: sampler requests from the replay buffer, results back.

Every unfinished trajectory in the buffer (new groups and carried-over
partial rollouts) becomes one request that continues `prompt + tokens so far`
under the current policy for at most `token_budget` new tokens. Each request's
seed is a pure function of (run seed, group id, sample index, iteration), so a
resumed run draws the same tokens.
"""

from __future__ import annotations

import hashlib
from typing import Any, Sequence

from kimi_jax.rl import replay_buffer
from kimi_jax.rl.config import RLConfig
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import SampleRequest, SampleResult
from kimi_jax.sampler.sampling import SamplingParams


def request_seed(*parts: int) -> int:
  digest = hashlib.blake2b(repr(tuple(int(p) for p in parts)).encode(),
                           digest_size=4).digest()
  return int.from_bytes(digest, "little")


def groups_to_open(buffer: replay_buffer.RolloutBuffer,
                   target_groups: int) -> int:
  """New groups needed so about `target_groups` x K responses are unfinished.

  Counting responses, not groups: a carried-over group may be waiting on a
  single long response, and the sampler's slots should stay full. With a
  queue, target_groups = rl.prompts_per_iteration + rl.queued_prompts.
  """
  k = buffer.group_size
  unfinished = len(buffer.pending())
  return max(0, -(-(target_groups * k - unfinished) // k))


def continue_requests(pending: Sequence[replay_buffer.Trajectory],
                      prompts: Sequence[list[int]], *, seed: int,
                      iteration: int, settings: SamplingSettings,
                      stop_tokens: tuple[int, ...],
                      max_response_lens: Sequence[int], token_budget: int,
                      images: Sequence[Any] | None = None
                      ) -> list[SampleRequest]:
  """One request per unfinished response: continue `prompt + tokens so far`
  for at most `token_budget` new tokens, up to its `max_response_lens`;
  `images[i]`: response i's prompt images (None: none)."""
  out = []
  images = [None] * len(pending) if images is None else images
  for traj, prompt, max_len, pixels in zip(pending, prompts,
                                           max_response_lens, images):
    budget = min(token_budget, max_len - traj.length)
    out.append(SampleRequest(
        id=(traj.group_id, traj.sample_index), prompt=tuple(prompt),
        prefix=traj.tokens,
        sampling=SamplingParams(
            temperature=settings.temperature, top_k=settings.top_k,
            top_p=settings.top_p,
            seed=request_seed(seed, traj.group_id, traj.sample_index,
                              iteration)),
        stop_tokens=stop_tokens, max_new_tokens=max_len, budget=budget,
        images=pixels))
  return out


def window_args(rl: RLConfig) -> dict[str, int]:
  """`Sampler.generate` keywords of the rollout phase: one window of
  `rl.token_budget` tokens per slot when prompts are queued beyond the slots
  (rl.queued_prompts > 0), else none (every request runs its whole budget)."""
  if not rl.queued_prompts:
    return {}
  return {"window": rl.token_budget, "min_admit": rl.queued_min_tokens}


def record_results(buffer: replay_buffer.RolloutBuffer,
                   results: Sequence[SampleResult | None], *, version: int
                   ) -> dict[str, int]:
  """Appends each result as a segment; budget stops stay in flight.

  None (a request the sampler's window closed on before admitting it)
  leaves its trajectory untouched: it is requested again next iteration and
  does not count as waiting.
  """
  counts = {"stop": 0, "length": 0, "repeat": 0, "budget": 0, "unstarted": 0}
  for res in results:
    if res is None:
      counts["unstarted"] += 1
      continue
    group_id, sample_index = res.id
    counts[res.finish_reason] += 1
    buffer.add_segment(
        group_id, sample_index, res.tokens, res.logprobs, version=version,
        finish_reason=None if res.finish_reason == "budget" else
        res.finish_reason, experts=res.experts)
  return counts


def stop_tokens(tokenizer: Any) -> tuple[int, ...]:
  """What ends a response: a Hugging Face tokenizer's stop ids (eos and the
  extra ones of generation_config.json), else the tokenizer's eos; none for
  a synthetic task, which generates every response to its limit."""
  if getattr(tokenizer, "stop_ids", None):
    return tuple(tokenizer.stop_ids)
  return () if tokenizer.eos_id is None else (tokenizer.eos_id,)


def response_text(tokens: Sequence[int], tokenizer) -> str:
  """Decodes a response, cutting at the first eos."""
  ids = list(tokens)
  if tokenizer.eos_id is not None and tokenizer.eos_id in ids:
    ids = ids[:ids.index(tokenizer.eos_id)]
  return tokenizer.decode(ids)
