"""python launch/plan.py --config experiments/qwen2_5_7b.py --mesh data=4,fsdp=16,tensor=4 --device-memory-gb 16

Prints the per-device memory plan of an experiment on a mesh of any size
(abstract devices: nothing is allocated), warns when it exceeds the given
device memory, and optionally writes it as JSON. `--config.x.y=v` overrides
apply as in launch/tpu_run.py.
"""

from __future__ import annotations

import argparse
import json
import os
import sys

# Runs from a checkout without installing the package, as launch/tpu_run.py.
sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from kimi_jax import plan  # noqa: E402
from kimi_jax.config import load_config, split_config_args  # noqa: E402


def main(argv: list[str]) -> int:
  overrides, rest = split_config_args(argv)
  parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[1])
  parser.add_argument("--config", required=True,
                      help="experiment file, optionally path.py:variant")
  parser.add_argument("--mesh", default="",
                      help="axis sizes, e.g. data=4,fsdp=16,tensor=4 "
                      "(default: the config's mesh section)")
  parser.add_argument("--num-devices", type=int, default=None,
                      help="device count, to resolve a -1 mesh axis")
  parser.add_argument("--device-memory-gb", type=float, default=None,
                      help="per-device memory (GB = 1e9 bytes) to warn above")
  parser.add_argument("--json", default="", help="write the plan here")
  args = parser.parse_args(rest)
  config = load_config(args.config, overrides)
  memory = plan.plan_for_config(config, plan.parse_mesh(args.mesh),
                                args.num_devices)
  print(plan.format_table(memory, args.device_memory_gb))
  if args.json:
    with open(args.json, "w") as f:
      json.dump(dict(memory.to_json(), config=args.config,
                     overrides=overrides,
                     device_memory_gb=args.device_memory_gb), f, indent=2)
  return 0


if __name__ == "__main__":
  sys.exit(main(sys.argv[1:]))
