"""What the CPU's other cores buy the peer workload.

Two child processes run the peer requests (sampler_workloads.py, 64 by
default) through kimi_jax's sampler, and through Tunix's when it is
installed: one started on a single core, one on all the cores this process
may use. Each is pinned before it imports JAX, so its XLA:CPU runtime sizes
its thread pool for the cores it has (pinning a running process instead
leaves that pool's threads fighting over one core, which measures the
fight). Both warm up, then take turns, a timed round each, so that a
drift in the machine's speed hits both alike; medians over `repeats`.

A decode step is several hundred small XLA:CPU operations run one after
another, most too small to split well between threads: `cores_gain`
(tokens/s on all cores over tokens/s on one) says how much of the machine
a sampler turns into speed. Linux only (os.sched_setaffinity).

  python benchmarks/sampler.py --part cores --json OUT
"""

from __future__ import annotations

import hashlib
import os
import sys

import numpy as np

from child import Child, allowed_cpus, say
from sampler_workloads import DEFAULT_STEPS, MODELS, NEW_TOKENS


def cores_figures(runs_s: dict[str, dict[str, list[float]]], batch: int,
                  n_cpus: int) -> dict:
  """Tokens/s per sampler and setting ("one", "all") from the timed
  seconds of each run, the gain of all cores over one, and kimi_jax's lead
  over Tunix in each setting (when Tunix ran)."""
  tokens = batch * NEW_TOKENS
  out: dict = dict(batch=batch, cpus=n_cpus, runs_s=runs_s)
  for name, by_setting in runs_s.items():
    for setting, runs in by_setting.items():
      out[f"{name}_tok_s_{setting}"] = tokens / float(np.median(runs))
    out[f"{name}_cores_gain"] = (out[f"{name}_tok_s_all"] /
                                 out[f"{name}_tok_s_one"])
  if "tunix" in runs_s:
    for setting in ("one", "all"):
      out[f"vs_tunix_{setting}"] = (out[f"kimi_jax_tok_s_{setting}"] /
                                    out[f"tunix_tok_s_{setting}"])
  return out


def serve(batch: int, steps: int, model: str, with_tunix: bool) -> None:
  """A child: warm both samplers up, say so, then answer every "run" line
  on stdin with one timed round (seconds of each sampler, and a digest of
  kimi_jax's results)."""
  import jax  # imported here: the child is pinned before JAX starts

  from sampler_measure import prepared, random_params, timed_generate
  from sampler_tunix import prepared as tunix_prepared
  from sampler_tunix import timed as tunix_timed
  cfg = MODELS[model]
  params = random_params(cfg)
  sampler, reqs, _ = prepared(cfg, params, batch, steps)
  tunix = tunix_prepared(cfg, params, batch) if with_tunix else None
  say(cpus=sorted(os.sched_getaffinity(0)), tunix=tunix is not None,
      device=str(jax.devices()[0]))
  for line in sys.stdin:
    if line.strip() != "run":
      return
    out, _, wall = timed_generate(sampler, params, reqs, "cores")
    theirs = None if tunix is None else tunix_timed(tunix[0], batch)
    say(kimi_jax=wall, tunix=theirs,
        digest=hashlib.sha256(repr(out).encode()).hexdigest())


def cores_part(batch: int = 64, steps: int = DEFAULT_STEPS,
               repeats: int = 5, model: str = "qwen2-shaped",
               with_tunix: bool = True) -> dict:
  """`repeats` rounds, each timing the child on the lowest-numbered allowed
  core, then the child on all allowed cores."""
  allowed = allowed_cpus("cores")
  call = f"sampler_cores.serve({batch}, {steps}, {model!r}, {with_tunix})"
  children = {"one": Child({allowed[0]}, call),
              "all": Child(set(allowed), call)}
  try:
    ready = {s: c.read() for s, c in children.items()}
    names = ["kimi_jax"] + (["tunix"] if ready["one"]["tunix"] else [])
    runs = {n: {s: [] for s in children} for n in names}
    digests = {s: set() for s in children}
    for _ in range(repeats):
      for setting, child in children.items():
        answer = child.ask("run")
        digests[setting].add(answer["digest"])
        for n in names:
          runs[n][setting].append(answer[n])
  finally:
    for child in children.values():
      child.close()
  report = cores_figures(runs, batch, len(allowed))
  report.update(device=ready["one"]["device"], steps_per_call=steps,
                new_tokens=NEW_TOKENS, repeats=repeats, model=model,
                cpus_of={s: r["cpus"] for s, r in ready.items()},
                one_core=allowed[0],
                # Every round of both children drew the same results.
                same_results=len(digests["one"] | digests["all"]) == 1)
  return report
