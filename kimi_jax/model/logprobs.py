"""Per-token log-probs of targets without the full B x T x V logits.

The policy loss, the reference log-probs and SFT's cross-entropy only need
log p(target_t) at every position. Computing the logits of all positions at
once holds B x T x V float32 values (and as much again for log-softmax and
its cotangent): 4 rows of 32k tokens over Qwen2.5's 152k vocabulary are
80 GB. Here the final hidden states are cut into chunks of
`cfg.logprob_chunk` positions and a `lax.scan` computes one chunk's logits,
log-softmax and target gather at a time, under `jax.checkpoint`, so the
backward pass recomputes each chunk's logits instead of keeping them: the
largest logits buffer is B x chunk x V.

With context parallelism the sequence is split over the `act_length` axes;
each of those G shards is chunked on its own (the scan runs over chunk index
within a shard, the shards stay side by side), so every device works on its
own positions in every step.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from kimi_jax.model import moe, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import Sharder, constrain
from kimi_jax.token_rows import TokenRows
from kimi_jax.vision.merge import RowImages


def _context_shards(sharder: Sharder | None, T: int) -> int:
  if sharder is None:
    return 1
  axes = sharder.rule_map.get("act_length", ())
  n = sharder.axis_size(axes) if axes else 1
  return n if T % n == 0 else 1


def rows_logprobs(params, rows: TokenRows, *, cfg: ModelConfig,
                  sharder: Sharder | None = None) -> jax.Array:
  """`token_logprobs` of packed `TokenRows` (their images and replayed
  experts included)."""
  return traced_rows_logprobs(params, rows, cfg=cfg, sharder=sharder)[0]


def traced_rows_logprobs(params, rows: TokenRows, *, cfg: ModelConfig,
                         sharder: Sharder | None = None
                         ) -> tuple[jax.Array, moe.Trace | None]:
  """`rows_logprobs` and an MoE model's trace (`moe.Trace` stacked over
  its MoE layers; None for a dense model). Rows carrying
  `experts_RxTxLxK` replay those choices of experts."""
  x, _, trace = transformer.traced_hidden_states(
      params, rows.tokens_RxT, rows.positions_RxT, rows.segment_ids_RxT,
      cfg=cfg, sharder=sharder, images=rows.images,
      experts_BxTxLxK=rows.experts_RxTxLxK)
  logp = hidden_logprobs(params, x, rows.targets_RxT, cfg=cfg,
                         sharder=sharder)
  return logp, trace


def router_aux_loss(trace: moe.Trace | None, cfg: ModelConfig
                    ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`cfg.router_aux_loss_coef` times the load-balancing loss
  (`moe.load_balancing_loss`) and its metric; 0 and no metric for a dense
  model or a zero coefficient."""
  if trace is None or not cfg.router_aux_loss_coef:
    return jnp.float32(0.0), {}
  aux = moe.load_balancing_loss(trace, cfg)
  return cfg.router_aux_loss_coef * aux, {"router_aux_loss": aux}


def hidden_logprobs(params, x_BxTxD: jax.Array, targets_BxT: jax.Array, *,
                    cfg: ModelConfig, sharder: Sharder | None = None
                    ) -> jax.Array:
  """log p(target) (float32) from final hidden states, chunk by chunk."""
  B, T, D = x_BxTxD.shape
  if T <= cfg.logprob_chunk:  # one chunk: nothing to scan over
    logits = transformer.unembed(params, x_BxTxD, cfg=cfg, sharder=sharder)
    return transformer.token_logprobs(logits, targets_BxT)
  G = _context_shards(sharder, T)
  local = T // G
  c = min(cfg.logprob_chunk, local)
  pad = -local % c
  n = (local + pad) // c
  # B x T -> B x G x local (+pad) -> n chunks of B x G x c, chunk-major.
  x = jnp.pad(x_BxTxD.reshape(B, G, local, D), ((0, 0), (0, 0), (0, pad),
                                                  (0, 0)))
  y = jnp.pad(targets_BxT.reshape(B, G, local), ((0, 0), (0, 0), (0, pad)))
  x_NxBxGxcxD = jnp.moveaxis(x.reshape(B, G, n, c, D), 2, 0)
  y_NxBxGxc = jnp.moveaxis(y.reshape(B, G, n, c), 2, 0)

  @jax.checkpoint
  def chunk(x_BxGxcxD, y_BxGxc):
    x_BxGcxD = constrain(sharder, x_BxGxcxD.reshape(B, G * c, D),
                         ("batch", "act_length", "act_embed"))
    logits = transformer.unembed(params, x_BxGcxD, cfg=cfg, sharder=sharder)
    logp = transformer.token_logprobs(logits, y_BxGxc.reshape(B, G * c))
    return logp.reshape(B, G, c)

  _, logp_NxBxGxc = jax.lax.scan(lambda _, xy: (None, chunk(*xy)), None,
                                 (x_NxBxGxcxD, y_NxBxGxc))
  logp = jnp.moveaxis(logp_NxBxGxc, 0, 2).reshape(B, G, n * c)[:, :, :local]
  return constrain(sharder, logp.reshape(B, T), ("batch", "act_length"))


def token_logprobs(params, tokens_BxT: jax.Array, positions_BxT: jax.Array,
                   segment_ids_BxT: jax.Array, targets_BxT: jax.Array, *,
                   cfg: ModelConfig, sharder: Sharder | None = None,
                   images: RowImages | None = None) -> jax.Array:
  """log p(targets_BxT | packed rows): the model's forward, then the chunked
  head (float32, B x T). Same values as log_softmax of the full logits."""
  x, _ = transformer.hidden_states(params, tokens_BxT, positions_BxT,
                                   segment_ids_BxT, cfg=cfg, sharder=sharder,
                                   images=images)
  return hidden_logprobs(params, x, targets_BxT, cfg=cfg, sharder=sharder)
