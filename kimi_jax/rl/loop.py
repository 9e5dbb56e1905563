"""The iterative synchronous RL loop (report sections 2.3 and 2.6).

One iteration:
  1. hand the trainer's params to the sampler (same arrays when shardings
     agree);
  2. top up the replay buffer with new prompts (K responses each) until
     about (`prompts_per_iteration` + `queued_prompts`) x K responses are
     unfinished, then continue every one for at most `token_budget` tokens
     (partial rollouts; with a queue, within one window of that many tokens,
     queued responses taking the slots that free up);
  3. score every group whose K responses have all finished: task reward,
     length reward (weight 0 during warm-up), repeat penalty;
  4. reset the optimizer, compute the reference log-probs under the current
     policy, and take gradient steps over minibatches of those groups;
  5. update prompt success rates, write metrics, checkpoint everything.
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any

import jax
import numpy as np

from kimi_jax import metrics as metrics_lib
from kimi_jax.console import log, progress
from kimi_jax import train_step as ts
from kimi_jax.rewards.base import score_all
from kimi_jax.rl import batching, length_reward, prompt_sampling
from kimi_jax.rl import replay_buffer, rollout, trainer
from kimi_jax.sharding import host_to_global

RL_PANELS = (
    ("reward", ("reward", "task_reward")),
    ("accuracy", ("accuracy",)),
    ("response length (tokens)", ("length_mean", "length_p95")),
    ("partial rollouts", ("frac_partial", "frac_budget_stopped")),
    ("length-reward weight", ("length_reward_weight",)),
    ("loss", ("loss",)),
    ("grad norm", ("grad_norm",)),
    ("tokens/s", ("rollout_tokens_per_s", "train_tokens_per_s")),
    ("handoff seconds", ("handoff_s",)),
)
EVAL_PANELS = (("held-out", ("pass_at_1", "greedy_accuracy")),
               ("held-out response length", ("mean_length",)))


_MODEL_KEYS = batching.ROW_KEYS + ("lengths",)
_TRAIN_KEYS = _MODEL_KEYS + ("reward", "correct", "ref_seq_logp", "valid")


def _model_inputs(mb: dict) -> dict:
  """What the reference forward needs; a fixed key set so the jitted
  functions see one structure."""
  return {k: mb[k] for k in _MODEL_KEYS}


def _train_inputs(mb: dict) -> dict:
  return {k: mb[k] for k in _TRAIN_KEYS}


_LOG_FIELDS = (("reward", "reward", ".3f"), ("acc", "accuracy", ".3f"),
               ("len", "length_mean", ".1f"), ("p95", "length_p95", ".0f"),
               ("partial", "frac_partial", ".2f"),
               ("len_w", "length_reward_weight", ".2f"),
               ("loss", "loss", ".4f"), ("gnorm", "grad_norm", ".3f"),
               ("roll_tok/s", "rollout_tokens_per_s", ".0f"),
               ("train_tok/s", "train_tokens_per_s", ".0f"),
               ("handoff_s", "handoff_s", ".4f"))


def format_row(iteration: int, row: dict) -> str:
  """One log line per iteration with the headline metrics."""
  parts = [f"{name}={row[key]:{fmt}}" for name, key, fmt in _LOG_FIELDS
           if key in row]
  return f"iter {iteration}: " + " ".join(parts)


def _p95(x) -> float:
  return float(np.percentile(x, 95)) if len(x) else 0.0


class RLLoop:
  """Owns the RL-stage state; `run(params)` goes to the last iteration."""

  def __init__(self, setup, host: dict):
    self.s = setup
    cfg = setup.cfg
    self.rl = cfg.rl
    self.host = dict(host)
    self.buffer = replay_buffer.RolloutBuffer(
        group_size=self.rl.samples_per_prompt,
        max_wait_iterations=self.rl.max_wait_iterations)
    if "buffer" in host:
      self.buffer.load_state_dict(host["buffer"])
    self.prompts = prompt_sampling.PromptSampler(setup.task.train,
                                                 cfg.prompt_sampling)
    if "prompt_sampler" in host:
      self.prompts.load_state_dict(host["prompt_sampler"])
    self.ledger = dict(host.get("ledger", {"trained_groups": [],
                                           "trained_responses": 0}))
    self._encoded: dict[int, list[int]] = {}
    self._steps: dict[tuple, Any] = {}
    self._counters: list[ts.TraceCounter] = []
    self._reset_opt = ts.make_reset_optimizer(setup.optimizer_rl,
                                              setup.shardings)
    self._seq_logp = trainer.make_seq_logp_fn(cfg.model, setup.sharder)
    lens = self.rl.train_len_buckets or (cfg.engine.cache_len,)
    self.len_buckets = tuple(lens)
    # Packed row counts divide over the mesh's batch shards (run.py checks
    # that an unpacked minibatch of P*K rows does).
    self.row_buckets = batching.row_buckets(
        self.rl.minibatch_prompts * self.rl.samples_per_prompt,
        setup.sharder.axis_size(setup.sharder.rule_map["batch"]))

  # ---- helpers ---------------------------------------------------------------

  def prompt_ids(self, index: int) -> list[int]:
    if index not in self._encoded:
      self._encoded[index] = self.s.task.encode_prompt(
          self.s.task.train[index])
    return self._encoded[index]

  def to_global(self, batch: dict[str, np.ndarray]) -> dict[str, Any]:
    """Places a host batch that every process holds in full."""
    sh = ts.batch_shardings(self.s.sharder,
                            {k: v.shape for k, v in batch.items()})
    return {k: host_to_global(v, sh[k]) for k, v in batch.items()}

  def step_fn(self, batch: dict[str, Any]):
    """The jitted train step for this batch shape (one compile per shape)."""
    key = tuple(sorted((k, v.shape) for k, v in batch.items()))
    if key not in self._steps:
      sh = {k: v.sharding for k, v in batch.items()}
      loss_fn = lambda p, b: trainer.policy_loss(
          p, b, cfg=self.s.cfg.model, rl=self.rl, sharder=self.s.sharder)
      fn, counter = ts.jit_train_step(loss_fn, self.s.optimizer_rl,
                                      self.s.shardings, sh)
      self._steps[key] = fn
      self._counters.append(counter)
    return self._steps[key]

  def compile_counts(self) -> dict[str, int]:
    out = {"train_step": sum(c.count for c in self._counters)}
    out.update({f"sampler_{k}": v
                for k, v in self.s.engine.compile_count().items()})
    return out

  # ---- one iteration -----------------------------------------------------------

  def rollout_phase(self, it: int, params) -> tuple[list, dict]:
    s, rl = self.s, self.rl
    handoff = s.engine.load_params(params)
    n_new = rollout.groups_to_open(
        self.buffer, rl.prompts_per_iteration + rl.queued_prompts)
    rng = np.random.default_rng([s.cfg.seed, it])
    for index in self.prompts.sample(it, n_new, rng):
      self.buffer.new_group(index)
    pending = self.buffer.pending()
    requests = rollout.continue_requests(
        pending, [self.prompt_ids(t.prompt_index) for t in pending],
        seed=s.cfg.seed, iteration=it, settings=s.cfg.sampling,
        stop_tokens=(s.tokenizer.eos_id,),
        max_response_len=rl.max_response_len, token_budget=rl.token_budget)
    t0 = time.perf_counter()
    results = s.sampler.generate(requests, **rollout.window_args(rl))
    rollout_s = time.perf_counter() - t0
    counts = rollout.record_results(self.buffer, results, version=it)
    started = [r for r in results if r is not None]
    generated = sum(len(r.tokens) for r in started)
    stats = {
        "handoff_s": handoff.seconds, "handoff_shared": float(
            handoff.kind == "shared"),
        "rollout_s": rollout_s,
        "rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
        "generated_tokens": generated, "new_prompts": n_new,
        "requests": len(started), "queued_unstarted": counts["unstarted"],
        "frac_budget_stopped": counts["budget"] / max(len(started), 1),
        "slot_utilisation": s.sampler.last_stats.slot_utilisation,
        "repeat_stops": counts["repeat"],
    }
    return self.buffer.complete_groups(), stats

  def score(self, it: int, groups: list) -> tuple[dict, dict]:
    """Rewards of every response in every completed group, P x K."""
    s, rl = self.s, self.rl
    trajs = [t for g in groups for t in g.trajectories]
    records = [s.task.train[g.prompt_index] for g in groups
               for _ in g.trajectories]
    texts = [rollout.response_text(t.tokens, s.tokenizer) for t in trajs]
    scored = score_all(s.task.reward, records, texts)
    P, K = len(groups), rl.samples_per_prompt
    task_r = np.array([x.score for x in scored], np.float32).reshape(P, K)
    correct = np.array([x.correct for x in scored], bool).reshape(P, K)
    lengths = np.array([t.length for t in trajs], np.int32).reshape(P, K)
    repeat = np.array([t.finish_reason == "repeat" for t in trajs],
                      bool).reshape(P, K)
    weight = length_reward.length_reward_weight(
        it, weight=rl.length_reward_weight,
        warmup_iterations=rl.length_reward_warmup)
    len_r = np.asarray(length_reward.length_reward(lengths, correct))
    total = task_r + weight * len_r + rl.repeat_penalty * repeat
    partial = np.array([len(t.segments) > 1 for t in trajs])
    stats = {
        "reward": float(total.mean()), "task_reward": float(task_r.mean()),
        "accuracy": float(correct.mean()),
        "length_mean": float(lengths.mean()), "length_p95": _p95(lengths),
        "length_reward_mean": float(len_r.mean()),
        "length_reward_weight": float(weight),
        "frac_partial": float(partial.mean()),
        "repeat_responses": int(repeat.sum()),
        "reward_errors": sum(x.error is not None for x in scored),
        "groups_scored": P,
    }
    return {"reward": total, "correct": correct}, stats

  def informative(self, scores: dict) -> np.ndarray:
    """Groups that carry a learning signal, P bools.

    With mirror descent, a group whose K rewards are all equal has zero
    advantage everywhere; at theta = theta_i its gradient is exactly zero and
    what is computed is rounding noise, which Adam (scale-free) would turn
    into a full-size step. Such groups are counted and left out. ReST learns
    from every group with a correct response.
    """
    if self.rl.loss == "rest":
      return scores["correct"].any(axis=1)
    r = scores["reward"]
    return r.max(axis=1) > r.min(axis=1)

  def train_phase(self, it: int, state: ts.TrainState, groups: list,
                  scores: dict) -> tuple[ts.TrainState, dict]:
    s, rl = self.s, self.rl
    mbs, members = batching.sorted_minibatches(
        groups, [self.prompt_ids(g.prompt_index) for g in groups],
        size=rl.minibatch_prompts, version=it,
        train_on_old_segments=rl.train_on_old_segments,
        len_buckets=self.len_buckets, pad_id=s.tokenizer.pad_id,
        rows=self.row_buckets, pack=rl.pack_sequences)
    batching.attach_scores(mbs, members, reward=scores["reward"],
                           correct=scores["correct"])
    if rl.reset_optimizer:
      state = state.replace(opt_state=self._reset_opt(state.params))
    # The reference pi_theta_i: the policy before this iteration's updates.
    for mb in mbs:
      mb["ref_seq_logp"] = (
          mb["sampler_seq_logp"] if rl.reference_logprobs == "sampler" else
          np.asarray(self._seq_logp(state.params,
                                    self.to_global(_model_inputs(mb)))))
    mismatch = float(np.mean(np.concatenate([
        np.abs(mb["ref_seq_logp"] - mb["sampler_seq_logp"])[
            mb["valid"] > 0] for mb in mbs])))
    t0 = time.perf_counter()
    history = []
    n_tokens = 0
    for _ in range(rl.epochs):
      for mb in mbs:
        batch = self.to_global(_train_inputs(mb))
        state, m = self.step_fn(batch)(state, batch)
        m = jax.device_get(m)
        if not m["finite"]:
          raise ts.NonFiniteError(
              f"RL iteration {it}: loss={m['loss']} grad_norm="
              f"{m['grad_norm']} is not finite; the update was not applied "
              "and the last good checkpoint is kept")
        history.append(m)
        n_tokens += int(mb["segment_ids"].astype(bool).sum())
    train_s = time.perf_counter() - t0
    stats = {k: float(np.mean([h[k] for h in history]))
             for k in ("loss", "grad_norm", "update_norm", "param_norm")}
    row_tokens = sum(mb["tokens"].size for mb in mbs) * rl.epochs
    stats.update(groups_trained=len(groups), train_s=train_s,
                 train_tokens_per_s=n_tokens / max(train_s, 1e-9),
                 logp_mismatch=mismatch,
                 train_len_max=max(mb["tokens"].shape[-1] for mb in mbs),
                 # Real tokens / tokens the train steps ran (padding).
                 train_row_fill=n_tokens / max(row_tokens, 1))
    return state, stats

  # ---- the loop -------------------------------------------------------------------

  def host_state(self, iteration: int) -> dict:
    return dict(self.host, stage="rl", iteration=iteration,
                buffer=self.buffer.state_dict(),
                prompt_sampler=self.prompts.state_dict(), ledger=self.ledger)

  def evaluate(self, it: int, params) -> dict:
    from kimi_jax.run import evaluate
    res = dataclasses.asdict(evaluate(self.s, params, seed_offset=1))
    self.s.metrics.write(it, "eval", res)
    self.host["last_eval"] = res
    return res

  def run(self, params, opt_state=None) -> dict:
    """Runs to the last iteration; `opt_state` resumes the optimizer (it
    only matters with reset_optimizer=False)."""
    from kimi_jax.run import _rl_step
    s, rl = self.s, self.rl
    state = ts.create_state(params, s.optimizer_rl, s.shardings)
    if opt_state is not None:
      state = state.replace(opt_state=opt_state)
    start = int(self.host.get("iteration", 0))
    bar = progress(range(start, rl.iterations), rl.iterations, "RL",
                    s.cfg.progress, start)
    for it in bar:
      t_iter = time.perf_counter()
      groups, roll = self.rollout_phase(it, state.params)
      row = dict(roll)
      if groups:
        scores, score_stats = self.score(it, groups)
        keep = self.informative(scores)
        row.update(score_stats, groups_uninformative=int((~keep).sum()))
        if keep.any():
          state, train_stats = self.train_phase(
              it, state, [g for g, k in zip(groups, keep) if k],
              {name: v[keep] for name, v in scores.items()})
          row.update(train_stats)
        self.prompts.update([g.prompt_index for g in groups],
                            list(scores["correct"].mean(axis=1)))
        # Finished groups are consumed exactly once, trained on or not.
        self.ledger["trained_groups"] = self.ledger["trained_groups"] + [
            g.group_id for g in groups]
        self.ledger["trained_responses"] += len(groups) * len(
            groups[0].trajectories)
      row.update(in_flight_groups=len(self.buffer),
                 iteration_s=time.perf_counter() - t_iter,
                 **{f"compiles_{k}": v for k, v in
                    self.compile_counts().items()})
      if rl.eval_every and (it + 1) % rl.eval_every == 0 and (
          it + 1) < rl.iterations:
        self.evaluate(it + 1, state.params)
      s.metrics.write(it + 1, "rl", row)
      log(format_row(it + 1, row))
      if hasattr(bar, "set_postfix"):
        bar.set_postfix(acc=f"{row.get('accuracy', float('nan')):.2f}",
                        len=f"{row.get('length_mean', 0):.1f}")
      if (it + 1) % s.cfg.checkpoint_every == 0 or it + 1 == rl.iterations:
        s.checkpointer.save(_rl_step(s.cfg, it + 1), params=state.params,
                            opt_state=state.opt_state,
                            host=self.host_state(it + 1))
    final = self.evaluate(rl.iterations, state.params)
    summary = {"warmstart_eval": self.host.get("warmstart_eval"),
               "final_eval": final, "compiles": self.compile_counts(),
               "ledger_groups": len(self.ledger["trained_groups"]),
               "iterations": rl.iterations}
    log(f"final held-out pass@1 {final['pass_at_1']:.3f} (greedy "
         f"{final['greedy_accuracy']:.3f}); compilations: "
         f"{self.compile_counts()}")
    if jax.process_index() == 0:
      with open(os.path.join(s.workdir, "summary.json"), "w") as f:
        json.dump(summary, f, indent=2)
      if s.cfg.plots:
        self.plot()
    return summary

  def plot(self) -> None:
    records = metrics_lib.read_jsonl(self.s.metrics.path)
    metrics_lib.plot_curves(records, "rl", RL_PANELS,
                            os.path.join(self.s.workdir, "rl_curves.png"),
                            "Kimi k1.5 RL")
    metrics_lib.plot_curves(records, "eval", EVAL_PANELS,
                            os.path.join(self.s.workdir, "eval_curves.png"),
                            "held-out evaluation")
    metrics_lib.plot_curves(records, "sft", (("loss", ("loss",)),),
                            os.path.join(self.s.workdir, "sft_curves.png"),
                            "warm start")
