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


def test_an_unsupported_spec_is_rejected():
  x = np.zeros((3, 2), np.float32)  # contracted axis before the token axis
  with pytest.raises(ValueError, match="project"):
    jax.grad(lambda w: project("dt,df->tf", x, w).sum())(
        np.zeros((3, 4), np.float32))
