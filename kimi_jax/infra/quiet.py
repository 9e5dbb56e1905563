"""What a launcher prints besides its own output: library logs only when
asked for, and no TPU start-up errors on a machine without a TPU.

Every launcher calls `start()` first thing in its main, before JAX starts
its backends. Nothing here imports JAX: the platform choice must be made
before JAX reads it.
"""

from __future__ import annotations

import glob
import importlib.metadata
import importlib.util
import os
import sys
from typing import Mapping

# libtpu reaches a chip only through these device files (v2-v4: accel,
# v5e and later: vfio).
_TPU_DEVICES = ("dev/accel*", "dev/vfio/*")
# What JAX itself looks for before it suggests a GPU build (and AMD's KFD).
_GPU_DEVICES = ("dev/nvidia0", "dev/nvidiactl", "dev/dxg", "dev/kfd")
# Set by importing JAX (no chip found) and libtpu (where it lies), so on
# every host.
_NOT_TPU_SIGNS = ("TPU_SKIP_MDS_QUERY", "TPU_LIBRARY_PATH")


def start(verbosity: int | None = None) -> None:
  """Keeps JAX off an absent TPU and library logs (Orbax's and JAX's INFO
  lines) below warnings.

  Args:
    verbosity: absl's logging level asked for on an argparse command line
      (0: INFO, 1 and up: debug); None keeps warnings only. An absl
      launcher leaves it out: its own --verbosity (-v) counts when given.
  """
  pin_platforms()
  from absl import flags, logging
  if verbosity is None and flags.FLAGS.is_parsed() and (
      flags.FLAGS["verbosity"].present):
    return
  if verbosity is None:
    logging.set_verbosity(logging.WARNING)
  else:
    logging.use_absl_handler()
    logging.set_verbosity(verbosity)


def pin_platforms(environ=os.environ, root: str = "/") -> str | None:
  """Sets JAX_PLATFORMS (and JAX's config, when JAX is loaded) to what
  `platforms_to_pin` says; returns it (None: JAX chooses as usual)."""
  jax = sys.modules.get("jax")
  if jax is not None and jax.config.jax_platforms:
    return None
  platforms = platforms_to_pin(environ, root)
  if platforms is not None:
    environ["JAX_PLATFORMS"] = platforms
    if jax is not None:
      jax.config.update("jax_platforms", platforms)
  return platforms


def platforms_to_pin(environ: Mapping[str, str], root: str = "/"
                     ) -> str | None:
  """"cpu" where JAX, left to choose, would only start libtpu (which prints
  start-up errors when it finds no chip) and then fall back to the CPU.

  That is: JAX_PLATFORMS is not set, libtpu is installed, the host has no
  TPU device file, no TPU setting in the environment, no GPU device file
  and no other PJRT plugin (CUDA, ROCm, ...) installed. Anywhere else JAX
  keeps its own choice, so TPU VMs and GPU machines are left alone.
  """
  if "JAX_PLATFORMS" in environ or "JAX_FORCE_TPU_INIT" in environ:
    return None
  if importlib.util.find_spec("libtpu") is None:
    return None
  if (tpu_may_be_present(environ, root) or gpu_may_be_present(root)
      or other_plugins_installed()):
    return None
  return "cpu"


def tpu_may_be_present(environ: Mapping[str, str], root: str = "/") -> bool:
  """A TPU device file under `root`, or a TPU_* setting in `environ`."""
  if any(k.startswith("TPU_") and k not in _NOT_TPU_SIGNS for k in environ):
    return True
  return any(glob.glob(os.path.join(root, p)) for p in _TPU_DEVICES)


def gpu_may_be_present(root: str = "/") -> bool:
  return any(os.path.exists(os.path.join(root, p)) for p in _GPU_DEVICES)


def other_plugins_installed() -> bool:
  """A PJRT plugin JAX would try on its own: a `jax_plugins` module or
  entry point (how the CUDA and ROCm builds register)."""
  if importlib.util.find_spec("jax_plugins") is not None:
    return True
  return bool(importlib.metadata.entry_points(group="jax_plugins"))
