"""Partial rollouts vs full rollouts: trained groups and tokens per second.

  python benchmarks/partial_rollout.py --json /tmp/partial_rollout.json
  python benchmarks/partial_rollout.py --workload long_tail --json /tmp/lt.json

Report section 2.6.2, measured on the code users run: every mode is a real
`RLLoop` (kimi_jax/rl/loop.py) with its own `LoopState` and train state,
sharing one `Engine` / `Sampler` and one `Learner` (one device, random
init), on a synthetic task that forces response lengths and scores
responses with a hash, so no verifier cost hides the difference. The loop
skips groups whose K rewards are all equal, in every mode alike.

Workload `default` (kimi_jax/data/synthetic.py, the tiny config's model):
groups of K = 4 responses to 8-token random prompts, no stop token; 90% of
responses need about the median length L (uniform in [0.75 L, 1.25 L]),
10% need 8 L; budget 2 L.

Workload `long_tail`, the regime partial rollouts are for: lengths drawn
from a log-normal with median L = 16 and sigma 1.5, rounded up and cut at
the maximum M = 240 (prompts of 16 tokens, a 256-token sequence). Half the
responses need at most 16 tokens, 90% at most 110, and the 3.5% that would
run past M stop there: a mass at the cap, as responses reaching
rl.max_response_len do. The report gives no distribution, only that
long-CoT lengths vary widely and a few run to the limit; sampled response
lengths are right-skewed with a multiplicative spread, which a log-normal
fits, and cutting it at M puts the would-be-longer ones at the cap. With
64 slots, 1 - 0.965^64 = 90% of full-rollout iterations hold a response at
the cap, so the tail sets their length: the "single lengthy trajectory"
that partial rollouts keep from monopolising the slots. The model is the
Qwen2-shaped config of docs/speed.md (4 layers, width 256, MLP 1024, 3.94 M
parameters; the tiny config's other model settings), whose decode step
costs grow with the slots on two CPU cores (measured first and reported as
`decode_step_ms`). Settings as experiments/_common.py sets them for the
long-CoT configs: K = 8, rl.token_budget = sequence / 4 = 64,
max_wait_iterations 4, 16 decode steps per call, prefill batches of
1/2/4/8. One train length, the whole sequence: packed rows hold several
short responses each, and the compile pass stays at one train-step shape
per row count.

The modes, P = slots / K groups:

  full:     rl.token_budget = the maximum: each iteration opens P new
            groups and generates every response to its end, then trains on
            the finished groups;
  partial:  rl.token_budget = B, rl.queued_prompts = Q (default P / 2):
            each iteration tops the buffer up to P + Q groups and runs one
            window of B tokens per slot; slots that free up mid-window
            start queued responses; the loop then trains on the groups
            whose K responses have all finished;
  partial_no_queue: the same without the queue (Q = 0, the shipped
            configs' setting), for reference;
  partial_keep_kv: partial with rl.keep_partial_kv (on with --keep-kv,
            the default for long_tail): a response the window cuts is
            continued next iteration in the sampler slot that holds its
            KV cache, computed under the earlier weights, instead of being
            prefilled again. It has a sampler of its own over the shared
            engine (the other modes' calls would free its kept slots).
            Each mode reports the sampler-trainer gap of the tokens it
            trains on (`logprob_gap_abs`, `logprob_gap_kl`): what the kept
            caches cost in sampled log-probs.

Segments: the shipped configs' setting, `rl.train_on_old_segments=True`
(every response token gets a gradient; `--mask-old-segments` trains only on
each iteration's own segment). Headline: trained groups per second (the fair
measure when earlier segments are masked) and trained response tokens per
second, over the iterations' wall time, after a compile pass over every
shape and one untimed iteration per mode. The modes alternate iteration by
iteration, so background load hits them alike. Per mode the JSON also has
each iteration's row (`per_iteration`) and a per-iteration breakdown
(`breakdown`): decode steps, generate calls, prefill tokens and the part
re-run for continued segments, and the seconds of rollout, train step and
the rest; with `--engine-timing` (on for long_tail) the engine's calls are
timed too, splitting the rollout into decode, prefill (the continued
segments' share of it by tokens), slot updates and the sampler's host work.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any, Sequence

import jax
import numpy as np

from kimi_jax.data import synthetic
from kimi_jax.data.tasks import Task
from kimi_jax.infra.config import load_config
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import batching
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.learner import Learner
from kimi_jax.rl.loop import RLLoop
from kimi_jax.rl.loop_state import LoopState
from kimi_jax.rl.prompt_sampling import PromptSamplingConfig
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import (SampleRequest, Sampler, SamplerStats,
                                     continuation)
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                    "experiments", "tiny.py")
# What each mode adds up over its timed iterations (from the loop's rows,
# and the sampler's own statistics of the rollout phase).
_SUMS = ("iteration_s", "rollout_s", "train_s", "score_s", "groups_trained",
         "trained_tokens", "loss_tokens", "decode_steps", "prefill_tokens",
         "generated_tokens", "requests", "queued_unstarted", "minibatches",
         "generate_calls", "continued_requests", "continued_prefill_tokens",
         "engine_decode_s", "engine_prefill_s", "engine_insert_s",
         "prefill_calls", "resumed_in_slot", "logprob_gap_abs_sum",
         "logprob_gap_kl_sum", "logprob_gap_tokens")
MODES = ("full", "partial", "partial_no_queue", "partial_keep_kv")
# Per-workload defaults of the flags left unset (None).
WORKLOADS = {
    "default": dict(model="tiny", slots=64, group_size=4, median_len=16,
                    prompt_len=8, iterations=20, step_costs=False,
                    engine_timing=False, prefill_batch_buckets=None,
                    keep_kv=False),
    "long_tail": dict(model="qwen_shaped", slots=64, group_size=8,
                      median_len=16, sigma=1.5, max_len=240, prompt_len=16,
                      iterations=8, step_costs=True, engine_timing=True,
                      prefill_batch_buckets=(1, 2, 4, 8), keep_kv=True),
}
# docs/speed.md's Qwen2-shaped sizes (benchmarks/sampler_workloads.py).
QWEN_SHAPED = dict(vocab_size=512, d_model=256, n_layers=4, n_heads=8,
                   n_kv_heads=2, head_dim=32, mlp_dim=1024)


def powers_of_two_buckets(top: int, start: int = 16) -> tuple[int, ...]:
  out, n = [], start
  while n < top:
    out.append(n)
    n *= 2
  return tuple(out) + (top,)


def tiny_model(cache_len: int) -> ModelConfig:
  return make_model("tiny", cache_len)


def make_model(name: str, cache_len: int) -> ModelConfig:
  """The tiny config's model, or its Qwen2-shaped variant; both keep the
  tiny config's other settings (unrolled layers, attention, dtypes)."""
  config = load_config(TINY)
  cfg = ModelConfig.from_mapping(config.model.to_dict())
  if name == "qwen_shaped":
    cfg = dataclasses.replace(cfg, **QWEN_SHAPED)
  elif name != "tiny":
    raise ValueError(f"unknown model {name!r} (tiny, qwen_shaped)")
  return dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, cache_len))


# ---- the long-tail task ------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class LongTailConfig:
  """Response lengths ceil(median * exp(sigma * z)), z standard normal,
  cut to [1, max_len]; random prompts of prompt_len tokens."""

  vocab_size: int
  group_size: int
  prompt_len: int = 16
  median_len: int = 16
  sigma: float = 1.5
  max_len: int = 240
  n_prompts: int = 4096
  seed: int = 0

  @property
  def short_range(self) -> tuple[int, int]:
    """The shortest response length first (as SyntheticConfig's)."""
    return (1, self.median_len)


def long_tail_lengths_K(cfg: LongTailConfig, index: int) -> list[int]:
  rng = np.random.default_rng([cfg.seed, index, 0])
  x = cfg.median_len * np.exp(cfg.sigma * rng.standard_normal(cfg.group_size))
  return [int(n) for n in np.clip(np.ceil(x), 1, cfg.max_len)]


def long_tail_task(cfg: LongTailConfig) -> Task:
  """The synthetic task's records and hash reward, long-tail lengths."""
  return synthetic.make_synthetic_task(cfg, long_tail_lengths_K,
                                       name="synthetic_long_tail")


def length_summary(task: Task, max_len: int) -> dict[str, float]:
  """The drawn lengths of every record: quantiles and the mass at the cap."""
  x = np.array([n for r in task.train for n in r["lengths_K"]])
  return {"mean": float(x.mean()), "median": float(np.median(x)),
          "p90": float(np.quantile(x, 0.9)),
          "p99": float(np.quantile(x, 0.99)),
          "frac_at_max": float(np.mean(x == max_len))}


# ---- the sampler's statistics per rollout phase ------------------------------


class RecordingSampler:
  """A mode's `Sampler`, keeping each `generate` call's `SamplerStats`
  and what its continued requests prefilled again (prompt + earlier
  segments), which the loop's row leaves out."""

  def __init__(self, sampler: Sampler):
    self._sampler = sampler
    self.last: SamplerStats | None = None
    self.continued = (0, 0)  # (requests, prefill tokens)

  def __getattr__(self, name: str):
    return getattr(self._sampler, name)

  def generate(self, params, requests: Sequence[SampleRequest], **kwargs):
    results, stats = self._sampler.generate(params, requests, **kwargs)
    started = [q for q, r in zip(requests, results) if r is not None]
    # What the call prefilled beyond new prompts: continued requests
    # not resumed in a kept slot, with their prompts and earlier segments.
    again = stats.prefill_tokens - sum(len(q.prompt) for q in started
                                       if not q.prefix)
    n_continued = sum(bool(q.prefix) for q in started) - stats.resumed
    self.last, self.continued = stats, (n_continued, again)
    return results, stats


# ---- building ----------------------------------------------------------------


def build(args: argparse.Namespace):
  """Engine, sampler, learner, task and the three modes' RL configs."""
  vocab = make_model(args.model, 1).vocab_size
  if args.workload == "long_tail":
    task_cfg = LongTailConfig(
        vocab_size=vocab, group_size=args.group_size,
        prompt_len=args.prompt_len, median_len=args.median_len,
        sigma=args.sigma, max_len=args.max_len, seed=args.seed)
    task = long_tail_task(task_cfg)
    cache_len = task_cfg.prompt_len + task_cfg.max_len
    # experiments/_common.py: token_budget = seq_len // 4.
    budget = args.budget or cache_len // 4
    # One train length, the whole sequence: packed rows hold many short
    # responses each, and the compile pass stays at one shape per row count.
    len_buckets = (cache_len,)
  else:
    task_cfg = synthetic.SyntheticConfig(
        vocab_size=vocab, group_size=args.group_size,
        prompt_len=args.prompt_len, median_len=args.median_len,
        seed=args.seed)
    task = synthetic.make_synthetic_task(task_cfg)
    cache_len = task_cfg.prompt_len + task_cfg.max_len
    budget = args.budget or 2 * args.median_len
    len_buckets = powers_of_two_buckets(cache_len)
  model = make_model(args.model, cache_len)
  sharder = Sharder(make_mesh(MeshConfig(), jax.devices()[:1]))
  engine = Engine(model, EngineConfig(
      args.slots, cache_len,
      prefill_batch_buckets=args.prefill_batch_buckets), sharder=sharder)
  # Lengths are forced, so a random policy's loops must not end them early.
  sampler = Sampler(engine, RepeatConfig(enabled=False),
                    steps_per_call=args.steps_per_call)
  prompts = args.slots // args.group_size
  queued = prompts // 2 if args.queued_prompts is None else args.queued_prompts
  old = not args.mask_old_segments
  base = RLConfig(
      iterations=1, prompts_per_iteration=prompts,
      samples_per_prompt=args.group_size, loss="mirror_descent",
      learning_rate=args.learning_rate,
      minibatch_prompts=args.minibatch_prompts,
      max_response_len=task_cfg.max_len, token_budget=task_cfg.max_len,
      # Enough carry-overs that no response is force-finished.
      max_wait_iterations=math.ceil(task_cfg.max_len / budget),
      train_len_buckets=len_buckets,
      train_on_old_segments=old,
      reference_logprobs="recompute" if old else args.reference_logprobs,
      pack_sequences=not args.no_pack)
  partial = dataclasses.replace(
      base, token_budget=budget,
      prompts_per_iteration=args.partial_prompts or prompts)
  rls = {"full": base,
         "partial": dataclasses.replace(
             partial, queued_prompts=queued,
             queued_min_tokens=args.queued_min_tokens or max(1, budget // 4))}
  if queued:
    rls["partial_no_queue"] = partial
  if args.keep_kv:
    rls["partial_keep_kv"] = dataclasses.replace(rls["partial"],
                                                 keep_partial_kv=True)
  learner = Learner(model, base, sharder, cache_len=cache_len)
  return model, sharder, engine, sampler, learner, task, task_cfg, rls


def compile_pass(engine: Engine, sampler: Sampler, learner: Learner,
                 params, task_cfg) -> float:
  """Compiles every shape the timed iterations can meet; returns seconds.

  Prefill / insert at every (length, batch) bucket pair (a response admitted
  mid-window stops at any length); generate at every cache view a decode
  step may read (one call per view, whose longest slot sets it); every
  packed (rows, length) train-step shape, on an all-padding minibatch (zero
  loss) through the learner's own `train`, on a throwaway state.
  """
  t0 = time.perf_counter()
  engine.warm_up_admission(params)
  below = 0  # the previous view: this call's slot reaches just past it
  for view in engine.engine_cfg.views:
    n = max(0, min(below + 1, engine.cache_len - 2) - task_cfg.prompt_len)
    sampler.generate(params, [SampleRequest(
        ("warm", view), (1,) * task_cfg.prompt_len, prefix=(1,) * n,
        max_new_tokens=n + 2, sampling=SamplingParams(seed=view))])
    below = view
  # A response continued in its kept slot (partial_keep_kv).
  cut = SampleRequest("warm_keep", (1,) * task_cfg.prompt_len,
                      max_new_tokens=4, budget=1,
                      sampling=SamplingParams(seed=1))
  first, _ = sampler.generate(params, [cut], keep_cut_kv=True)
  sampler.generate(params, [continuation(cut, first[0], budget=1)])
  rl = learner.rl
  P, K = rl.minibatch_prompts, rl.samples_per_prompt
  shortest = task_cfg.prompt_len + task_cfg.short_range[0] - 1
  lens = [b for b in learner.len_buckets
          if b >= batching.bucket_length(shortest, learner.len_buckets)]
  # Unpacked, a minibatch of n groups has n K rows, bucketed as well.
  rows = learner.row_buckets if rl.pack_sequences else sorted({
      batching.bucket_length(n * K, learner.row_buckets)
      for n in range(1, P + 1)})
  mbs = [batching.empty_minibatch(P, K, R, T, 0) for T in lens for R in rows]
  state, _ = learner.train(learner.init_state(params), mbs)
  jax.block_until_ready(state.params)
  return time.perf_counter() - t0


# ---- the decode step's cost and the engine's calls ---------------------------


class EngineTimer:
  """Seconds and calls of an engine's decode, prefill and slot updates,
  while `enabled`. Each timed call is waited for: a decode call's output is
  read at once anyway, so only a prefill's or an insert's overlap with the
  host's next steps is lost."""

  # `traced_generate` is the decode call (`generate` goes through it).
  KINDS = {"traced_generate": "decode", "prefill_batch": "prefill",
           "insert_batch": "insert", "free_slots": "insert",
           "set_sampling": "insert"}

  def __init__(self, engine: Engine, enabled: bool = True):
    self.enabled = enabled
    self.seconds: dict[str, float] = {}
    self.calls: dict[str, int] = {}
    for name, kind in self.KINDS.items():
      if hasattr(engine, name):
        setattr(engine, name, self._timed(kind, getattr(engine, name)))

  def _timed(self, kind: str, fn):
    def call(*args, **kwargs):
      if not self.enabled:
        return fn(*args, **kwargs)
      t0 = time.perf_counter()
      out = jax.block_until_ready(fn(*args, **kwargs))
      self.seconds[kind] = self.seconds.get(kind, 0.0) + (
          time.perf_counter() - t0)
      self.calls[kind] = self.calls.get(kind, 0) + 1
      return out
    return call

  def take(self) -> dict[str, float]:
    """The figures since the last take, as a row's entries."""
    out = {f"engine_{k}_s": self.seconds.get(k, 0.0)
           for k in ("decode", "prefill", "insert")}
    out["prefill_calls"] = self.calls.get("prefill", 0)
    self.seconds, self.calls = {}, {}
    return out


def _step_s(sampler: Sampler, timer: EngineTimer, params, n_busy: int,
            context: int, steps: int, repeats: int = 3) -> float:
  """Seconds of one decode step with `n_busy` slots busy, each holding
  `context` tokens and more: the engine's decode calls in a `generate` of
  n_busy requests `steps` tokens long, over its decode steps (median of
  `repeats`, after an untimed call)."""
  requests = [SampleRequest(("step", i), (1,) * context,
                            max_new_tokens=steps,
                            sampling=SamplingParams(seed=i))
              for i in range(n_busy)]
  sampler.generate(params, requests)  # compiles, if anything is new
  seconds = []
  for _ in range(repeats):
    timer.take()
    _, stats = sampler.generate(params, requests)
    seconds.append(timer.take()["engine_decode_s"] / stats.decode_steps)
  return float(np.median(seconds))


def decode_step_costs(model: ModelConfig, sharder: Sharder, sampler: Sampler,
                      timer: EngineTimer, params, *, context: int,
                      steps: int) -> dict[str, Any]:
  """Milliseconds per decode step: on engines of 8, 16, 32, ... slots up to
  the benchmark's, every slot busy (how a step's cost grows with the
  batch), and on the benchmark's engine with that many slots busy (it
  runs every slot at each step, busy or not). Every slot holds `context`
  tokens and more, which sets the cache view the steps read (`view`).
  `timer` times the benchmark's engine."""
  engine = sampler.engine
  top = engine.max_concurrent_decodes
  counts = [n for n in (8, 16, 32, 64, 128, 256) if n < top] + [top]
  by_engine, by_busy = {}, {}
  for n in counts:
    by_busy[n] = 1e3 * _step_s(sampler, timer, params, n, context, steps)
    if n == top:
      by_engine[n] = by_busy[n]
      continue
    sized = Engine(model, EngineConfig(n, engine.cache_len,
                                       prefill_batch_buckets=(n,)),
                   sharder=sharder)
    by_engine[n] = 1e3 * _step_s(
        Sampler(sized, RepeatConfig(enabled=False),
                steps_per_call=sampler.steps_per_call),
        EngineTimer(sized), params, n, context, steps)
  return {"context_tokens": context, "steps": steps,
          "view": engine.engine_cfg.view_for(context + steps),
          "by_engine_slots": by_engine, "by_busy_slots": by_busy}


# ---- one mode ----------------------------------------------------------------

_PER_ITERATION = ("iteration_s", "rollout_s", "train_s", "score_s",
                  "groups_trained", "trained_tokens", "decode_steps",
                  "generate_calls", "prefill_tokens",
                  "continued_prefill_tokens", "requests",
                  "continued_requests", "generated_tokens", "minibatches",
                  "engine_decode_s", "engine_prefill_s", "engine_insert_s",
                  "prefill_calls", "resumed_in_slot", "logprob_gap_abs",
                  "logprob_gap_kl")


@dataclasses.dataclass
class Mode:
  """One side of the comparison: its loop, its states and its totals."""

  name: str
  loop: RLLoop
  state: LoopState
  train: Any
  sampler: RecordingSampler
  timer: EngineTimer | None = None
  totals: dict[str, float] = dataclasses.field(default_factory=dict)
  rows: list[dict[str, float]] = dataclasses.field(default_factory=list)

  def iteration(self) -> dict[str, float]:
    self.sampler.last, self.sampler.continued = None, (0, 0)
    if self.timer:
      self.timer.take()
    self.state, self.train, row = self.loop.iteration(self.state, self.train)
    stats = self.sampler.last
    row.update(generate_calls=stats.generate_calls if stats else 0,
               continued_requests=self.sampler.continued[0],
               continued_prefill_tokens=self.sampler.continued[1],
               **_gap_sums(row),
               **(self.timer.take() if self.timer else {}))
    return row

  def add(self, row: dict[str, float]) -> None:
    for k in _SUMS:
      self.totals[k] = self.totals.get(k, 0) + row.get(k, 0)
    self.totals["iterations"] = self.totals.get("iterations", 0) + 1
    self.rows.append({k: row.get(k, 0) for k in _PER_ITERATION})


def _gap_sums(row: dict[str, Any]) -> dict[str, float]:
  """The iteration's sampler-trainer gap as sums over its measured tokens
  (means weighted by tokens when added up over iterations)."""
  n = row.get("logprob_gap_tokens") or 0
  if not n or row.get("logprob_gap_abs") is None:
    return {"logprob_gap_tokens": 0}
  return {"logprob_gap_tokens": n,
          "logprob_gap_abs_sum": row["logprob_gap_abs"] * n,
          "logprob_gap_kl_sum": row["logprob_gap_kl"] * n}


def breakdown(t: dict[str, float], engine_timing: bool) -> dict[str, float]:
  """Per iteration: where the wall time goes and the work behind it. With
  the engine's calls timed, the rollout splits into decode calls, prefill
  calls, slot updates and the sampler's host work; the part of the prefill
  that continued segments re-run is its share of the prefill tokens."""
  n = max(t["iterations"], 1)
  out = {
      "wall_s": t["iteration_s"] / n, "rollout_s": t["rollout_s"] / n,
      "train_s": t["train_s"] / n, "score_s": t["score_s"] / n,
      "other_s": (t["iteration_s"] - t["rollout_s"] - t["train_s"]
                  - t["score_s"]) / n,
      "decode_steps": t["decode_steps"] / n,
      "generate_calls": t["generate_calls"] / n,
      "requests": t["requests"] / n,
      "continued_requests": t["continued_requests"] / n,
      "prefill_tokens": t["prefill_tokens"] / n,
      "continued_prefill_tokens": t["continued_prefill_tokens"] / n,
      "trained_tokens": t["trained_tokens"] / n,
      "train_steps": t["minibatches"] / n,
      "prefill_tokens_per_trained_token": t["prefill_tokens"] / max(
          t["trained_tokens"], 1),
      "decode_steps_per_trained_group": t["decode_steps"] / max(
          t["groups_trained"], 1),
  }
  if engine_timing:
    decode, prefill, insert = (t[f"engine_{k}_s"] / n
                               for k in ("decode", "prefill", "insert"))
    out.update(
        decode_s=decode, prefill_s=prefill, insert_s=insert,
        sampler_host_s=out["rollout_s"] - decode - prefill - insert,
        prefill_calls=t["prefill_calls"] / n,
        decode_ms_per_step=1e3 * decode / max(out["decode_steps"], 1e-9),
        continued_prefill_s=prefill * t["continued_prefill_tokens"] / max(
            t["prefill_tokens"], 1))
  return out


def summarise(mode: Mode, slots: int) -> dict[str, Any]:
  t = mode.totals
  wall = t["iteration_s"]
  buffer = mode.state.buffer
  return {
      "token_budget": mode.loop.rl.token_budget,
      "queued_prompts": mode.loop.rl.queued_prompts,
      "iterations": int(t["iterations"]),
      "groups_trained": int(t["groups_trained"]),
      "trained_tokens": int(t["trained_tokens"]),
      "loss_tokens": int(t["loss_tokens"]),
      "wall_s": wall, "rollout_s": t["rollout_s"], "train_s": t["train_s"],
      "score_s": t["score_s"],
      "decode_steps": int(t["decode_steps"]), "requests": int(t["requests"]),
      "generate_calls": int(t["generate_calls"]),
      "continued_requests": int(t["continued_requests"]),
      "unstarted_requests": int(t["queued_unstarted"]),
      "prefill_tokens": int(t["prefill_tokens"]),
      # Of those, what continued segments prefilled again: their prompt
      # and every earlier segment.
      "continued_prefill_tokens": int(t["continued_prefill_tokens"]),
      "generated_tokens": int(t["generated_tokens"]),
      "train_steps": int(t["minibatches"]),
      "slot_utilisation": (t["generated_tokens"] - t["requests"]) / max(
          t["decode_steps"] * slots, 1),
      "groups_per_s": t["groups_trained"] / max(wall, 1e-9),
      "trained_tokens_per_s": t["trained_tokens"] / max(wall, 1e-9),
      "loss_tokens_per_s": t["loss_tokens"] / max(wall, 1e-9),
      # The two phases on their own: what partial rollouts change is the
      # rollout side; a trained token costs the trainer about the same.
      "trained_tokens_per_rollout_s": t["trained_tokens"] / max(
          t["rollout_s"], 1e-9),
      "trained_tokens_per_train_s": t["trained_tokens"] / max(
          t["train_s"], 1e-9),
      "train_fraction": t["train_s"] / max(wall, 1e-9),
      "in_flight_groups_at_end": len(buffer),
      # Responses cut short by max_wait_iterations (should be 0 here).
      "budget_exhausted": buffer.stats["budget_exhausted"],
      "resumed_in_slot": int(t["resumed_in_slot"]),
      # Mean over the tokens measured in every timed iteration.
      "logprob_gap_abs": t["logprob_gap_abs_sum"] / max(
          t["logprob_gap_tokens"], 1),
      "logprob_gap_kl": t["logprob_gap_kl_sum"] / max(
          t["logprob_gap_tokens"], 1),
      "logprob_gap_tokens": int(t["logprob_gap_tokens"]),
      "breakdown": breakdown(t, mode.timer is not None),
      "per_iteration": mode.rows,
  }


def _note(args: argparse.Namespace, text: str) -> None:
  if args.verbose:
    print(text, file=sys.stderr, flush=True)


def run(args: argparse.Namespace) -> dict[str, Any]:
  if args.slots % args.group_size:
    raise SystemExit(f"--slots ({args.slots}) must be a multiple of the "
                     f"group size {args.group_size}")
  load_before = os.getloadavg()
  (model, sharder, engine, sampler, learner, task, task_cfg,
   rls) = build(args)
  budget = rls["partial"].token_budget
  ps = PromptSamplingConfig()  # uniform
  timer = EngineTimer(engine)
  steps = None
  if args.step_costs:
    t0 = time.perf_counter()
    # Slots near the end of the cache: the view while a long response is
    # live, which is most of a full-rollout iteration.
    n = min(2 * args.steps_per_call, engine.cache_len // 2)
    steps = decode_step_costs(
        model, sharder, sampler, timer,
        transformer.init_sharded(model, 10_000, sharder),
        context=engine.cache_len - n - 1, steps=n)
    steps["seconds"] = time.perf_counter() - t0
    _note(args, f"decode step costs in {steps['seconds']:.0f}s")
  # The learner's first train step donates these parameters.
  warm_params = transformer.init_sharded(model, 10_000, sharder)
  n_parameters = sum(x.size for x in jax.tree_util.tree_leaves(warm_params))
  timer.enabled = False
  compile_s = compile_pass(engine, sampler, learner, warm_params, task_cfg)
  _note(args, f"compile pass in {compile_s:.0f}s")

  def counts() -> int:
    return learner.compile_count() + sum(engine.compile_count().values())

  compiles_before = counts()
  timer.enabled = args.engine_timing
  modes = []
  for name, rl in rls.items():
    recorder = RecordingSampler(
        Sampler(engine, sampler.repeat, steps_per_call=sampler.steps_per_call)
        if rl.keep_partial_kv else sampler)
    loop = RLLoop(rl=rl, seed=args.seed, settings=SamplingSettings(),
                  task=task, sampler=recorder, learner=learner)
    state = LoopState.initial(
        group_size=rl.samples_per_prompt,
        max_wait_iterations=rl.max_wait_iterations, records=task.train,
        prompt_sampling=ps)
    params = transformer.init_sharded(model, args.seed, sharder)
    modes.append(Mode(name, loop, state, learner.init_state(params),
                      recorder, timer if timer.enabled else None))
  warmup_s = {}
  for mode in modes:  # untimed: any missed compile, partial's buffer fills
    warmup_s[mode.name] = mode.iteration()["iteration_s"]
  _note(args, "warm-up iterations: " + ", ".join(
      f"{k} {v:.1f}s" for k, v in warmup_s.items()))
  for it in range(1, args.iterations + 1):
    for mode in modes:
      mode.add(mode.iteration())
    if args.verbose:
      print(f"iteration {it}: " + ", ".join(
          f"{m.name} {m.totals['iteration_s']:.1f}s" for m in modes),
            file=sys.stderr)
  rows = {m.name: summarise(m, args.slots) for m in modes}
  full = rows["full"]

  def speedup(row: dict, key: str = "trained_tokens_per_s") -> float:
    return row[key] / max(full[key], 1e-9)

  for row in rows.values():  # each mode against full rollouts
    row["vs_full"] = {
        "trained_tokens_per_s": speedup(row),
        "groups_per_s": speedup(row, "groups_per_s"),
        "rollout_phase": speedup(row, "trained_tokens_per_rollout_s"),
        "train_phase": speedup(row, "trained_tokens_per_train_s")}
  partial = rows["partial"]
  long_tail = args.workload == "long_tail"
  return {
      "workload": args.workload,
      "partial_vs_full_speedup": speedup(partial),
      "partial_vs_full_groups_per_s_speedup": speedup(partial,
                                                      "groups_per_s"),
      "partial_groups_per_s": partial["groups_per_s"],
      "full_groups_per_s": full["groups_per_s"],
      "partial_trained_tokens_per_s": partial["trained_tokens_per_s"],
      "full_trained_tokens_per_s": full["trained_tokens_per_s"],
      "partial_vs_full_loss_token_speedup": speedup(partial,
                                                    "loss_tokens_per_s"),
      "partial_vs_full_rollout_phase_speedup": speedup(
          partial, "trained_tokens_per_rollout_s"),
      "partial_vs_full_train_phase_speedup": speedup(
          partial, "trained_tokens_per_train_s"),
      **({"partial_no_queue_vs_full_speedup": speedup(
          rows["partial_no_queue"])} if "partial_no_queue" in rows else {}),
      **({"partial_keep_kv_vs_full_speedup": speedup(
          rows["partial_keep_kv"])} if "partial_keep_kv" in rows else {}),
      **rows,
      "decode_step_ms": steps,
      "lengths": length_summary(task, task_cfg.max_len),
      "compile_s": compile_s, "warmup_iteration_s": warmup_s,
      "recompiles_during_timed_run": counts() - compiles_before,
      "settings": {
          "workload": args.workload, "model_name": args.model,
          "model_parameters": int(n_parameters),
          "slots": args.slots, "group_size": args.group_size,
          "median_len": task_cfg.median_len, "long_len": task_cfg.max_len,
          "long_frac": None if long_tail else task_cfg.long_frac,
          "sigma": task_cfg.sigma if long_tail else None,
          "prompt_len": task_cfg.prompt_len,
          "budget": budget,
          "partial_prompts": rls["partial"].prompts_per_iteration,
          "queued_prompts": rls["partial"].queued_prompts,
          "queued_min_tokens": rls["partial"].queued_min_tokens,
          "train_on_old_segments": learner.rl.train_on_old_segments,
          "reference_logprobs": learner.rl.reference_logprobs,
          "pack_sequences": learner.rl.pack_sequences,
          "max_wait_iterations": learner.rl.max_wait_iterations,
          "minibatch_prompts": args.minibatch_prompts,
          "train_len_buckets": learner.len_buckets,
          "prefill_batch_buckets": engine.engine_cfg.batch_buckets,
          "steps_per_call": args.steps_per_call, "seed": args.seed,
          "keep_kv": args.keep_kv,
          "iterations": args.iterations,
          "model": dataclasses.asdict(model)},
      "device": f"{jax.devices()[0].platform} ({jax.devices()[0]})",
      "loadavg_before": list(load_before),
      "loadavg_after": list(os.getloadavg()),
  }


def _lengths_text(s: dict[str, Any], lengths: dict[str, float]) -> str:
  if s["workload"] == "long_tail":
    return (f"lengths log-normal, median {s['median_len']}, sigma "
            f"{s['sigma']}, cut at {s['long_len']} "
            f"({lengths['frac_at_max']:.1%} there, mean "
            f"{lengths['mean']:.1f})")
  return (f"lengths {1 - s['long_frac']:.0%} ~{s['median_len']} / "
          f"{s['long_frac']:.0%} {s['long_len']}")


def print_table(r: dict[str, Any]) -> None:
  s = r["settings"]
  print(f"\npartial vs full rollouts ({r['device']}; {s['workload']} "
        f"workload, {s['model_name']} model; {s['slots']} slots, "
        f"K={s['group_size']}, partial {s['partial_prompts']} in flight + "
        f"{s['queued_prompts']} queued (starting while >= "
        f"{s['queued_min_tokens']} window tokens remain), "
        f"{_lengths_text(s, r['lengths'])}, budget {s['budget']}, "
        f"train_on_old_segments={s['train_on_old_segments']}, "
        f"{s['steps_per_call']} decode steps per call, {s['iterations']} "
        f"timed iterations each)")
  steps = r.get("decode_step_ms")
  if steps:
    print("decode step ms by slots (engine of that many / busy in the "
          "benchmark's): " + ", ".join(
              f"{n}: {steps['by_engine_slots'][n]:.2f} / "
              f"{steps['by_busy_slots'][n]:.2f}"
              for n in steps["by_engine_slots"]))
  cols = ("groups_trained", "trained_tokens", "rollout_s", "train_s",
          "wall_s", "decode_steps", "generate_calls", "prefill_tokens",
          "continued_prefill_tokens", "slot_utilisation", "groups_per_s",
          "trained_tokens_per_s", "logprob_gap_abs")
  print("| mode | " + " | ".join(cols) + " |")
  print("|---" * (len(cols) + 1) + "|")
  for name in MODES:
    if name not in r:
      continue
    row = r[name]
    cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c])
             for c in cols]
    print(f"| {name} | " + " | ".join(cells) + " |")
  keys = ("wall_s", "rollout_s", "decode_s", "prefill_s",
          "continued_prefill_s", "insert_s", "sampler_host_s", "train_s",
          "other_s", "decode_steps", "decode_ms_per_step", "generate_calls",
          "prefill_calls", "prefill_tokens", "continued_prefill_tokens",
          "trained_tokens")
  print("\nper iteration | " + " | ".join(keys) + " |")
  print("|---" * (len(keys) + 1) + "|")
  for name in MODES:
    if name in r:
      b = r[name]["breakdown"]
      print(f"| {name} | " + " | ".join(
          f"{b[k]:.3f}" if k in b else "-" for k in keys) + " |")
  print(f"\npartial_vs_full_speedup: {r['partial_vs_full_speedup']:.2f}x "
        f"trained tokens/s, "
        f"{r['partial_vs_full_groups_per_s_speedup']:.2f}x trained groups/s "
        f"(rollout phase alone "
        f"{r['partial_vs_full_rollout_phase_speedup']:.2f}x, train phase "
        f"alone {r['partial_vs_full_train_phase_speedup']:.2f}x)"
        + (f"; without the queue "
           f"{r['partial_no_queue_vs_full_speedup']:.2f}x"
           if "partial_no_queue_vs_full_speedup" in r else "")
        + (f"; keeping cut responses' KV caches "
           f"{r['partial_keep_kv_vs_full_speedup']:.2f}x"
           if "partial_keep_kv_vs_full_speedup" in r else "") +
        f"\ncompile {r['compile_s']:.1f}s, recompiles while timed: "
        f"{r['recompiles_during_timed_run']}; load average "
        f"{r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f}")


def parse_args(argv=None) -> argparse.Namespace:
  doc = __doc__.split("\n\n", 2)
  parser = argparse.ArgumentParser(
      description=doc[0] + "\n\n" + doc[2],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--workload", choices=tuple(WORKLOADS),
                      default="default",
                      help="default: 90%% of lengths ~L, 10%% 8 L, the tiny "
                      "model; long_tail: log-normal lengths cut at the "
                      "maximum, the Qwen2-shaped model (default: "
                      "%(default)s)")
  parser.add_argument("--model", choices=("tiny", "qwen_shaped"),
                      help="the policy's sizes (default: the workload's)")
  parser.add_argument("--iterations", type=int,
                      help="timed RL iterations per mode, after one untimed "
                      "warm-up iteration each (default: 20, long_tail 8)")
  parser.add_argument("--slots", type=int,
                      help="sampler slots; P = slots / K prompts per "
                      "iteration (default: 64)")
  parser.add_argument("--median-len", type=int,
                      help="L: default workload: 90%% of responses need ~L "
                      "tokens, 10%% need 8 L, the cache holds prompt + 8 L; "
                      "long_tail: the log-normal's median (default: 16)")
  parser.add_argument("--sigma", type=float,
                      help="long_tail: the log-normal's sigma (default: 1.5)")
  parser.add_argument("--max-len", type=int,
                      help="long_tail: the maximum response length, where "
                      "longer draws are cut (default: 240)")
  parser.add_argument("--prompt-len", type=int,
                      help="prompt tokens (default: 8, long_tail 16)")
  parser.add_argument("--budget", type=int, default=0,
                      help="partial rollouts' tokens per response per "
                      "iteration, rl.token_budget (default: 2 L; "
                      "long_tail: (prompt + maximum) / 4)")
  parser.add_argument("--partial-prompts", type=int, default=0,
                      help="groups partial rollouts keep in flight (default: "
                      "slots / K, as full rollouts)")
  parser.add_argument("--queued-prompts", type=int, default=None,
                      help="partial rollouts: rl.queued_prompts, extra groups "
                      "queued beyond the slots; the rollout phase is one "
                      "window of `budget` tokens per slot. Partial rollouts "
                      "also run without it, as a third row (default: "
                      "slots / K / 2; 0: no queue, two rows)")
  parser.add_argument("--queued-min-tokens", type=int, default=0,
                      help="rl.queued_min_tokens: queued responses start only "
                      "while this many window tokens remain (default: "
                      "budget / 4)")
  parser.add_argument("--keep-kv", action=argparse.BooleanOptionalAction,
                      help="also run partial_keep_kv: partial rollouts with "
                      "rl.keep_partial_kv (default: on for long_tail)")
  parser.add_argument("--group-size", type=int,
                      help="K responses per prompt (default: 4, long_tail 8)")
  parser.add_argument("--minibatch-prompts", type=int, default=4,
                      help="prompts per train step (default: %(default)s)")
  parser.add_argument("--steps-per-call", type=int, default=None,
                      help="sampler.steps_per_call, decode steps per engine "
                      "call (default: experiments/tiny.py's, as the RL loop "
                      "runs it)")
  parser.add_argument("--step-costs", action=argparse.BooleanOptionalAction,
                      help="time a decode step at 8, 16, 32, ... slots first "
                      "(default: on for long_tail)")
  parser.add_argument("--engine-timing",
                      action=argparse.BooleanOptionalAction,
                      help="time the engine's decode, prefill and slot-update "
                      "calls, waiting for each, for the per-iteration "
                      "breakdown (default: on for long_tail)")
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--mask-old-segments", action="store_true",
                      help="rl.train_on_old_segments=False: only each "
                      "iteration's own segment gets a gradient (the shipped "
                      "configs train on every segment)")
  parser.add_argument("--reference-logprobs", default="sampler",
                      choices=("sampler", "recompute"),
                      help="with --mask-old-segments: reuse the sampler's "
                      "log-probs (default) or recompute them; training on "
                      "old segments always recomputes")
  parser.add_argument("--no-pack", action="store_true",
                      help="one response per training row (rl.pack_sequences"
                      "=False) in every mode, instead of packed rows")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", metavar="PATH",
                      help="also write the results here as JSON")
  parser.add_argument("--verbose", action="store_true",
                      help="progress per iteration on stderr")
  args = parser.parse_args(argv)
  for key, value in WORKLOADS[args.workload].items():
    if getattr(args, key, None) is None:
      setattr(args, key, value)
  if args.steps_per_call is None:
    args.steps_per_call = int(load_config(TINY).sampler.steps_per_call)
  return args


def main(argv=None) -> dict[str, Any]:
  args = parse_args(argv)
  report = run(args)
  print_table(report)
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=str)
  return report


if __name__ == "__main__":
  main()
