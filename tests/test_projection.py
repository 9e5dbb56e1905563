"""`project` is `jnp.einsum` in value and in both gradients; only the form
of the weight gradient differs (kimi_jax/model/projection.py)."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from kimi_jax.model.projection import project

pytestmark = pytest.mark.host_inputs

# The model's projections: (spec, x shape, w shape).
SPECS = [("btd,dhk->bthk", (2, 5, 6), (6, 3, 4)),
         ("bthk,hkd->btd", (2, 5, 3, 4), (3, 4, 6)),
         ("btd,df->btf", (2, 5, 6), (6, 7)),
         ("btd,vd->btv", (2, 5, 6), (9, 6))]


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
def test_value_and_gradients_match_einsum(spec, x_shape, w_shape):
  rng = np.random.default_rng(0)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal(w_shape).astype(np.float32)
  out_shape = jnp.einsum(spec, x, w).shape
  c = rng.standard_normal(out_shape).astype(np.float32)  # a cotangent
  loss = lambda f: lambda x_, w_: jnp.sum(f(spec, x_, w_) * c)
  np.testing.assert_array_equal(jax.jit(project, static_argnums=0)(spec, x, w),
                                jnp.einsum(spec, x, w))
  got = jax.grad(loss(project), argnums=(0, 1))(x, w)
  want = jax.grad(loss(jnp.einsum), argnums=(0, 1))(x, w)
  for g, e in zip(got, want):
    np.testing.assert_allclose(g, e, rtol=1e-5, atol=1e-5)
  # dw independently: sum over tokens of x (x) cotangent, by numpy.
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  np.testing.assert_allclose(got[1], np.einsum(f"{xs},{out}->{ws}", x, c),
                             rtol=1e-5, atol=1e-5)


def _bf16(a):
  """a rounded to bfloat16, back in float64 (numpy's own arithmetic)."""
  return np.asarray(jnp.asarray(a, jnp.bfloat16).astype(jnp.float32),
                    np.float64)


@pytest.mark.parametrize("spec,x_shape,w_shape", SPECS)
def test_bfloat16_inputs_accumulated_in_float32(spec, x_shape, w_shape):
  """out_dtype=float32 on bfloat16 inputs: the exact product of the rounded
  inputs, to float32 accumulation; each gradient the exact product of its
  (bfloat16-rounded) operands, rounded to bfloat16 once."""
  rng = np.random.default_rng(1)
  x = rng.standard_normal(x_shape).astype(np.float32)
  w = rng.standard_normal(w_shape).astype(np.float32)
  xb, wb = jnp.asarray(x, jnp.bfloat16), jnp.asarray(w, jnp.bfloat16)
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  got = jax.jit(project, static_argnums=(0, 3))(spec, xb, wb, jnp.float32)
  assert got.dtype == jnp.float32
  exact = np.einsum(spec, _bf16(x), _bf16(w))
  np.testing.assert_allclose(got, exact, rtol=1e-5, atol=1e-5)
  # Rounding the product to bfloat16 instead would be off by ~4e-3.
  assert np.abs(np.asarray(got) - exact).max() < 1e-4
  c = rng.standard_normal(exact.shape).astype(np.float32)
  dx, dw = jax.grad(lambda x_, w_: jnp.sum(
      project(spec, x_, w_, jnp.float32) * c), argnums=(0, 1))(xb, wb)
  assert dx.dtype == dw.dtype == jnp.bfloat16
  # The weight gradient's product takes the cotangent rounded to bfloat16.
  want_dx = np.einsum(f"{out},{ws}->{xs}", c, _bf16(w))
  want_dw = np.einsum(f"{xs},{out}->{ws}", _bf16(x), _bf16(c))
  for g, e in ((dx, want_dx), (dw, want_dw)):
    np.testing.assert_allclose(np.asarray(g, np.float64), e, rtol=8e-3,
                               atol=8e-3 * np.abs(e).max())


def test_an_unsupported_spec_is_rejected():
  x = np.zeros((3, 2), np.float32)  # contracted axis before the token axis
  with pytest.raises(ValueError, match="project"):
    jax.grad(lambda w: project("dt,df->tf", x, w).sum())(
        np.zeros((3, 4), np.float32))
