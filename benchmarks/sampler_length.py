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
  sigma 1.2: like the report's responses, most short and a few long),
  capped at 16 x the median (1024); so the longest is 16x the median.
  Today's engine: rows reserved at the maximum for 16 slots, each decode
  step reading every reserved entry (min_view = cache_len). The paged
  engine: the same KV memory as one pool of pages shared by 64 slots,
  decode views following the live tokens, continuous batching admitting
  while the pool has pages and preempting when it runs out. Both run the
  same requests in the same process, alternating, median of 3; reported:
  generated tokens/s, the speedup, preemptions and the pool's peak pages.
"""

from __future__ import annotations

import dataclasses
import time

import jax
import numpy as np

from kimi_jax.model import transformer
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from sampler_workloads import NEW_TOKENS, PROMPT_LEN, QWEN_SHAPED, requests
from timing import no_compiles

RESERVED = (160, 2048, 8192)
TAIL_MEDIAN, TAIL_SIGMA, TAIL_MAX_RATIO = 64, 1.2, 16
TAIL_REQUESTS, TAIL_DENSE_SLOTS, TAIL_PAGED_SLOTS, PAGE = 128, 16, 64, 16


def _params(cfg):
  return jax.jit(lambda k: transformer.init_params(cfg, k))(
      jax.random.key(0))


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
    params[S] = _params(cfg)
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
  """New-token counts: log-normal, median TAIL_MEDIAN, capped at
  TAIL_MAX_RATIO x the median (and at least 1)."""
  rng = np.random.default_rng(seed)
  x = TAIL_MEDIAN * np.exp(TAIL_SIGMA * rng.standard_normal(n))
  return [int(v) for v in np.clip(np.round(x), 1,
                                  TAIL_MEDIAN * TAIL_MAX_RATIO)]


def long_tail(steps: int, repeats: int = 3) -> dict:
  """Today's engine against the paged one (see module doc)."""
  lengths = tail_lengths(TAIL_REQUESTS)
  max_new = TAIL_MEDIAN * TAIL_MAX_RATIO
  S = PROMPT_LEN + max_new
  cfg = dataclasses.replace(QWEN_SHAPED, max_seq_len=S)
  reqs = requests(cfg, TAIL_REQUESTS, lengths,
                  lambda i: SamplingParams(seed=i), seed=5)
  pool = TAIL_DENSE_SLOTS * S // PAGE  # the rows' memory, in pages
  engines = {
      "rows_whole": Engine(cfg, EngineConfig(
          TAIL_DENSE_SLOTS, S, (PROMPT_LEN, S), min_view=S)),
      "paged": Engine(cfg, EngineConfig(
          TAIL_PAGED_SLOTS, S, (PROMPT_LEN, S), page_size=PAGE,
          kv_pages=pool)),
  }
  params = _params(cfg)
  runs = {k: Sampler(e, RepeatConfig(enabled=False), steps_per_call=steps)
          for k, e in engines.items()}
  got = _alternate(runs, {k: params for k in runs}, reqs, repeats)
  out = dict(requests=TAIL_REQUESTS, prompt_len=PROMPT_LEN,
             lengths=dict(median=float(np.median(lengths)),
                          mean=float(np.mean(lengths)), max=max(lengths),
                          cap=max_new, distribution=(
                              f"lognormal(median {TAIL_MEDIAN}, sigma "
                              f"{TAIL_SIGMA}), capped at {max_new}")),
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
  out["paged_vs_rows_whole_speedup"] = (out["tok_s_paged"] /
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
  print(f"paged vs rows (whole view): "
        f"{t['paged_vs_rows_whole_speedup']:.2f}x")
