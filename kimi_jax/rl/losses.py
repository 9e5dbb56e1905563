"""Policy losses of Kimi k1.5: online policy mirror descent and ReST.

Layout: P prompts, K sampled responses per prompt (one group per prompt), T
response token slots. `token_logp_PxKxT[p, j, t]` is log pi_theta of the t-th
token slot of response j of prompt p, computed by the caller from the logits
of the current parameters; `mask_PxKxT` is 1 on the tokens that enter the
loss (response tokens of the current policy, see `docs/rl.md`) and 0 on
padding, prompt tokens and excluded segments. All functions are pure and
jittable; `kind` / `baseline` strings are static.

The sequence log-probability used throughout is

  log pi(y_j | x) = sum_t mask[j, t] * token_logp[j, t].

The losses proper (`mirror_descent_seq_loss`, `rest_seq_loss`) take these
P x K sums, so the trainer can compute them from packed rows
(`packed_sequence_logp`, `kimi_jax/rl/batching.py`); `mirror_descent_loss`
and `rest_loss` are the same losses on the P x K x T layout.

The sampler and the trainer compute log-probs of the same tokens under the
same weights with different programs (decode with a KV cache, maybe another
compute dtype, vs a packed forward pass), so the two differ:
`logprob_gap_sums` measures that gap, and `tis_weights` gives the truncated
importance weights that can correct the policy-gradient term for it
(`mirror_descent_loss(..., tis_weight_PxKxT=...)`, or the weighted sums as
`mirror_descent_seq_loss(..., pg_seq_logp_PxK=...)`).
"""

from __future__ import annotations

from typing import Literal

import jax
import jax.numpy as jnp

BaselineKind = Literal["mean", "soft"]
_BASELINES = ("mean", "soft")


def sequence_logp(token_logp_PxKxT: jax.Array, mask_PxKxT: jax.Array
                  ) -> jax.Array:
  """log pi(y|x) = sum_t mask_t * logp_t, in float32; returns PxK.

  Masked slots are selected away (not multiplied by 0), so a -inf log-prob on
  a padded slot cannot turn the sum into NaN.
  """
  logp = jnp.where(mask_PxKxT.astype(bool),
                   token_logp_PxKxT.astype(jnp.float32), 0.0)
  return jnp.sum(logp, axis=-1)


def baseline(reward_PxK: jax.Array, *, tau: float,
             kind: BaselineKind = "mean") -> jax.Array:
  """Per-prompt baseline r_bar of eq. 3; returns P (float32).

  mean: r_bar = (1/K) sum_j r_j.
  soft: r_bar = tau * log((1/K) sum_j exp(r_j / tau))
              = tau * (logsumexp_j(r_j / tau) - log K),
        the sample estimate of tau * log Z; computed with logsumexp so large
        r / tau does not overflow. It lies between the mean and the max of
        the rewards and tends to the mean as tau -> inf.
  """
  if kind not in _BASELINES:
    raise ValueError(f"baseline kind must be one of {_BASELINES}, got "
                     f"{kind!r}")
  r = reward_PxK.astype(jnp.float32)
  if kind == "mean":
    return jnp.mean(r, axis=-1)
  k = r.shape[-1]
  return tau * (jax.nn.logsumexp(r / tau, axis=-1) - jnp.log(jnp.float32(k)))


def packed_sums(x_RxT: jax.Array, seq_RxT: jax.Array, n_seq: int
                ) -> jax.Array:
  """Per-sequence sums of a packed R x T array; returns n_seq (float32).

  seq_RxT holds each token's sequence index in [0, n_seq); n_seq marks
  padding, whose sum is dropped.
  """
  return jax.ops.segment_sum(x_RxT.astype(jnp.float32).reshape(-1),
                             seq_RxT.reshape(-1),
                             num_segments=n_seq + 1)[:n_seq]


def packed_sequence_logp(token_logp_RxT: jax.Array, mask_RxT: jax.Array,
                         seq_RxT: jax.Array, P: int, K: int) -> jax.Array:
  """log pi(y|x) = sum of masked token log-probs per response; P x K.

  The packed counterpart of `sequence_logp` (same masking by selection).
  """
  logp = jnp.where(mask_RxT.astype(bool),
                   token_logp_RxT.astype(jnp.float32), 0.0)
  return packed_sums(logp, seq_RxT, P * K).reshape(P, K)


def mirror_descent_loss(token_logp_PxKxT: jax.Array,
                        ref_seq_logp_PxK: jax.Array,
                        mask_PxKxT: jax.Array,
                        reward_PxK: jax.Array,
                        *,
                        tau: float,
                        baseline_kind: BaselineKind = "mean",
                        valid_P: jax.Array | None = None,
                        tis_weight_PxKxT: jax.Array | None = None,
                        ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`mirror_descent_seq_loss` on P x K x T token log-probs; adds the
  n_tokens metric (mask tokens of valid prompts). tis_weight_PxKxT: the
  policy-gradient term's token weights (`tis_weights`); None: none."""
  seq_logp_PxK = sequence_logp(token_logp_PxKxT, mask_PxKxT)
  pg_seq_logp_PxK = None if tis_weight_PxKxT is None else sequence_logp(
      jax.lax.stop_gradient(tis_weight_PxKxT) * token_logp_PxKxT,
      mask_PxKxT)
  loss, metrics = mirror_descent_seq_loss(
      seq_logp_PxK, ref_seq_logp_PxK, reward_PxK, tau=tau,
      baseline_kind=baseline_kind, valid_P=valid_P,
      pg_seq_logp_PxK=pg_seq_logp_PxK)
  valid = (jnp.ones(reward_PxK.shape[:1], bool) if valid_P is None
           else valid_P.astype(bool))
  metrics["n_tokens"] = jnp.sum(jnp.where(
      valid[:, None, None], mask_PxKxT.astype(jnp.float32), 0.0))
  return loss, metrics


def mirror_descent_seq_loss(seq_logp_PxK: jax.Array,
                            ref_seq_logp_PxK: jax.Array,
                            reward_PxK: jax.Array,
                            *,
                            tau: float,
                            baseline_kind: BaselineKind = "mean",
                            valid_P: jax.Array | None = None,
                            pg_seq_logp_PxK: jax.Array | None = None,
                            ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """Surrogate loss whose negative gradient is eq. 3 of the report.

  For prompt p with responses y_1..y_K sampled from the reference pi_theta_i,
  with s_j = log pi_theta(y_j|x) (masked sum, differentiable) and
  ref_j = log pi_theta_i(y_j|x) (a constant, same mask):

    A_j  = r_j - r_bar                      (r_bar from `baseline`)
    L_p  = -(1/K) sum_j [ s_j * A_j - (tau/2) * (s_j - ref_j)^2 ]
    loss = (1/P') sum_{p valid} L_p         (P' = number of valid prompts)

  so -grad(loss) = (1/P') sum_p (1/K) sum_j [ grad s_j * A_j
                     - (tau/2) grad (s_j - ref_j)^2 ],   exactly eq. 3.

  The advantage carries no gradient (rewards do not depend on theta). At
  theta = theta_i the penalty's gradient is zero; it grows as the minibatch
  updates within an iteration move theta away from the reference.

  Truncated importance sampling (pg_seq_logp_PxK given): eq. 3 assumes
  y_j ~ pi_theta_i, but the tokens were drawn by the sampler, whose
  log-probs q_t of them differ from the trainer's log pi_theta_i (numerics,
  or an older policy for earlier segments of a partial rollout). The
  policy-gradient term then reads s~_j = sum_t mask_t w_t log pi_theta(y_t)
  with w_t = stop_grad(min(pi_theta_i(y_t) / q_t, cap)) (`tis_weights`):

    L_p = -(1/K) sum_j [ s~_j * A_j - (tau/2) * (s_j - ref_j)^2 ]

  Token-level, in the policy-gradient term only: the exact correction of
  a sequence sampled from q is the sequence ratio prod_t w_t, whose
  variance grows with the response's length, so each token's score
  function is reweighted by its own ratio instead (truncated at `cap`, as in
  off-policy actor-critic methods). The penalty stays unweighted: it is a
  trust region on the drawn responses, not an expectation to debias, its
  gradient is 0 at theta_i whatever the weights, and weighting it would
  move its minimum away from s_j = ref_j. pg_term reports the weighted
  term.

  Args:
    seq_logp_PxK: s = log pi_theta(y|x), from `sequence_logp` (P x K x T
      layout) or `packed_sequence_logp` (packed rows).
    ref_seq_logp_PxK: log pi_theta_i(y|x) over the same mask, precomputed.
    reward_PxK: total reward per response (task reward plus any weighted
      length reward / penalties).
    tau: regularisation strength, > 0 (a Python float).
    baseline_kind: "mean" (default) or "soft" (tau log-mean-exp).
    valid_P: optional 0/1 per prompt; padding prompts (0) are excluded from
      the loss, its gradient and the metrics. None means all are valid.
    pg_seq_logp_PxK: the policy-gradient term's s~_j (the importance-weighted
      masked sum, see above); None: s_j, eq. 3 as it stands.

  Returns:
    (loss scalar, metrics), metrics averaged over valid responses:
    reward_mean, baseline_mean, advantage_mean, advantage_abs_mean,
    seq_logp_mean, log_ratio_mean, log_ratio_sq_mean, pg_term (the s*A part
    of the loss), penalty_term (the tau part).
  """
  if not tau > 0:
    raise ValueError(f"tau must be > 0, got {tau}")
  P = reward_PxK.shape[0]
  valid = (jnp.ones((P,), bool) if valid_P is None
           else valid_P.astype(bool))
  n_valid = jnp.maximum(jnp.sum(valid.astype(jnp.float32)), 1.0)

  def mean_valid(x_PxK: jax.Array) -> jax.Array:
    # where (not multiply) so non-finite padding cannot leak into the mean.
    return jnp.sum(jnp.where(valid, jnp.mean(x_PxK, axis=-1), 0.0)) / n_valid

  seq_logp_PxK = seq_logp_PxK.astype(jnp.float32)
  # Zeroing padded rewards keeps their advantage finite: a NaN there would
  # reach the gradient as 0 * NaN even though the loss selects it away.
  reward = jnp.where(valid[:, None], reward_PxK.astype(jnp.float32), 0.0)
  r_bar_P = baseline(reward, tau=tau, kind=baseline_kind)
  adv_PxK = jax.lax.stop_gradient(reward - r_bar_P[:, None])
  log_ratio_PxK = seq_logp_PxK - jax.lax.stop_gradient(
      ref_seq_logp_PxK.astype(jnp.float32))
  pg_logp_PxK = (seq_logp_PxK if pg_seq_logp_PxK is None
                 else pg_seq_logp_PxK.astype(jnp.float32))
  pg_term = -mean_valid(pg_logp_PxK * adv_PxK)
  penalty_term = 0.5 * tau * mean_valid(log_ratio_PxK ** 2)
  loss = pg_term + penalty_term
  metrics = {
      "reward_mean": mean_valid(reward),
      "baseline_mean": mean_valid(r_bar_P[:, None]),
      "advantage_mean": mean_valid(adv_PxK),
      "advantage_abs_mean": mean_valid(jnp.abs(adv_PxK)),
      "seq_logp_mean": mean_valid(seq_logp_PxK),
      "log_ratio_mean": mean_valid(log_ratio_PxK),
      "log_ratio_sq_mean": mean_valid(log_ratio_PxK ** 2),
      "pg_term": pg_term,
      "penalty_term": penalty_term,
  }
  return loss, metrics


def tis_weights(ref_logp: jax.Array, sampler_logp: jax.Array,
                mask: jax.Array, *, cap: float) -> jax.Array:
  """Truncated importance weights of the sampled tokens (any layout).

    w_t = min(exp(ref_logp_t - sampler_logp_t), cap)   on mask tokens
    w_t = 1                                           elsewhere

  ref_logp: the trainer's log pi_theta_i of each token; sampler_logp: the
  sampler's log-prob of the same token. Stop-gradient, float32. Masked-out
  slots are selected away before the exp, so padding cannot overflow.
  """
  if not cap > 0:
    raise ValueError(f"cap must be > 0, got {cap}")
  on = mask.astype(bool)
  log_ratio = jnp.where(on, ref_logp.astype(jnp.float32)
                        - sampler_logp.astype(jnp.float32), 0.0)
  w = jnp.where(on, jnp.minimum(jnp.exp(log_ratio), jnp.float32(cap)), 1.0)
  return jax.lax.stop_gradient(w)


def tis_stats(weight: jax.Array, mask: jax.Array, *, cap: float
              ) -> dict[str, jax.Array]:
  """Mean weight and the fraction of tokens the cap truncates, over mask
  tokens (0 without any)."""
  on = mask.astype(bool)
  n = jnp.maximum(jnp.sum(on.astype(jnp.float32)), 1.0)
  return {
      "tis_weight_mean": jnp.sum(jnp.where(on, weight, 0.0)) / n,
      "tis_clipped_frac": jnp.sum(
          (on & (weight >= jnp.float32(cap))).astype(jnp.float32)) / n,
  }


def logprob_gap_sums(trainer_logp: jax.Array, sampler_logp: jax.Array,
                     mask: jax.Array) -> dict[str, jax.Array]:
  """Sums over mask tokens of the sampler-trainer gap (any layout).

  With r_t = trainer_logp_t - sampler_logp_t (the same token, the same
  weights, two programs):

    gap_abs_sum = sum_t |r_t|
    gap_kl_sum  = sum_t (exp(r_t) - 1 - r_t)      (k3, each term >= 0)
    gap_tokens  = number of mask tokens

  Divided by gap_tokens these are `logprob_gap_abs` and `logprob_gap_kl`:
  with tokens drawn from the sampler's distribution q, the k3 term's mean
  is an unbiased, nonnegative estimate of KL(q || pi_trainer) per token
  (exact as such when sampling used temperature 1 and no truncation; the
  sampler records untempered log-probs). Sums, not means, so minibatches
  combine exactly. float32; masked slots are selected away.
  """
  on = mask.astype(bool)
  r = jnp.where(on, trainer_logp.astype(jnp.float32)
                - sampler_logp.astype(jnp.float32), 0.0)
  return {
      "gap_abs_sum": jnp.sum(jnp.abs(r)),
      # expm1(r) - r: exp(r) - 1 - r without cancellation at small r.
      "gap_kl_sum": jnp.sum(jnp.where(on, jnp.expm1(r) - r, 0.0)),
      "gap_tokens": jnp.sum(on.astype(jnp.float32)),
  }


def rest_loss(token_logp_PxKxT: jax.Array, mask_PxKxT: jax.Array,
              correct_PxK: jax.Array
              ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """`rest_seq_loss` on P x K x T token log-probs."""
  return rest_seq_loss(sequence_logp(token_logp_PxKxT, mask_PxKxT),
                       jnp.sum(mask_PxKxT.astype(jnp.float32), axis=-1),
                       correct_PxK)


def rest_seq_loss(seq_logp_PxK: jax.Array, n_tokens_PxK: jax.Array,
                  correct_PxK: jax.Array
                  ) -> tuple[jax.Array, dict[str, jax.Array]]:
  """ReST: supervised fit of the correct responses only.

    loss = -sum_{j correct} log pi(y_j|x) / max(sum_{j correct} |y_j|, 1)

  i.e. the mean negative log-likelihood per loss token of correct
  responses (|y_j| counts the tokens in the mask). Incorrect responses get no
  (negative) gradient at all; with no correct response in the batch the loss
  and its gradient are exactly zero.

  Returns (loss scalar, metrics) with metrics: n_correct, n_tokens, nll.
  """
  correct = correct_PxK.astype(bool)
  logp = jnp.where(correct, seq_logp_PxK.astype(jnp.float32), 0.0)
  n_tokens = jnp.sum(jnp.where(correct, n_tokens_PxK.astype(jnp.float32),
                               0.0))
  loss = -jnp.sum(logp) / jnp.maximum(n_tokens, 1.0)
  metrics = {
      "n_correct": jnp.sum(correct.astype(jnp.float32)),
      "n_tokens": n_tokens,
      "nll": loss,
  }
  return loss, metrics
