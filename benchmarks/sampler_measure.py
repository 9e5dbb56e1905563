"""The sampler benchmark's measurements: generated tokens/s, cached against
recomputed decoding, continuous against static batching, batched against
one-at-a-time admission, and the weight-handoff paths. Every timed call
runs after a warm-up that compiles what it needs (`timing.no_compiles`).
"""

from __future__ import annotations

import functools
import os
import time

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model import logprobs, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import losses
from kimi_jax.sampler import handoff
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from sampler_workloads import CACHE_LEN, NEW_TOKENS, PROMPT_LEN, requests
from timing import no_compiles


def random_params(cfg: ModelConfig):
  """The benchmarks' weights of `cfg`: random, seed 0."""
  return jax.jit(lambda k: transformer.init_params(cfg, k))(
      jax.random.key(0))


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


def prepared(cfg, params, batch: int, steps: int,
             sharder: Sharder | None = None, matmul_dtype: str = ""
             ) -> tuple[Sampler, list, float]:
  """(sampler, requests, compile seconds) for B requests of PROMPT_LEN
  tokens, NEW_TOKENS new ones each, seeded temperature-1 sampling, repeat
  detection on (as the RL loop runs it), after one warm-up call; on one
  device, or the slots split over `sharder`'s mesh; the weight matmuls in
  `matmul_dtype` ("": the model's)."""
  engine = Engine(cfg, EngineConfig(batch, CACHE_LEN, (PROMPT_LEN,),
                                    matmul_dtype=matmul_dtype),
                  sharder=sharder)
  sampler = Sampler(engine, RepeatConfig(), steps_per_call=steps)
  seeded = lambda i: SamplingParams(seed=i)
  reqs = requests(cfg, batch, [NEW_TOKENS] * batch, seeded, seed=1)
  return sampler, reqs, warm(sampler, params, reqs)


def logprob_gap(cfg: ModelConfig, params, reqs, results) -> dict:
  """How far a sampler's log-probs of the tokens it drew are from the
  model's own (`cfg` as the trainer runs it, teacher-forced over each
  request's prompt and response): `logprob_gap_abs`, the mean |difference|
  per token, and `logprob_gap_kl`, the k3 estimate of KL(sampler || model)
  per token, as the RL loop logs them (`losses.logprob_gap_sums`)."""
  by_id = {r.id: r for r in results}
  rows = [(req.prompt, by_id[req.id]) for req in reqs]
  T = max(len(p) + len(r.tokens) for p, r in rows)
  tokens = np.zeros((len(rows), T), np.int32)
  sampled = np.zeros((len(rows), T), np.float32)
  mask = np.zeros((len(rows), T), np.float32)
  for i, (prompt, r) in enumerate(rows):
    seq = list(prompt) + list(r.tokens)
    tokens[i, :len(seq)] = seq
    # Position t's target is token t + 1: the response's log-probs sit at
    # the positions before each drawn token.
    at = slice(len(prompt) - 1, len(seq) - 1)
    sampled[i, at] = r.logprobs
    mask[i, at] = 1.0
  positions = np.broadcast_to(np.arange(T, dtype=np.int32), tokens.shape)
  targets = np.concatenate([tokens[:, 1:], tokens[:, :1] * 0], axis=1)
  inputs = jax.device_put((tokens, positions, np.ones_like(tokens), targets))
  model = jax.jit(functools.partial(logprobs.token_logprobs, cfg=cfg))(
      params, *inputs)
  sums = jax.device_get(jax.jit(losses.logprob_gap_sums)(
      model, *jax.device_put((sampled, mask))))
  n = float(sums["gap_tokens"])
  return dict(logprob_gap_abs=float(sums["gap_abs_sum"]) / n,
              logprob_gap_kl=float(sums["gap_kl_sum"]) / n, tokens=int(n))


def throughput_row(sampler: Sampler, batch: int, runs: list, compile_s: float
                   ) -> dict:
  """The tokens/s row of `batch` from its `timed_generate` runs (median)."""
  wall = float(np.median([r[2] for r in runs]))
  tokens = runs[0][1].tokens_generated
  return dict(batch=batch, tokens=tokens, seconds=wall,
              tokens_per_s=tokens / wall, runs_s=[r[2] for r in runs],
              compile_s=compile_s,
              compile_count=sampler.engine.compile_count())


def throughput(cfg, params, batch: int, steps: int, repeats: int = 1
               ) -> tuple[dict, Engine]:
  """`prepared`'s requests, median of `repeats` timed calls."""
  sampler, reqs, compile_s = prepared(cfg, params, batch, steps)
  runs = [timed_generate(sampler, params, reqs, f"throughput b{batch}")
          for _ in range(repeats)]
  return throughput_row(sampler, batch, runs, compile_s), sampler.engine


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
  params = random_params(cfg)
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
