"""Partial rollouts vs full rollouts: trained-on tokens per second.

  python benchmarks/partial_rollout.py --json /tmp/partial_rollout.json

Report section 2.6.2 on the project's own components, used as the RL loop
(kimi_jax/rl/loop.py) uses them: the tiny config's model (random init, one
device, max_seq_len raised to fit), one Engine / Sampler with a fixed slot
count, the RolloutBuffer, `rollout.continue_requests` / `record_results`,
`batching.sorted_minibatches` (packed rows), the reference log-prob pass and the
jitted mirror-descent train step with the optimizer reset every iteration.

Workload: groups of K responses per prompt, random-token prompts, no stop
token; every response is forced to a target length (its `max_new_tokens`,
so it ends with "length"): 90% need about the median length L (uniform in
[0.75 L, 1.25 L]), 10% need 8 L. Targets, prompts and the synthetic 0/1
rewards are fixed by the seed and the group id, so every mode sees the same
sequence of groups. Only throughput is measured, never learning.

  full:     each iteration opens P = slots / K new groups and generates
            every response to its end (budget None), then trains on all P
            groups;
  partial:  each iteration tops the buffer up to P groups in flight plus Q
            queued (rl.queued_prompts, default P / 2) and runs one window
            of `budget` tokens per slot: every unfinished response continues
            for at most `budget` tokens, slots that free up mid-window start
            queued responses (with what is left of the window); then it
            trains on the groups whose K responses have all finished;
  partial_no_queue: the same without the queue (Q = 0), for reference.

Metric: response tokens of trained groups / (rollout + training wall time),
after a compile pass over every shape and one untimed iteration per mode (so
partial does not start from an empty buffer: over the window, tokens carried
in roughly balance those left in flight at the end). The modes alternate
iteration by iteration, so background load hits them alike.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import math
import os
import sys
import time
from typing import Any

import jax
import numpy as np

from kimi_jax import train_step as ts
from kimi_jax.config import load_config
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import batching, replay_buffer, rollout, trainer
from kimi_jax.rl.config import RLConfig
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, host_to_global, make_mesh

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                    "experiments", "tiny.py")
PAD_ID = 0
_MODEL_KEYS = batching.ROW_KEYS + ("lengths",)
_TRAIN_KEYS = _MODEL_KEYS + ("reward", "correct", "ref_seq_logp", "valid")


@dataclasses.dataclass(frozen=True)
class Workload:
  """The long-tail length mix; every draw is a pure function of (seed, id)."""

  median_len: int
  group_size: int = 4
  prompt_len: int = 8
  long_factor: int = 8
  long_frac: float = 0.1
  seed: int = 0

  @property
  def max_len(self) -> int:
    return self.long_factor * self.median_len

  @property
  def short_range(self) -> tuple[int, int]:
    """Inclusive range of the short responses' lengths, ~[0.75 L, 1.25 L]."""
    return (max(1, math.ceil(0.75 * self.median_len)),
            max(1, int(1.25 * self.median_len)))

  def target_lengths_K(self, group_id: int) -> np.ndarray:
    rng = np.random.default_rng([self.seed, group_id, 0])
    lo, hi = self.short_range
    short_K = rng.integers(lo, hi + 1, self.group_size)
    is_long_K = rng.random(self.group_size) < self.long_frac
    return np.where(is_long_K, self.max_len, short_K)

  def prompt(self, group_id: int, vocab: int) -> list[int]:
    rng = np.random.default_rng([self.seed, group_id, 1])
    # Token 0 is the pad id; prompts avoid it only for readability.
    return [int(t) for t in rng.integers(1, vocab, self.prompt_len)]

  def rewards_K(self, group_id: int) -> np.ndarray:
    """Synthetic 0/1 rewards: throughput does not depend on their values."""
    rng = np.random.default_rng([self.seed, group_id, 2])
    return rng.integers(0, 2, self.group_size).astype(np.float32)


def powers_of_two_buckets(top: int, start: int = 16) -> tuple[int, ...]:
  out, n = [], start
  while n < top:
    out.append(n)
    n *= 2
  return tuple(out) + (top,)


def tiny_model(cache_len: int) -> ModelConfig:
  config = load_config(TINY)
  cfg = ModelConfig.from_mapping(config.model.to_dict())
  return dataclasses.replace(cfg, max_seq_len=max(cfg.max_seq_len, cache_len))


class Bench:
  """What both modes share: model config, engine, sampler, jitted steps."""

  def __init__(self, work: Workload, *, slots: int, budget: int,
               minibatch_prompts: int, steps_per_call: int,
               learning_rate: float, reference_logprobs: str = "sampler",
               pack: bool = True, queued_prompts: int = 0,
               queued_min_tokens: int = 1):
    self.work = work
    self.cache_len = work.prompt_len + work.max_len
    self.model = tiny_model(self.cache_len)
    self.sharder = Sharder(make_mesh(MeshConfig(), jax.devices()[:1]))
    self.engine = Engine(self.model, EngineConfig(slots, self.cache_len),
                         sharder=self.sharder)
    # Lengths are forced, so a random policy's loops must not end them early.
    self.sampler = Sampler(self.engine, RepeatConfig(enabled=False),
                           steps_per_call=steps_per_call)
    prompts = slots // work.group_size
    self.rl = RLConfig(
        iterations=1, prompts_per_iteration=prompts,
        samples_per_prompt=work.group_size, loss="mirror_descent",
        learning_rate=learning_rate, minibatch_prompts=minibatch_prompts,
        max_response_len=work.max_len, token_budget=budget,
        # Enough carry-overs that no response is force-finished.
        max_wait_iterations=math.ceil(work.max_len / budget),
        train_len_buckets=powers_of_two_buckets(self.cache_len),
        reference_logprobs=reference_logprobs, pack_sequences=pack,
        queued_prompts=queued_prompts, queued_min_tokens=queued_min_tokens)
    self.row_buckets = batching.row_buckets(minibatch_prompts *
                                            work.group_size)
    self.optimizer = ts.make_optimizer(ts.OptimizerConfig(
        learning_rate=learning_rate, grad_clip=self.rl.grad_clip))
    self.shardings = ts.state_shardings(self.optimizer, self.model,
                                        self.sharder)
    self.reset_opt = ts.make_reset_optimizer(self.optimizer, self.shardings)
    self.seq_logp = trainer.make_seq_logp_fn(self.model, self.sharder)
    self._steps: dict[tuple, Any] = {}
    self._counters: list[ts.TraceCounter] = []

  def fresh_state(self, seed: int) -> ts.TrainState:
    params = transformer.init_sharded(self.model, jax.random.key(seed),
                                      self.sharder)
    return ts.create_state(params, self.optimizer, self.shardings)

  def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, jax.Array]:
    sh = ts.batch_shardings(self.sharder,
                            {k: v.shape for k, v in batch.items()})
    return {k: host_to_global(v, sh[k]) for k, v in batch.items()}

  def step_fn(self, batch: dict[str, jax.Array]):
    """One jitted train step per batch shape, as RLLoop.step_fn."""
    key = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if key not in self._steps:
      loss_fn = lambda p, b: trainer.policy_loss(
          p, b, cfg=self.model, rl=self.rl, sharder=self.sharder)
      fn, counter = ts.jit_train_step(
          loss_fn, self.optimizer, self.shardings,
          {k: v.sharding for k, v in batch.items()})
      self._steps[key] = fn
      self._counters.append(counter)
    return self._steps[key]

  def compile_count(self) -> int:
    return (sum(c.count for c in self._counters) +
            sum(self.engine.compile_count().values()))


@dataclasses.dataclass
class Mode:
  """One side of the comparison: its buffer, train state and totals."""

  name: str
  budget: int | None  # None: every response runs to its end
  prompts: int  # groups topped up to at the start of each iteration
  buffer: replay_buffer.RolloutBuffer
  state: ts.TrainState
  totals: dict[str, float] = dataclasses.field(default_factory=dict)
  # Sampler.generate keywords: partial rollouts' window when a queue is on.
  window: dict[str, int] = dataclasses.field(default_factory=dict)

  def add(self, stats: dict[str, float]) -> None:
    for k, v in stats.items():
      self.totals[k] = self.totals.get(k, 0) + v


def rollout_phase(bench: Bench, mode: Mode, it: int
                  ) -> tuple[list[replay_buffer.Group], dict[str, float]]:
  """Top up to P groups, continue every unfinished response, as the loop."""
  work, vocab = bench.work, bench.model.vocab_size
  bench.engine.load_params(mode.state.params)
  for _ in range(rollout.groups_to_open(mode.buffer, mode.prompts)):
    # One synthetic prompt per group: prompt index = group id.
    mode.buffer.new_group(prompt_index=mode.buffer.stats["groups_opened"])
  requests = []
  for traj in mode.buffer.pending():
    target = int(work.target_lengths_K(traj.group_id)[traj.sample_index])
    (req,) = rollout.continue_requests(
        [traj], [work.prompt(traj.prompt_index, vocab)], seed=work.seed,
        iteration=it, settings=rollout.SamplingSettings(), stop_tokens=(),
        max_response_len=target, token_budget=mode.budget or target)
    requests.append(req if mode.budget else dataclasses.replace(req,
                                                                budget=None))
  results = bench.sampler.generate(requests, **mode.window)
  counts = rollout.record_results(mode.buffer, results, version=it)
  s = bench.sampler.last_stats
  return mode.buffer.complete_groups(), {
      "requests": s.requests, "unstarted": counts["unstarted"],
      "decode_steps": s.decode_steps,
      "decode_tokens": s.tokens_generated - s.requests,
      "prefill_tokens": s.prefill_tokens,
      "generated_tokens": s.tokens_generated,
      "budget_stops": counts["budget"]}


def train_phase(bench: Bench, state: ts.TrainState,
                groups: list[replay_buffer.Group], it: int
                ) -> tuple[ts.TrainState, dict[str, float]]:
  """RLLoop.train_phase on synthetic rewards: every completed group."""
  work, rl, vocab = bench.work, bench.rl, bench.model.vocab_size
  mbs, members = batching.sorted_minibatches(
      groups, [work.prompt(g.prompt_index, vocab) for g in groups],
      size=rl.minibatch_prompts, version=it,
      train_on_old_segments=rl.train_on_old_segments,
      len_buckets=rl.train_len_buckets, pad_id=PAD_ID, rows=bench.row_buckets,
      pack=rl.pack_sequences)
  reward_PxK = np.stack([work.rewards_K(g.group_id) for g in groups])
  batching.attach_scores(mbs, members, reward=reward_PxK,
                         correct=reward_PxK > 0)
  state = train_on(bench, state, mbs, it)
  trained = sum(t.length for g in groups for t in g.trajectories)
  return state, {"groups_trained": len(groups), "trained_tokens": trained,
                 "loss_tokens": float(sum(mb["mask"].sum() for mb in mbs)),
                 "train_steps": len(mbs),
                 "train_row_tokens": float(sum(mb["tokens"].size
                                               for mb in mbs))}


def train_on(bench: Bench, state: ts.TrainState,
             mbs: list[dict[str, np.ndarray]], it: int) -> ts.TrainState:
  """Optimizer reset, reference log-probs, one step per minibatch."""
  state = state.replace(opt_state=bench.reset_opt(state.params))
  for mb in mbs:  # the reference pi_theta_i, before this iteration's steps
    mb["ref_seq_logp"] = (
        mb["sampler_seq_logp"] if bench.rl.reference_logprobs == "sampler"
        else np.asarray(bench.seq_logp(state.params, bench.to_global(
            {k: mb[k] for k in _MODEL_KEYS}))))
  for mb in mbs:
    batch = bench.to_global({k: mb[k] for k in _TRAIN_KEYS})
    state, m = bench.step_fn(batch)(state, batch)
    if not jax.device_get(m)["finite"]:
      raise ts.NonFiniteError(f"iteration {it}: loss {m['loss']} not finite")
  return state


def iteration(bench: Bench, mode: Mode, it: int) -> dict[str, float]:
  t0 = time.perf_counter()
  groups, stats = rollout_phase(bench, mode, it)
  t1 = time.perf_counter()
  if groups:
    mode.state, train_stats = train_phase(bench, mode.state, groups, it)
    stats.update(train_stats)
  t2 = time.perf_counter()
  stats.update(rollout_s=t1 - t0, train_s=t2 - t1, wall_s=t2 - t0,
               iterations=1)
  return stats


def compile_pass(bench: Bench, budget: int) -> float:
  """Compiles every shape the timed iterations can meet; returns seconds.

  Prefill / insert: prompt + a continued prefix of k * budget tokens, as
  partial rollouts resume (k = 0 for full rollouts). Train: every packed
  row-count bucket at every length bucket a response in the mix can reach.
  """
  t0 = time.perf_counter()
  work, vocab = bench.work, bench.model.vocab_size
  state = bench.fresh_state(seed=10_000)
  bench.engine.load_params(state.params)
  # Batched prefill / insert at every (length, batch) bucket pair, and
  # free_slots: a response admitted mid-window stops at any length.
  bench.engine.warm_up_admission(bench.engine.params)
  # Two new tokens each, so generate compiles too.
  bench.sampler.generate([SampleRequest(
      ("warm", n), tuple(work.prompt(0, vocab)), prefix=(1,) * n,
      max_new_tokens=n + 2, sampling=SamplingParams(seed=n))
                          for n in range(0, work.max_len - 1, budget)])
  # Every (rows, length) bucket pair: an all-padding minibatch of that shape
  # (zero loss, finite), through the same reference pass and train step.
  P, K = bench.rl.minibatch_prompts, work.group_size
  shortest = work.prompt_len + work.short_range[0] - 1
  lens = [b for b in bench.rl.train_len_buckets
          if b >= batching.bucket_length(shortest,
                                         bench.rl.train_len_buckets)]
  rows = bench.row_buckets if bench.rl.pack_sequences else (P * K,)
  mbs = [dict(batching.empty_minibatch(P, K, R, T, PAD_ID),
              reward=np.zeros((P, K), np.float32),
              correct=np.zeros((P, K), bool)) for T in lens for R in rows]
  state = train_on(bench, state, mbs, 0)
  jax.block_until_ready(state.params)
  return time.perf_counter() - t0


def summarise(mode: Mode, slots: int) -> dict[str, float]:
  t = mode.totals
  wall = t.get("wall_s", 0.0)
  return {
      "budget": mode.budget, "iterations": int(t["iterations"]),
      "groups_trained": int(t.get("groups_trained", 0)),
      "trained_tokens": int(t.get("trained_tokens", 0)),
      "loss_tokens": int(t.get("loss_tokens", 0)),
      "wall_s": wall, "rollout_s": t["rollout_s"], "train_s": t["train_s"],
      "decode_steps": int(t["decode_steps"]),
      "requests": int(t["requests"]),
      "unstarted_requests": int(t["unstarted"]),
      "prefill_tokens": int(t["prefill_tokens"]),
      "generated_tokens": int(t["generated_tokens"]),
      "budget_stops": int(t["budget_stops"]),
      "train_steps": int(t.get("train_steps", 0)),
      "slot_utilisation": t["decode_tokens"] / max(t["decode_steps"] * slots,
                                                   1),
      # What the trainer ran: packed R x T rows, summed over iterations.
      "train_row_tokens": int(t.get("train_row_tokens", 0)),
      "trained_tokens_per_s": t.get("trained_tokens", 0) / max(wall, 1e-9),
      "loss_tokens_per_s": t.get("loss_tokens", 0) / max(wall, 1e-9),
      # The two phases on their own: what partial rollouts change is the
      # rollout side; a trained token costs the trainer about the same.
      "trained_tokens_per_rollout_s": t.get("trained_tokens", 0) / max(
          t["rollout_s"], 1e-9),
      "trained_tokens_per_train_s": t.get("trained_tokens", 0) / max(
          t["train_s"], 1e-9),
      "train_fraction": t["train_s"] / max(wall, 1e-9),
      "in_flight_groups_at_end": len(mode.buffer),
      # Responses cut short by max_wait_iterations (should be 0 here).
      "budget_exhausted": mode.buffer.stats["budget_exhausted"],
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  work = Workload(median_len=args.median_len, group_size=args.group_size,
                  seed=args.seed)
  budget = args.budget or 2 * args.median_len
  if args.slots % work.group_size:
    raise SystemExit(f"--slots ({args.slots}) must be a multiple of the "
                     f"group size {work.group_size}")
  load_before = os.getloadavg()
  prompts = args.slots // work.group_size
  queued = prompts // 2 if args.queued_prompts is None else args.queued_prompts
  bench = Bench(work, slots=args.slots, budget=budget,
                minibatch_prompts=args.minibatch_prompts,
                steps_per_call=args.steps_per_call,
                learning_rate=args.learning_rate,
                reference_logprobs=args.reference_logprobs,
                pack=not args.no_pack, queued_prompts=queued,
                queued_min_tokens=args.queued_min_tokens or max(1,
                                                                budget // 4))
  compile_s = compile_pass(bench, budget)
  compiles_before = bench.compile_count()
  new_buffer = lambda: replay_buffer.RolloutBuffer(
      group_size=work.group_size,
      max_wait_iterations=bench.rl.max_wait_iterations)
  in_flight = args.partial_prompts or prompts
  modes = [Mode("full", None, prompts, new_buffer(),
                bench.fresh_state(args.seed)),
           Mode("partial", budget, in_flight + queued, new_buffer(),
                bench.fresh_state(args.seed),
                window=rollout.window_args(bench.rl))]
  if queued:  # the same partial rollouts without the queue, for reference
    modes.append(Mode("partial_no_queue", budget, in_flight, new_buffer(),
                      bench.fresh_state(args.seed)))
  warmup_s = {}
  for mode in modes:  # untimed: any missed compile, partial's buffer fills
    warmup_s[mode.name] = iteration(bench, mode, 0)["wall_s"]
  for it in range(1, args.iterations + 1):
    for mode in modes:
      mode.add(iteration(bench, mode, it))
    if args.verbose:
      print(f"iteration {it}: " + ", ".join(
          f"{m.name} {m.totals['wall_s']:.1f}s" for m in modes),
            file=sys.stderr)
  rows = {m.name: summarise(m, args.slots) for m in modes}
  full, partial = rows["full"], rows["partial"]
  speedup = lambda row: row["trained_tokens_per_s"] / max(
      full["trained_tokens_per_s"], 1e-9)
  return {
      "partial_vs_full_speedup": speedup(partial),
      "partial_trained_tokens_per_s": partial["trained_tokens_per_s"],
      "full_trained_tokens_per_s": full["trained_tokens_per_s"],
      "partial_vs_full_loss_token_speedup": partial["loss_tokens_per_s"] /
                                            max(full["loss_tokens_per_s"],
                                                1e-9),
      "partial_vs_full_rollout_phase_speedup":
          partial["trained_tokens_per_rollout_s"] /
          max(full["trained_tokens_per_rollout_s"], 1e-9),
      "partial_vs_full_train_phase_speedup":
          partial["trained_tokens_per_train_s"] /
          max(full["trained_tokens_per_train_s"], 1e-9),
      **({"partial_no_queue_vs_full_speedup": speedup(
          rows["partial_no_queue"])} if queued else {}),
      **rows,
      "compile_s": compile_s, "warmup_iteration_s": warmup_s,
      "recompiles_during_timed_run": bench.compile_count() - compiles_before,
      "settings": {
          "slots": args.slots, "group_size": work.group_size,
          "prompts_per_iteration": bench.rl.prompts_per_iteration,
          "median_len": work.median_len, "long_len": work.max_len,
          "long_frac": work.long_frac, "prompt_len": work.prompt_len,
          "partial_prompts": in_flight,
          "queued_prompts": bench.rl.queued_prompts,
          "queued_min_tokens": bench.rl.queued_min_tokens,
          "budget": budget, "cache_len": bench.cache_len,
          "reference_logprobs": bench.rl.reference_logprobs,
          "pack_sequences": bench.rl.pack_sequences,
          "max_wait_iterations": bench.rl.max_wait_iterations,
          "minibatch_prompts": args.minibatch_prompts,
          "train_len_buckets": bench.rl.train_len_buckets,
          "steps_per_call": args.steps_per_call, "seed": args.seed,
          "iterations": args.iterations, "model": dataclasses.asdict(
              bench.model)},
      "device": f"{jax.devices()[0].platform} ({jax.devices()[0]})",
      "loadavg_before": list(load_before),
      "loadavg_after": list(os.getloadavg()),
  }


def print_table(r: dict[str, Any]) -> None:
  s = r["settings"]
  print(f"\npartial vs full rollouts ({r['device']}; {s['slots']} slots, "
        f"K={s['group_size']}, P={s['prompts_per_iteration']} (partial "
        f"{s['partial_prompts']} in flight + {s['queued_prompts']} queued, "
        f"starting while >= {s['queued_min_tokens']} window tokens remain), "
        f"lengths "
        f"{1 - s['long_frac']:.0%} ~{s['median_len']} / {s['long_frac']:.0%} "
        f"{s['long_len']}, budget {s['budget']}, {s['iterations']} timed "
        f"iterations each)")
  cols = ("groups_trained", "trained_tokens", "loss_tokens", "rollout_s",
          "train_s", "wall_s", "decode_steps", "prefill_tokens",
          "slot_utilisation", "trained_tokens_per_s")
  print("| mode | " + " | ".join(cols) + " |")
  print("|---" * (len(cols) + 1) + "|")
  for name in ("full", "partial", "partial_no_queue"):
    if name not in r:
      continue
    row = r[name]
    cells = [f"{row[c]:.2f}" if isinstance(row[c], float) else str(row[c])
             for c in cols]
    print(f"| {name} | " + " | ".join(cells) + " |")
  print(f"\npartial_vs_full_speedup: {r['partial_vs_full_speedup']:.2f}x "
        f"(rollout phase alone "
        f"{r['partial_vs_full_rollout_phase_speedup']:.2f}x, train phase "
        f"alone {r['partial_vs_full_train_phase_speedup']:.2f}x, counting "
        f"loss-masked tokens {r['partial_vs_full_loss_token_speedup']:.2f}x)"
        + (f"; without the queue "
           f"{r['partial_no_queue_vs_full_speedup']:.2f}x"
           if "partial_no_queue_vs_full_speedup" in r else "") +
        f"\ncompile {r['compile_s']:.1f}s, recompiles while timed: "
        f"{r['recompiles_during_timed_run']}; load average "
        f"{r['loadavg_before'][0]:.2f} -> {r['loadavg_after'][0]:.2f}")


def parse_args(argv=None) -> argparse.Namespace:
  doc = __doc__.split("\n\n", 2)
  parser = argparse.ArgumentParser(
      description=doc[0] + "\n\n" + doc[2],
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--iterations", type=int, default=20,
                      help="timed RL iterations per mode, after one untimed "
                      "warm-up iteration each (default: %(default)s)")
  parser.add_argument("--slots", type=int, default=64,
                      help="sampler slots; P = slots / K prompts per "
                      "iteration (default: %(default)s)")
  parser.add_argument("--median-len", type=int, default=16,
                      help="L: 90%% of responses need ~L tokens, 10%% need "
                      "8 L; the cache holds prompt + 8 L (default: "
                      "%(default)s)")
  parser.add_argument("--budget", type=int, default=0,
                      help="partial rollouts' tokens per response per "
                      "iteration (default: 2 L)")
  parser.add_argument("--partial-prompts", type=int, default=0,
                      help="groups partial rollouts keep in flight (default: "
                      "slots / K, as full rollouts; more lets new short "
                      "responses fill slots that waiting groups leave idle)")
  parser.add_argument("--queued-prompts", type=int, default=None,
                      help="partial rollouts: extra groups queued beyond the "
                      "slots (rl.queued_prompts); the rollout phase is one "
                      "window of `budget` tokens per slot and a queued "
                      "response started after s decode steps gets budget - s. "
                      "Partial rollouts also run without it, as a third row "
                      "(default: slots / K / 2; 0: no queue, two rows)")
  parser.add_argument("--queued-min-tokens", type=int, default=0,
                      help="rl.queued_min_tokens: queued responses start only "
                      "while this many window tokens remain (default: "
                      "budget / 4)")
  parser.add_argument("--group-size", type=int, default=4,
                      help="K responses per prompt (default: %(default)s)")
  parser.add_argument("--minibatch-prompts", type=int, default=4,
                      help="prompts per train step (default: %(default)s)")
  parser.add_argument("--steps-per-call", type=int, default=1,
                      help="decode steps per engine call; the RL loop uses 1 "
                      "(default: %(default)s)")
  parser.add_argument("--learning-rate", type=float, default=1e-3)
  parser.add_argument("--reference-logprobs", default="sampler",
                      choices=("sampler", "recompute"),
                      help="rl.reference_logprobs for both modes: reuse the "
                      "sampler's log-probs (the default) or recompute them")
  parser.add_argument("--no-pack", action="store_true",
                      help="one response per training row (rl.pack_sequences"
                      "=False) in both modes, instead of packed rows")
  parser.add_argument("--seed", type=int, default=0)
  parser.add_argument("--json", metavar="PATH",
                      help="also write the results here as JSON")
  parser.add_argument("--verbose", action="store_true",
                      help="progress per iteration on stderr")
  return parser.parse_args(argv)


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
