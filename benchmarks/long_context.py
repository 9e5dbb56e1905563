"""python benchmarks/long_context.py --json docs/results/long_context_cpu.json

How the RL train step's memory grows with the sequence length, dense versus
memory-efficient. For a small model (experiments/tiny.py widened to 8 layers
of 256, a 32k vocabulary, remat as the long-context configs run), the real
RL train step (`plan.main_job_functions`: policy loss, optimizer, donated
state) is compiled by XLA on this CPU for one minibatch of 2 rows at each
length 512 ... 8192, with

  dense:      model.attention="dot" (B H T T scores) and log-probs from the
              full logits (model.logprob_chunk = T: B T V at once);
  efficient:  model.attention="blockwise" (512-token blocks) and log-probs
              512 positions at a time;

and the compiler's per-device peak (arguments + outputs - aliased + temp,
`memory_analysis`) is reported. `peak_bytes_ratio_16x_len` = peak at 8192 /
peak at 512 for the efficient path: about 16 for linear growth (less, as the
parameters and optimizer state are a fixed part), far more for T^2 terms.
It also times forward + backward (jit(grad) of the masked cross-entropy) at
2048 tokens for both paths, so blockwise attention's speed cost is visible.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

import jax  # noqa: E402
import numpy as np  # noqa: E402

from kimi_jax import train_step as ts  # noqa: E402
from kimi_jax.infra import aot
from kimi_jax.infra.config import load_config, to_dataclass  # noqa: E402
from kimi_jax.job import plan  # noqa: E402
from kimi_jax.model import transformer  # noqa: E402
from kimi_jax.model.config import ModelConfig  # noqa: E402
from kimi_jax.sharding import (MeshConfig, Sharder, make_mesh,  # noqa: E402
                               rules_from_config)
from kimi_jax.token_rows import TokenRows  # noqa: E402

TINY = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(
    __file__))), "experiments", "tiny.py")
LENGTHS = (512, 1024, 2048, 4096, 8192)
PATHS = {"dense": dict(attention="dot"),
         "efficient": dict(attention="blockwise", attention_block=512,
                           logprob_chunk=512)}


def _config(T: int, path: str):
  overrides = {
      "model.vocab_size": 32768, "model.d_model": 256, "model.n_layers": 8,
      "model.n_heads": 8, "model.n_kv_heads": 2, "model.head_dim": 32,
      "model.mlp_dim": 1024, "model.max_seq_len": T, "model.remat": True,
      "model.logprob_chunk": T, "sampler.cache_len": T,
      "sampler.prefill_buckets": (T,), "rl.max_response_len": T // 2,
      "rl.train_len_buckets": (T,), "rl.minibatch_prompts": 1,
      "rl.samples_per_prompt": 2, "mesh.data": 1,
  }
  overrides.update({f"model.{k}": v for k, v in PATHS[path].items()})
  return load_config(TINY, overrides)


def peak_bytes(T: int, path: str, sharder: Sharder) -> dict:
  functions = plan.main_job_functions(_config(T, path), sharder)
  fn, args = functions[f"rl_train_step_T{T}"]
  m = aot.compile_memory(fn, args)
  return dict(temp_bytes=m.temp_bytes, peak_bytes=m.total_bytes)


def fwd_bwd_seconds(T: int, path: str, repeats: int) -> float:
  config = _config(T, path)
  cfg = to_dataclass(ModelConfig, config.model, "model")
  rows = 2
  rng = np.random.default_rng(0)
  batch = jax.device_put(TokenRows(
      tokens_RxT=rng.integers(0, cfg.vocab_size, (rows, T)).astype(np.int32),
      targets_RxT=rng.integers(0, cfg.vocab_size, (rows, T)).astype(np.int32),
      positions_RxT=np.tile(np.arange(T, dtype=np.int32), (rows, 1)),
      segment_ids_RxT=np.ones((rows, T), np.int32),
      mask_RxT=np.ones((rows, T), np.float32)))
  params = jax.jit(lambda: transformer.init_params(cfg, jax.random.key(0)))()
  grad = jax.jit(jax.grad(lambda p, b: ts.cross_entropy_loss(p, b,
                                                             cfg=cfg)[0]))
  jax.block_until_ready(grad(params, batch))  # compile
  t0 = time.perf_counter()
  for _ in range(repeats):
    jax.block_until_ready(grad(params, batch))
  return (time.perf_counter() - t0) / repeats


def main(argv: list[str]) -> int:
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
  parser.add_argument("--json", default="")
  parser.add_argument("--repeats", type=int, default=3)
  args = parser.parse_args(argv)
  device = jax.devices()[0]
  sharder = Sharder(make_mesh(MeshConfig(data=1), [device]),
                    rules_from_config(load_config(TINY).sharding.rules))
  table = {path: {T: peak_bytes(T, path, sharder) for T in LENGTHS}
           for path in PATHS}
  print(f"RL train step, per-device peak (MB), {device.platform}, 2 rows")
  print(f"{'tokens':>8}{'dense':>12}{'efficient':>12}")
  for T in LENGTHS:
    print(f"{T:>8}{table['dense'][T]['peak_bytes'] / 1e6:>12.1f}"
          f"{table['efficient'][T]['peak_bytes'] / 1e6:>12.1f}")
  ratio = {path: table[path][LENGTHS[-1]]["peak_bytes"] /
           table[path][LENGTHS[0]]["peak_bytes"] for path in PATHS}
  print(f"peak at {LENGTHS[-1]} / peak at {LENGTHS[0]}: dense "
        f"{ratio['dense']:.1f}, efficient {ratio['efficient']:.1f}")
  seconds = {path: fwd_bwd_seconds(2048, path, args.repeats)
             for path in PATHS}
  print(f"forward+backward at 2048 tokens x 2 rows: dense "
        f"{seconds['dense']:.3f} s, blockwise {seconds['efficient']:.3f} s "
        f"({seconds['efficient'] / seconds['dense']:.2f}x)")
  result = dict(
      device=device.platform, rows=2, lengths=list(LENGTHS),
      peak_bytes={p: {str(T): v["peak_bytes"] for T, v in t.items()}
                  for p, t in table.items()},
      temp_bytes={p: {str(T): v["temp_bytes"] for T, v in t.items()}
                  for p, t in table.items()},
      peak_bytes_ratio_16x_len=ratio["efficient"],
      dense_peak_bytes_ratio_16x_len=ratio["dense"],
      fwd_bwd_seconds_2048=seconds,
      blockwise_over_dense_seconds=seconds["efficient"] / seconds["dense"])
  if args.json:
    with open(args.json, "w") as f:
      json.dump(result, f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
