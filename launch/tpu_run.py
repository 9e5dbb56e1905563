"""The main job: supervised warm start, then Kimi k1.5 RL.

  python launch/tpu_run.py --config experiments/tiny.py --workdir /tmp/kimi_tiny
  python launch/tpu_run.py --config experiments/tiny.py:micro --workdir DIR \\
      --config.rl.iterations=20 --config.rl.tau=0.5

From a Hugging Face checkpoint and JSONL data (docs/real_path.md):

  python launch/tpu_run.py --config experiments/qwen2_5_1_5b.py:cpu_smoke \\
      --workdir W --config.init_from_hf=HF --config.task.train_path=T.jsonl \\
      --config.task.eval_path=E.jsonl --config.sft.train_path=S.jsonl

takes the model section from HF/config.json (a --config.model.* override
must agree with it, except the run settings: dtypes, remat, max_seq_len)
and writes the trained policy to W/hf_export/.

A config with a `pipeline` section runs the whole way from raw problems
(kimi_jax/curation/gym_pipeline.py: data, vanilla SFT, curation, warm-up data,
long-CoT SFT, RL):

  python launch/tpu_run.py --config experiments/gym_tiny.py --workdir W

Rerun with the same --workdir to resume. Override any config key with
--config.section.key=value; unknown keys and wrong types are rejected,
naming the key. Bad input (config, data file, checkpoint directory) stops
the run with one line naming the key, file, line or field. On a TPU pod
run the same command on every worker (jax.distributed starts by itself);
elsewhere pass --coordinator_address, --num_processes and --process_id.
"""

import sys

from absl import app, flags

from kimi_jax.infra import quiet
from kimi_jax.infra.config import ConfigError, define_config_flag, parse_flags

_CONFIG = define_config_flag()
_WORKDIR = flags.DEFINE_string(
    "workdir", None, "where checkpoints, metrics, TensorBoard files and plots "
    "go (local path or gs://); rerun to resume", required=True)
_COORDINATOR = flags.DEFINE_string(
    "coordinator_address", None, "host:port of process 0 (multi-process, "
    "non-TPU)")
_NUM_PROCESSES = flags.DEFINE_integer("num_processes", None,
                                      "number of processes (multi-process)")
_PROCESS_ID = flags.DEFINE_integer("process_id", None,
                                   "this process's index (multi-process)")
_CPU_DEVICES = flags.DEFINE_integer(
    "cpu_devices", None, "number of devices per process on the CPU backend")
_HEARTBEAT = flags.DEFINE_integer(
    "heartbeat_timeout_seconds", 100, "multi-process: how soon the others "
    "stop after one process dies")


def main(argv):
  del argv
  quiet.start()
  from ml_collections import config_flags
  from kimi_jax.data.records import DataError
  from kimi_jax.job.experiment import explicit_model_keys, parse_config
  from kimi_jax.model.hf import HFCheckpointError
  from kimi_jax.infra.workdir_lock import WorkdirBusyError
  explicit_model = explicit_model_keys(
      config_flags.get_override_values(flags.FLAGS["config"]))
  from kimi_jax.curation import gym_pipeline
  pipeline = gym_pipeline.is_pipeline(_CONFIG.value)
  # Validate before any device work: a bad config fails in seconds.
  config_error = None
  try:
    if pipeline:
      gym_pipeline.check(_CONFIG.value)
    else:
      parse_config(_CONFIG.value, explicit_model=explicit_model)
  except (ConfigError, ValueError) as exc:
    config_error = exc
  from kimi_jax.infra import distributed
  try:
    dist = distributed.DistributedConfig(
        coordinator_address=_COORDINATOR.value,
        num_processes=_NUM_PROCESSES.value, process_id=_PROCESS_ID.value,
        cpu_devices=_CPU_DEVICES.value,
        heartbeat_timeout_seconds=_HEARTBEAT.value)
  except ValueError as exc:
    sys.exit(f"flag error: {exc}")
  if config_error is not None and not dist.explicit:
    sys.exit(f"config error: {config_error}")
  distributed.initialize(dist)
  if config_error is not None:
    # Only this process may be misconfigured (a per-host flag or path); had
    # it exited before joining, its peers would wait for it at start-up.
    # Joined, its exit stops them after one heartbeat timeout.
    distributed.fail(f"config error: {config_error}")
  from kimi_jax.job.run import train_and_evaluate
  try:
    if pipeline:
      gym_pipeline.run(_CONFIG.value, _WORKDIR.value)
    else:
      train_and_evaluate(_CONFIG.value, _WORKDIR.value,
                         explicit_model=explicit_model)
  except ConfigError as exc:
    distributed.fail(f"config error: {exc}")
  except WorkdirBusyError as exc:
    distributed.fail(f"workdir error: {exc}")
  except DataError as exc:
    distributed.fail(f"data error: {exc}")
  except HFCheckpointError as exc:
    distributed.fail(f"checkpoint error: {exc}")
  except Exception as exc:  # noqa: BLE001 - report, then stop every process
    distributed.fail(f"{type(exc).__name__}: {exc}", exc)


if __name__ == "__main__":
  app.run(main, flags_parser=parse_flags)
