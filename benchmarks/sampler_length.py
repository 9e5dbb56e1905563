"""The sampler at reserved lengths far beyond the live tokens.

`benchmarks/sampler.py --part length` runs two workloads on the Qwen2-shaped
model (random weights, seed 0):

fixed: the peer workload (64 requests of 32 random prompt tokens, 128 new
  tokens each, seeded temperature-1 sampling, repeat detection on), so no
  slot ever holds more than 160 entries, through engines that reserve 160,
  2048 and 8192 entries per slot (the row layout; nothing else changes).
  A decode step reads only up to the longest live slot's view, so the three
  should run at about the same speed: `slowdown_8192_vs_160` is the ratio
  of tokens/s at 160 to tokens/s at 8192 (median of 3 timed calls each,
  after a warm-up call; the three lengths alternate).

long_tail: 128 requests whose new-token counts are log-normal (median 64,
  sigma 1.2: like the report's responses, most short and a few long), with
  every 20th request running to the cap (responses that hit the length
  limit), the cap 16 x the drawn median: the longest is 16x the median.
  Three engines with the same KV memory run the same requests in the same
  process, alternating, median of 3: rows reserved at the maximum for 16
  slots with each decode step reading every reserved entry (min_view =
  cache_len: the engine before views), the same rows with views following
  the longest live slot (the default), and one pool of pages shared by 64
  slots, admitting while the pool has pages and preempting when it runs
  out. Reported: generated tokens/s, the speedups over the first,
  preemptions and the pool's peak pages.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from sampler_measure import random_params
from sampler_workloads import NEW_TOKENS, PROMPT_LEN, QWEN_SHAPED, requests
from timing import no_compiles

RESERVED = (160, 2048, 8192)
TAIL_MEDIAN, TAIL_SIGMA, TAIL_MAX_RATIO, TAIL_AT_CAP = 64, 1.2, 16, 20
TAIL_REQUESTS, TAIL_DENSE_SLOTS, TAIL_PAGED_SLOTS, PAGE = 128, 16, 64, 16


def _timed(sampler: Sampler, params, reqs, label: str):
  with no_compiles(label):
    start = time.perf_counter()
    out, stats = sampler.generate(params, reqs)
    return out, stats, time.perf_counter() - start


def _alternate(runs: dict, params: dict, reqs, repeats: int) -> dict:
  """Median seconds of `repeats` timed calls per sampler, alternating, after
  one warm-up call each; the outputs of the last call and its stats."""
  seconds = {name: [] for name in runs}
  last = {}
  for name, sampler in runs.items():
    sampler.generate(params[name], reqs)
  for _ in range(repeats):
    for name, sampler in runs.items():
      out, stats, s = _timed(sampler, params[name], reqs, name)
      seconds[name].append(s)
      last[name] = (out, stats)
  return {name: dict(seconds=float(np.median(s)), runs_s=s,
                     outputs=last[name][0], stats=last[name][1])
          for name, s in seconds.items()}


def fixed(steps: int, repeats: int = 3) -> dict:
  """The peer workload at reserved lengths RESERVED (see module doc)."""
  runs, params = {}, {}
  for S in RESERVED:
    cfg = dataclasses.replace(QWEN_SHAPED, max_seq_len=S)
    engine = Engine(cfg, EngineConfig(64, S, (PROMPT_LEN,)))
    runs[S] = Sampler(engine, RepeatConfig(), steps_per_call=steps)
    params[S] = random_params(cfg)
  reqs = requests(QWEN_SHAPED, 64, [NEW_TOKENS] * 64,
                  lambda i: SamplingParams(seed=i), seed=1)
  got = _alternate(runs, params, reqs, repeats)
  ref = got[RESERVED[0]]["outputs"]
  out = dict(requests=64, prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS,
             repeats=repeats, steps_per_call=steps, rows=[])
  for S in RESERVED:
    r = got[S]
    tok_s = r["stats"].tokens_generated / r["seconds"]
    out[f"tok_s_cache_{S}"] = tok_s
    out["rows"].append(dict(
        reserved=S, tokens=r["stats"].tokens_generated,
        seconds=r["seconds"], runs_s=r["runs_s"], tokens_per_s=tok_s,
        same_tokens_as_160=[x.tokens for x in r["outputs"]] ==
        [x.tokens for x in ref],
        views_compiled=runs[S].engine.compile_count().get("generate")))
  out["slowdown_8192_vs_160"] = (out["tok_s_cache_160"] /
                                 out["tok_s_cache_8192"])
  return out


def tail_lengths(n: int, seed: int = 0) -> list[int]:
  """New-token counts: log-normal around TAIL_MEDIAN, every TAIL_AT_CAP-th
  at the cap, the cap TAIL_MAX_RATIO x the median of the counts (at least
  1 each)."""
  rng = np.random.default_rng(seed)
  x = np.maximum(np.round(TAIL_MEDIAN * np.exp(
      TAIL_SIGMA * rng.standard_normal(n))), 1)
  x[::TAIL_AT_CAP] = np.inf
  cap = TAIL_MAX_RATIO * int(np.median(x))
  return [int(v) for v in np.minimum(x, cap)]


def long_tail(steps: int, repeats: int = 3) -> dict:
  """Today's engine against the paged one (see module doc)."""
  lengths = tail_lengths(TAIL_REQUESTS)
  max_new = max(lengths)
  S = PROMPT_LEN + max_new
  cfg = dataclasses.replace(QWEN_SHAPED, max_seq_len=S)
  reqs = requests(cfg, TAIL_REQUESTS, lengths,
                  lambda i: SamplingParams(seed=i), seed=5)
  pool = TAIL_DENSE_SLOTS * S // PAGE  # the rows' memory, in pages
  engines = {
      "rows_whole": Engine(cfg, EngineConfig(
          TAIL_DENSE_SLOTS, S, (PROMPT_LEN, S), min_view=S)),
      "rows_views": Engine(cfg, EngineConfig(
          TAIL_DENSE_SLOTS, S, (PROMPT_LEN, S))),
      "paged": Engine(cfg, EngineConfig(
          TAIL_PAGED_SLOTS, S, (PROMPT_LEN, S), page_size=PAGE,
          kv_pages=pool)),
  }
  params = random_params(cfg)
  runs = {k: Sampler(e, RepeatConfig(enabled=False), steps_per_call=steps)
          for k, e in engines.items()}
  got = _alternate(runs, {k: params for k in runs}, reqs, repeats)
  out = dict(requests=TAIL_REQUESTS, prompt_len=PROMPT_LEN,
             lengths=dict(median=float(np.median(lengths)),
                          mean=float(np.mean(lengths)), max=max(lengths),
                          cap=max_new, distribution=(
                              f"lognormal(median {TAIL_MEDIAN}, sigma "
                              f"{TAIL_SIGMA}), every {TAIL_AT_CAP}th at "
                              f"the cap {max_new}")),
             cache_len=S, kv_entries=TAIL_DENSE_SLOTS * S, page_size=PAGE,
             repeats=repeats, steps_per_call=steps, rows=[])
  for name, r in got.items():
    st = r["stats"]
    out["rows"].append(dict(
        engine=name, slots=engines[name].max_concurrent_decodes,
        tokens=st.tokens_generated, seconds=r["seconds"],
        runs_s=r["runs_s"], tokens_per_s=st.tokens_generated / r["seconds"],
        decode_steps=st.decode_steps, preemptions=st.preemptions,
        peak_pages=st.peak_pages,
        finished_lengths_match=[len(x.tokens) for x in r["outputs"]] ==
        lengths))
    out[f"tok_s_{name}"] = st.tokens_generated / r["seconds"]
  for name in ("rows_views", "paged"):
    out[f"{name}_vs_rows_whole_speedup"] = (out[f"tok_s_{name}"] /
                                            out["tok_s_rows_whole"])
  return out


def length_part(steps: int) -> dict:
  return dict(device=str(jax.devices()[0]), fixed=fixed(steps),
              long_tail=long_tail(steps))


def print_length(report: dict) -> None:
  f = report["fixed"]
  print(f"fixed workload: {f['requests']} requests x {f['new_tokens']} new "
        f"tokens (live <= {f['prompt_len'] + f['new_tokens']})")
  print(f"{'reserved':>9} {'tok/s':>9} {'same tokens':>12}")
  for r in f["rows"]:
    print(f"{r['reserved']:>9} {r['tokens_per_s']:>9.0f} "
          f"{str(r['same_tokens_as_160']):>12}")
  print(f"slowdown 8192 vs 160: {f['slowdown_8192_vs_160']:.2f}x")
  t = report["long_tail"]
  print(f"long tail: {t['requests']} requests, {t['lengths']['distribution']}"
        f", {t['kv_entries']} KV entries per layer on both sides")
  print(f"{'engine':>11} {'slots':>6} {'tok/s':>8} {'preempt':>8} "
        f"{'peak pages':>11}")
  for r in t["rows"]:
    print(f"{r['engine']:>11} {r['slots']:>6} {r['tokens_per_s']:>8.0f} "
          f"{r['preemptions']:>8} {r['peak_pages']:>11}")
  print(f"vs rows reading the whole cache: rows with views "
        f"{t['rows_views_vs_rows_whole_speedup']:.2f}x, paged "
        f"{t['paged_vs_rows_whole_speedup']:.2f}x")
