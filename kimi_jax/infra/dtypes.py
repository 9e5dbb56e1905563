"""Parameter and compute dtypes of a config section, by name.

The policy transformer (`model.*`) and the vision tower (`vision.*`) name
their dtypes the same way; this module is what both read them with (it
imports nothing of the project, so neither config imports the other for
it).
"""

from __future__ import annotations

import jax.numpy as jnp

DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16,
          "float16": jnp.float16}


def check_dtypes(cfg, section: str) -> None:
  """Raises naming `<section>.param_dtype` / `compute_dtype` if unknown."""
  for name in ("param_dtype", "compute_dtype"):
    if getattr(cfg, name) not in DTYPES:
      raise ValueError(f"{section}.{name} must be one of {sorted(DTYPES)}, "
                       f"got {getattr(cfg, name)!r}")


def check_matmul_dtype(matmul_dtype: str, key: str,
                       compute_dtype: str | None = None) -> None:
  """Raises naming `key` unless matmul_dtype is "" (the compute dtype's)
  or a known dtype no wider than `compute_dtype` (when given)."""
  if not matmul_dtype:
    return
  if matmul_dtype not in DTYPES:
    raise ValueError(f"{key} must be '' or one of {sorted(DTYPES)}, got "
                     f"{matmul_dtype!r}")
  if compute_dtype is not None and (DTYPES[matmul_dtype].dtype.itemsize >
                                    DTYPES[compute_dtype].dtype.itemsize):
    raise ValueError(f"{key}={matmul_dtype!r} is wider than "
                     f"model.compute_dtype={compute_dtype!r}")


class NamedDtypes:
  """For a frozen config with `param_dtype` and `compute_dtype` names."""

  param_dtype: str
  compute_dtype: str

  @property
  def param_jnp_dtype(self):
    return DTYPES[self.param_dtype]

  @property
  def compute_jnp_dtype(self):
    return DTYPES[self.compute_dtype]

  @property
  def matmul_jnp_dtype(self):
    """The weight matmuls' input dtype: `matmul_dtype` where a config has
    one set, else the compute dtype."""
    return DTYPES[getattr(self, "matmul_dtype", "") or self.compute_dtype]
