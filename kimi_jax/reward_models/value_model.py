"""The classic reward model: the policy transformer with a scalar value head.

Report 2.3.5 (after InstructGPT): a value head on the model reads
(question, reference answer, response) and outputs one scalar saying
whether the response is correct. Here:

  params = {"model": <transformer params>, "head": {"w_D": (D,)}}
  logit_t = w . h_t      h: transformer.hidden_states (after the final norm,
                         the states the LM head `unembed` reads)
  P(correct) = sigmoid(logit_last + offset)

read at the last token of each packed sequence (segment). The head has no
bias, so it is exactly Hugging Face's `*ForSequenceClassification` `score`
layer (`score.weight` = w as a [1, D] matrix) and an export loads in
transformers as is (`kimi_jax/reward_models/store.py`). `offset` is a
calibration constant kept beside the params (0 after the binary loss; fitted
after the pairwise loss, whose scores are shift-invariant).

Losses over a packed `ValueBatch` (mask: the positions whose score counts):
  binary cross-entropy:  mean over scored positions of
      softplus(s) - y * s                    (= -log sigmoid(s) if y = 1,
                                                -log(1 - sigmoid(s)) if y = 0)
  Bradley-Terry (pairwise): mean over complete pairs (chosen c = correct,
      rejected r = incorrect response to the same prompt) of
      -log sigmoid(s_c - s_r) = softplus(s_r - s_c).
"""

from __future__ import annotations

from typing import Any

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sharding import Sharder, constrain
from kimi_jax.token_rows import TokenRows

LOSSES = ("bce", "bradley_terry")


@flax.struct.dataclass
class ValueBatch:
  """Packed reward-model rows.

  rows: tokens, positions and segment ids of packed inputs; mask_RxT is 1
    at each segment's last token (where its score is read), targets unused.
  label_RxT: 1.0 / 0.0 (correct / incorrect) at scored positions.
  pair_RxT: Bradley-Terry pair id (>= 1) at scored positions of paired
    examples, 0 elsewhere.
  """

  rows: TokenRows
  label_RxT: np.ndarray
  pair_RxT: np.ndarray


def init_params(model_params: Any, cfg: ModelConfig) -> dict[str, Any]:
  """A value model on a copy of `model_params` (a reward model never shares
  arrays with a policy whose train state is donated) with a zero head, so
  every score starts at P = 0.5. The head takes the final norm's sharding
  (both are (D,) vectors)."""
  shardings = jax.tree.map(lambda x: x.sharding, model_params)

  def build(p):
    return {"model": jax.tree.map(jnp.copy, p),
            "head": {"w_D": jnp.zeros((cfg.d_model,), cfg.param_jnp_dtype)}}

  out = {"model": shardings, "head": {"w_D": shardings["final_norm"]}}
  return jax.jit(build, out_shardings=out)(model_params)


def param_shardings(cfg: ModelConfig, sharder: Sharder) -> dict[str, Any]:
  return {"model": transformer.param_shardings(cfg, sharder),
          "head": {"w_D": sharder.param_sharding(
              "head.w_D", (cfg.d_model,), ("norm",))}}


def abstract_params(cfg: ModelConfig) -> dict[str, Any]:
  return {"model": transformer.abstract_params(cfg),
          "head": {"w_D": jax.ShapeDtypeStruct((cfg.d_model,),
                                               cfg.param_jnp_dtype)}}


def score_logits(params: dict[str, Any], tokens_RxT: jax.Array,
                 positions_RxT: jax.Array, segment_ids_RxT: jax.Array, *,
                 cfg: ModelConfig, sharder: Sharder | None = None
                 ) -> jax.Array:
  """The head's logit at every position, logits_RxT (float32)."""
  h, _ = transformer.hidden_states(params["model"], tokens_RxT,
                                   positions_RxT, segment_ids_RxT, cfg=cfg,
                                   sharder=sharder)
  logits = jnp.einsum("btd,d->bt", h, params["head"]["w_D"].astype(h.dtype),
                      preferred_element_type=jnp.float32)
  return constrain(sharder, logits, ("batch", "act_length"))


def bce_loss(params: dict[str, Any], batch: ValueBatch, *, cfg: ModelConfig,
             sharder: Sharder | None = None
             ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Binary cross-entropy of the scored positions (see the module doc)."""
  rows = batch.rows
  s_RxT = score_logits(params, rows.tokens_RxT, rows.positions_RxT,
                       rows.segment_ids_RxT, cfg=cfg, sharder=sharder)
  mask_RxT = rows.mask_RxT.astype(jnp.float32)
  y_RxT = batch.label_RxT.astype(jnp.float32)
  per_RxT = jax.nn.softplus(s_RxT) - y_RxT * s_RxT
  n = jnp.maximum(mask_RxT.sum(), 1.0)
  loss = (per_RxT * mask_RxT).sum() / n
  right = ((s_RxT > 0) == (y_RxT > 0.5)).astype(jnp.float32)
  return loss, {"accuracy": (right * mask_RxT).sum() / n,
                "scored": mask_RxT.sum()}


def bradley_terry_loss(params: dict[str, Any], batch: ValueBatch, *,
                       cfg: ModelConfig, sharder: Sharder | None = None
                       ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Pairwise loss over complete (chosen, rejected) pairs (module doc).

  Pair members may sit in different rows: scores are summed per pair id
  with signs (+ chosen, - rejected), which gives s_c - s_r.
  """
  rows = batch.rows
  s_RxT = score_logits(params, rows.tokens_RxT, rows.positions_RxT,
                       rows.segment_ids_RxT, cfg=cfg, sharder=sharder)
  scored = (rows.mask_RxT > 0) & (batch.pair_RxT > 0)
  sign = jnp.where(batch.label_RxT > 0.5, 1.0, -1.0)
  n_ids = batch.pair_RxT.size + 1
  pair_N = jnp.where(scored, batch.pair_RxT, 0).reshape(-1)
  margin_P = jax.ops.segment_sum(
      jnp.where(scored, sign * s_RxT, 0.0).reshape(-1), pair_N,
      num_segments=n_ids)
  chosen_P = jax.ops.segment_sum(
      jnp.where(scored & (batch.label_RxT > 0.5), 1.0, 0.0).reshape(-1),
      pair_N, num_segments=n_ids)
  members_P = jax.ops.segment_sum(scored.astype(jnp.float32).reshape(-1),
                                  pair_N, num_segments=n_ids)
  # Id 0 collects unpaired positions; a pair counts with both members.
  complete_P = ((members_P == 2.0) & (chosen_P == 1.0)).at[0].set(False)
  complete_P = complete_P.astype(jnp.float32)
  n = jnp.maximum(complete_P.sum(), 1.0)
  loss = (jax.nn.softplus(-margin_P) * complete_P).sum() / n
  ordered = ((margin_P > 0).astype(jnp.float32) * complete_P).sum() / n
  return loss, {"pair_accuracy": ordered, "pairs": complete_P.sum()}


def loss_fn(kind: str):
  if kind not in LOSSES:
    raise ValueError(f"value loss must be one of {LOSSES}, got {kind!r}")
  return bce_loss if kind == "bce" else bradley_terry_loss


def fit_offset(logits: np.ndarray, labels: np.ndarray, steps: int = 50
               ) -> float:
  """The constant c minimising the binary cross-entropy of sigmoid(s + c)
  against the labels (Newton's method on one variable): calibrates a
  pairwise-trained head, whose scores have no meaningful zero."""
  s = np.asarray(logits, np.float64)
  y = np.asarray(labels, np.float64)
  if not len(s) or y.min() == y.max():
    raise ValueError("fit_offset needs both correct and incorrect labels")
  c = 0.0
  for _ in range(steps):
    p = 1.0 / (1.0 + np.exp(-(s + c)))
    grad, hess = (p - y).sum(), max((p * (1 - p)).sum(), 1e-12)
    c -= grad / hess
    if abs(grad) < 1e-9:
      break
  return float(c)
