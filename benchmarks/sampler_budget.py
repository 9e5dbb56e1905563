"""Where the peer workload's wall time goes, call by call, and what it
leaves of a lead over Tunix's sampler.

The peer workload (sampler_workloads.py, 64 requests by default) runs
through `Sampler.generate` with every prefill and generate call waited on
as it returns (`clocked`), so each is timed alone: the prefill seconds,
each generate call's view (cache entries a step reads), steps and seconds
per step, and the host's time outside the calls (wall minus both). Plain
runs of the same call alternate with the clocked ones, and with Tunix's
sampler when it is installed, so a drift in the machine's speed hits all
three alike; medians over `repeats`.

`budget` turns one clocked run into the figures the speed discussion needs:
  best_case_s: the run if every call cost, per step, what the cheapest call
    (the smallest view) cost: prefill + host + steps x that;
  step_ms_for_target: the milliseconds per decode step a run would need to
    reach `target` x Tunix's tokens/s, prefill and host as measured.
"""

from __future__ import annotations

import contextlib
import time
from typing import Iterator

import jax
import numpy as np

from kimi_jax.sampler.engine import Engine
from sampler_measure import prepared, random_params, timed_generate
from sampler_tunix import prepared as tunix_prepared
from sampler_tunix import timed as tunix_timed
from sampler_workloads import DEFAULT_STEPS, NEW_TOKENS, QWEN_SHAPED

TARGET = 2.0  # the lead over Tunix's sampler the speed work aims at


@contextlib.contextmanager
def clocked(engine: Engine) -> Iterator[list[dict]]:
  """Inside the block every `prefill_batch` and `traced_generate` call of
  `engine` waits for its outputs and appends to the yielded log one entry:
  kind, seconds, and for a generate call its view and the steps it ran."""
  log: list[dict] = []
  prefill, generate = engine.prefill_batch, engine.traced_generate
  pick_view = engine._view_for_call  # the view is chosen inside the call
  views: list[int] = []

  def view_for_call(*args, **kwargs):
    out = pick_view(*args, **kwargs)
    views.append(out[0])
    return out

  def prefill_batch(*args, **kwargs):
    start = time.perf_counter()
    prefix = prefill(*args, **kwargs)
    jax.block_until_ready(prefix.token)
    log.append(dict(kind="prefill", seconds=time.perf_counter() - start))
    return prefix

  def traced_generate(*args, **kwargs):
    start = time.perf_counter()
    out = generate(*args, **kwargs)
    tokens_NxB = np.asarray(out[1])  # the driver reads it next, cached
    seconds = time.perf_counter() - start
    # Rows the loop did not run are -1 in every slot.
    steps = int(np.sum(np.any(tokens_NxB >= 0, axis=1)))
    log.append(dict(kind="generate", seconds=seconds, view=views[-1],
                    steps=steps))
    return out

  engine.prefill_batch = prefill_batch
  engine.traced_generate = traced_generate
  engine._view_for_call = view_for_call
  try:
    yield log
  finally:  # the instance attributes shadow the methods: drop them
    del engine.prefill_batch, engine.traced_generate, engine._view_for_call


def budget(log: list[dict], wall_s: float, tunix_s: float | None = None,
           target: float = TARGET) -> dict:
  """The figures of one clocked run (see the module doc); the Tunix ones
  only with `tunix_s`, Tunix's median seconds for the same requests."""
  calls = [c for c in log if c["kind"] == "generate" and c["steps"]]
  prefill_s = sum(c["seconds"] for c in log if c["kind"] == "prefill")
  generate_s = sum(c["seconds"] for c in log if c["kind"] == "generate")
  steps = sum(c["steps"] for c in calls)
  host_s = wall_s - prefill_s - generate_s
  cheapest_s = min(c["seconds"] / c["steps"] for c in calls)
  out = dict(wall_s=wall_s, prefill_s=prefill_s, generate_s=generate_s,
             host_s=host_s, decode_steps=steps,
             step_ms_mean=1e3 * generate_s / steps,
             step_ms_cheapest=1e3 * cheapest_s,
             best_case_s=prefill_s + host_s + steps * cheapest_s,
             calls=[dict(c, step_ms=1e3 * c["seconds"] / c["steps"])
                    for c in calls])
  if tunix_s is not None:
    out.update(
        tunix_s=tunix_s, target=target,
        vs_tunix_clocked=tunix_s / wall_s,
        vs_tunix_best_case=tunix_s / out["best_case_s"],
        step_ms_for_target=1e3 * (tunix_s / target - prefill_s - host_s)
        / steps)
  return out


def budget_part(batch: int = 64, steps: int = DEFAULT_STEPS,
                repeats: int = 5, cfg=QWEN_SHAPED) -> dict:
  """`repeats` rounds of a plain run, a clocked run and (if installed)
  Tunix's run of the same `batch` requests; the clocked run of median wall
  time is the one `budget` reads."""
  params = random_params(cfg)
  sampler, reqs, _ = prepared(cfg, params, batch, steps)
  tunix = tunix_prepared(cfg, params, batch)
  plain, runs, theirs = [], [], []
  for _ in range(repeats):
    plain.append(timed_generate(sampler, params, reqs, "plain")[2])
    with clocked(sampler.engine) as log:
      _, stats, wall = timed_generate(sampler, params, reqs, "clocked")
    counted = sum(c.get("steps", 0) for c in log)
    if counted != stats.decode_steps:
      raise AssertionError(f"the clocked calls ran {counted} steps, the "
                           f"sampler counted {stats.decode_steps}")
    runs.append((wall, log))
    if tunix is not None:
      theirs.append(tunix_timed(tunix[0], batch))
  runs.sort(key=lambda r: r[0])
  wall, log = runs[len(runs) // 2]
  tunix_s = float(np.median(theirs)) if theirs else None
  report = budget(log, wall, tunix_s)
  report.update(device=str(jax.devices()[0]), batch=batch,
                steps_per_call=steps, new_tokens=NEW_TOKENS, repeats=repeats,
                plain_s=float(np.median(plain)), plain_runs_s=plain,
                clocked_runs_s=[r[0] for r in runs],
                tunix_runs_s=theirs)
  report["plain_tok_s"] = batch * NEW_TOKENS / report["plain_s"]
  if tunix_s is not None:
    report["vs_tunix_plain"] = tunix_s / report["plain_s"]
  return report
