"""Long2short over several seeds: each seed's comparison (long2short.json)
gathered into mean ± sd per method, and each method's paired difference to
the long model of its own seed as mean ± standard error.

Every seed is a whole experiment (its own data, vanilla model, long and
short models), so a method's spread over seeds includes the long model's;
the paired difference removes that part.
"""

from __future__ import annotations

import json
import os
from typing import Any, Callable, Mapping

import ml_collections

from kimi_jax.ablation.stats import stat
from kimi_jax.ablation.table import fmt_signed, fmt_stat
from kimi_jax.infra.console import log
from kimi_jax.infra.files import write_json
from kimi_jax.long2short import pipeline, report

# The per-method figures gathered, in each split's record.
METRICS = ("pass_at_1", "mean_tokens")
REFERENCE = "long"
RESULT_FILE = "long2short_seeds.json"
FIGURE_FILE = "token_efficiency_seeds.png"


def _split(record: Mapping[str, Any], split: str) -> Mapping[str, Any] | None:
  return record if split == "eval" else record.get(split)


def aggregate(per_seed: Mapping[int, Mapping[str, Any]]) -> dict[str, Any]:
  """per_seed: seed -> that seed's long2short.json. Returns {"seeds",
  "methods": {name: {split: {metric: stat, "vs_long": {metric: stat}}}}}
  over the splits every seed evaluated ("eval" held out, "val")."""
  if not per_seed:
    raise ValueError("no seed finished")
  seeds = sorted(per_seed)
  names = list(per_seed[seeds[0]]["methods"])
  for s in seeds:
    if list(per_seed[s]["methods"]) != names:
      raise ValueError(f"seed {s}: methods {list(per_seed[s]['methods'])} "
                       f"differ from seed {seeds[0]}'s {names}")
  splits = [sp for sp in ("eval", "val") if all(
      _split(per_seed[s]["methods"][REFERENCE], sp) for s in seeds)]
  methods: dict[str, Any] = {}
  for name in names:
    methods[name] = {}
    for sp in splits:
      rows = [_split(per_seed[s]["methods"][name], sp) for s in seeds]
      refs = [_split(per_seed[s]["methods"][REFERENCE], sp) for s in seeds]
      out: dict[str, Any] = {m: stat([r[m] for r in rows]) for m in METRICS}
      if name != REFERENCE:
        out["vs_long"] = {m: stat([r[m] - f[m] for r, f in zip(rows, refs)])
                          for m in METRICS}
      methods[name][sp] = out
  return {"seeds": seeds, "methods": methods,
          "shortest_solution_tokens": stat([
              per_seed[s]["shortest_solution_tokens"] for s in seeds])}


def markdown(agg: Mapping[str, Any], split: str = "eval") -> str:
  """One row per method: pass@1 and mean tokens (mean ± sd over seeds),
  then their paired differences to the long model (mean ± s.e.)."""
  head = ("method", "pass@1", "mean tokens", "Δ pass@1 vs long (± s.e.)",
          "Δ tokens vs long (± s.e.)")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for name, rec in agg["methods"].items():
    r = rec[split]
    vs = r.get("vs_long")
    lines.append("| " + " | ".join((
        name, fmt_stat(r["pass_at_1"], 3), fmt_stat(r["mean_tokens"], 1),
        fmt_signed(vs["pass_at_1"], 3, "sem") if vs else "",
        fmt_signed(vs["mean_tokens"], 1, "sem") if vs else "")) + " |")
  return "\n".join(lines)


def mean_methods(agg: Mapping[str, Any], split: str = "eval"
                 ) -> dict[str, dict[str, float]]:
  """Each method's mean pass@1 and tokens: the points of the seeds'
  token-efficiency figure."""
  return {name: {m: rec[split][m]["mean"] for m in METRICS}
          for name, rec in agg["methods"].items()}


def run(config: ml_collections.ConfigDict, workdir: str, n: int, *,
        run_fn: Callable[[ml_collections.ConfigDict, str], Mapping[str, Any]]
        | None = None) -> dict[str, Any]:
  """Seeds config.seed .. config.seed + n - 1, each a whole long2short run
  in workdir/seed<S> (a seed with its comparison written is read back, an
  unfinished one continues past its finished stages), then their
  aggregate in workdir/RESULT_FILE and the figure at the means; returns
  the aggregate."""
  run_fn = run_fn or pipeline.run
  per_seed = {}
  for seed in range(int(config.seed), int(config.seed) + n):
    one = ml_collections.ConfigDict(config.to_dict())
    one.seed = seed
    path = os.path.join(workdir, f"seed{seed}")
    done = os.path.join(path, pipeline.RESULT_FILE)
    if os.path.isfile(done):
      log(f"long2short: seed {seed} finished, {done}")
      with open(done) as f:
        per_seed[seed] = json.load(f)
      continue
    log(f"long2short: seed {seed} -> {path}")
    per_seed[seed] = run_fn(one, path)
  agg = aggregate(per_seed)
  write_json(os.path.join(workdir, RESULT_FILE), agg)
  report.plot_token_efficiency(
      mean_methods(agg), os.path.join(workdir, FIGURE_FILE),
      title=f"token efficiency, mean over seeds {agg['seeds']}")
  return agg
