"""Sequences the sampler's KV cache holds on a TPU slice: rows against pages.

  python benchmarks/kv_capacity.py --config experiments/qwen2_5_7b.py \\
      --topology v5p:4x4x4 --json PATH

Builds the experiment's engine twice on the slice's mesh (the TPU compiler
runs on this host: needs libtpu, requirements-test.txt): as shipped (a row
of cache_len entries per slot) and paged with the same KV memory
(`--page_size` entries per page, `--slots_factor` times the slots, the pool
holding max_slots x cache_len entries), and paged again with Pallas's TPU
paged attention kernel (`sampler.attention_kernel=pallas_tpu`) in place
of the XLA gather. For each it compiles the decode
call (`sampler_generate`: steps_per_call steps over every slot, the view
covering the whole cache) and reports the compiler's per-chip bytes, the
cache per chip, and the sequences each holds at mean live lengths 2048,
8192 and 16384 tokens (rows: always max_slots; pages: pool entries / mean
live length, at most the slots). Nothing is estimated but the last line's
division.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

os.environ.setdefault("TPU_SKIP_MDS_QUERY", "1")

from kimi_jax.infra import aot, quiet  # noqa: E402
from kimi_jax.infra.config import load_config, to_dataclass  # noqa: E402
from kimi_jax.job import plan  # noqa: E402
from kimi_jax.sharding import (MeshConfig, Sharder, make_mesh,  # noqa: E402
                               rules_from_config)


def compile_variant(config_path: str, overrides: dict, topology: str
                    ) -> dict:
  config = load_config(config_path, overrides)
  devices = aot.topology_devices(topology)
  hbm = aot.hbm_bytes(devices)
  mesh_cfg = to_dataclass(MeshConfig, config.mesh, "mesh")
  sharder = Sharder(make_mesh(mesh_cfg, devices),
                    rules_from_config(config.sharding.rules))
  fn, args = plan.main_job_functions(config, sharder)["sampler_generate"]
  start = time.perf_counter()
  try:
    generate = aot.compile_memory(fn, args).to_json(hbm)
  except aot.CompileOutOfMemory as exc:  # reported, not hidden
    generate = aot.out_of_memory_json(exc)
  print(f"{overrides or 'as shipped'}: compiled in "
        f"{time.perf_counter() - start:.0f} s", file=sys.stderr)
  return dict(overrides=overrides, mesh=mesh_cfg.resolve(len(devices)),
              hbm_bytes=hbm, sampler_generate=generate,
              kv_cache=plan.kv_cache_report(config, sharder))


def main(argv=None) -> dict:
  parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
  parser.add_argument("--config", default="experiments/qwen2_5_7b.py")
  parser.add_argument("--topology", default="v5p:4x4x4")
  parser.add_argument("--page_size", type=int, default=256)
  parser.add_argument("--slots_factor", type=int, default=4)
  parser.add_argument("--json", help="write the report here")
  args = parser.parse_args(argv)
  quiet.start()
  base = load_config(args.config, {})
  slots, cache_len = int(base.sampler.max_slots), int(base.sampler.cache_len)
  paged = {"sampler.page_size": args.page_size,
           "sampler.kv_pages": slots * cache_len // args.page_size,
           "sampler.max_slots": slots * args.slots_factor}
  kernel = dict(paged, **{"sampler.attention_kernel": "pallas_tpu"})
  report = dict(config=args.config, topology=args.topology,
                rows=compile_variant(args.config, {}, args.topology),
                pages=compile_variant(args.config, paged, args.topology),
                pages_tpu_kernel=compile_variant(args.config, kernel,
                                                 args.topology))
  live = report["rows"]["kv_cache"]["sequences_at_mean_live"]
  paged_live = report["pages"]["kv_cache"]["sequences_at_mean_live"]
  report["pages_vs_rows_sequences"] = {n: paged_live[n] / live[n]
                                       for n in live}
  print(f"{'layout':<18}{'slots':>7}{'KV GB/chip':>12}"
        f"{'decode GB/chip':>16}" + "".join(f"{'seqs @' + n:>12}"
                                            for n in live))
  for name in ("rows", "pages", "pages_tpu_kernel"):
    r = report[name]
    print(f"{name:<18}{r['kv_cache']['slots']:>7}"
          f"{r['kv_cache']['bytes_per_device'] / 1e9:>12.2f}"
          f"{r['sampler_generate']['total_bytes'] / 1e9:>16.2f}" + "".join(
              f"{v:>12}" for v in r["kv_cache"][
                  "sequences_at_mean_live"].values()))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(report, f, indent=1)
  return report


if __name__ == "__main__":
  main()
