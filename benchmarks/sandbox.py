#!/usr/bin/env python3
"""Sandbox throughput / latency for a trivial Python program (`print(1)`).

For each concurrency 1..N, runs `--runs` isolated executions through
`Sandbox.run` from N client threads, next to an unisolated baseline
`subprocess.run([python, "-c", "print(1)"])` with the same interpreter.

  python benchmarks/sandbox.py --concurrency 4 --runs 100 --json out.json

JSON keys: isolated_execs_per_s (best over the concurrency levels; the level is
in isolated_execs_per_s_concurrency), isolated_execs_per_s_c2 (concurrency 2),
p50_latency_s / p99_latency_s (isolated, concurrency 1) and `rows`.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Callable

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax.sandbox import ExecRequest, Sandbox  # noqa: E402

SOURCE = "print(1)"


def _percentile(xs: list[float], q: float) -> float:
  xs = sorted(xs)
  return xs[min(len(xs) - 1, max(0, round(q * (len(xs) - 1))))]


def measure(fn: Callable[[], bool], runs: int, concurrency: int) -> dict:
  """Runs fn `runs` times from `concurrency` threads; fn returns success."""
  def timed(_: int) -> tuple[float, bool]:
    t = time.perf_counter()
    ok = fn()
    return time.perf_counter() - t, ok

  with ThreadPoolExecutor(concurrency) as pool:
    list(pool.map(timed, range(concurrency * 2)))  # warm up
    start = time.perf_counter()
    out = list(pool.map(timed, range(runs)))
    elapsed = time.perf_counter() - start
  lat = [t for t, _ in out]
  return {"execs_per_s": runs / elapsed, "p50_s": statistics.median(lat),
          "p99_s": _percentile(lat, 0.99), "failures": sum(not ok for _, ok in out)}


def main(argv: list[str] | None = None) -> dict:
  p = argparse.ArgumentParser(description=__doc__,
                              formatter_class=argparse.RawDescriptionHelpFormatter)
  p.add_argument("--concurrency", type=int, default=4, help="max level N")
  p.add_argument("--runs", type=int, default=100, help="executions per level")
  p.add_argument("--json", default=None, help="write results here")
  a = p.parse_args(argv)

  sb = Sandbox(max_workers=a.concurrency)
  python = sb.toolchain.python
  req = ExecRequest("python", SOURCE)

  def isolated() -> bool:
    r = sb.run(req)
    return r.status == "ok" and r.stdout == "1\n"

  def baseline() -> bool:
    r = subprocess.run([python, "-c", SOURCE], capture_output=True)
    return r.returncode == 0 and r.stdout == b"1\n"

  rows = []
  print(f"{'conc':>4} | {'isolated/s':>10} {'p50 ms':>7} {'p99 ms':>7} | "
        f"{'plain/s':>8} {'p50 ms':>7} {'p99 ms':>7} | fails")
  for c in range(1, a.concurrency + 1):
    iso = measure(isolated, a.runs, c)
    base = measure(baseline, a.runs, c)
    rows.append({"concurrency": c, "isolated": iso, "baseline": base})
    print(f"{c:>4} | {iso['execs_per_s']:>10.1f} {iso['p50_s'] * 1e3:>7.1f} "
          f"{iso['p99_s'] * 1e3:>7.1f} | {base['execs_per_s']:>8.1f} "
          f"{base['p50_s'] * 1e3:>7.1f} {base['p99_s'] * 1e3:>7.1f} | "
          f"{iso['failures']}/{base['failures']}", flush=True)
  sb.close()

  best = max(rows, key=lambda r: r["isolated"]["execs_per_s"])
  by_c = {r["concurrency"]: r for r in rows}
  result = {
      "isolated_execs_per_s": best["isolated"]["execs_per_s"],
      "isolated_execs_per_s_concurrency": best["concurrency"],
      "isolated_execs_per_s_c2": by_c.get(2, rows[-1])["isolated"]["execs_per_s"],
      "p50_latency_s": by_c[1]["isolated"]["p50_s"],
      "p99_latency_s": by_c[1]["isolated"]["p99_s"],
      "baseline_execs_per_s": max(r["baseline"]["execs_per_s"] for r in rows),
      "baseline_p50_latency_s": by_c[1]["baseline"]["p50_s"],
      "failures": sum(r["isolated"]["failures"] for r in rows),
      "rows": rows,
      "program": SOURCE, "runs_per_level": a.runs, "python": python,
      "cpus": os.cpu_count(), "platform": platform.platform(),
      "load_avg_at_end": os.getloadavg(),
  }
  print(f"isolated: best {result['isolated_execs_per_s']:.1f}/s at concurrency "
        f"{best['concurrency']}, p50 {result['p50_latency_s'] * 1e3:.1f} ms at "
        f"concurrency 1 (load avg {os.getloadavg()[0]:.2f})")
  if a.json:
    with open(a.json, "w") as f:
      json.dump(result, f, indent=2)
  return result


if __name__ == "__main__":
  main()
