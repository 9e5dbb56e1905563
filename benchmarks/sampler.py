"""Sampler throughput, cached vs recomputed decoding, continuous vs static.

  python benchmarks/sampler.py --json /tmp/sampler.json
  python benchmarks/sampler.py --part peer --json /tmp/peer.json
  python benchmarks/sampler.py --part length --json /tmp/length.json
  python benchmarks/sampler.py --part budget --json /tmp/budget.json
  python benchmarks/sampler.py --part cores --json /tmp/cores.json
  python benchmarks/sampler.py --part profile --json /tmp/profile.json
  python benchmarks/sampler.py --part matmul --json /tmp/matmul.json

--part peer: a fixed workload on the Qwen2-shaped config (4 layers, vocab
512, width 256, 3.94 M parameters, random weights, seed 0): B requests of
32 random prompt tokens, 128 new tokens each at temperature 1 (top_k 0,
top_p 1, no stop token), B = 8, 32, 64; the whole `Sampler.generate` call is
timed (the host has the tokens at its end), median of 5 (`--repeats`)
after one warm-up call. `ceiling_fraction_b64` = tok_s_b64 / (peak / (2 x
parameters)), with the peak the fp32 FLOP/s of a jitted 2048^3 matmul
measured in the same process (median of 5). With Tunix installed
(requirements-peer.txt), its sampler runs the same requests on the same
weights, its timed calls alternating with kimi_jax's so that a drift in
the machine's speed hits both (sampler_tunix.py): `tunix_tok_s_b{B}` and
`speedup_vs_tunix_b{B}`. The same requests also run through a sampler
whose weight matmuls take bfloat16 inputs and accumulate in float32
(`sampler.matmul_dtype="bfloat16"`; norms, attention and sampling stay
float32), alternating with the rest: `tok_s_b{B}_bf16_matmuls` and
`speedup_vs_tunix_b{B}_bf16_matmuls` (against the faster of Tunix's two
settings below), with each sampler's log-prob gap to
the float32 model (teacher-forced over the drawn tokens: mean |difference|
and the k3 KL estimate per token, as the RL loop logs them) and the
number of requests that drew exactly the float32 sampler's tokens; and
Tunix's sampler with its model in bfloat16 (weights and computation, its
own setting): `tunix_bf16_tok_s_b{B}`. In a
process with several devices (on a CPU host,
XLA_FLAGS=--xla_force_host_platform_device_count=2) the same requests
also run with the slots split over all devices, a `mesh.data` mesh on
which each device steps its own slots in its own loop, alternating with
the rest: `tok_s_b{B}_devices{N}` and `speedup_vs_tunix_b{B}_devices{N}`.

Every timed section must run without compiling: a section that compiles
(anything, counted through jax.monitoring) raises instead of reporting a
figure that includes a compilation.

Measures, on the tiny config (experiments/tiny.py's model, max_seq_len raised
to fit) and a Qwen2-shaped config:
  - generated tokens/s at batch 8/32/64 (32-token prompts, 128 new tokens,
    temperature 1), compile time separately;
  - cached_vs_recompute_speedup: greedy decoding with the KV cache against
    recomputing the full forward for every new token (outputs must match);
  - continuous_vs_static_speedup: a long-tail mix (10% of requests need 8x
    the median length) through the same engine with continuous batching vs
    static batches of the slot count (each runs until its longest member is
    done); median of 3 runs of each side, alternating;
  - admission (tiny only; alone with --part admission): requests/s of
    admitting 256 requests into 64 slots and freeing them, one at a time
    (prefill, read the first token, insert, free_resource per request) vs
    batched (prefill_batch, one read, insert_batch, free_slots per 64).

--part length: the peer workload at reserved cache lengths 160, 2048 and
8192 (`slowdown_8192_vs_160`), and a long-tail workload through today's
row cache against the paged one (sampler_length.py has the details).

--part budget: the peer workload at 64 requests (`--batches` takes one
number) with every call waited on and timed alone: prefill, each generate
call's view and ms per step, the host's time between calls, and what the
run would take if every step cost the cheapest call's (sampler_budget.py).

--part cores: the peer workload at 64 requests (`--batches` takes one
number) in a child process pinned to one core before it imports JAX and
in one on all allowed cores, taking turns, for kimi_jax's sampler and
Tunix's: what the other cores buy each (sampler_cores.py; Linux only).

--part profile: one traced call of the peer workload at 64 requests on one
core and on all: thread milliseconds per decode step by kind of XLA:CPU
operation, and how many threads ran at once (sampler_profile.py).

--part matmul: the peer workload's MLP products at 64 slots (64 x 256 x
1024 and 64 x 1024 x 256) with float32 inputs and with bfloat16 ones
accumulated in float32, each a jitted loop of 200 dependent products
(median of 5): ms per product and the bfloat16 speedup.

The parts live beside this script: sampler_workloads.py (models, requests),
sampler_measure.py (the measurements), sampler_tunix.py (Tunix's sampler on
the peer workload), sampler_tables.py (the printed tables) and timing.py
(timed sections that must not compile, the matmul peak).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile

import jax
import jax.numpy as jnp

from kimi_jax.model.config import count_params
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from sampler_measure import (admission, cached_vs_recompute,
                             continuous_vs_static, handoff_timings,
                             logprob_gap, prepared, random_params, throughput,
                             throughput_row, timed_generate)
from sampler_budget import budget_part
from sampler_cores import cores_part
from sampler_profile import profile_part
from sampler_length import length_part, print_length
from sampler_tables import (print_admission, print_budget, print_cores,
                            print_handoff, print_matmul, print_peer,
                            print_profile, print_table)
from sampler_tunix import prepared as tunix_prepared
from sampler_tunix import row as tunix_row
from sampler_tunix import timed as tunix_timed
from sampler_workloads import (DEFAULT_STEPS, NEW_TOKENS, PROMPT_LEN,
                               QWEN_SHAPED, tiny_config)
from timing import matmul_peak_flops, pin_matmul_precision, product_seconds


# The weight-matmul dtype of the peer workload's second kimi_jax row.
LOW_MATMULS = "bfloat16"


def peer(steps: int, batches=(8, 32, 64), repeats: int = 5) -> dict:
  """The fixed Qwen2-shaped workload (see the module docstring)."""
  load_before = os.getloadavg()
  peak = matmul_peak_flops()
  cfg = QWEN_SHAPED
  params = random_params(cfg)
  ceiling = peak / (2 * count_params(cfg))
  report = dict(device=str(jax.devices()[0]), workload=dict(
      prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, temperature=1.0,
      top_k=0, top_p=1.0, repeats=repeats, steps_per_call=steps),
                params=count_params(cfg), matmul_peak_flops=peak,
                ceiling_tok_s=ceiling, rows=[])
  n = jax.device_count()
  data = Sharder(make_mesh(MeshConfig(data=n))) if n > 1 else None
  for b in batches:
    sampler, reqs, compile_s = prepared(cfg, params, b, steps)
    tunix = tunix_prepared(cfg, params, b)  # Tunix's sampler (optional)
    tunix_low = None if tunix is None else tunix_prepared(
        cfg, params, b, jnp.bfloat16)
    split = None if data is None else prepared(cfg, params, b, steps, data)
    low = prepared(cfg, params, b, steps, matmul_dtype=LOW_MATMULS)[0]
    ours, theirs, split_runs, low_runs, theirs_low = [], [], [], [], []
    for _ in range(repeats):  # alternating, so drifts in speed hit all
      ours.append(timed_generate(sampler, params, reqs, f"throughput b{b}"))
      low_runs.append(timed_generate(low, params, reqs,
                                     f"{LOW_MATMULS} matmuls b{b}"))
      if tunix is not None:
        theirs.append(tunix_timed(tunix[0], b))
        theirs_low.append(tunix_timed(tunix_low[0], b))
      if split is not None:
        split_runs.append(timed_generate(split[0], params, reqs,
                                         f"{n} devices b{b}"))
    row = throughput_row(sampler, b, ours, compile_s)
    if split is not None:
      row["devices"] = throughput_row(split[0], b, split_runs, split[2])
      row["devices"]["n"] = n
      report[f"tok_s_b{b}_devices{n}"] = row["devices"]["tokens_per_s"]
    row["ceiling_fraction"] = row["tokens_per_s"] / ceiling
    row.update(logprob_gap(cfg, params, reqs, ours[-1][0]))
    row["low_matmuls"] = low_matmuls_row(cfg, params, reqs, ours, low_runs,
                                         low, b)
    report["rows"].append(row)
    report[f"tok_s_b{b}"] = row["tokens_per_s"]
    report[f"tok_s_b{b}_bf16_matmuls"] = row["low_matmuls"]["tokens_per_s"]
    report[f"speedup_bf16_matmuls_vs_float32_b{b}"] = (
        row["low_matmuls"]["tokens_per_s"] / row["tokens_per_s"])
    print(f"[peer] batch {b}: {row['tokens_per_s']:.0f} tok/s "
          f"({row['ceiling_fraction']:.3f} of the ceiling)", file=sys.stderr)
    if tunix is not None:
      row["tunix"] = tunix_row(b, theirs, tunix[1])
      row["tunix_bf16"] = tunix_row(b, theirs_low, tunix_low[1])
      report[f"tunix_tok_s_b{b}"] = row["tunix"]["tokens_per_s"]
      report[f"tunix_bf16_tok_s_b{b}"] = row["tunix_bf16"]["tokens_per_s"]
      report[f"speedup_vs_tunix_b{b}"] = (row["tokens_per_s"] /
                                          row["tunix"]["tokens_per_s"])
      # Against the faster of Tunix's two settings.
      report[f"speedup_vs_tunix_b{b}_bf16_matmuls"] = (
          row["low_matmuls"]["tokens_per_s"] /
          max(row["tunix"]["tokens_per_s"],
              row["tunix_bf16"]["tokens_per_s"]))
      if split is not None:
        report[f"speedup_vs_tunix_b{b}_devices{n}"] = (
            row["devices"]["tokens_per_s"] / row["tunix"]["tokens_per_s"])
      print(f"[peer] batch {b}: Tunix {row['tunix']['tokens_per_s']:.0f} "
            f"tok/s", file=sys.stderr)
  if 64 in batches:
    report["ceiling_fraction_b64"] = report["tok_s_b64"] / ceiling
  report["loadavg_before"] = load_before
  report["loadavg_after"] = os.getloadavg()
  return report


def low_matmuls_row(cfg, params, reqs, ours: list, low_runs: list, low,
                    batch: int) -> dict:
  """The row of the sampler whose weight matmuls take bfloat16 inputs
  (`sampler.matmul_dtype`): tokens/s, the gap of its log-probs to the
  float32 model's, and how many requests drew the float32 sampler's
  tokens exactly (the same seeds)."""
  row = throughput_row(low, batch, low_runs, 0.0)
  row.pop("compile_s")
  row["matmul_dtype"] = LOW_MATMULS
  row.update(logprob_gap(cfg, params, reqs, low_runs[-1][0]))
  same = {r.id: r.tokens for r in ours[-1][0]}
  row["requests_same_tokens"] = sum(same[r.id] == r.tokens
                                    for r in low_runs[-1][0])
  return row


# The peer workload's MLP products at 64 slots: (rows, contracted, out).
DECODE_PRODUCTS = ((64, 256, 1024), (64, 1024, 256))


def matmul_part(shapes=DECODE_PRODUCTS, steps: int = 200) -> dict:
  """Each product of `shapes` with float32 inputs and with bfloat16 ones
  (float32 accumulation, as `sampler.matmul_dtype="bfloat16"` runs them):
  ms per product, GFLOP/s, and the bfloat16 speedup."""
  report = dict(device=str(jax.devices()[0]), steps=steps, rows=[])
  for m, k, n in shapes:
    name = f"{m}x{k}x{n}"
    row = dict(shape=name)
    for dtype in ("float32", "bfloat16"):
      s = product_seconds(m, k, n, jnp.dtype(dtype), steps)
      row[f"ms_{dtype}"] = 1e3 * s
      row[f"gflop_s_{dtype}"] = 2 * m * k * n / s / 1e9
      report[f"product_ms_{name}_{dtype}"] = 1e3 * s
    row["bf16_speedup"] = row["ms_float32"] / row["ms_bfloat16"]
    report[f"bf16_speedup_{name}"] = row["bf16_speedup"]
    report["rows"].append(row)
  return report


def admission_only() -> dict:
  """The batched-admission comparison alone, on the tiny config."""
  name, cfg = tiny_config()
  params = random_params(cfg)
  return dict(device=str(jax.devices()[0].platform),
              configs={name: dict(admission=admission(cfg, params))})


def everything(batches: list[int], steps: int) -> dict:
  report = dict(device=str(jax.devices()[0].platform),
                steps_per_call=steps, prompt_len=PROMPT_LEN,
                new_tokens=NEW_TOKENS, loadavg_before=os.getloadavg(),
                configs={})
  tiny_name, tiny = tiny_config()
  for name, cfg in ((tiny_name, tiny), ("qwen2-shaped", QWEN_SHAPED)):
    params = random_params(cfg)
    rows, engines = [], {}
    for b in batches:
      row, engines[b] = throughput(cfg, params, b, steps)
      rows.append(row)
      print(f"[{name}] batch {b}: {row['tokens_per_s']:.0f} tok/s "
            f"(compile {row['compile_s']:.1f}s)", file=sys.stderr)
    small = engines[min(batches)]  # its slots also serve the comparisons
    entry = dict(model=cfg.__dict__, throughput=rows,
                 cached_vs_recompute=cached_vs_recompute(cfg, params, small,
                                                         steps),
                 continuous_vs_static=continuous_vs_static(cfg, params, small,
                                                           steps))
    if name.startswith("tiny"):
      entry["admission"] = admission(cfg, params)
    report["configs"][name] = entry
  report["loadavg_after"] = os.getloadavg()
  return report


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write results here")
  parser.add_argument("--batches", default=None,
                      help="comma-separated request counts (default "
                           "8,32,64; --part budget, cores and profile: one, "
                           "default 64)")
  parser.add_argument("--steps-per-call", type=int, default=DEFAULT_STEPS,
                      help="decode steps per host round trip "
                           "(sampler.steps_per_call in the configs)")
  parser.add_argument("--repeats", type=int, default=5,
                      help="--part peer, budget and cores: timed calls per "
                           "batch, sampler and setting (the median is "
                           "reported)")
  parser.add_argument("--part", choices=("all", "peer", "handoff",
                                         "admission", "length", "budget",
                                         "cores", "profile", "matmul"),
                      default="all",
                      help="peer: the fixed Qwen2-shaped workload and its "
                      "ceiling fraction; handoff: only the weight-handoff "
                      "timings (run with several devices, e.g. XLA_FLAGS="
                      "--xla_force_host_platform_device_count=8); "
                      "admission: only the batched-admission comparison; "
                      "length: reserved cache lengths and the long tail; "
                      "budget: one batch's time call by call; cores: one "
                      "batch pinned to one CPU core against all of them; "
                      "profile: a decode step's thread time by kind of "
                      "operation, on one core and on all; matmul: the "
                      "decode step's MLP products in float32 and with "
                      "bfloat16 inputs")
  args = parser.parse_args(argv)
  precision = pin_matmul_precision()
  batches = [int(b) for b in (args.batches or "8,32,64").split(",")]
  steps = args.steps_per_call
  if args.part == "peer":
    report = peer(steps, batches, args.repeats)
    print_peer(report)
  elif args.part == "matmul":
    report = matmul_part()
    print_matmul(report)
  elif args.part == "handoff":
    with tempfile.TemporaryDirectory() as tmp:
      report = dict(handoff=handoff_timings(QWEN_SHAPED, tmp))
    print_handoff(report)
  elif args.part in ("budget", "cores", "profile"):
    if args.batches is not None and len(batches) != 1:
      parser.error(f"--part {args.part} takes one batch, got --batches "
                   f"{args.batches}")
    batch = batches[0] if args.batches else 64
    if args.part == "budget":
      report = budget_part(batch, steps, args.repeats)
      print_budget(report)
    elif args.part == "cores":
      report = cores_part(batch, steps, args.repeats)
      print_cores(report)
    else:
      report = profile_part(batch, steps)
      print_profile(report)
  elif args.part == "length":
    report = length_part(steps)
    print_length(report)
  elif args.part == "admission":
    report = admission_only()
    print_admission(report)
  else:
    report = everything(batches, steps)
    print_table(report)
  report["matmul_precision"] = precision
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=str)
  return report


if __name__ == "__main__":
  main()
