"""Partial rollouts vs full rollouts: trained groups and tokens per second.

  python benchmarks/partial_rollout.py --json /tmp/partial_rollout.json

Report section 2.6.2, measured on the code users run: every mode is a real
`RLLoop` (kimi_jax/rl/loop.py) with its own `LoopState` and train state,
sharing one `Engine` / `Sampler` and one `Learner` (the tiny config's model,
random init, one device), on a synthetic task (kimi_jax/data/synthetic.py)
that forces response lengths and scores responses with a hash, so no
verifier cost hides the difference.

Workload: groups of K responses per prompt, random-token prompts, no stop
token; every response is forced to a target length: 90% need about the
median length L (uniform in [0.75 L, 1.25 L]), 10% need 8 L. The loop skips
groups whose K rewards are all equal, in every mode alike.

  full:     rl.token_budget = the longest response: each iteration opens
            P = slots / K new groups and generates every response to its
            end, then trains on the finished groups;
  partial:  rl.token_budget = B (default 2 L), rl.queued_prompts = Q
            (default P / 2): each iteration tops the buffer up to P + Q
            groups and runs one window of B tokens per slot; slots that
            free up mid-window start queued responses; the loop then trains
            on the groups whose K responses have all finished;
  partial_no_queue: the same without the queue (Q = 0), for reference.

Segments: the shipped configs' setting, `rl.train_on_old_segments=True`
(every response token gets a gradient; `--mask-old-segments` trains only on
each iteration's own segment). Headline: trained groups per second (the fair
measure when earlier segments are masked) and trained response tokens per
second, over the iterations' wall time, after a compile pass over every
shape and one untimed iteration per mode. The modes alternate iteration by
iteration, so background load hits them alike.
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

from kimi_jax.data import synthetic
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
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                    "experiments", "tiny.py")
# What each mode adds up over its timed iterations (from the loop's rows).
_SUMS = ("iteration_s", "rollout_s", "train_s", "score_s", "groups_trained",
         "trained_tokens", "loss_tokens", "decode_steps", "prefill_tokens",
         "generated_tokens", "requests", "queued_unstarted", "minibatches")


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


@dataclasses.dataclass
class Mode:
  """One side of the comparison: its loop, its states and its totals."""

  name: str
  loop: RLLoop
  state: LoopState
  train: Any
  totals: dict[str, float] = dataclasses.field(default_factory=dict)

  def iteration(self) -> dict[str, float]:
    self.state, self.train, row = self.loop.iteration(self.state, self.train)
    return row

  def add(self, row: dict[str, float]) -> None:
    for k in _SUMS:
      self.totals[k] = self.totals.get(k, 0) + row.get(k, 0)
    self.totals["iterations"] = self.totals.get("iterations", 0) + 1


def build(args: argparse.Namespace):
  """Engine, sampler, learner, task and the three modes' RL configs."""
  task_cfg = synthetic.SyntheticConfig(
      vocab_size=tiny_model(1).vocab_size, group_size=args.group_size,
      median_len=args.median_len, seed=args.seed)
  budget = args.budget or 2 * args.median_len
  cache_len = task_cfg.prompt_len + task_cfg.max_len
  model = tiny_model(cache_len)
  sharder = Sharder(make_mesh(MeshConfig(), jax.devices()[:1]))
  engine = Engine(model, EngineConfig(args.slots, cache_len), sharder=sharder)
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
      train_len_buckets=powers_of_two_buckets(cache_len),
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
  learner = Learner(model, base, sharder, cache_len=cache_len)
  return model, sharder, engine, sampler, learner, \
      synthetic.make_synthetic_task(task_cfg), task_cfg, rls


def compile_pass(engine: Engine, sampler: Sampler, learner: Learner,
                 params, task_cfg: synthetic.SyntheticConfig, budget: int
                 ) -> float:
  """Compiles every shape the timed iterations can meet; returns seconds.

  Prefill / insert at every (length, batch) bucket pair (a response admitted
  mid-window stops at any length); generate; every packed (rows, length)
  train-step shape, on an all-padding minibatch (zero loss) through the
  learner's own `train`, on a throwaway state.
  """
  t0 = time.perf_counter()
  engine.warm_up_admission(params)
  sampler.generate(params, [SampleRequest(
      ("warm", n), (1,) * task_cfg.prompt_len, prefix=(1,) * n,
      max_new_tokens=n + 2, sampling=SamplingParams(seed=n))
                           for n in range(0, task_cfg.max_len - 1, budget)])
  rl = learner.rl
  P, K = rl.minibatch_prompts, rl.samples_per_prompt
  shortest = task_cfg.prompt_len + task_cfg.short_range[0] - 1
  lens = [b for b in learner.len_buckets
          if b >= batching.bucket_length(shortest, learner.len_buckets)]
  rows = learner.row_buckets if rl.pack_sequences else (P * K,)
  mbs = [batching.empty_minibatch(P, K, R, T, 0) for T in lens for R in rows]
  state, _ = learner.train(learner.init_state(params), mbs)
  jax.block_until_ready(state.params)
  return time.perf_counter() - t0


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
      "unstarted_requests": int(t["queued_unstarted"]),
      "prefill_tokens": int(t["prefill_tokens"]),
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
  }


def run(args: argparse.Namespace) -> dict[str, Any]:
  if args.slots % args.group_size:
    raise SystemExit(f"--slots ({args.slots}) must be a multiple of the "
                     f"group size {args.group_size}")
  load_before = os.getloadavg()
  (model, sharder, engine, sampler, learner, task, task_cfg,
   rls) = build(args)
  budget = rls["partial"].token_budget
  ps = PromptSamplingConfig()  # uniform
  compile_s = compile_pass(engine, sampler, learner,
                           transformer.init_sharded(model, 10_000, sharder),
                           task_cfg, budget)

  def counts() -> int:
    return learner.compile_count() + sum(engine.compile_count().values())

  compiles_before = counts()
  modes = []
  for name, rl in rls.items():
    loop = RLLoop(rl=rl, seed=args.seed, settings=SamplingSettings(),
                  task=task, sampler=sampler, learner=learner)
    state = LoopState.initial(
        group_size=rl.samples_per_prompt,
        max_wait_iterations=rl.max_wait_iterations, records=task.train,
        prompt_sampling=ps)
    params = transformer.init_sharded(model, args.seed, sharder)
    modes.append(Mode(name, loop, state, learner.init_state(params)))
  warmup_s = {}
  for mode in modes:  # untimed: any missed compile, partial's buffer fills
    warmup_s[mode.name] = mode.iteration()["iteration_s"]
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

  partial = rows["partial"]
  return {
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
      **rows,
      "compile_s": compile_s, "warmup_iteration_s": warmup_s,
      "recompiles_during_timed_run": counts() - compiles_before,
      "settings": {
          "slots": args.slots, "group_size": args.group_size,
          "median_len": task_cfg.median_len, "long_len": task_cfg.max_len,
          "long_frac": task_cfg.long_frac, "prompt_len": task_cfg.prompt_len,
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
          "steps_per_call": args.steps_per_call, "seed": args.seed,
          "iterations": args.iterations,
          "model": dataclasses.asdict(model)},
      "device": f"{jax.devices()[0].platform} ({jax.devices()[0]})",
      "loadavg_before": list(load_before),
      "loadavg_after": list(os.getloadavg()),
  }


def print_table(r: dict[str, Any]) -> None:
  s = r["settings"]
  print(f"\npartial vs full rollouts ({r['device']}; {s['slots']} slots, "
        f"K={s['group_size']}, partial {s['partial_prompts']} in flight + "
        f"{s['queued_prompts']} queued (starting while >= "
        f"{s['queued_min_tokens']} window tokens remain), lengths "
        f"{1 - s['long_frac']:.0%} ~{s['median_len']} / {s['long_frac']:.0%} "
        f"{s['long_len']}, budget {s['budget']}, train_on_old_segments="
        f"{s['train_on_old_segments']}, {s['steps_per_call']} decode steps "
        f"per call, {s['iterations']} timed iterations each)")
  cols = ("groups_trained", "trained_tokens", "rollout_s", "train_s",
          "wall_s", "decode_steps", "prefill_tokens", "slot_utilisation",
          "groups_per_s", "trained_tokens_per_s")
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
        f"trained tokens/s, "
        f"{r['partial_vs_full_groups_per_s_speedup']:.2f}x trained groups/s "
        f"(rollout phase alone "
        f"{r['partial_vs_full_rollout_phase_speedup']:.2f}x, train phase "
        f"alone {r['partial_vs_full_train_phase_speedup']:.2f}x)"
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
                      "iteration, rl.token_budget (default: 2 L)")
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
  parser.add_argument("--group-size", type=int, default=4,
                      help="K responses per prompt (default: %(default)s)")
  parser.add_argument("--minibatch-prompts", type=int, default=4,
                      help="prompts per train step (default: %(default)s)")
  parser.add_argument("--steps-per-call", type=int, default=None,
                      help="sampler.steps_per_call, decode steps per engine "
                      "call (default: experiments/tiny.py's, as the RL loop "
                      "runs it)")
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
