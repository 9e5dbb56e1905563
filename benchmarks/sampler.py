"""Sampler throughput, cached vs recomputed decoding, continuous vs static.

  python benchmarks/sampler.py --json /tmp/sampler.json
  python benchmarks/sampler.py --part peer --json /tmp/peer.json

--part peer: issue 14's fixed workload on the Qwen2-shaped config (4 layers,
vocab 512, width 256, 3.94 M parameters, random weights, seed 0): B requests
of 32 random prompt tokens, 128 new tokens each at temperature 1 (top_k 0,
top_p 1, no stop token), B = 8, 32, 64; the whole `Sampler.generate` call is
timed (the host has the tokens at its end), median of 3 after one warm-up
call. `ceiling_fraction_b64` = tok_s_b64 / (peak / (2 x parameters)), with
the peak the fp32 FLOP/s of a jitted 2048^3 matmul measured in the same
process (median of 5).

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
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import sys
import tempfile
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig, count_params
from kimi_jax.sampler import handoff
from kimi_jax.sampler.driver import SampleRequest, Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

PROMPT_LEN, NEW_TOKENS = 32, 128
# Decode steps per host round trip (sampler.steps_per_call in the configs).
DEFAULT_STEPS = 16
CACHE_LEN = PROMPT_LEN + NEW_TOKENS
QWEN_SHAPED = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8,
                          n_kv_heads=2, head_dim=32, mlp_dim=1024,
                          tie_embeddings=True, qkv_bias=True,
                          max_seq_len=CACHE_LEN)
FALLBACK_TINY = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                            n_kv_heads=2, head_dim=16, mlp_dim=256,
                            max_seq_len=CACHE_LEN)


# float32 matmuls at full float32 precision on every backend, in the peak
# and the workload alike (a GPU would otherwise run float32 products as
# TF32; on CPU it changes nothing).
MATMUL_PRECISION = "highest"


def pin_matmul_precision() -> str:
  jax.config.update("jax_default_matmul_precision", MATMUL_PRECISION)
  return MATMUL_PRECISION


_COMPILES = [0]


def _count_compile(event: str, *_, **__) -> None:
  if event == "/jax/core/compile/backend_compile_duration":
    _COMPILES[0] += 1


jax.monitoring.register_event_duration_secs_listener(_count_compile)


class CompiledInTimedSection(RuntimeError):
  """A timed section compiled: its time would include the compilation."""


@contextlib.contextmanager
def no_compiles(label: str):
  """Raises if anything compiles inside the block (a missing warm-up)."""
  before = _COMPILES[0]
  yield
  if _COMPILES[0] != before:
    raise CompiledInTimedSection(
        f"{label}: {_COMPILES[0] - before} compilation(s) inside a timed "
        f"section; warm up every shape it uses first")


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
  """fp32 FLOP/s of a jitted n^3 matmul on the default device (median)."""
  a = jax.device_put(np.random.default_rng(0).standard_normal(
      (n, n), np.float32))
  matmul = jax.jit(lambda x, y: x @ y)
  jax.block_until_ready(matmul(a, a))
  seconds = []
  with no_compiles("matmul peak"):
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(matmul(a, a))
      seconds.append(time.perf_counter() - start)
  return 2 * n**3 / float(np.median(seconds))


def tiny_config() -> tuple[str, ModelConfig]:
  path = os.path.join(os.path.dirname(__file__), "..", "experiments",
                      "tiny.py")
  if not os.path.exists(path):
    return "tiny (fallback)", FALLBACK_TINY
  from kimi_jax.config import load_config
  config = load_config(path, {"model.max_seq_len": CACHE_LEN})
  return "tiny", ModelConfig.from_mapping(config.model.to_dict())


def requests(cfg: ModelConfig, n: int, lengths: list[int], sampling,
             seed: int = 0) -> list[SampleRequest]:
  rng = np.random.default_rng(seed)
  return [SampleRequest(i, tuple(int(t) for t in rng.integers(
      0, cfg.vocab_size, PROMPT_LEN)), max_new_tokens=lengths[i],
                        sampling=sampling(i)) for i in range(n)]


def timed_generate(sampler: Sampler, params, reqs, label: str):
  """(results, stats, wall seconds) of one whole `generate` call, which must
  not compile."""
  with no_compiles(label):
    start = time.perf_counter()
    out, stats = sampler.generate(params, reqs)
    return out, stats, time.perf_counter() - start


def warm(sampler: Sampler, params, reqs) -> float:
  """One untimed call that compiles what `reqs` need; its seconds."""
  start = time.perf_counter()
  sampler.generate(params, reqs)
  return time.perf_counter() - start


def throughput(cfg, params, batch: int, steps: int, repeats: int = 1
               ) -> tuple[dict, Engine]:
  """B requests of PROMPT_LEN tokens, NEW_TOKENS new ones each, seeded
  temperature-1 sampling, repeat detection on (as the RL loop runs it);
  median of `repeats` timed calls after one warm-up call."""
  engine = Engine(cfg, EngineConfig(batch, CACHE_LEN, (PROMPT_LEN,)))
  sampler = Sampler(engine, RepeatConfig(), steps_per_call=steps)
  seeded = lambda i: SamplingParams(seed=i)
  reqs = requests(cfg, batch, [NEW_TOKENS] * batch, seeded, seed=1)
  compile_s = warm(sampler, params, reqs)
  runs = [timed_generate(sampler, params, reqs, f"throughput b{batch}")
          for _ in range(repeats)]
  wall = float(np.median([r[2] for r in runs]))
  tokens = runs[0][1].tokens_generated
  return dict(batch=batch, tokens=tokens, seconds=wall,
              tokens_per_s=tokens / wall, runs_s=[r[2] for r in runs],
              compile_s=compile_s, compile_count=engine.compile_count()
              ), engine


def recompute_decode(cfg: ModelConfig):
  """Greedy decoding that runs the full forward over the whole (padded)
  sequence for every new token, all in one jitted loop (no host cost)."""

  @jax.jit
  def run(params, tokens_BxT, lengths_B):
    B, T = tokens_BxT.shape
    positions = jnp.broadcast_to(jnp.arange(T), (B, T))

    def body(_, carry):
      tokens, lengths = carry
      segments = (positions < lengths[:, None]).astype(jnp.int32)
      logits, _ = transformer.forward(params, tokens, positions, segments,
                                      cfg=cfg)
      last = jnp.take_along_axis(logits, (lengths - 1)[:, None, None],
                                 axis=1)[:, 0]
      nxt = jnp.argmax(last, axis=-1).astype(jnp.int32)
      tokens = tokens.at[jnp.arange(B), lengths].set(nxt)
      return tokens, lengths + 1

    return jax.lax.fori_loop(0, NEW_TOKENS, body, (tokens_BxT, lengths_B))[0]

  return run


def cached_vs_recompute(cfg, params, engine: Engine, steps: int,
                        batch: int = 4) -> dict:
  """`batch` sequences; the cached side runs them in the engine's (larger or
  equal) slot count, which only handicaps it."""
  greedy = lambda i: SamplingParams(greedy=True)
  reqs = requests(cfg, batch, [NEW_TOKENS] * batch, greedy, seed=2)
  sampler = Sampler(engine, RepeatConfig(enabled=False), steps_per_call=steps)
  warm(sampler, params, reqs)
  cached, _, cached_s = timed_generate(sampler, params, reqs, "cached")
  run = recompute_decode(cfg)
  tokens = np.zeros((batch, CACHE_LEN), np.int32)
  tokens[:, :PROMPT_LEN] = [r.prompt for r in reqs]
  lengths = np.full((batch,), PROMPT_LEN, np.int32)
  start = time.perf_counter()
  jax.block_until_ready(run(params, tokens, lengths))
  compile_s = time.perf_counter() - start
  with no_compiles("recompute"):
    start = time.perf_counter()
    out = np.asarray(jax.block_until_ready(run(params, tokens, lengths)))
    recompute_s = time.perf_counter() - start
  same = all(tuple(out[b, PROMPT_LEN:]) == c.tokens
             for b, c in enumerate(cached))
  return dict(batch=batch, new_tokens=NEW_TOKENS, cached_s=cached_s,
              recompute_s=recompute_s, recompute_compile_s=compile_s,
              outputs_equal=same,
              cached_vs_recompute_speedup=recompute_s / cached_s)


def continuous_vs_static(cfg, params, engine: Engine, steps: int,
                         n_requests: int = 64,
                         median: int = 16, repeats: int = 3) -> dict:
  slots = engine.max_concurrent_decodes
  # Every 10th request is long: 8x the median.
  lengths = [median * 8 if i % 10 == 0 else median for i in range(n_requests)]
  reqs = requests(cfg, n_requests, lengths, lambda i: SamplingParams(seed=i),
                  seed=3)
  sampler = Sampler(engine, RepeatConfig(enabled=False), steps_per_call=steps)
  batches = [reqs[i:i + slots] for i in range(0, n_requests, slots)]
  for part in [reqs] + batches:  # compiles every admission shape used
    warm(sampler, params, part)
  # Median of `repeats` runs of each side, alternating (a loaded box).
  cont_runs, static_runs = [], []
  for _ in range(repeats):
    cont, cont_stats, seconds = timed_generate(sampler, params, reqs,
                                               "continuous")
    cont_runs.append(seconds)
    static, static_s, static_steps = [], 0.0, 0
    for part in batches:
      out, stats, seconds = timed_generate(sampler, params, part, "static")
      static += out
      static_s += seconds
      static_steps += stats.decode_steps
    static_runs.append(static_s)
  cont_steps = cont_stats.decode_steps
  cont_s, static_s = float(np.median(cont_runs)), float(np.median(static_runs))
  assert [len(r.tokens) for r in cont] == lengths
  return dict(slots=slots, requests=n_requests, median_len=median,
              long_len=median * 8, continuous_s=cont_s, static_s=static_s,
              continuous_runs_s=cont_runs, static_runs_s=static_runs,
              continuous_steps=cont_steps, static_steps=static_steps,
              same_outputs=cont == static,
              continuous_vs_static_speedup=static_s / cont_s)


def admission(cfg: ModelConfig, params, slots: int = 64,
              n_requests: int = 256, repeats: int = 3) -> dict:
  """Admission cost alone: the driver's per-request host work, without
  decoding. Both sides read every first token back, as the driver must
  (stop tokens, budgets); best of `repeats` after a compiling warm-up."""
  engine = Engine(cfg, EngineConfig(slots, CACHE_LEN, (PROMPT_LEN,)))
  reqs = requests(cfg, n_requests, [1] * n_requests,
                  lambda i: SamplingParams(seed=i), seed=4)
  rounds = [reqs[i:i + slots] for i in range(0, n_requests, slots)]

  def one_at_a_time():
    state, firsts = engine.init_decode_state(), []
    for batch in rounds:
      for slot, r in enumerate(batch):
        prefix = engine.prefill(params, r.prompt, r.sampling)
        firsts.append(int(np.asarray(prefix.token)[0]))
        state = engine.insert(prefix, state, slot)
      for slot in range(len(batch)):
        state = engine.free_resource(state, slot)
    jax.block_until_ready(state)
    return firsts

  def batched():
    state, firsts = engine.init_decode_state(), []
    for batch in rounds:
      prefix = engine.prefill_batch(params, [r.prompt for r in batch],
                                    [r.sampling for r in batch],
                                    [0] * len(batch))
      token_N, _ = jax.device_get((prefix.token, prefix.logprob))
      firsts += [int(t) for t in token_N[:len(batch)]]
      state = engine.insert_batch(prefix, state, range(len(batch)))
      state = engine.free_slots(state, np.arange(slots) < len(batch))
    jax.block_until_ready(state)
    return firsts

  out = dict(slots=slots, requests=n_requests, prompt_len=PROMPT_LEN)
  for name, fn in (("one_at_a_time", one_at_a_time), ("batched", batched)):
    firsts = fn()  # compiles
    seconds = []
    for _ in range(repeats):
      with no_compiles(f"admission {name}"):
        start = time.perf_counter()
        fn()
        seconds.append(time.perf_counter() - start)
    out[name] = dict(seconds=min(seconds),
                     requests_per_s=n_requests / min(seconds),
                     ms_per_request=1e3 * min(seconds) / n_requests,
                     first_tokens=firsts)
  out["same_first_tokens"] = (out["one_at_a_time"].pop("first_tokens") ==
                              out["batched"].pop("first_tokens"))
  out["batched_vs_one_at_a_time_speedup"] = (
      out["one_at_a_time"]["seconds"] / out["batched"]["seconds"])
  out["compile_count"] = engine.compile_count()
  return out


def handoff_timings(cfg: ModelConfig, workdir: str) -> dict:
  """The three weight-handoff paths into an engine on a mesh of every
  device (tensor=2 when there are >= 2 devices, the rest data)."""
  n = len(jax.devices())
  mesh_cfg = MeshConfig(data=-1, tensor=2 if n >= 2 else 1)
  sharder = Sharder(make_mesh(mesh_cfg))
  engine = Engine(cfg, EngineConfig(8 * n, CACHE_LEN), sharder=sharder)
  params = jax.jit(lambda k: transformer.init_params(cfg, k))(
      jax.random.key(0))
  on_device0 = jax.device_put(params, jax.devices()[0])
  out = dict(devices=n, mesh=mesh_cfg.resolve(n),
             param_bytes=sum(x.nbytes for x in jax.tree_util.tree_leaves(
                 params)))
  trainer_like = jax.block_until_ready(
      jax.device_put(params, engine.param_shardings))
  for name, src in (("shared", trainer_like), ("resharded", on_device0)):
    reports = [handoff.place_params(src, engine.param_shardings)[1]
               for _ in range(3)]
    out[name] = dict(kind=reports[-1].kind,
                     seconds=min(r.seconds for r in reports))
  path = os.path.join(workdir, "handoff_params")
  save_s = handoff.save_params(path, trainer_like)
  reports = [handoff.restore_params(path, transformer.abstract_params(cfg),
                                    engine.param_shardings)[1]
             for _ in range(3)]
  out["checkpoint"] = dict(kind=reports[-1].kind, save_seconds=save_s,
                           seconds=min(r.seconds for r in reports))
  return out


def peer(steps: int, batches=(8, 32, 64), repeats: int = 3) -> dict:
  """Issue 14's workload (see the module docstring)."""
  load_before = os.getloadavg()
  peak = matmul_peak_flops()
  cfg = QWEN_SHAPED
  params = jax.jit(lambda k: transformer.init_params(cfg, k))(
      jax.random.key(0))
  ceiling = peak / (2 * count_params(cfg))
  report = dict(device=str(jax.devices()[0]), workload=dict(
      prompt_len=PROMPT_LEN, new_tokens=NEW_TOKENS, temperature=1.0,
      top_k=0, top_p=1.0, repeats=repeats, steps_per_call=steps),
                params=count_params(cfg), matmul_peak_flops=peak,
                ceiling_tok_s=ceiling, rows=[])
  for b in batches:
    row, _ = throughput(cfg, params, b, steps, repeats)
    row["ceiling_fraction"] = row["tokens_per_s"] / ceiling
    report["rows"].append(row)
    report[f"tok_s_b{b}"] = row["tokens_per_s"]
    print(f"[peer] batch {b}: {row['tokens_per_s']:.0f} tok/s "
          f"({row['ceiling_fraction']:.3f} of the ceiling)", file=sys.stderr)
  if 64 in batches:
    report["ceiling_fraction_b64"] = report["tok_s_b64"] / ceiling
  report["loadavg_before"] = load_before
  report["loadavg_after"] = os.getloadavg()
  return report


def print_peer(report: dict) -> None:
  print(f"\nsampler, issue-14 workload ({report['device']}; matmul peak "
        f"{report['matmul_peak_flops'] / 1e9:.1f} GFLOP/s, ceiling "
        f"{report['ceiling_tok_s']:.0f} tok/s; "
        f"{report['workload']['steps_per_call']} steps per call; load "
        f"{report['loadavg_before'][0]:.2f} -> "
        f"{report['loadavg_after'][0]:.2f})")
  print("| batch | tokens/s | ceiling fraction | wall s (median) | runs s |")
  print("|---|---|---|---|---|")
  for r in report["rows"]:
    print(f"| {r['batch']} | {r['tokens_per_s']:.0f} | "
          f"{r['ceiling_fraction']:.3f} | {r['seconds']:.3f} | "
          f"{', '.join(f'{x:.3f}' for x in r['runs_s'])} |")


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--json", help="write results here")
  parser.add_argument("--batches", default="8,32,64")
  parser.add_argument("--steps-per-call", type=int, default=DEFAULT_STEPS)
  parser.add_argument("--part", choices=("all", "peer", "handoff",
                                         "admission"),
                      default="all",
                      help="peer: issue 14's fixed workload and ceiling "
                      "fraction; handoff: only the weight-handoff timings (run "
                      "with several devices, e.g. XLA_FLAGS="
                      "--xla_force_host_platform_device_count=8); "
                      "admission: only the batched-admission comparison")
  args = parser.parse_args(argv)
  precision = pin_matmul_precision()
  batches = [int(b) for b in args.batches.split(",")]
  steps = args.steps_per_call
  if args.part == "peer":
    report = peer(steps, batches)
    print_peer(report)
  elif args.part == "handoff":
    with tempfile.TemporaryDirectory() as tmp:
      report = dict(handoff=handoff_timings(QWEN_SHAPED, tmp))
    for name in ("shared", "resharded", "checkpoint"):
      print(f"| {name} | {report['handoff'][name]['seconds'] * 1e3:.2f} ms |"
            f" {report['handoff'][name]} |")
    print(f"params: {report['handoff']['param_bytes'] / 2**20:.1f} MiB, "
          f"mesh {report['handoff']['mesh']}")
  elif args.part == "admission":
    name, cfg = tiny_config()
    params = jax.jit(lambda k: transformer.init_params(cfg, k))(
        jax.random.key(0))
    report = dict(device=str(jax.devices()[0].platform),
                  configs={name: dict(admission=admission(cfg, params))})
    print_admission(report)
  else:
    report = everything(batches, steps)
    print_table(report)
  report["matmul_precision"] = precision
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1, default=str)
  return report


def everything(batches: list[int], steps: int) -> dict:
  report = dict(device=str(jax.devices()[0].platform),
                steps_per_call=steps, prompt_len=PROMPT_LEN,
                new_tokens=NEW_TOKENS, loadavg_before=os.getloadavg(),
                configs={})
  tiny_name, tiny = tiny_config()
  for name, cfg in ((tiny_name, tiny), ("qwen2-shaped", QWEN_SHAPED)):
    params = jax.jit(lambda k, c=cfg: transformer.init_params(c, k))(
        jax.random.key(0))
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


def print_table(report: dict) -> None:
  print(f"\nsampler benchmark ({report['device']}, prompt "
        f"{report['prompt_len']}, {report['new_tokens']} new tokens, "
        f"{report['steps_per_call']} steps per call)")
  print("| config | batch | tokens/s | wall s | compile s | compilations |")
  print("|---|---|---|---|---|---|")
  for name, entry in report["configs"].items():
    for r in entry["throughput"]:
      print(f"| {name} | {r['batch']} | {r['tokens_per_s']:.0f} | "
            f"{r['seconds']:.2f} | {r['compile_s']:.1f} | "
            f"{sum(r['compile_count'].values())} |")
  print("\n| config | measure | value | detail |")
  print("|---|---|---|---|")
  for name, entry in report["configs"].items():
    c = entry["cached_vs_recompute"]
    print(f"| {name} | cached_vs_recompute_speedup | "
          f"{c['cached_vs_recompute_speedup']:.1f}x | batch {c['batch']}: "
          f"cached {c['cached_s']:.2f}s, recompute {c['recompute_s']:.2f}s, "
          f"outputs equal: {c['outputs_equal']} |")
    if "continuous_vs_static" in entry:
      s = entry["continuous_vs_static"]
      print(f"| {name} | continuous_vs_static_speedup | "
            f"{s['continuous_vs_static_speedup']:.1f}x | {s['requests']} "
            f"requests, {s['slots']} slots: continuous {s['continuous_s']:.2f}s"
            f" / {s['continuous_steps']} steps, static {s['static_s']:.2f}s / "
            f"{s['static_steps']} steps, same outputs: {s['same_outputs']} |")
  print_admission(report, header=False)


def print_admission(report: dict, header: bool = True) -> None:
  if header:
    print("| config | measure | value | detail |")
    print("|---|---|---|---|")
  for name, entry in report["configs"].items():
    if "admission" not in entry:
      continue
    a = entry["admission"]
    one, batched = a["one_at_a_time"], a["batched"]
    print(f"| {name} | admission_batched_vs_one_at_a_time | "
          f"{a['batched_vs_one_at_a_time_speedup']:.1f}x | {a['requests']} "
          f"requests, {a['slots']} slots: one at a time "
          f"{one['requests_per_s']:.0f} req/s ({one['ms_per_request']:.2f} "
          f"ms/req), batched {batched['requests_per_s']:.0f} req/s "
          f"({batched['ms_per_request']:.3f} ms/req), same first tokens: "
          f"{a['same_first_tokens']} |")


if __name__ == "__main__":
  main()
