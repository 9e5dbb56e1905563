"""Activation-by-weight products whose weight gradient is one plain matmul.

`project(spec, x, w)` is `jnp.einsum(spec, x, w)` (same primal ops, so the
same bits) for the model's projections: x's leading (batch, length) axes
pass through, its trailing axes contract with w. Only the gradient
differs in form. Autodiff writes the weight gradient as dot(g, x) followed
by a transpose to w's axis order; XLA:CPU folds that transpose into the
producer of g, which then writes g transposed (a strided pass over several
activation-sized arrays; on CPU the RL train step of the Qwen2-shaped
benchmark config took 5.2x its forward pass with einsum, 4.0x with
`project`, measured side by side: docs/speed.md). Here it is dot(x, g) (or
dot(g, x)) over the flattened tokens, contracting the token axis of both,
in w's axis order: no transpose at all. The input gradient is autodiff's
own.
"""

from __future__ import annotations

import functools
import math

import jax
import jax.numpy as jnp


def _parse(spec: str) -> tuple[int, bool]:
  """(number of token axes, whether w lists its contracted axes first)."""
  ins, out = spec.split("->")
  xs, ws = ins.split(",")
  token = [a for a in xs if a in out]
  contract = [a for a in xs if a not in out]
  w_out = [a for a in ws if a not in xs]
  ok = (xs == "".join(token + contract) and out == "".join(token + w_out)
        and sorted(ws) == sorted(contract + w_out))
  if ok and ws == "".join(contract + w_out):
    return len(token), True
  if ok and ws == "".join(w_out + contract):
    return len(token), False
  raise ValueError(f"project: {spec!r} is not 'tokens+contracted,"
                   f"contracted+out->tokens+out' (or w as out+contracted)")


def weight_operands(x: jax.Array, w: jax.Array, compute_dtype, matmul_dtype
                    ) -> tuple[jax.Array, jax.Array, object]:
  """(x, w, out_dtype) of an activation-by-weight product: both in
  matmul_dtype, and out_dtype the compute dtype where the two differ (the
  product accumulated in it), else None (the inputs' own)."""
  out = None if matmul_dtype == compute_dtype else compute_dtype
  return x.astype(matmul_dtype), w.astype(matmul_dtype), out


def project(spec: str, x: jax.Array, w: jax.Array, out_dtype=None
            ) -> jax.Array:
  """`jnp.einsum(spec, x, w, preferred_element_type=out_dtype)`; see the
  module docstring. out_dtype: the product's dtype when wider than the
  inputs' (bfloat16 inputs accumulated in float32); None: the inputs'."""
  return _project(spec, out_dtype, x, w)


@functools.partial(jax.custom_vjp, nondiff_argnums=(0, 1))
def _project(spec, out_dtype, x, w):
  return jnp.einsum(spec, x, w, preferred_element_type=out_dtype)


def _project_fwd(spec, out_dtype, x, w):
  return _project(spec, out_dtype, x, w), (x, w)


def _project_bwd(spec, out_dtype, res, g):
  x, w = res
  n_token, contract_first = _parse(spec)
  _, x_vjp = jax.vjp(lambda x_: jnp.einsum(
      spec, x_, w, preferred_element_type=out_dtype), x)
  (dx,) = x_vjp(g)
  n = math.prod(x.shape[:n_token])
  x_NxC = x.reshape(n, -1)
  # The weight gradient's product at the forward's precision: its inputs
  # in x's dtype, accumulated in out_dtype.
  g_NxO = g.reshape(n, -1).astype(x.dtype)
  tokens = (((0,), (0,)), ((), ()))
  if contract_first:
    dw = jax.lax.dot_general(x_NxC, g_NxO, tokens,
                             preferred_element_type=out_dtype)
  else:
    dw = jax.lax.dot_general(g_NxO, x_NxC, tokens,
                             preferred_element_type=out_dtype)
  return dx.astype(x.dtype), dw.reshape(w.shape).astype(w.dtype)


_project.defvjp(_project_fwd, _project_bwd)
