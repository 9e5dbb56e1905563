"""Multi-process start-up: one JAX process per host, one global mesh.

On TPU pods `jax.distributed.initialize()` finds its peers by itself. Elsewhere
(GPU clusters, or several CPU processes in a test) pass the coordinator
address, the number of processes and this process's id. CPU processes talk
through gloo collectives.
"""

from __future__ import annotations

import dataclasses
import os

import jax


@dataclasses.dataclass(frozen=True)
class DistributedConfig:
  coordinator_address: str | None = None
  num_processes: int | None = None
  process_id: int | None = None
  # Devices per process for the CPU backend (tests, laptops).
  cpu_devices: int | None = None
  # When one process dies, the others stop after this many seconds.
  heartbeat_timeout_seconds: int = 100

  @property
  def explicit(self) -> bool:
    return self.coordinator_address is not None

  def __post_init__(self):
    given = [self.coordinator_address is not None,
             self.num_processes is not None, self.process_id is not None]
    if any(given) and not all(given):
      raise ValueError("--coordinator_address, --num_processes and "
                       "--process_id must be given together")
    if self.num_processes is not None and not (
        0 <= self.process_id < self.num_processes):
      raise ValueError(f"--process_id {self.process_id} is not in "
                       f"[0, {self.num_processes})")


def on_tpu_pod(environ=os.environ) -> bool:
  """Whether this is one worker of a multi-host TPU slice (or multislice).

  Cloud TPU VMs list every worker of the slice in TPU_WORKER_HOSTNAMES; a
  single host (a one-host slice, or an offline AOT compile that sets the
  variable to "localhost") needs no distributed runtime.
  """
  hosts = [h for h in environ.get("TPU_WORKER_HOSTNAMES", "").split(",")
           if h.strip()]
  return len(hosts) > 1 or bool(environ.get("MEGASCALE_COORDINATOR_ADDRESS"))


def initialize(cfg: DistributedConfig) -> None:
  """Starts the multi-controller runtime when more than one process runs."""
  if cfg.cpu_devices:
    jax.config.update("jax_num_cpu_devices", cfg.cpu_devices)
  if cfg.explicit:
    if jax.config.jax_platforms in (None, "", "cpu") or os.environ.get(
        "JAX_PLATFORMS", "") == "cpu":
      jax.config.update("jax_cpu_collectives_implementation", "gloo")
    jax.distributed.initialize(
        coordinator_address=cfg.coordinator_address,
        num_processes=cfg.num_processes, process_id=cfg.process_id,
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_seconds)
  elif on_tpu_pod():
    jax.distributed.initialize(
        heartbeat_timeout_seconds=cfg.heartbeat_timeout_seconds)


def fail(message: str, exc: BaseException | None = None) -> None:
  """Shows the error and exits at once, without the shutdown barrier.

  Waiting at the barrier would hang on the processes still inside a
  collective; exiting lets the coordination service see this process die,
  and the others stop with an error after the heartbeat timeout.
  """
  import sys
  import traceback
  if exc is not None:
    traceback.print_exception(exc, file=sys.stderr)
  print(f"process {jax.process_index()}: {message}", file=sys.stderr,
        flush=True)
  sys.stdout.flush()
  os._exit(1)
