"""The main job: supervised warm start, then Kimi k1.5 RL.

  python launch/tpu_run.py --config experiments/tiny.py --workdir /tmp/kimi_tiny
  python launch/tpu_run.py --config experiments/tiny.py --workdir DIR \\
      --config.rl.iterations=20 --config.rl.tau=0.5

Rerun with the same --workdir to resume. Override any config key with
--config.section.key=value; unknown keys and wrong types are rejected. On a
TPU pod run the same command on every worker (jax.distributed starts by
itself); elsewhere pass --coordinator_address, --num_processes, --process_id.
"""

import argparse
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))


def parse_args(argv):
  from kimi_jax.config import split_config_args
  overrides, rest = split_config_args(argv)
  p = argparse.ArgumentParser(
      description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter,
      epilog="Any --config.KEY=VALUE overrides that key of the config file.")
  p.add_argument("--config", required=True,
                 help="experiment file with get_config(), e.g. "
                 "experiments/tiny.py (or file.py:arg)")
  p.add_argument("--workdir", required=True,
                 help="where checkpoints, metrics, TensorBoard files and "
                 "plots go (local path or gs://); rerun to resume")
  p.add_argument("--coordinator_address", default=None,
                 help="host:port of process 0 (multi-process, non-TPU)")
  p.add_argument("--num_processes", type=int, default=None)
  p.add_argument("--process_id", type=int, default=None)
  p.add_argument("--cpu_devices", type=int, default=None,
                 help="number of devices per process on the CPU backend")
  p.add_argument("--heartbeat_timeout_seconds", type=int, default=100,
                 help="multi-process: how soon the others stop after one "
                 "process dies")
  args = p.parse_args(rest)
  return args, overrides


def main(argv=None):
  args, overrides = parse_args(sys.argv[1:] if argv is None else argv)
  from kimi_jax.config import ConfigError, load_config
  # Validate before joining the other processes: a bad config fails fast.
  try:
    config = load_config(args.config, overrides)
    from kimi_jax.run import parse_config
    parse_config(config)
  except (ConfigError, ValueError) as exc:
    sys.exit(f"config error: {exc}")
  from kimi_jax import distributed
  distributed.initialize(distributed.DistributedConfig(
      coordinator_address=args.coordinator_address,
      num_processes=args.num_processes, process_id=args.process_id,
      cpu_devices=args.cpu_devices,
      heartbeat_timeout_seconds=args.heartbeat_timeout_seconds))
  from kimi_jax.run import train_and_evaluate
  try:
    train_and_evaluate(config, args.workdir)
  except ConfigError as exc:
    distributed.fail(f"config error: {exc}")
  except Exception as exc:  # noqa: BLE001 - report, then stop every process
    distributed.fail(f"{type(exc).__name__}: {exc}", exc)


if __name__ == "__main__":
  main()
