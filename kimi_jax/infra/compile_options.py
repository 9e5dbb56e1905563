"""XLA compiler options for the train steps, per backend.

XLA:CPU hands matmuls and reductions to YNNPACK. Its default fusion set
(each dot alone, plus reductions) keeps a dot apart from the elementwise
work around it; letting YNNPACK fuse them ("DOT" instead of
"INDIVIDUAL_DOT") takes about 5% off the RL train step of
`benchmarks/rl_iteration.py` (362 vs 380 ms, medians of 30 interleaved
steps in one process, 2-core AMD EPYC, jaxlib 0.10.2; docs/speed.md).

Train steps only. The sampler keeps XLA's defaults: its tokens and
log-probs are pinned bit for bit (tests/test_sampler_golden.py), and a
fused dot rounds differently in the last bit. A jaxlib that does not know
the option gets none (probed once per process), so an upgrade changes
speed, never whether a run starts.
"""

from __future__ import annotations

import functools
from typing import Mapping

import jax
import jax.numpy as jnp

_FUSION = "LIBRARY_FUSION_TYPE_"
CPU_TRAIN_OPTIONS: Mapping[str, str] = {
    "xla_cpu_experimental_ynn_fusion_type": f"{_FUSION}DOT,{_FUSION}REDUCE",
}


def train_step_options(platform: str, matmul_dtype=jnp.float32
                       ) -> dict[str, str]:
  """Compiler options for a train step on `platform` ("cpu", "tpu", ...)
  whose weight matmuls take `matmul_dtype` inputs. With narrower inputs
  XLA:CPU gets none: its fused dot of bfloat16 inputs rounds the float32
  product to bfloat16 (about 2e-3 off), where the dot alone does not."""
  if (platform != "cpu" or jnp.dtype(matmul_dtype) != jnp.float32 or
      not accepted(tuple(CPU_TRAIN_OPTIONS.items()))):
    return {}
  return dict(CPU_TRAIN_OPTIONS)


@functools.lru_cache(maxsize=None)
def accepted(options: tuple[tuple[str, str], ...]) -> bool:
  """Whether this jaxlib's CPU compiler takes `options` (name, value) pairs."""
  probe = jax.jit(lambda x: jnp.max(x @ x, axis=-1))
  lowered = probe.lower(jax.ShapeDtypeStruct((8, 8), jnp.float32))
  try:
    lowered.compile(compiler_options=dict(options))
  except jax.errors.JaxRuntimeError:  # INVALID_ARGUMENT: unknown name/value
    return False
  return True
