"""The RL section of an experiment config, typed and validated at start."""

from __future__ import annotations

import dataclasses

from kimi_jax.train_step import AdamWConfig

# "rest": the report's ReST baseline (section 3.5), fitting the best
# response per prompt; "rest_all_verified" fits every verified response.
_LOSSES = ("mirror_descent", "rest", "rest_all_verified")
REST_LOSSES = ("rest", "rest_all_verified")
_BASELINES = ("mean", "soft")


@dataclasses.dataclass(frozen=True, kw_only=True)
class RLConfig(AdamWConfig):
  """Every field mirrors `config.rl.<field>`; errors name that key.

  The optimizer's settings are AdamWConfig's. warmup_steps (ours) ramps
  the learning rate up from 0; the reset starts the ramp over every
  iteration. Without it, a fresh Adam's first steps move every weight by
  the full learning rate.
  """

  iterations: int
  prompts_per_iteration: int
  samples_per_prompt: int
  loss: str = "mirror_descent"
  tau: float = 1.0
  baseline: str = "mean"
  learning_rate: float = 1e-6
  minibatch_prompts: int = 8
  epochs: int = 1
  reset_optimizer: bool = True
  max_response_len: int = 1024
  token_budget: int = 1024
  max_wait_iterations: int = 4
  # A queue for partial rollouts (report 2.6.2: while some slots work on long
  # trajectories, others take new, shorter tasks). With queued_prompts > 0
  # the loop opens that many groups beyond prompts_per_iteration and the
  # rollout phase is one window of token_budget tokens per slot: a slot that
  # frees up mid-window starts a queued response, which gets what is left of
  # the window, as long as at least queued_min_tokens are left. Responses
  # not started wait, unstarted, for the next iteration. 0: no queue, every
  # request runs its whole budget.
  queued_prompts: int = 0
  queued_min_tokens: int = 1
  # Keep each budget-cut response's KV cache in its sampler slot across the
  # weight update and continue it there next iteration, instead of
  # prefilling its prompt and earlier segments again. Its keys and values
  # stay those of the earlier weights, so the sampled log-probs of the
  # continued tokens move away from the trainer's (see docs/rl.md). Off:
  # every continued response is prefilled under the current weights.
  keep_partial_kv: bool = False
  train_on_old_segments: bool = False
  # log pi_theta_i(y|x) for the penalty: "recompute" runs a forward pass
  # before the updates; "sampler" sums the sampler's log-probs of the same
  # tokens (equal to within ~1e-5, see tests) and saves that pass.
  reference_logprobs: str = "recompute"
  # Truncated importance sampling of the policy-gradient term: each loss
  # token's weight is min(pi_theta_i / sampler prob, tis_cap), correcting
  # for the gap between the sampler's and the trainer's log-probs
  # (losses.mirror_descent_seq_loss). None or 0: off.
  tis_cap: float | None = None
  length_reward_weight: float = 0.0
  length_reward_warmup: int = 0
  repeat_penalty: float = -1.0
  train_len_buckets: tuple[int, ...] = ()
  # Pack each minibatch's sequences into rows (first fit, longest first) so
  # short responses fill the room beside long ones; False: one per row.
  pack_sequences: bool = True
  eval_every: int = 10
  eval_samples: int = 4
  # Standard benchmarks ("NAME=FILE", docs/evaluation.md) sampled at every
  # held-out evaluation; their pass@1 is logged as stage "benchmarks".
  eval_benchmarks: tuple[str, ...] = ()
  # Routing replay (an MoE policy only): the sampler records the experts
  # every token went to, and the reference pass and the train step route
  # each token to those experts instead of choosing again, so the trained
  # log-prob is that of the sampled computation (docs/rl.md).
  routing_replay: bool = False

  def __post_init__(self):
    def bad(key, msg):
      raise ValueError(f"config.rl.{key}: {msg}")

    if self.iterations < 0:
      bad("iterations", f"must be >= 0 (0: supervised warm start only), got "
          f"{self.iterations}")
    for key in ("prompts_per_iteration", "samples_per_prompt",
                "minibatch_prompts", "epochs", "max_response_len",
                "token_budget", "eval_samples"):
      if getattr(self, key) <= 0:
        bad(key, f"must be positive, got {getattr(self, key)}")
    if self.loss not in _LOSSES:
      bad("loss", f"must be one of {_LOSSES}, got {self.loss!r}")
    if self.baseline not in _BASELINES:
      bad("baseline", f"must be one of {_BASELINES}, got {self.baseline!r}")
    if not self.tau > 0:
      bad("tau", f"must be > 0, got {self.tau}")
    if self.loss == "mirror_descent" and self.samples_per_prompt < 2:
      bad("samples_per_prompt", "must be >= 2: the mean-reward baseline of a "
          "single response equals its reward, so every advantage would be 0")
    if self.token_budget > self.max_response_len:
      bad("token_budget", f"({self.token_budget}) is larger than "
          f"rl.max_response_len ({self.max_response_len})")
    if self.minibatch_prompts > self.prompts_per_iteration:
      bad("minibatch_prompts", f"({self.minibatch_prompts}) is larger than "
          f"rl.prompts_per_iteration ({self.prompts_per_iteration})")
    if self.reference_logprobs not in ("recompute", "sampler"):
      bad("reference_logprobs", f"must be 'recompute' or 'sampler', got "
          f"{self.reference_logprobs!r}")
    if self.reference_logprobs == "sampler" and self.train_on_old_segments:
      bad("reference_logprobs", "'sampler' needs train_on_old_segments="
          "False: tokens of earlier segments were sampled by older policies, "
          "so their sampler log-probs are not log pi_theta_i")
    if not isinstance(self.keep_partial_kv, bool):
      bad("keep_partial_kv", f"must be true or false, got "
          f"{self.keep_partial_kv!r}")
    if self.keep_partial_kv and self.reference_logprobs != "recompute":
      bad("keep_partial_kv", "needs rl.reference_logprobs='recompute': a "
          "continued segment's sampler log-probs read keys and values of "
          "the earlier weights, so they are not log pi_theta_i")
    if self.keep_partial_kv and self.routing_replay:
      bad("keep_partial_kv", "does not combine with rl.routing_replay: a "
          "kept slot has no prefill to record its context's experts")
    if self.tis_cap is not None:
      if (isinstance(self.tis_cap, bool)
          or not isinstance(self.tis_cap, (int, float))):
        bad("tis_cap", f"must be a number or None, got {self.tis_cap!r}")
      if not self.tis_cap >= 0:
        bad("tis_cap", f"must be >= 0 (None or 0: off), got {self.tis_cap}")
      if self.tis_cap and self.loss != "mirror_descent":
        bad("tis_cap", f"weights the mirror-descent loss; rl.loss is "
            f"{self.loss!r}")
      if self.tis_cap and self.reference_logprobs != "recompute":
        bad("tis_cap", "needs rl.reference_logprobs='recompute': the "
            "weights compare the trainer's log-probs with the sampler's, "
            "and 'sampler' takes the one for the other")
    if self.max_wait_iterations < 0:
      bad("max_wait_iterations", "must be >= 0")
    if self.queued_prompts < 0:
      bad("queued_prompts", f"must be >= 0, got {self.queued_prompts}")
    if not 1 <= self.queued_min_tokens <= self.token_budget:
      bad("queued_min_tokens", f"must be in [1, rl.token_budget="
          f"{self.token_budget}], got {self.queued_min_tokens}")
    if self.warmup_steps < 0:
      bad("warmup_steps", f"must be >= 0, got {self.warmup_steps}")
    if self.length_reward_warmup < 0 or self.length_reward_weight < 0:
      bad("length_reward_weight", "weight and warmup must be >= 0")
    if list(self.train_len_buckets) != sorted(set(self.train_len_buckets)):
      bad("train_len_buckets", "must be strictly increasing")
    if self.eval_every < 0:
      bad("eval_every", "must be >= 0 (0 disables periodic evaluation)")
    if (not isinstance(self.eval_benchmarks, (tuple, list)) or
        not all(isinstance(b, str) and b for b in self.eval_benchmarks)):
      bad("eval_benchmarks", f"must be a list of 'NAME=FILE' strings, got "
          f"{self.eval_benchmarks!r}")

  @property
  def tis(self) -> bool:
    """Whether truncated importance sampling is on (rl.tis_cap > 0)."""
    return bool(self.tis_cap)
