"""The iterative synchronous RL loop (report sections 2.3 and 2.6).

`RLLoop.iteration(loop_state, train_state) -> (loop_state, train_state,
metrics)` is one iteration:
  1. the weight handoff: the trainer's params into the sampler's shardings
     (the same arrays when they agree);
  2. rollout: top up the replay buffer with new prompts (K responses each)
     until about (`prompts_per_iteration` + `queued_prompts`) x K responses
     are unfinished, then continue every one for at most `token_budget`
     tokens (partial rollouts; with a queue, within one window of that many
     tokens, queued responses taking the slots that free up);
  3. score every group whose K responses have all finished: task reward,
     length reward (weight 0 during warm-up), repeat penalty;
  4. the learner resets the optimizer, computes the reference log-probs
     under the current policy and takes gradient steps over minibatches of
     the groups that carry a gradient (Scores.trained_P);
  5. update prompt success rates and counters.
`RLLoop.run` repeats it, evaluating, logging and checkpointing on the way.
Everything the loop needs comes in typed: the task, the sampler, the
learner, and for `run` an evaluator, a checkpoint saver and a metrics
writer.
"""

from __future__ import annotations

import dataclasses
import time
from typing import Callable, Mapping, Protocol, Sequence

import numpy as np

from kimi_jax import train_step as ts
from kimi_jax.data.tasks import Task, prompt_images
from kimi_jax.infra.console import log, progress
from kimi_jax.infra.metrics import MetricsWriter
from kimi_jax.rewards.base import reward_stats, score_all
from kimi_jax.rl import batching, length_reward, replay_buffer, rollout
from kimi_jax.rl.config import REST_LOSSES, RLConfig
from kimi_jax.rl.evaluation import EvalResult, task_of
from kimi_jax.rl.learner import Learner
from kimi_jax.rl.loop_state import LoopState
from kimi_jax.sampler import handoff
from kimi_jax.sampler.config import SamplingSettings
from kimi_jax.sampler.driver import Sampler
from kimi_jax.token_rows import image_slots

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


def by_task(tasks_P: Sequence[str], correct_PxK: np.ndarray
            ) -> tuple[dict[str, float], dict[str, int]]:
  """Training accuracy and scored groups per task (`task_of`), so a mixed
  prompt set shows where the rollouts went and which task's reward rose
  (e.g. a guessable one)."""
  tasks = np.asarray(tasks_P)
  names = sorted(set(tasks.tolist()))
  return ({t: float(correct_PxK[tasks == t].mean()) for t in names},
          count_by_task(list(tasks_P)))


def count_by_task(tasks: Sequence[str]) -> dict[str, int]:
  """How many of the groups belong to each task: the trained groups per
  task say how many updates each task drove (a compute-matched comparison
  counts them)."""
  return {t: tasks.count(t) for t in sorted(set(tasks))}


def _p95(x) -> float:
  return float(np.percentile(x, 95)) if len(x) else 0.0


def total_reward(task_PxK: np.ndarray, verified_PxK: np.ndarray,
                 lengths_PxK: np.ndarray, repeat_PxK: np.ndarray, *,
                 length_weight: float, repeat_penalty: float
                 ) -> tuple[np.ndarray, np.ndarray]:
  """(task + length reward + repeat penalty, the length reward), P x K.

  The length reward's "correct" (report 2.3.3) is `verified`: a right answer
  that a step check scores 0 (a lucky one) earned no reward, so it gets no
  bonus for being short either, only the penalty for being long.
  """
  len_PxK = np.asarray(length_reward.length_reward(lengths_PxK, verified_PxK))
  total = task_PxK + length_weight * len_PxK + repeat_penalty * repeat_PxK
  return total, len_PxK


@dataclasses.dataclass(frozen=True)
class Scores:
  """Of P completed groups x K responses."""

  reward_PxK: np.ndarray  # task + length reward + repeat penalty
  correct_PxK: np.ndarray  # the answer's verdict (accuracy, success rates)
  # Correct and not vetoed by the reward's score (RewardResult.verified):
  # what ReST fits and the length reward counts as correct. Equal to
  # correct_PxK unless the reward checks steps.
  verified_PxK: np.ndarray

  def fitted_PxK(self, loss: str) -> np.ndarray:
    """What a ReST loss fits. "rest" (report 3.5: "fitting the best
    response sampled"): per group the verified response of the highest
    reward (length reward and repeat penalty included), the first sampled
    among equals; "rest_all_verified": every verified response."""
    if loss == "rest_all_verified":
      return self.verified_PxK
    masked_PxK = np.where(self.verified_PxK, self.reward_PxK, -np.inf)
    best_P = np.argmax(masked_PxK, axis=1)  # the first of equal maxima
    fitted_PxK = np.zeros_like(self.verified_PxK, dtype=bool)
    fitted_PxK[np.arange(len(best_P)), best_P] = True
    return fitted_PxK & self.verified_PxK

  def informative_P(self, loss: str) -> np.ndarray:
    """Groups with a learning signal at theta = theta_i: for mirror descent,
    rewards not all equal; for ReST, a verified response."""
    if loss in REST_LOSSES:
      return self.verified_PxK.any(axis=1)
    r = self.reward_PxK
    return r.max(axis=1) > r.min(axis=1)

  def trained_P(self, loss: str, *, steps: int) -> np.ndarray:
    """Groups the learner trains on when it takes `steps` gradient steps.

    Mirror descent: a group whose K rewards are all equal has zero
    advantage everywhere, so at theta = theta_i (the first step) its
    gradient is exactly zero, and what is computed is rounding noise that
    Adam (scale-free) would turn into a full-size step. From the second step
    on, theta has moved and the squared log-ratio term -(tau/2)(log
    pi_theta(y|x) - log pi_theta_i(y|x))^2 has a gradient for every
    response, these included: it holds the policy near theta_i on them. So
    with one step per iteration they are left out (nothing is lost); with
    several (epochs, or more than one minibatch) they are kept, unless no
    group has a signal: then every gradient is zero at theta_i, the exact
    phase never leaves it, and nothing is trained. ReST learns from every
    group with a verified response. tests/test_golden.py checks both cases.
    """
    informative = self.informative_P(loss)
    if loss in REST_LOSSES or steps <= 1 or not informative.any():
      return informative
    return np.ones_like(informative)


def _signal_first(mbs: list[batching.Minibatch]
                  ) -> list[batching.Minibatch]:
  """The minibatches with one that has unequal rewards first: the first step
  runs at theta = theta_i, where equal-reward groups alone give only
  rounding noise."""
  def has_signal(mb: batching.Minibatch) -> bool:
    r = mb.reward_PxK[mb.valid_P > 0]
    return bool((r.max(axis=1) > r.min(axis=1)).any())
  first = next((i for i, mb in enumerate(mbs) if has_signal(mb)), 0)
  return [mbs[first]] + mbs[:first] + mbs[first + 1:]


class IterationSaver(Protocol):
  """Makes an RL iteration durable (the job's checkpointer)."""

  def save_iteration(self, loop_state: LoopState,
                     train_state: ts.TrainState) -> None:
    ...


class RLLoop:
  """One RL stage: its config and the components an iteration drives."""

  def __init__(self, *, rl: RLConfig, seed: int, settings: SamplingSettings,
               task: Task, sampler: Sampler, learner: Learner):
    self.rl = rl
    self.seed = seed
    self.settings = settings
    self.task = task
    self.sampler = sampler
    self.learner = learner
    self._encoded: dict[int, list[int]] = {}

  def prompt_ids(self, index: int) -> list[int]:
    if index not in self._encoded:
      self._encoded[index] = self.task.encode_prompt(self.task.train[index])
    return self._encoded[index]

  def prompt_images(self, index: int) -> np.ndarray | None:
    """The images of train prompt `index` (n x H x W x C), or None."""
    return prompt_images(self.task.train[index])

  def image_inputs(self, indices: Sequence[int]
                   ) -> batching.ImageInputs | None:
    """The prompts' images for packing, when the policy has a vision
    tower; None for a text model."""
    slots = image_slots(self.learner.model.vision)
    if slots is None:
      return None
    empty = np.zeros((0,) + slots.like, np.float32)
    return batching.ImageInputs(
        pixels=[x if (x := self.prompt_images(i)) is not None else empty
                for i in indices], slots=slots)

  def max_response_len(self, prompt_index: int, sample_index: int) -> int:
    cap = self.task.response_cap
    full = self.rl.max_response_len
    return full if cap is None else min(full, cap(
        self.task.train[prompt_index], sample_index))

  def compile_counts(self) -> dict[str, int]:
    out = {"train_step": self.learner.compile_count()}
    out.update({f"sampler_{k}": v
                for k, v in self.sampler.engine.compile_count().items()})
    return out

  # ---- one iteration ----------------------------------------------------------

  def rollout_phase(self, it: int, state: LoopState, sampler_params
                    ) -> tuple[list[replay_buffer.Group], dict[str, float]]:
    """Tops the buffer up and continues every unfinished response; returns
    the groups completed (popped from `state.buffer`, which it changes)."""
    rl, buffer = self.rl, state.buffer
    n_new = rollout.groups_to_open(
        buffer, rl.prompts_per_iteration + rl.queued_prompts)
    rng = np.random.default_rng([self.seed, it])
    for index in state.prompts.sample(it, n_new, rng):
      buffer.new_group(index)
    pending = buffer.pending()
    requests = rollout.continue_requests(
        pending, [self.prompt_ids(t.prompt_index) for t in pending],
        seed=self.seed, iteration=it, settings=self.settings,
        stop_tokens=rollout.stop_tokens(self.task.tokenizer),
        max_response_lens=[self.max_response_len(t.prompt_index,
                                                  t.sample_index)
                           for t in pending],
        token_budget=rl.token_budget,
        images=[self.prompt_images(t.prompt_index) for t in pending])
    t0 = time.perf_counter()
    results, sampler_stats = self.sampler.generate(
        sampler_params, requests, keep_cut_kv=rl.keep_partial_kv,
        **rollout.window_args(rl))
    rollout_s = time.perf_counter() - t0
    counts = rollout.record_results(buffer, results, version=it)
    started = [r for r in results if r is not None]
    generated = sum(len(r.tokens) for r in started)
    stats = {
        "rollout_s": rollout_s,
        "rollout_tokens_per_s": generated / max(rollout_s, 1e-9),
        "generated_tokens": generated, "new_prompts": n_new,
        "requests": len(started), "queued_unstarted": counts["unstarted"],
        "frac_budget_stopped": counts["budget"] / max(len(started), 1),
        "slot_utilisation": sampler_stats.slot_utilisation,
        "decode_steps": sampler_stats.decode_steps,
        "prefill_tokens": sampler_stats.prefill_tokens,
        "resumed_in_slot": sampler_stats.resumed,
        "repeat_stops": counts["repeat"],
    }
    return buffer.complete_groups(), stats

  def tasks_of(self, groups: Sequence[replay_buffer.Group]) -> list[str]:
    """Each group's task (`task_of` its prompt's record)."""
    return [task_of(self.task.train[g.prompt_index]) for g in groups]

  def score(self, it: int, groups: list[replay_buffer.Group]
            ) -> tuple[Scores, dict[str, float]]:
    """Rewards of every response in every completed group, P x K."""
    rl, task = self.rl, self.task
    t0 = time.perf_counter()
    trajs = [t for g in groups for t in g.trajectories]
    records = [task.train[g.prompt_index] for g in groups
               for _ in g.trajectories]
    texts = [rollout.response_text(t.tokens, task.tokenizer) for t in trajs]
    scored = score_all(task.reward, records, texts)
    P, K = len(groups), rl.samples_per_prompt
    task_r = np.array([x.score for x in scored], np.float32).reshape(P, K)
    correct = np.array([x.correct for x in scored], bool).reshape(P, K)
    verified = np.array([x.verified for x in scored], bool).reshape(P, K)
    lengths = np.array([t.length for t in trajs], np.int32).reshape(P, K)
    repeat = np.array([t.finish_reason == "repeat" for t in trajs],
                      bool).reshape(P, K)
    weight = length_reward.length_reward_weight(
        it, weight=rl.length_reward_weight,
        warmup_iterations=rl.length_reward_warmup)
    total, len_r = total_reward(task_r, verified, lengths, repeat,
                                length_weight=weight,
                                repeat_penalty=rl.repeat_penalty)
    partial = np.array([len(t.segments) > 1 for t in trajs])
    acc_by_task, groups_by_task = by_task(self.tasks_of(groups), correct)
    stats = {
        "reward": float(total.mean()), "task_reward": float(task_r.mean()),
        "accuracy": float(correct.mean()),
        "accuracy_by_task": acc_by_task, "groups_by_task": groups_by_task,
        "length_mean": float(lengths.mean()), "length_p95": _p95(lengths),
        "length_reward_mean": float(len_r.mean()),
        "length_reward_weight": float(weight),
        "frac_partial": float(partial.mean()),
        "repeat_responses": int(repeat.sum()),
        "reward_errors": sum(x.error is not None for x in scored),
        "groups_scored": P, "score_s": time.perf_counter() - t0,
        # A reward model's calls, seconds, malformed verdicts, ...
        **reward_stats(task.reward),
    }
    return Scores(reward_PxK=total, correct_PxK=correct,
                  verified_PxK=verified), stats

  def minibatches(self, it: int, groups: list[replay_buffer.Group],
                  scores: Scores) -> list[batching.Minibatch]:
    """The groups packed into bucketed minibatches, rewards attached."""
    rl, learner = self.rl, self.learner
    mbs, members = batching.sorted_minibatches(
        groups, [self.prompt_ids(g.prompt_index) for g in groups],
        size=rl.minibatch_prompts, version=it,
        train_on_old_segments=rl.train_on_old_segments,
        len_buckets=learner.len_buckets, pad_id=self.task.tokenizer.pad_id,
        rows=learner.row_buckets, pack=rl.pack_sequences,
        images=self.image_inputs([g.prompt_index for g in groups]))
    # The minibatch's correct_PxK is what ReST fits.
    fitted_PxK = (scores.fitted_PxK(rl.loss) if rl.loss in REST_LOSSES else
                  scores.verified_PxK)
    return batching.with_scores(mbs, members, reward_PxK=scores.reward_PxK,
                                correct_PxK=fitted_PxK)

  def iteration(self, state: LoopState, train: ts.TrainState
                ) -> tuple[LoopState, ts.TrainState, dict[str, float]]:
    """One RL iteration; `state` itself is left unchanged."""
    t_iter = time.perf_counter()
    state = state.copy()
    it = state.iteration
    # The weight handoff.
    sampler_params, report = handoff.place_params(
        train.params, self.sampler.engine.param_shardings)
    groups, row = self.rollout_phase(it, state, sampler_params)
    row.update(handoff_s=report.seconds,
               handoff_shared=float(report.kind == "shared"))
    counters = state.counters
    if groups:
      scores, score_stats = self.score(it, groups)
      steps = self.rl.epochs * -(-len(groups) // self.rl.minibatch_prompts)
      keep_P = scores.trained_P(self.rl.loss, steps=steps)
      row.update(score_stats, groups_uninformative=int(
          (~scores.informative_P(self.rl.loss)).sum()))
      if keep_P.any():
        kept = [g for g, k in zip(groups, keep_P) if k]
        mbs = self.minibatches(it, kept, Scores(
            scores.reward_PxK[keep_P], scores.correct_PxK[keep_P],
            scores.verified_PxK[keep_P]))
        if self.rl.loss == "mirror_descent":
          mbs = _signal_first(mbs)
        train, train_stats = self.learner.train(train, mbs)
        row.update(train_stats, groups_trained=len(kept),
                   groups_trained_by_task=count_by_task(
                       self.tasks_of(kept)),
                   trained_tokens=sum(t.length for g in kept
                                      for t in g.trajectories))
      state.prompts.update([g.prompt_index for g in groups],
                           list(scores.correct_PxK.mean(axis=1)))
      # Finished groups are consumed exactly once, trained on or not.
      n_kept = int(keep_P.sum())
      counters = counters.add(
          groups_consumed=len(groups), groups_trained=n_kept,
          groups_uninformative=len(groups) - n_kept,
          responses_trained=n_kept * self.rl.samples_per_prompt)
    row.update(in_flight_groups=len(state.buffer),
               iteration_s=time.perf_counter() - t_iter,
               **{f"compiles_{k}": v for k, v in
                  self.compile_counts().items()})
    return (dataclasses.replace(state, iteration=it + 1, counters=counters),
            train, row)

  # ---- the loop -----------------------------------------------------------------

  def run(self, state: LoopState, train: ts.TrainState, *,
          evaluate: Callable[[object], EvalResult], saver: IterationSaver,
          metrics: MetricsWriter, checkpoint_every: int,
          show_progress: bool, eval_kind: str = "eval",
          benchmarks: Callable[[object], Mapping[str, float]] | None = None
          ) -> tuple[LoopState, ts.TrainState]:
    """Iterations from `state.iteration` to `rl.iterations`, evaluating
    every `rl.eval_every` (logged as `eval_kind`: "val" when `evaluate`
    reads the validation set; `benchmarks(params)`, when given, logged as
    "benchmarks"), saving every `checkpoint_every` and at the end."""
    rl = self.rl
    bar = progress(range(state.iteration, rl.iterations), rl.iterations,
                   "RL", show_progress, state.iteration)
    for _ in bar:
      state, train, row = self.iteration(state, train)
      it = state.iteration
      if rl.eval_every and it % rl.eval_every == 0 and it < rl.iterations:
        result = dataclasses.asdict(evaluate(train.params))
        metrics.write(it, eval_kind, result)
        if benchmarks is not None:
          metrics.write(it, "benchmarks", benchmarks(train.params))
        state = dataclasses.replace(state, last_eval=result)
      metrics.write(it, "rl", row)
      log(format_row(it, row))
      if hasattr(bar, "set_postfix"):
        bar.set_postfix(acc=f"{row.get('accuracy', float('nan')):.2f}",
                        len=f"{row.get('length_mean', 0):.1f}")
      if it % checkpoint_every == 0 or it == rl.iterations:
        saver.save_iteration(state, train)
    return state, train
