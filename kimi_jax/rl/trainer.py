"""The RL policy loss on a P x K x T batch, and the reference log-probs.

The train step itself is `kimi_jax.train_step` (sharded, donated, NaN-safe);
this module only supplies the loss it differentiates.
"""

from __future__ import annotations

import functools

import jax

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import losses
from kimi_jax.rl.config import RLConfig
from kimi_jax.sharding import Sharder


def token_logp_PxKxT(params, batch, *, cfg: ModelConfig,
                     sharder: Sharder | None) -> jax.Array:
  P, K, T = batch["tokens"].shape
  flat = lambda x: x.reshape(P * K, T)
  logits, _ = transformer.forward(params, flat(batch["tokens"]),
                                  flat(batch["positions"]),
                                  flat(batch["segment_ids"]), cfg=cfg,
                                  sharder=sharder)
  return transformer.token_logprobs(logits, flat(batch["targets"])).reshape(
      P, K, T)


def seq_logp(params, batch, *, cfg: ModelConfig, sharder: Sharder | None
             ) -> jax.Array:
  """log pi(y|x) over the loss mask, P x K: the iteration's reference."""
  logp = token_logp_PxKxT(params, batch, cfg=cfg, sharder=sharder)
  out = losses.sequence_logp(logp, batch["mask"])
  # Replicated: the host of every process reads it back.
  return out if sharder is None else jax.lax.with_sharding_constraint(
      out, sharder.replicated())


def policy_loss(params, batch, *, cfg: ModelConfig, rl: RLConfig,
                sharder: Sharder | None):
  """Mirror descent (report eq. 3) or ReST, chosen by `rl.loss`.

  Padding prompts (valid_P = 0) are left out of the loss and its metrics.
  """
  logp = token_logp_PxKxT(params, batch, cfg=cfg, sharder=sharder)
  if rl.loss == "rest":
    return losses.rest_loss(logp, batch["mask"], batch["correct"])
  return losses.mirror_descent_loss(
      logp, batch["ref_seq_logp"], batch["mask"], batch["reward"],
      tau=rl.tau, baseline_kind=rl.baseline, valid_P=batch["valid"])


def make_seq_logp_fn(cfg: ModelConfig, sharder: Sharder | None):
  return jax.jit(functools.partial(seq_logp, cfg=cfg, sharder=sharder))
