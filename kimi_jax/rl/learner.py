"""The trainer side of an RL iteration: reference log-probs and updates.

`Learner.train(state, minibatches) -> (state, stats)` does what the report's
iteration asks of the trainer (2.3.2): reset the optimizer (no state carries
over from the previous iteration's reference policy), compute the reference
log pi_theta_i(y|x) of every response under the parameters the iteration
starts from, then take `rl.epochs` passes of gradient steps over the
minibatches. The first step of an iteration runs at theta_i, so its own
forward pass gives the first minibatch's reference log-probs (recomputed,
exactly: the same model at the same parameters) and no separate reference
pass runs for it; the other minibatches' references are computed before
that step changes the parameters. It owns the RL optimizer, the train state's shardings and one
jitted train step per minibatch shape (shapes are bucketed, so the cache
stays small).

The sampler-trainer gap (`logprob_gap_abs`, `logprob_gap_kl`) compares
the sampler's log-probs of the tokens it sampled in this iteration with the
trainer's log pi_theta_i of the same tokens: the iteration's reference
policy is the sampling policy (the loop hands the trainer's parameters to
the sampler before the rollout), so both are the same weights and the gap
is numerics alone. Tokens of earlier segments of a partial rollout were
sampled under older weights and are left out of it. It is read where the
trainer computes log pi_theta_i anyway: the reference pass, and the first
step, which runs at theta_i (with rl.reference_logprobs='sampler' no
reference pass runs, so only the first minibatch is measured). With
rl.tis_cap the reference pass also keeps every token's log pi_theta_i (the
importance weights' numerator), so it runs for the first minibatch too
instead of that step computing its own.

Nothing waits on the device just to log: a step's metrics are read back
after the next step has been dispatched, and the NaN guard (the step itself
refuses a non-finite update) is checked as they arrive.
"""

from __future__ import annotations

import functools
import time
from typing import Any, Callable, Sequence

import jax
import numpy as np

from kimi_jax import train_step as ts
from kimi_jax.model import moe, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import batching, trainer
from kimi_jax.rl.batching import Minibatch
from kimi_jax.rl.config import RLConfig
from kimi_jax.sharding import (Sharder, abstract_arrays, batch_shardings,
                               place_batch)
from kimi_jax.token_rows import image_slots

_MEAN_KEYS = ("loss", "grad_norm", "update_norm", "param_norm")
_GAP_KEYS = ("gap_abs_sum", "gap_kl_sum", "gap_tokens")


def _shape_key(mb: Minibatch) -> tuple:
  return tuple(np.shape(x) for x in jax.tree_util.tree_leaves(mb))


class Learner:
  """Optimizer, shardings and jitted functions of the RL stage."""

  def __init__(self, model: ModelConfig, rl: RLConfig, sharder: Sharder, *,
               cache_len: int, compiler_options: dict[str, str] | None = None):
    if rl.routing_replay and not model.n_experts:
      raise ValueError("config.rl.routing_replay is set but the model is "
                       "dense (config.model.n_experts is 0): there are no "
                       "experts to replay")
    # None: the backend's train-step options (kimi_jax.infra.compile_options).
    self.compiler_options = compiler_options
    self.model = model
    self.rl = rl
    self.sharder = sharder
    self.optimizer = ts.make_optimizer(rl.optimizer())
    self.shardings = ts.state_shardings(self.optimizer, model, sharder)
    self._reset = ts.make_reset_optimizer(self.optimizer, self.shardings)
    # log pi(y|x) alone, for callers that need only the sums.
    self._seq_logp = jax.jit(functools.partial(trainer.seq_logp, cfg=model,
                                               sharder=sharder))
    self._reference = jax.jit(functools.partial(
        trainer.reference, cfg=model, sharder=sharder, token_level=rl.tis))
    self._steps: dict[tuple, Callable] = {}
    # The step's self_reference flags (see trainer.policy_loss), placed on
    # first use (a compile-only mesh, as for AOT, holds no arrays).
    self._self_ref: dict[bool, jax.Array] = {}
    self._counters: list[ts.TraceCounter] = []
    # The shapes minibatches are packed to: lengths from the config (or the
    # sampler's cache), packed row counts dividing over the batch shards.
    self.len_buckets = tuple(rl.train_len_buckets or (cache_len,))
    self.row_buckets = batching.row_buckets(
        rl.minibatch_prompts * rl.samples_per_prompt,
        sharder.axis_size(sharder.rule_map["batch"]))

  def init_state(self, params, opt_state=None) -> ts.TrainState:
    """A train state on `params`; `opt_state` resumes the optimizer."""
    state = ts.create_state(params, self.optimizer, self.shardings)
    return state if opt_state is None else state.replace(opt_state=opt_state)

  def compile_count(self) -> int:
    """Train-step compilations so far (one per minibatch shape)."""
    return sum(c.count for c in self._counters)

  def _step_fn(self, mb: Minibatch) -> Callable:
    key = _shape_key(mb)
    if key not in self._steps:
      policy_loss = functools.partial(trainer.policy_loss, cfg=self.model,
                                      rl=self.rl, sharder=self.sharder)

      def loss_fn(params, batch):
        mb, self_reference = batch
        return policy_loss(params, mb, self_reference=self_reference)

      fn, counter = ts.jit_train_step(
          loss_fn, self.optimizer, self.shardings,
          (batch_shardings(self.sharder, mb), self.sharder.replicated()),
          compiler_options=self.compiler_options,
          matmul_dtype=self.model.matmul_jnp_dtype)
      self._steps[key] = fn
      self._counters.append(counter)
    return self._steps[key]

  def aot_functions(self) -> dict[str, tuple[Callable, tuple]]:
    """The learner's jitted functions at the config's shapes, with abstract
    sharded arguments, for ahead-of-time compilation (e.g. for a TPU
    topology, `kimi_jax.infra.aot`): the train step for every length bucket on a
    minibatch of the experiment's own rows (the largest row bucket), and the
    reference log-probs at the largest bucket."""
    model, rl = self.model, self.rl
    params = transformer.abstract_params(model)
    state = abstract_arrays(ts.TrainState(
        step=jax.ShapeDtypeStruct((), np.int32), params=params,
        opt_state=jax.eval_shape(self.optimizer.init, params)),
                            self.shardings)
    P, K, R = rl.minibatch_prompts, rl.samples_per_prompt, self.row_buckets[-1]

    def minibatch(T: int) -> Minibatch:
      like = batching.abstract_minibatch(
          P, K, R, T, image_slots(model.vision),
          moe.replay_record(model) if rl.routing_replay else None)
      return abstract_arrays(like, batch_shardings(self.sharder, like))

    out = {}
    # The largest bucket first: the likeliest to exceed memory.
    for T in sorted(self.len_buckets, reverse=True):
      mb = minibatch(T)
      flag = jax.ShapeDtypeStruct((), np.bool_,
                                  sharding=self.sharder.replicated())
      out[f"rl_train_step_T{T}"] = (self._step_fn(mb), (state, (mb, flag)))
    T = self.len_buckets[-1]
    out[f"reference_logprobs_T{T}"] = (self._reference,
                                       (state.params, minibatch(T)))
    return out

  def reference(self, params, placed: Sequence[Minibatch], *,
                skip_first: bool = False
                ) -> tuple[list[Minibatch], list[dict[str, Any] | None]]:
    """Each minibatch with ref_seq_logp_PxK = log pi_theta_i(y|x) under
    `params` (recomputed, or the sampler's sums: rl.reference_logprobs)
    and, with rl.tis_cap, ref_logp_RxT; and what each recomputation
    measured, replicated for every host to read: seq_logp_PxK and the
    sampler-trainer gap sums (`trainer.gap_sums`); None when the sampler's
    are used. skip_first: the first minibatch is left as it is (its first
    step computes its reference itself)."""
    out, measured = [], []
    for i, mb in enumerate(placed):
      sampler = self.rl.reference_logprobs == "sampler"
      if sampler:
        mb = mb.replace(ref_seq_logp_PxK=mb.sampler_seq_logp_PxK)
      if sampler or (skip_first and i == 0):
        out.append(mb)
        measured.append(None)
        continue
      got = self._reference(params, mb)
      mb = mb.replace(ref_seq_logp_PxK=jax.device_put(
          got["seq_logp_PxK"], mb.ref_seq_logp_PxK.sharding))
      if "logp_RxT" in got:
        mb = mb.replace(ref_logp_RxT=jax.device_put(
            got.pop("logp_RxT"), mb.ref_logp_RxT.sharding))
      out.append(mb)
      measured.append(got)
    return out, measured

  def train(self, state: ts.TrainState, minibatches: Sequence[Minibatch]
            ) -> tuple[ts.TrainState, dict[str, float]]:
    """Optimizer reset, reference log-probs, `rl.epochs` passes of steps.

    `minibatches` are host (numpy) minibatches with rewards attached.
    Raises `NonFiniteError` (after the fact: that update was not applied)
    when a step's loss or gradient norm is not finite.
    """
    if not minibatches:
      raise ValueError("Learner.train needs at least one minibatch")
    t0 = time.perf_counter()
    if self.rl.reset_optimizer:
      state = state.replace(opt_state=self._reset(state.params))
    placed = [place_batch(self.sharder, mb) for mb in minibatches]
    # The reference pi_theta_i: the policy before this iteration's updates.
    # Recomputed, the first minibatch's comes out of its own first step.
    # Truncated importance sampling needs every token's reference, which
    # the step does not return: the reference pass covers all minibatches.
    fused = self.rl.reference_logprobs == "recompute" and not self.rl.tis
    placed, measured = self.reference(state.params, placed,
                                      skip_first=fused)
    jax.block_until_ready([mb.ref_seq_logp_PxK for mb in placed])
    t1 = time.perf_counter()
    history: list[dict[str, Any]] = []
    pending = None
    for epoch in range(self.rl.epochs):
      for i, mb in enumerate(placed):
        first = fused and epoch == 0 and i == 0
        state, metrics = self._step_fn(mb)(
            state, (mb, self._self_reference(first)))
        own_PxK = metrics.pop("seq_logp_PxK")
        if first:
          placed[0] = mb.replace(ref_seq_logp_PxK=jax.device_put(
              own_PxK, mb.ref_seq_logp_PxK.sharding))
          measured[0] = {"seq_logp_PxK": own_PxK}
        if pending is not None:
          history.append(self._checked(jax.device_get(pending)))
        pending = metrics
    history.append(self._checked(jax.device_get(pending)))
    t2 = time.perf_counter()
    n_tokens = sum(float(mb.rows.mask_RxT.sum()) for mb in minibatches)
    row_tokens = sum(mb.rows.tokens_RxT.size for mb in minibatches)
    real_tokens = sum(int((mb.rows.segment_ids_RxT > 0).sum())
                      for mb in minibatches)
    stats = {k: float(np.mean([h[k] for h in history])) for k in _MEAN_KEYS}
    measured = jax.device_get(measured)
    if "gap_tokens" not in (measured[0] or {}):
      # No reference pass measured the first minibatch (fused, or the
      # sampler's reference); its first step ran at theta_i, so its gap
      # stands in.
      measured[0] = dict(measured[0] or {},
                         **{k: history[0][k] for k in _GAP_KEYS})
    stats.update(_gap_stats(measured))
    if self.rl.tis:
      for k in ("tis_weight_mean", "tis_clipped_frac"):
        stats[k] = float(np.mean([h[k] for h in history]))
    if "log_ratio_sq_mean" in history[0]:
      # How far the steps moved from the iteration's reference: eq. 3's
      # penalty is tau/2 times this. The first step reads 0 by definition.
      stats["log_ratio_sq"] = float(np.mean(
          [h["log_ratio_sq_mean"] for h in history[1:] or history]))
    stats.update(
        minibatches=len(minibatches), loss_tokens=n_tokens,
        reference_s=t1 - t0, update_s=t2 - t1,
        train_s=t2 - t0,
        train_tokens_per_s=n_tokens * self.rl.epochs / max(t2 - t1, 1e-9),
        logp_mismatch=_mismatch(minibatches, [
            (m or {}).get("seq_logp_PxK") for m in measured]),
        train_len_max=max(mb.rows.shape[1] for mb in minibatches),
        # Sequence tokens (prompts and responses) / tokens the train steps
        # ran: what packing and the length buckets leave as padding.
        train_row_fill=real_tokens / max(row_tokens, 1))
    return state, stats

  def _self_reference(self, flag: bool) -> jax.Array:
    if flag not in self._self_ref:
      self._self_ref[flag] = jax.device_put(np.bool_(flag),
                                            self.sharder.replicated())
    return self._self_ref[flag]

  @staticmethod
  def _checked(metrics: dict[str, Any]) -> dict[str, Any]:
    if not metrics["finite"]:
      raise ts.NonFiniteError(
          f"RL train step: loss={metrics['loss']} grad_norm="
          f"{metrics['grad_norm']} is not finite; the update was not applied "
          "and the last good checkpoint is kept")
    return metrics


def _gap_stats(sums: Sequence[dict[str, Any] | None]) -> dict[str, float]:
  """logprob_gap_abs / logprob_gap_kl: the mean |trainer - sampler| and
  k3 KL(sampler || trainer) per token sampled in this iteration, over the
  minibatches measured (None: not measured); logprob_gap_tokens: how many
  tokens that is. NaN without any token."""
  sums = [s for s in sums if s is not None]
  n = float(sum(s["gap_tokens"] for s in sums))
  mean = lambda k: (float(sum(s[k] for s in sums)) / n if n
                    else float("nan"))
  return {"logprob_gap_abs": mean("gap_abs_sum"),
          "logprob_gap_kl": mean("gap_kl_sum"),
          "logprob_gap_tokens": n}


def _mismatch(host: Sequence[Minibatch], refs: Sequence[Any]) -> float:
  """Mean |reference - sampler| sequence log-prob over real prompts: how far
  the sampler's numerics are from the trainer's (0 when reusing them)."""
  diffs = [np.abs(np.asarray(ref) - mb.sampler_seq_logp_PxK)[
      mb.valid_P > 0].ravel() for ref, mb in zip(refs, host)
           if ref is not None]
  diffs = np.concatenate(diffs) if diffs else np.zeros((0,))
  return float(diffs.mean()) if diffs.size else 0.0
