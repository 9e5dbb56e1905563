"""The RL policy loss on a packed minibatch, and the reference log-probs.

A minibatch (`kimi_jax/rl/batching.py`) holds R x T packed rows plus P x K
per-response arrays; the model runs on the rows and `losses` gets log
pi(y|x) per response. The train step itself is `kimi_jax.train_step`
(sharded, donated, NaN-safe); this module only supplies the loss it
differentiates.
"""

from __future__ import annotations

import functools

import jax

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import losses
from kimi_jax.rl.config import RLConfig
from kimi_jax.sharding import Sharder


def token_logp_RxT(params, batch, *, cfg: ModelConfig,
                   sharder: Sharder | None) -> jax.Array:
  """log pi_theta of every target of the packed rows."""
  logits, _ = transformer.forward(params, batch["tokens"], batch["positions"],
                                  batch["segment_ids"], cfg=cfg,
                                  sharder=sharder)
  return transformer.token_logprobs(logits, batch["targets"])


def _per_response(x_RxT, batch) -> jax.Array:
  P, K = batch["lengths"].shape
  return losses.packed_sequence_logp(x_RxT, batch["mask"], batch["seq"], P, K)


def seq_logp(params, batch, *, cfg: ModelConfig, sharder: Sharder | None
             ) -> jax.Array:
  """log pi(y|x) over the loss mask, P x K: the iteration's reference."""
  out = _per_response(token_logp_RxT(params, batch, cfg=cfg, sharder=sharder),
                      batch)
  # Replicated: the host of every process reads it back.
  return out if sharder is None else jax.lax.with_sharding_constraint(
      out, sharder.replicated())


def policy_loss(params, batch, *, cfg: ModelConfig, rl: RLConfig,
                sharder: Sharder | None):
  """Mirror descent (report eq. 3) or ReST, chosen by `rl.loss`.

  Padding prompts (valid_P = 0) own no tokens and are left out of the loss
  and its metrics.
  """
  seq_logp_PxK = _per_response(
      token_logp_RxT(params, batch, cfg=cfg, sharder=sharder), batch)
  if rl.loss == "rest":
    n_tokens_PxK = _per_response(batch["mask"], batch)
    return losses.rest_seq_loss(seq_logp_PxK, n_tokens_PxK, batch["correct"])
  loss, metrics = losses.mirror_descent_seq_loss(
      seq_logp_PxK, batch["ref_seq_logp"], batch["reward"], tau=rl.tau,
      baseline_kind=rl.baseline, valid_P=batch["valid"])
  metrics["n_tokens"] = batch["mask"].sum()
  return loss, metrics


def make_seq_logp_fn(cfg: ModelConfig, sharder: Sharder | None):
  return jax.jit(functools.partial(seq_logp, cfg=cfg, sharder=sharder))
