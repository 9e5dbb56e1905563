"""The RL policy loss on a packed `Minibatch`, and the reference log-probs.

The model runs on the minibatch's rows and `losses` gets log pi(y|x) per
response. The train step itself is `kimi_jax.train_step` (sharded, donated,
NaN-safe) driven by `kimi_jax.rl.learner`; this module only supplies the
functions it differentiates or evaluates.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.model import logprobs
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import losses
from kimi_jax.rl.batching import Minibatch
from kimi_jax.rl.config import REST_LOSSES, RLConfig
from kimi_jax.sharding import Sharder
from kimi_jax.token_rows import TokenRows


def token_logp_RxT(params, rows: TokenRows, *, cfg: ModelConfig,
                   sharder: Sharder | None) -> jax.Array:
  """log pi_theta of every target of the packed rows (replaying the
  sampler's experts where the rows carry them)."""
  return logprobs.rows_logprobs(params, rows, cfg=cfg, sharder=sharder)


def _per_response(x_RxT, mb: Minibatch) -> jax.Array:
  P, K = mb.group_shape
  return losses.packed_sequence_logp(x_RxT, mb.rows.mask_RxT, mb.seq_RxT, P,
                                     K)


def seq_logp(params, mb: Minibatch, *, cfg: ModelConfig,
             sharder: Sharder | None) -> jax.Array:
  """log pi(y|x) over the loss mask, P x K: the iteration's reference."""
  out = _per_response(token_logp_RxT(params, mb.rows, cfg=cfg,
                                     sharder=sharder), mb)
  # Replicated: the host of every process reads it back.
  return out if sharder is None else jax.lax.with_sharding_constraint(
      out, sharder.replicated())


def gap_sums(token_logp_RxT: jax.Array, mb: Minibatch,
             sharder: Sharder | None) -> dict[str, jax.Array]:
  """`losses.logprob_gap_sums` of the trainer's log-probs against the
  sampler's over the tokens sampled in this iteration (`current_RxT`),
  replicated for every host to read."""
  out = losses.logprob_gap_sums(jax.lax.stop_gradient(token_logp_RxT),
                                mb.sampler_logp_RxT, mb.current_RxT)
  return out if sharder is None else jax.lax.with_sharding_constraint(
      out, sharder.replicated())


def reference(params, mb: Minibatch, *, cfg: ModelConfig,
              sharder: Sharder | None, token_level: bool = False
              ) -> dict[str, jax.Array]:
  """The iteration's reference under `params` (theta_i), one forward pass:
  seq_logp_PxK (`seq_logp`, replicated), the sampler-trainer gap sums
  (`gap_sums`) and, with `token_level`, every target's log-prob
  (logp_RxT, for truncated importance sampling)."""
  logp_RxT = token_logp_RxT(params, mb.rows, cfg=cfg, sharder=sharder)
  seq = _per_response(logp_RxT, mb)
  if sharder is not None:
    seq = jax.lax.with_sharding_constraint(seq, sharder.replicated())
  out = dict(gap_sums(logp_RxT, mb, sharder), seq_logp_PxK=seq)
  if token_level:
    out["logp_RxT"] = logp_RxT
  return out


def policy_loss(params, mb: Minibatch, *, cfg: ModelConfig, rl: RLConfig,
                sharder: Sharder | None, self_reference=None):
  """Mirror descent (report eq. 3) or ReST, chosen by `rl.loss`.

  Padding prompts (valid_P = 0) own no tokens and are left out of the loss
  and its metrics. self_reference (a traced bool, or None: false): the
  reference log pi_theta_i(y|x) is this call's own log pi_theta(y|x)
  (stop-gradient) instead of `mb.ref_seq_logp_PxK` - exact when params are
  theta_i, as in the first step of an iteration. The metrics carry
  `seq_logp_PxK` (stop-gradient), so that step's values serve as the
  minibatch's reference afterwards, and the sampler-trainer gap sums
  (`gap_sums`) of this call's parameters: the learner reads them from a
  step at theta_i.

  An MoE model adds `model.router_aux_loss_coef` times the load-balancing
  loss (`logprobs.router_aux_loss`; 0 by default in RL).

  With rl.tis_cap the policy-gradient term weights each token by
  `losses.tis_weights` of `mb.ref_logp_RxT` (the trainer's log pi_theta_i,
  which the learner computes in its reference pass) against the sampler's
  log-probs.
  """
  logp_RxT, trace = logprobs.traced_rows_logprobs(params, mb.rows, cfg=cfg,
                                                  sharder=sharder)
  seq_logp_PxK = _per_response(logp_RxT, mb)
  gap = gap_sums(logp_RxT, mb, sharder)
  aux, aux_metrics = logprobs.router_aux_loss(trace, cfg)
  own_PxK = jax.lax.stop_gradient(seq_logp_PxK)
  if sharder is not None:
    own_PxK = jax.lax.with_sharding_constraint(own_PxK, sharder.replicated())
  if rl.loss in REST_LOSSES:
    n_tokens_PxK = _per_response(mb.rows.mask_RxT, mb)
    loss, metrics = losses.rest_seq_loss(seq_logp_PxK, n_tokens_PxK,
                                         mb.correct_PxK)
    if aux_metrics:
      loss = loss + aux
    return loss, dict(metrics, **gap, **aux_metrics, seq_logp_PxK=own_PxK)
  ref_PxK = mb.ref_seq_logp_PxK
  if self_reference is not None:
    ref_PxK = jnp.where(self_reference, own_PxK, ref_PxK)
  pg_seq_PxK, tis = None, {}
  if rl.tis:
    w_RxT = losses.tis_weights(mb.ref_logp_RxT, mb.sampler_logp_RxT,
                               mb.rows.mask_RxT, cap=rl.tis_cap)
    pg_seq_PxK = _per_response(w_RxT * logp_RxT, mb)
    tis = losses.tis_stats(w_RxT, mb.rows.mask_RxT, cap=rl.tis_cap)
  loss, metrics = losses.mirror_descent_seq_loss(
      seq_logp_PxK, ref_PxK, mb.reward_PxK, tau=rl.tau,
      baseline_kind=rl.baseline, valid_P=mb.valid_P,
      pg_seq_logp_PxK=pg_seq_PxK)
  metrics.update(gap, **tis, **aux_metrics)
  if aux_metrics:
    loss = loss + aux
  metrics["n_tokens"] = mb.rows.mask_RxT.sum()
  metrics["seq_logp_PxK"] = own_PxK
  return loss, metrics
