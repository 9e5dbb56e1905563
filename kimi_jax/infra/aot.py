"""Ahead-of-time compilation for a real TPU topology, from any host.

With `libtpu` installed, `jax.experimental.topologies.get_topology_desc`
describes the devices of a TPU slice (e.g. "v5p:4x4x4", 64 chips) without
owning one. A mesh over those devices, abstract arguments carrying their
shardings, and `jax.jit(...).lower(...).compile()` run the real TPU compiler
on this host; `compiled.memory_analysis()` then gives what each device would
hold: arguments, outputs (less what aliases donated arguments) and the
compiler's temporaries. Nothing runs and nothing is allocated.

This is how `launch/plan.py --aot TOPOLOGY` proves a config fits before a
slice is rented. The CPU backend of the same process keeps working: the
topology's devices are only used to build meshes for lowering.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import re
from typing import Any, Callable, Mapping

import jax
import numpy as np

# Which HBM a chip has (bytes, as Cloud TPU's documentation quotes them, in
# decimal GB), by the device kind the topology's devices report.
HBM_BYTES = {
    "TPU v4": 32 * 10**9,
    "TPU v5 lite": 16 * 10**9,  # v5e
    "TPU v5": 95 * 10**9,  # v5p
    "TPU v6 lite": 32 * 10**9,  # v6e (Trillium)
}

# libtpu reads these when it loads; without them it asks a cloud metadata
# server (unreachable off Google Cloud) what machine it is on.
_TPU_ENV = {
    "TPU_SKIP_MDS_QUERY": "1",
    "TPU_ACCELERATOR_TYPE": "",  # set per topology below
    "TPU_WORKER_ID": "0",
    "TPU_WORKER_HOSTNAMES": "localhost",
    # No chip is opened, so concurrent compiles (pytest workers) may share
    # libtpu instead of contending for its lock file.
    "ALLOW_MULTIPLE_LIBTPU_LOAD": "1",
}


def prepare_environment(topology: str) -> None:
  """Sets the TPU runtime's variables for an offline compile of `topology`.

  Call before JAX first loads libtpu (before `topology_devices`); variables
  already set by the user are kept.
  """
  for key, value in _TPU_ENV.items():
    if key == "TPU_ACCELERATOR_TYPE":
      value = accelerator_type(topology)
    os.environ.setdefault(key, value)


def accelerator_type(topology: str) -> str:
  """"v5p:4x4x4" -> "v5p-128"-style names libtpu knows (cores for v4/v5p,
  chips for v5e/v6e)."""
  gen, _, shape = topology.partition(":")
  chips = int(np.prod([int(x) for x in shape.split("x")])) if shape else 1
  per_chip = 2 if gen in ("v4", "v5p") else 1
  name = {"v5e": "v5litepod", "v6e": "v6e"}.get(gen, gen)
  return f"{name}-{chips * per_chip}"


def topology_devices(topology: str) -> list[jax.Device]:
  """The devices of a TPU slice, e.g. "v5p:4x4x4" (64 chips), for lowering
  and compiling only. Needs libtpu (requirements-test.txt)."""
  if ":" not in topology:
    raise ValueError(f"--aot: topology must look like v5p:4x4x4, got "
                     f"{topology!r}")
  prepare_environment(topology)
  from jax.experimental import topologies
  try:
    desc = topologies.get_topology_desc(topology_name=topology,
                                        platform="tpu")
  except Exception as exc:  # libtpu missing or an unknown topology
    raise RuntimeError(
        f"cannot describe TPU topology {topology!r}: {exc}. Ahead-of-time "
        f"TPU compilation needs libtpu (pip install -r "
        f"requirements-test.txt)") from exc
  return list(desc.devices)


def hbm_bytes(devices: list[jax.Device]) -> int:
  kind = devices[0].device_kind
  if kind not in HBM_BYTES:
    raise ValueError(f"no HBM size known for device kind {kind!r} (known: "
                     f"{sorted(HBM_BYTES)})")
  return HBM_BYTES[kind]


@dataclasses.dataclass(frozen=True)
class FunctionMemory:
  """Per-device bytes of one compiled function (compiler's figures).

  total = arguments + outputs - aliased (outputs written into donated
  arguments' buffers) + temporaries: what the device holds at the peak.
  """

  argument_bytes: int
  output_bytes: int
  alias_bytes: int
  temp_bytes: int

  @property
  def total_bytes(self) -> int:
    return (self.argument_bytes + self.output_bytes - self.alias_bytes +
            self.temp_bytes)

  def to_json(self, hbm: int) -> dict[str, Any]:
    return dict(argument_bytes=self.argument_bytes,
                output_bytes=self.output_bytes, alias_bytes=self.alias_bytes,
                temp_bytes=self.temp_bytes, total_bytes=self.total_bytes,
                fits=self.total_bytes <= hbm)


class CompileOutOfMemory(RuntimeError):
  """The TPU compiler refused a program that does not fit the chip's HBM."""

  def __init__(self, message: str, used_bytes: int):
    super().__init__(message)
    self.used_bytes = used_bytes


# The compiler's two phrasings: "... in memory space hbm. Used 15.81G of
# 15.75G hbm." and "... on HBM, the total memory required for HLO
# temporaries (24.00G) exceeds available HBM (15.75G)."
_OOM = re.compile(r"Ran out of memory (?:in memory space hbm\. Used |on HBM, "
                  r"the total memory required for [^(]*\()([0-9.]+)([KMGT])")


@contextlib.contextmanager
def without_persistent_cache():
  """JAX's persistent compilation cache off for the block: an executable
  compiled for a TPU topology with no TPU client cannot be loaded back
  (JAX warns on every lookup), so reading or writing the cache only costs."""
  from jax.experimental.compilation_cache import compilation_cache
  enabled = jax.config.jax_enable_compilation_cache
  # JAX decides once per process whether the cache is used; reset_cache
  # makes it read the flag again, here and after the block.
  jax.config.update("jax_enable_compilation_cache", False)
  compilation_cache.reset_cache()
  try:
    yield
  finally:
    jax.config.update("jax_enable_compilation_cache", enabled)
    compilation_cache.reset_cache()


def compile_for_topology(fn: Callable, args: tuple):
  """`fn.lower(*args).compile()` without the persistent cache."""
  with without_persistent_cache():
    return fn.lower(*args).compile()


def compile_memory(fn: Callable, args: tuple) -> FunctionMemory:
  """Compiles jitted `fn` for abstract `args` (ShapeDtypeStructs with
  shardings; static arguments as their values) and returns the compiler's
  per-device memory.

  Raises `CompileOutOfMemory` (with the bytes the compiler says it needed)
  when the TPU compiler rejects the program for exceeding HBM."""
  try:
    compiled = compile_for_topology(fn, args)
  except jax.errors.JaxRuntimeError as exc:
    found = _OOM.search(str(exc))
    if not found:
      raise
    scale = {"K": 2**10, "M": 2**20, "G": 2**30, "T": 2**40}[found.group(2)]
    raise CompileOutOfMemory(str(exc).split("\n")[0],
                             int(float(found.group(1)) * scale)) from exc
  m = compiled.memory_analysis()
  return FunctionMemory(argument_bytes=int(m.argument_size_in_bytes),
                        output_bytes=int(m.output_size_in_bytes),
                        alias_bytes=int(m.alias_size_in_bytes),
                        temp_bytes=int(m.temp_size_in_bytes))


def out_of_memory_json(error: CompileOutOfMemory) -> dict[str, Any]:
  """A function the compiler refused: only its total (what the compiler
  says it needed) is known."""
  return dict(argument_bytes=None, output_bytes=None, alias_bytes=None,
              temp_bytes=None, total_bytes=error.used_bytes, fits=False,
              error=str(error))


def format_report(report: Mapping[str, Any]) -> str:
  """A text table of an `aot_report` in GB per device."""
  gb = 1e9
  lines = [f"TPU compiler, {report['topology']} "
           f"({report['devices']} chips, {report['hbm_bytes'] / gb:.0f} GB "
           f"HBM each), mesh {report['mesh']}, seq_len {report['seq_len']}",
           f"{'function':<34}{'args':>9}{'out':>9}{'alias':>9}{'temp':>9}"
           f"{'total':>9}  fits"]
  for name, f in report["functions"].items():
    if f["argument_bytes"] is None:
      lines.append(f"{name:<34}{'(compiler: out of HBM)':>36}"
                   f"{f['total_bytes'] / gb:>9.2f}  OUT OF MEMORY")
      continue
    lines.append(
        f"{name:<34}{f['argument_bytes'] / gb:>9.2f}"
        f"{f['output_bytes'] / gb:>9.2f}{f['alias_bytes'] / gb:>9.2f}"
        f"{f['temp_bytes'] / gb:>9.2f}{f['total_bytes'] / gb:>9.2f}  "
        f"{'fits' if f['fits'] else 'OUT OF MEMORY'}")
  lines.append(f"all fit: {report['fits']}")
  return "\n".join(lines)
