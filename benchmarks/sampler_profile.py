"""Where a decode step's time goes, by kind of XLA:CPU operation.

A child process (benchmarks/child.py) runs the peer workload
(sampler_workloads.py, 64 requests by default) once under
`jax.profiler.trace`, with XLA_FLAGS dumping the optimized HLO of the
sampler's generate programs. Each traced operation of those programs is
mapped to the JAX operation that produced it (the `op_name` metadata of
its instruction in the dump) and put in one class:

  weight matmuls      einsum products with the weights (projections, MLP,
                      unembedding)
  attention products  the two batched products of a query with its slot's
                      cached keys and values
  cache writes        scatters inside the decode loop (the new token's key
                      and value)
  reductions          reductions inside the decode loop (norms, softmax,
                      the sampler's sums)
  view copies         the per-call slice of the cache view and its write
                      back, outside the decode loop
  other               everything else (elementwise fusions, rotary
                      embedding, random bits, copies, the loop itself)

and summed as thread milliseconds per decode step. `busy_ms_per_step` is
the time at least one thread ran an operation, `parallelism` the thread
time over it (1: one thread at a time). Two children run it, one pinned to
one core and one on all the cores this process may use.
"""

from __future__ import annotations

import glob
import gzip
import json
import os
import re
import tempfile
from collections import defaultdict

from child import Child, allowed_cpus, say
from sampler_workloads import DEFAULT_STEPS, MODELS

CLASSES = ("weight matmuls", "attention products", "cache writes",
           "reductions", "view copies", "other")
EINSUM = re.compile(r"[a-z]+,[a-z]+->[a-z]+/dot_general$")
INSTRUCTION = re.compile(
    r"^\s*(?:ROOT )?%?([\w.\-]+) = .*?op_name=\"([^\"]*)\"")


def classify(op_name: str) -> str:
  """The class (see the module doc) of an operation from its op_name."""
  in_loop = "while/body/" in op_name
  if EINSUM.search(op_name):
    return "weight matmuls"
  if op_name.endswith("/dot_general"):
    return "attention products"
  if in_loop and "scatter" in op_name:
    return "cache writes"
  if in_loop and re.search(r"/reduce(_\w+)?$", op_name):
    return "reductions"
  if not in_loop and re.search(r"(^|/)(slice|scatter|gather)$", op_name):
    return "view copies"
  return "other"


def op_names(hlo_text: str) -> dict[str, str]:
  """Instruction name -> op_name, over an optimized HLO module's text."""
  out = {}
  for line in hlo_text.splitlines():
    match = INSTRUCTION.match(line)
    if match:
      out[match.group(1)] = match.group(2)
  return out


def op_classes(modules: list[dict[str, str]]) -> dict[str, str]:
  """Instruction name -> class over the generate programs (one per cache
  view). The trace names an operation's program only by its name, which
  all views share, so a name whose class differs between them is
  "other"."""
  seen: dict[str, set[str]] = defaultdict(set)
  for names in modules:
    for instr, op_name in names.items():
      seen[instr].add(classify(op_name))
  return {i: c.pop() if len(c) == 1 else "other" for i, c in seen.items()}


def _union_us(spans: list[tuple[float, float]]) -> float:
  total, end = 0.0, float("-inf")
  for start, stop in sorted(spans):
    if stop > end:
      total += stop - max(start, end)
      end = stop
  return total


def profile_figures(events: list[dict], classes: dict[str, str],
                    steps: int) -> dict:
  """Thread ms per decode step by class, busy ms per step and parallelism
  from trace events (tid, ts and dur in us, op: the instruction name) of
  the generate programs. `while` operations are left out: their time is
  the time of the operations they run."""
  by_class = dict.fromkeys(CLASSES, 0.0)
  spans: dict[int, list[tuple[float, float]]] = defaultdict(list)
  for e in events:
    if e["op"].startswith("while"):
      continue
    by_class[classes.get(e["op"], "other")] += e["dur"]
    spans[e["tid"]].append((e["ts"], e["ts"] + e["dur"]))
  thread_us = sum(by_class.values())
  busy_us = _union_us([s for per in spans.values() for s in per])
  per_step = lambda us: us / steps / 1e3
  return dict(thread_ms_per_step={c: per_step(v) for c, v in by_class.items()},
              thread_ms_per_step_total=per_step(thread_us),
              busy_ms_per_step=per_step(busy_us),
              parallelism=thread_us / busy_us if busy_us else 0.0,
              threads=len(spans), decode_steps=steps)


def generate_events(trace_dir: str) -> list[dict]:
  """The generate programs' operations in a `jax.profiler.trace` run's
  Perfetto trace."""
  path, = glob.glob(os.path.join(trace_dir, "**", "*.trace.json.gz"),
                    recursive=True)
  with gzip.open(path) as f:
    events = json.load(f)["traceEvents"]
  return [dict(tid=e["tid"], ts=e["ts"], dur=e["dur"], op=e["name"])
          for e in events if e.get("ph") == "X"
          and "generate" in e.get("args", {}).get("hlo_module", "")]


def serve(batch: int, steps: int, model: str, trace_dir: str) -> None:
  """A child: warm up, trace one call, say its wall time and steps."""
  import jax  # imported here: the child's XLA_FLAGS are set by then

  from sampler_measure import prepared, random_params, timed_generate
  cfg = MODELS[model]
  params = random_params(cfg)
  sampler, reqs, _ = prepared(cfg, params, batch, steps)
  timed_generate(sampler, params, reqs, "profile warm-up")
  with jax.profiler.trace(trace_dir, create_perfetto_trace=True):
    _, stats, wall = timed_generate(sampler, params, reqs, "profile")
  say(wall_s=wall, decode_steps=stats.decode_steps,
      cpus=sorted(os.sched_getaffinity(0)))


def profile_one(cpus: set[int], batch: int, steps: int, model: str) -> dict:
  """One child's traced call on `cpus`, read back into figures."""
  with tempfile.TemporaryDirectory() as tmp:
    dump, trace = os.path.join(tmp, "hlo"), os.path.join(tmp, "trace")
    flags = os.environ.get("XLA_FLAGS", "")
    env = dict(os.environ, XLA_FLAGS=(
        f"{flags} --xla_dump_to={dump} "
        f"--xla_dump_hlo_module_re=.*generate.*").strip())
    child = Child(cpus, f"sampler_profile.serve({batch}, {steps}, {model!r}, "
                  f"{trace!r})", env)
    try:
      answer = child.read()
    finally:
      child.close()
    modules = []
    for path in glob.glob(os.path.join(dump, "*after_optimizations.txt")):
      with open(path) as f:
        modules.append(op_names(f.read()))
    if not modules:
      raise RuntimeError(f"no optimized generate program was dumped to "
                         f"{dump}")
    report = profile_figures(generate_events(trace), op_classes(modules),
                             answer["decode_steps"])
  report.update(wall_s=answer["wall_s"], cpus=answer["cpus"],
                programs=len(modules))
  return report


def profile_part(batch: int = 64, steps: int = DEFAULT_STEPS,
                 model: str = "qwen2-shaped") -> dict:
  """The profile on one core and on all allowed cores."""
  allowed = allowed_cpus("profile")
  return dict(batch=batch, steps_per_call=steps, model=model,
              one=profile_one({allowed[0]}, batch, steps, model),
              all=profile_one(set(allowed), batch, steps, model))
