"""Mixture-of-experts MLP blocks (Qwen3-MoE), dropless, by grouped matmuls.

A layer's router scores each token against every expert (softmax over the
experts, in float32), keeps the top k (`n_experts_per_token`) and, with
`norm_topk_prob`, renormalises their probabilities to sum 1; those are the
gates. Each token's k copies are sorted by expert and every expert runs on
its contiguous run of tokens with `jax.lax.ragged_dot` (one grouped matmul
per projection, no token dropped, no capacity factor); the outputs go back
to their tokens weighted by the gates.

Routing replay: given the experts each token chose elsewhere (the sampler,
`experts_BxTxK`), the router still computes its probabilities (the gates,
and their gradient) but the top-k choice is the given one. Each block also
reports what it chose and the load-balancing statistics (`Trace`).

Parameters, stacked over all layers like the rest (`transformer`):
router (L, D, E), expert_gate and expert_up (L, E, D, Fe), expert_down
(L, E, Fe, D). A model whose layers are all sparse has no dense MLP
params; one with `dense_layers` keeps both kinds stacked over every layer
(each layer reads one kind; the other kind's slices are zeros and get zero
gradients), so the layers still scan as one stack.

Shapes in names: B batch, T tokens, N = B * T, D width, E experts, K
experts per token, Fe expert width, L layers (Lm: the MoE layers).
"""

from __future__ import annotations

from typing import Any, Callable, NamedTuple

import jax
import jax.numpy as jnp

from jax.sharding import PartitionSpec

from kimi_jax.model.config import ModelConfig
from kimi_jax.model.projection import weight_operands
from kimi_jax.sharding import Sharder, constrain

Params = dict[str, Any]

MOE_PARAMS = ("router", "expert_gate", "expert_up", "expert_down")
DENSE_MLP_PARAMS = ("w_gate", "w_up", "w_down")


class Trace(NamedTuple):
  """What one MoE layer did (stacked over the MoE layers by the model).

  experts_BxTxK: the experts each token went to (int32).
  counts_E: token copies sent to each expert, over valid tokens.
  prob_sum_E: the router's probabilities summed over valid tokens.
  n_valid: how many tokens were valid (float32 scalar).
  """

  experts_BxTxK: jax.Array
  counts_E: jax.Array
  prob_sum_E: jax.Array
  n_valid: jax.Array


# ---- parameters --------------------------------------------------------------


def layer_param_shapes(cfg: ModelConfig) -> dict[str, tuple[int, ...]]:
  L, D, E, F = cfg.n_layers, cfg.d_model, cfg.n_experts, cfg.expert_mlp_dim
  return {"router": (L, D, E), "expert_gate": (L, E, D, F),
          "expert_up": (L, E, D, F), "expert_down": (L, E, F, D)}


def layer_logical_axes() -> dict[str, tuple[str | None, ...]]:
  # The router is small: its expert axis stays whole.
  return {"router": ("layers", "embed", None),
          "expert_gate": ("layers", "experts", "embed", "expert_mlp"),
          "expert_up": ("layers", "experts", "embed", "expert_mlp"),
          "expert_down": ("layers", "experts", "expert_mlp", "embed")}


def has_dense_mlp(cfg: ModelConfig) -> bool:
  """Whether the layer params hold the dense MLP (some layer uses it)."""
  return not cfg.n_experts or bool(cfg.dense_layers)


def layer_uses(cfg: ModelConfig, name: str, layer: int) -> bool:
  """Whether layer `layer` reads its slice of layer param `name`."""
  if name in MOE_PARAMS:
    return cfg.sparse_kinds[layer]
  if name in DENSE_MLP_PARAMS:
    return not cfg.sparse_kinds[layer]
  return True


def zero_unused(cfg: ModelConfig, layers: Params) -> Params:
  """Layer params with the slices no layer reads set to zero (a model
  with dense layers keeps both MLP kinds stacked over every layer)."""
  if not cfg.n_experts or not cfg.dense_layers:
    return layers
  out = dict(layers)
  for name in MOE_PARAMS + DENSE_MLP_PARAMS:
    used = jnp.asarray([layer_uses(cfg, name, i)
                        for i in range(cfg.n_layers)])
    x = layers[name]
    out[name] = jnp.where(used.reshape((-1,) + (1,) * (x.ndim - 1)), x,
                          jnp.zeros_like(x))
  return out


# ---- the block ---------------------------------------------------------------


def route(h_NxD: jax.Array, router_DxE: jax.Array, cfg: ModelConfig,
          experts_NxK: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
  """(experts_NxK, gates_NxK in the compute dtype, probs_NxE float32).

  Router logits in float32, softmax over experts, the top k (or the given
  `experts_NxK`), renormalised with `cfg.norm_topk_prob`."""
  logits = jnp.einsum("nd,de->ne", h_NxD,
                      router_DxE.astype(cfg.compute_jnp_dtype),
                      preferred_element_type=jnp.float32)
  probs_NxE = jax.nn.softmax(logits, axis=-1)
  if experts_NxK is None:
    top_NxK, experts_NxK = jax.lax.top_k(probs_NxE, cfg.n_experts_per_token)
  else:
    experts_NxK = experts_NxK.astype(jnp.int32)
    top_NxK = jnp.take_along_axis(probs_NxE, experts_NxK, axis=-1)
  if cfg.norm_topk_prob:
    top_NxK = top_NxK / jnp.sum(top_NxK, axis=-1, keepdims=True)
  return (experts_NxK.astype(jnp.int32), top_NxK.astype(cfg.compute_jnp_dtype),
          probs_NxE)


def _expert_product(x_MxD: jax.Array, w_ExDxF: jax.Array, sizes_E: jax.Array,
                    cfg: ModelConfig) -> jax.Array:
  """Each run of rows times its expert's weight; with a `cfg.matmul_dtype`
  of its own, both rounded to it and accumulated in the compute dtype."""
  x, w, out = weight_operands(x_MxD, w_ExDxF, cfg.compute_jnp_dtype,
                              cfg.matmul_jnp_dtype)
  return jax.lax.ragged_dot(x, w, sizes_E, preferred_element_type=out)


def grouped_experts(h_NxD: jax.Array, experts_NxK: jax.Array,
                    gates_NxK: jax.Array, lp: Params, cfg: ModelConfig
                    ) -> jax.Array:
  """sum_k gate_k * expert_{e_k}(h) per token, dropless: the N * K token
  copies sorted by expert, each projection one `ragged_dot` over the
  experts' runs."""
  N, K = experts_NxK.shape
  E = cfg.n_experts
  flat_M = experts_NxK.reshape(-1)
  order_M = jnp.argsort(flat_M, stable=True)
  sizes_E = jnp.bincount(flat_M, length=E).astype(jnp.int32)
  x_MxD = jnp.take(h_NxD, order_M // K, axis=0)
  gate = _expert_product(x_MxD, lp["expert_gate"], sizes_E, cfg)
  up = _expert_product(x_MxD, lp["expert_up"], sizes_E, cfg)
  y_MxD = _expert_product(jax.nn.silu(gate) * up, lp["expert_down"], sizes_E,
                          cfg)
  y_MxD = y_MxD * jnp.take(gates_NxK.reshape(-1), order_M)[:, None]
  back = jnp.zeros_like(y_MxD).at[order_M].set(y_MxD, unique_indices=True)
  return back.reshape(N, K, -1).sum(axis=1)


def moe_mlp(h_BxTxD: jax.Array, lp: Params, cfg: ModelConfig,
            sharder: Sharder | None, valid_BxT: jax.Array | None = None,
            experts_BxTxK: jax.Array | None = None
            ) -> tuple[jax.Array, Trace]:
  """The MoE block on normed hidden states: its output and `Trace`.

  valid_BxT: tokens that count in the load-balancing statistics (None:
  all). experts_BxTxK: replay these choices instead of the top k.

  On a mesh the block runs in `jax.shard_map` over the token axes (batch,
  and the sequence under context parallelism): each shard routes, sorts
  and multiplies its own tokens' copies against the whole expert weights
  (gathered one layer at a time), so no sort or gather ever spans the
  global batch; the statistics are summed over the shards. A batch that
  does not divide over the batch axes (a small prefill) runs unsplit."""
  B, T, D = h_BxTxD.shape
  valid_BxT = (jnp.ones((B, T), bool) if valid_BxT is None else valid_BxT)
  weights = {k: lp[k] for k in MOE_PARAMS}
  replay = experts_BxTxK is not None
  batch = _token_axes(sharder, "batch", B)
  length = _token_axes(sharder, "act_length", T)
  token_axes = batch + length

  def local(h, w, valid, experts):
    out, trace = _moe_tokens(h, w, cfg, valid, experts if replay else None)
    if token_axes:
      trace = trace._replace(
          counts_E=jax.lax.psum(trace.counts_E, token_axes),
          prob_sum_E=jax.lax.psum(trace.prob_sum_E, token_axes),
          n_valid=jax.lax.psum(trace.n_valid, token_axes))
    return out, trace

  experts = experts_BxTxK if replay else jnp.zeros((B, T, 1), jnp.int32)
  if not token_axes:
    out, trace = local(h_BxTxD, weights, valid_BxT, experts)
  else:
    tok = PartitionSpec(_part(batch), _part(length))
    tok3 = PartitionSpec(_part(batch), _part(length), None)
    rep = PartitionSpec()
    out, trace = jax.shard_map(
        local, mesh=sharder.mesh,
        in_specs=(tok3, {k: rep for k in weights}, tok, tok3),
        out_specs=(tok3, Trace(tok3, rep, rep, rep)))(
            h_BxTxD, weights, valid_BxT, experts)
  out = constrain(sharder, out, ("batch", "act_length", "act_embed"))
  return out, trace


def _token_axes(sharder: Sharder | None, name: str, dim: int
                ) -> tuple[str, ...]:
  """The mesh axes logical axis `name` (of size dim) splits over: none
  without a mesh, or when dim does not divide over them."""
  if sharder is None:
    return ()
  axes = tuple(sharder.rule_map.get(name, ()))
  axes = tuple(a for a in axes if sharder.mesh.shape[a] > 1)
  return axes if axes and dim % sharder.axis_size(axes) == 0 else ()


def _part(axes: tuple[str, ...]):
  return (axes if len(axes) > 1 else axes[0]) if axes else None


def _moe_tokens(h_BxTxD, w: Params, cfg: ModelConfig, valid_BxT,
                experts_BxTxK) -> tuple[jax.Array, Trace]:
  """`moe_mlp` of the tokens at hand (one shard's, on a mesh)."""
  B, T, D = h_BxTxD.shape
  K = cfg.n_experts_per_token
  h_NxD = h_BxTxD.reshape(B * T, D)
  experts_NxK, gates_NxK, probs_NxE = route(
      h_NxD, w["router"], cfg,
      None if experts_BxTxK is None else experts_BxTxK.reshape(B * T, K))
  out = grouped_experts(h_NxD, experts_NxK, gates_NxK, w, cfg)
  w_N = valid_BxT.reshape(-1).astype(jnp.float32)
  counts_E = jnp.zeros((cfg.n_experts,), jnp.float32).at[
      experts_NxK.reshape(-1)].add(jnp.repeat(w_N, K))
  trace = Trace(experts_BxTxK=experts_NxK.reshape(B, T, K),
                counts_E=counts_E,
                prob_sum_E=jnp.sum(probs_NxE * w_N[:, None], axis=0),
                n_valid=jnp.sum(w_N))
  return out.reshape(B, T, D), trace


def empty_trace(cfg: ModelConfig, B: int, T: int) -> Trace:
  """The trace of a dense layer (a scanned model mixing both kinds)."""
  E = cfg.n_experts
  return Trace(jnp.zeros((B, T, cfg.n_experts_per_token), jnp.int32),
               jnp.zeros((E,), jnp.float32), jnp.zeros((E,), jnp.float32),
               jnp.zeros((), jnp.float32))


def ffn(h_BxTxD: jax.Array, lp: Params, cfg: ModelConfig,
        sharder: Sharder | None, sparse, dense_fn: Callable[[jax.Array],
                                                            jax.Array],
        valid_BxT=None, experts_BxTxK=None
        ) -> tuple[jax.Array, Trace | None]:
  """A layer's feed-forward block: the MoE block where `sparse` (a Python
  bool, or a traced bool of a scanned model with both kinds), else
  `dense_fn(h)`. The trace is None for a dense model."""
  if not cfg.n_experts:
    return dense_fn(h_BxTxD), None
  moe = lambda: moe_mlp(h_BxTxD, lp, cfg, sharder, valid_BxT, experts_BxTxK)
  B, T, _ = h_BxTxD.shape
  dense = lambda: (dense_fn(h_BxTxD), empty_trace(cfg, B, T))
  if isinstance(sparse, bool):
    return moe() if sparse else dense()
  return jax.lax.cond(sparse, moe, dense)


def scanned_sparse(cfg: ModelConfig):
  """Each layer's kind as the scan over layers sees it: one Python bool
  when all layers are alike, else a per-layer bool array to scan."""
  kinds = cfg.sparse_kinds
  if len(set(kinds)) == 1:
    return kinds[0]
  return jnp.asarray(kinds)


def layers_replay(cfg: ModelConfig, experts_BxTxLxK: jax.Array
                  ) -> jax.Array:
  """Replayed choices of the MoE layers (B x T x Lm x K) as one entry per
  layer (L x B x T x K; dense layers' entries zero, never read)."""
  B, T, Lm, K = experts_BxTxLxK.shape
  if Lm != len(cfg.moe_layers):
    raise ValueError(f"routing replay holds {Lm} layers of experts, the "
                     f"model has {len(cfg.moe_layers)} MoE layers")
  per_layer = jnp.moveaxis(experts_BxTxLxK.astype(jnp.int32), 2, 0)
  out = jnp.zeros((cfg.n_layers, B, T, K), jnp.int32)
  return out.at[jnp.asarray(cfg.moe_layers)].set(per_layer)


def moe_traces(cfg: ModelConfig, per_layer: Trace) -> Trace:
  """The MoE layers' entries of a trace stacked over every layer."""
  if len(cfg.moe_layers) == cfg.n_layers:
    return per_layer
  idx = jnp.asarray(cfg.moe_layers)
  return jax.tree.map(lambda x: x[idx], per_layer)


def experts_BxTxLxK(trace: Trace) -> jax.Array:
  """A stacked trace's choices, token-major (B x T x Lm x K)."""
  return jnp.moveaxis(trace.experts_BxTxK, 0, 2)


def expert_id_dtype(n_experts: int):
  """The narrowest integer type that holds expert ids 0..n_experts-1 (what
  routing replay records per token: int8 up to 128 experts, else int16)."""
  if not 0 < n_experts <= 32768:
    raise ValueError(f"routing replay records expert ids as int8/int16: "
                     f"model.n_experts must be in [1, 32768], got {n_experts}")
  return jnp.int8 if n_experts <= 128 else jnp.int16


def replay_record(cfg: ModelConfig) -> tuple[int, int, Any]:
  """(Lm, K, id dtype): what routing replay records per token of `cfg`."""
  return (len(cfg.moe_layers), cfg.n_experts_per_token,
          jnp.dtype(expert_id_dtype(cfg.n_experts)))


def load_balancing_loss(trace: Trace, cfg: ModelConfig) -> jax.Array:
  """Switch Transformer's auxiliary loss over the MoE layers (as
  transformers' `load_balancing_loss_func`):

    E * sum_e f_e * P_e,  f_e = copies sent to e / tokens,
                          P_e = mean router probability of e,

  both over every MoE layer's valid tokens."""
  n = jnp.maximum(jnp.sum(trace.n_valid), 1.0)
  f_E = jnp.sum(trace.counts_E, axis=0) / n
  p_E = jnp.sum(trace.prob_sum_E, axis=0) / n
  return cfg.n_experts * jnp.sum(f_E * p_E)
