"""Timed sections for the benchmarks: one that compiles anything (counted
through jax.monitoring) raises instead of reporting a figure that includes
a compilation; and the float32 matmul peak that ceilings are taken from.
"""

from __future__ import annotations

import contextlib
import time

import jax
import jax.numpy as jnp
import numpy as np

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


def median_seconds(call, label: str, repeats: int = 5) -> float:
  """Median wall seconds of `repeats` calls of `call()` (waited on), after
  one warm-up call; none may compile."""
  jax.block_until_ready(call())
  seconds = []
  with no_compiles(label):
    for _ in range(repeats):
      start = time.perf_counter()
      jax.block_until_ready(call())
      seconds.append(time.perf_counter() - start)
  return float(np.median(seconds))


def matmul_peak_flops(n: int = 2048, repeats: int = 5) -> float:
  """fp32 FLOP/s of a jitted n^3 matmul on the default device (median)."""
  a = jax.device_put(np.random.default_rng(0).standard_normal(
      (n, n), np.float32))
  matmul = jax.jit(lambda x, y: x @ y)
  return 2 * n**3 / median_seconds(lambda: matmul(a, a), "matmul peak",
                                   repeats)


def product_seconds(m: int, k: int, n: int, dtype, steps: int = 200,
                    repeats: int = 5) -> float:
  """Seconds of one m x k by k x n product whose inputs are in `dtype`,
  accumulated in float32 (median of `repeats` jitted loops of `steps`
  products, each feeding the next so none is hoisted or skipped)."""
  rng = np.random.default_rng(0)
  x = jax.device_put(rng.standard_normal((m, k), np.float32))
  w = jax.device_put(rng.standard_normal((k, n), np.float32).astype(dtype))

  @jax.jit
  def loop(x, w):
    def body(_, acc_MxN):
      x_in = (x + 1e-9 * acc_MxN[0, 0]).astype(dtype)
      return acc_MxN + jax.lax.dot(x_in, w,
                                   preferred_element_type=jnp.float32)
    return jax.lax.fori_loop(0, steps, body, jnp.zeros((m, n), jnp.float32))

  return median_seconds(lambda: loop(x, w), f"{m}x{k}x{n} product",
                        repeats) / steps
