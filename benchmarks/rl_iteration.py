"""One RL iteration of a fixed workload, through the real loop.

  python benchmarks/rl_iteration.py --json /tmp/rl_iteration.json

The Qwen2-shaped model of `benchmarks/sampler.py --part peer` (3.94 M
parameters, random weights, seed 0) runs `RLLoop.iteration` (the shipped
loop, sampler, learner and weight handoff) on a synthetic task
(kimi_jax/data/synthetic.py): 8 prompts x 4 samples per iteration, 32 random
prompt tokens, exactly 64 response tokens (no eos; token budget = max length,
so no partial rollouts), mirror-descent loss, reference log-probs
recomputed, one optimizer step over all 32 responses (one minibatch of all 8
groups, 1 epoch), and a hash reward that differs within every group so no
group is dropped as uninformative. `sampler.steps_per_call` and
`model.scan_layers` come from experiments/tiny.py, as a user gets them, and
the train step gets the backend's compiler options
(kimi_jax/infra/compile_options.py). A baseline runs beside it, iteration by
iteration (`baseline` in the JSON; `--baseline`): by default the same loop
with its train step compiled with XLA's default options, or the other
`scan_layers`.

Reported, median over 5 iterations after 2 warm-ups: `iteration_s` (the
whole iteration: handoff, rollout, reward, reference, update, bookkeeping),
`rollout_s` (Sampler.generate), `reference_s` (the learner's reference
log-prob pass, with the optimizer reset), `update_s` (the train step),
`other_s` (the rest); `update_mfu` = model FLOPs of the update (6 x
parameters x tokens of the rows trained on) / update_s / the float32 peak of
a jitted 2048^3 matmul measured in the same process. A timed iteration that
compiles anything raises.
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os

import jax
import numpy as np

from kimi_jax.data import synthetic
from kimi_jax.infra import compile_options
from kimi_jax.infra.config import load_config
from kimi_jax.model import transformer
from kimi_jax.model.config import count_params
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.learner import Learner
from kimi_jax.rl.loop import RLLoop
from kimi_jax.rl.loop_state import LoopState
from kimi_jax.rl.prompt_sampling import PromptSamplingConfig
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from sampler_workloads import QWEN_SHAPED
from timing import (CompiledInTimedSection, matmul_peak_flops, no_compiles,
                    pin_matmul_precision)

PROMPTS, SAMPLES, PROMPT_LEN, RESPONSE_LEN = 8, 4, 32, 64
WARMUP, TIMED = 2, 5
TINY = os.path.join(os.path.dirname(os.path.abspath(__file__)), "..",
                    "experiments", "tiny.py")


def shipped_scan_layers() -> bool:
  """The tiny config's `model.scan_layers` (what the RL loop runs with)."""
  return bool(load_config(TINY).model.scan_layers)


def build_loop(scan_layers: bool, compiler_options: dict | None = None
               ) -> tuple[RLLoop, LoopState, object]:
  """The workload's loop; `compiler_options` for its train step (None: the
  shipped backend options of kimi_jax/infra/compile_options.py, {}: XLA's)."""
  cache_len = PROMPT_LEN + RESPONSE_LEN
  model = dataclasses.replace(QWEN_SHAPED, max_seq_len=cache_len,
                              scan_layers=scan_layers)
  sharder = Sharder(make_mesh(MeshConfig(), jax.devices()[:1]))
  steps_per_call = int(load_config(TINY).sampler.steps_per_call)
  engine = Engine(model, EngineConfig(PROMPTS * SAMPLES, cache_len,
                                      (PROMPT_LEN, cache_len)),
                  sharder=sharder)
  sampler = Sampler(engine, RepeatConfig(enabled=False),
                    steps_per_call=steps_per_call)
  rl = RLConfig(iterations=WARMUP + TIMED, prompts_per_iteration=PROMPTS,
                samples_per_prompt=SAMPLES, loss="mirror_descent",
                learning_rate=1e-4, minibatch_prompts=PROMPTS, epochs=1,
                max_response_len=RESPONSE_LEN, token_budget=RESPONSE_LEN,
                reference_logprobs="recompute",
                train_len_buckets=(cache_len,), pack_sequences=False)
  learner = Learner(model, rl, sharder, cache_len=cache_len,
                    compiler_options=compiler_options)
  task = synthetic.make_synthetic_task(synthetic.SyntheticConfig(
      vocab_size=model.vocab_size, group_size=SAMPLES, prompt_len=PROMPT_LEN,
      fixed_len=RESPONSE_LEN, n_prompts=256))
  loop = RLLoop(rl=rl, seed=0, settings=SamplingSettings(), task=task,
                sampler=sampler, learner=learner)
  state = LoopState.initial(group_size=SAMPLES,
                            max_wait_iterations=rl.max_wait_iterations,
                            records=task.train,
                            prompt_sampling=PromptSamplingConfig())
  train = learner.init_state(transformer.init_sharded(model, 0, sharder))
  return loop, state, train


def check_row(row: dict) -> None:
  want = PROMPTS * SAMPLES * RESPONSE_LEN
  if row["generated_tokens"] != want:
    raise RuntimeError(f"an iteration generated {row['generated_tokens']} "
                       f"tokens, not {want}")
  if row.get("groups_trained") != PROMPTS or row.get("minibatches") != 1:
    raise RuntimeError(f"an iteration trained {row.get('groups_trained')} "
                       f"groups in {row.get('minibatches')} steps, not "
                       f"{PROMPTS} in 1")


def timed_iterations(loops: dict[str, tuple]) -> dict[str, list[dict]]:
  """WARMUP + TIMED iterations of every loop, interleaved (so a change in
  the machine's load hits them alike); the timed rows per loop."""
  rows = {name: [] for name in loops}
  for i in range(WARMUP + TIMED):
    for name, (loop, state, train) in loops.items():
      if i < WARMUP:
        state, train, row = loop.iteration(state, train)
      else:
        with no_compiles(f"RL iteration {i} ({name})"):
          state, train, row = loop.iteration(state, train)
      check_row(row)
      loops[name] = (loop, state, train)
      if i >= WARMUP:
        rows[name].append(row)
  return rows


def summary(loop: RLLoop, timed: list[dict], peak: float) -> dict:
  med = lambda key: float(np.median([r[key] for r in timed]))
  other = [r["iteration_s"] - r["rollout_s"] - r["reference_s"] -
           r["update_s"] for r in timed]
  n_params = count_params(loop.learner.model)
  rows_trained_tokens = PROMPTS * SAMPLES * loop.learner.len_buckets[-1]
  update_flops = 6 * n_params * rows_trained_tokens
  rollout_tokens = PROMPTS * SAMPLES * RESPONSE_LEN
  return dict(
      iteration_s=med("iteration_s"), rollout_s=med("rollout_s"),
      reference_s=med("reference_s"), update_s=med("update_s"),
      other_s=float(np.median(other)), handoff_s=med("handoff_s"),
      iterations_s=[r["iteration_s"] for r in timed],
      update_flops=update_flops,
      update_mfu=update_flops / med("update_s") / peak,
      rollout_tok_s=rollout_tokens / med("rollout_s"),
      rollout_ceiling_fraction=(rollout_tokens / med("rollout_s")) / (
          peak / (2 * n_params)))


BASELINES = {
    # name: (scan_layers differs from the shipped loop, train-step options)
    "xla_options": (False, {}),
    "layer_loop": (True, None),
}


def run(baseline: str = "xla_options") -> dict:
  """The shipped loop and one baseline, interleaved iteration by iteration.
  (Only one: a third loop in the process slowed every loop's rollout by
  about 20% on the 2-core box, so each baseline gets its own run.)"""
  load_before = os.getloadavg()
  peak = matmul_peak_flops()
  scan = shipped_scan_layers()
  flip_scan, options = BASELINES[baseline]
  base_scan = scan != flip_scan
  loops = {"shipped": build_loop(scan),
           "baseline": build_loop(base_scan, compiler_options=options)}
  rows = timed_iterations(loops)
  loop = loops["shipped"][0]
  shipped_options = compile_options.train_step_options(
      jax.devices()[0].platform)
  return dict(
      device=str(jax.devices()[0]), params=count_params(loop.learner.model),
      steps_per_call=loop.sampler.steps_per_call, scan_layers=scan,
      train_compiler_options=shipped_options,
      workload=dict(prompts=PROMPTS, samples=SAMPLES, prompt_len=PROMPT_LEN,
                    response_len=RESPONSE_LEN, warmup=WARMUP, timed=TIMED),
      **summary(loop, rows["shipped"], peak),
      matmul_peak_flops=peak,
      baseline=dict(name=baseline, scan_layers=base_scan,
                    train_compiler_options=(shipped_options if options is None
                                            else options),
                    **summary(loops["baseline"][0], rows["baseline"], peak)),
      loadavg_before=list(load_before), loadavg_after=list(os.getloadavg()))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(
      description=__doc__.split("\n\n")[0],
      epilog="\n\n".join(__doc__.split("\n\n")[1:]),
      formatter_class=argparse.RawDescriptionHelpFormatter)
  parser.add_argument("--json", help="write results here")
  parser.add_argument(
      "--baseline", choices=sorted(BASELINES), default="xla_options",
      help="what runs beside the shipped loop: its train step compiled with "
      "XLA's default options (xla_options), or the other model.scan_layers "
      "(layer_loop)")
  args = parser.parse_args(argv)
  precision = pin_matmul_precision()
  report = dict(run(args.baseline), matmul_precision=precision)
  print(f"\nRL iteration, fixed workload ({report['device']}, "
        f"{report['steps_per_call']} decode steps per call; load "
        f"{report['loadavg_before'][0]:.2f} -> "
        f"{report['loadavg_after'][0]:.2f})")
  print("| run | layers | train-step compiler options | iteration s | "
        "rollout s | reference s | update s | other s | update MFU | "
        "rollout tok/s |")
  print("|---|---|---|---|---|---|---|---|---|---|")
  for name, r in (("shipped", report),
                  (f"baseline ({args.baseline})", report["baseline"])):
    layers = "scan" if r["scan_layers"] else "unrolled"
    options = (", ".join(f"{k}={v}" for k, v in
                         r["train_compiler_options"].items()) or "XLA's")
    print(f"| {name} | {layers} | {options} | {r['iteration_s']:.3f} | "
          f"{r['rollout_s']:.3f} | {r['reference_s']:.3f} | "
          f"{r['update_s']:.3f} | {r['other_s']:.3f} | "
          f"{r['update_mfu']:.3f} | {r['rollout_tok_s']:.0f} |")
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=str)
  return report


if __name__ == "__main__":
  try:
    main()
  except CompiledInTimedSection as exc:
    raise SystemExit(f"benchmark invalid: {exc}") from exc
