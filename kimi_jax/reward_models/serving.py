"""Reward models as RL rewards, on the job's mesh.

Three `BatchRewardFn`s (kimi_jax/rewards/base.py), each owning what runs on
the device, built once by the job with its sharder:

  ValueRMReward      the classic model: one jitted forward per packed batch
                     (`ValueScorer`); correct when P(correct) >= threshold
  CotRMReward        the CoT model: rationales through its own engine and
                     `Sampler` (continuous batching, greedy), the verdict
                     read by `parse_verdict`; malformed / missing -> incorrect
  VerifierFirst      the task's rule-based verifier where it read and judged
                     an answer, the model for the rest (no answer found, an
                     answer that did not parse, a verifier error)

Scores are binary (1 correct, 0 not), as every reward here. The reward
model's params are loaded once, held by the reward and never updated: RL
trains the policy's train state only (tests/test_reward_models.py checks
the bits after an RL step).

Each reward counts what it did since the loop last asked (`take_stats`):
calls, items, seconds, generated tokens, malformed and missing verdicts,
truncated inputs, verifier fallbacks; with `audit`, also the task's verifier
on every scored response: agreement of the model with it and the verifier's
accuracy of the rollouts (reward hacking shows as reward up, that flat).
"""

from __future__ import annotations

import dataclasses
import time
from typing import Any, Callable, Mapping, Sequence

import numpy as np

from kimi_jax.reward_models import store, value_train
from kimi_jax.reward_models import template as template_lib
from kimi_jax.reward_models.config import RewardModelConfig, rm_kind
from kimi_jax.reward_models.cot_model import CotJudge, JudgeItem
from kimi_jax.reward_models.labelled import extracted_answer
from kimi_jax.rewards.base import RewardFn, RewardResult, score_all
from kimi_jax.rewards.math_policy import UNPARSED
from kimi_jax.sampler import handoff
from kimi_jax.sampler.build import make_sampler
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sharding import Sharder

class _Stats:
  """Counters since the last `take`."""

  def __init__(self, prefix: str):
    self.prefix = prefix
    self.reset()

  def reset(self) -> None:
    self.values: dict[str, float] = {}

  def add(self, **kv: float) -> None:
    for k, v in kv.items():
      self.values[k] = self.values.get(k, 0.0) + float(v)

  def take(self) -> dict[str, float]:
    out = {f"{self.prefix}_{k}": v for k, v in self.values.items()}
    n, audited = self.values.get("audited", 0.0), "agree"
    if n:
      out[f"{self.prefix}_agreement"] = self.values[audited] / n
      out[f"{self.prefix}_verifier_accuracy"] = \
          self.values["verifier_correct"] / n
    self.reset()
    return out


def _audit(stats: _Stats, verifier: RewardFn | None,
           records: Sequence[Mapping[str, Any]], responses: Sequence[str],
           results: Sequence[RewardResult]) -> None:
  if verifier is None:
    return
  truth = score_all(verifier, records, responses)
  stats.add(audited=len(truth),
            agree=sum(t.correct == r.correct for t, r in zip(truth, results)),
            verifier_correct=sum(t.correct for t in truth))


def _item(record: Mapping[str, Any], response: str) -> JudgeItem:
  return JudgeItem(str(record["prompt"]), str(record["answer"]), response,
                   str(record.get("id", "")))


class ValueRMReward:
  """The classic reward model as a reward (see the module doc)."""

  def __init__(self, scorer: value_train.ValueScorer, *, tokenizer: Any,
               template: template_lib.RMTemplate, logit_offset: float,
               threshold: float = 0.5, audit: RewardFn | None = None):
    self.scorer, self.tokenizer, self.template = scorer, tokenizer, template
    self.offset, self.threshold, self.audit = logit_offset, threshold, audit
    self.stats = _Stats("rm")

  def __call__(self, record: Mapping[str, Any], response: str
               ) -> RewardResult:
    return self.batch([record], [response])[0]

  def probabilities(self, items: Sequence[JudgeItem]
                    ) -> tuple[np.ndarray, list[bool]]:
    inputs = [template_lib.encode(self.template, self.tokenizer, it.question,
                                  it.reference, it.response, it.where)
              for it in items]
    logits = self.scorer.logits([x.ids for x in inputs])
    return (value_train.sigmoid(logits + self.offset),
            [x.truncated for x in inputs])

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    t0 = time.perf_counter()
    probs, truncated = self.probabilities(
        [_item(r, s) for r, s in zip(records, responses)])
    out = [RewardResult(score=float(p >= self.threshold),
                        correct=bool(p >= self.threshold),
                        info={"p_correct": float(p)}) for p in probs]
    self.stats.add(calls=1, items=len(out), truncated=sum(truncated),
                   seconds=time.perf_counter() - t0)
    _audit(self.stats, self.audit, records, responses, out)
    return out

  def take_stats(self) -> dict[str, float]:
    return self.stats.take()


class CotRMReward:
  """The chain-of-thought reward model as a reward (see the module doc)."""

  def __init__(self, judge: CotJudge, *, audit: RewardFn | None = None):
    self.judge, self.audit = judge, audit
    self.stats = _Stats("rm")

  def __call__(self, record: Mapping[str, Any], response: str
               ) -> RewardResult:
    return self.batch([record], [response])[0]

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    t0 = time.perf_counter()
    judged, sampler_stats = self.judge.judge(
        [_item(r, s) for r, s in zip(records, responses)])
    out = []
    for (j,) in judged:
      out.append(RewardResult(
          score=float(j.verdict.correct), correct=j.verdict.correct,
          error=None if j.verdict.status == "ok" else
          f"verdict {j.verdict.status}",
          info={"verdict": j.verdict.status, "rationale": j.text[-200:]}))
    self.stats.add(
        calls=1, items=len(out), seconds=time.perf_counter() - t0,
        tokens=sum(j.tokens for (j,) in judged),
        malformed=sum(j.verdict.status == "malformed" for (j,) in judged),
        missing=sum(j.verdict.status == "missing" for (j,) in judged),
        truncated=sum(j.truncated for (j,) in judged),
        slot_utilisation=sampler_stats.slot_utilisation)
    _audit(self.stats, self.audit, records, responses, out)
    return out

  def take_stats(self) -> dict[str, float]:
    out = self.stats.take()
    if out.get("rm_calls"):
      out["rm_slot_utilisation"] /= out["rm_calls"]
    return out


def verifier_decided(result: RewardResult) -> bool:
  """Whether a rule-based verdict stands: the verifier read an answer and
  judged it (no error, an extracted answer, not "did not parse")."""
  return (result.error is None and result.info.get("reason") != UNPARSED
          and extracted_answer(result) is not None)


class VerifierFirst:
  """The verifier where it decides (`verifier_decided`), the model for the
  rest: "verifier when it parses, model otherwise"."""

  def __init__(self, verifier: RewardFn, model: Any,
               decided: Callable[[RewardResult], bool] = verifier_decided):
    self.verifier, self.model, self.decided = verifier, model, decided

  def __call__(self, record: Mapping[str, Any], response: str
               ) -> RewardResult:
    return self.batch([record], [response])[0]

  def batch(self, records: Sequence[Mapping[str, Any]],
            responses: Sequence[str]) -> list[RewardResult]:
    out = score_all(self.verifier, records, responses)
    todo = [i for i, r in enumerate(out) if not self.decided(r)]
    if todo:
      judged = self.model.batch([records[i] for i in todo],
                                [responses[i] for i in todo])
      for i, r in zip(todo, judged):
        out[i] = dataclasses.replace(r, info=dict(r.info, by="model"))
    self.model.stats.add(verifier_decided=len(out) - len(todo),
                         model_decided=len(todo))
    return out

  def take_stats(self) -> dict[str, float]:
    return self.model.take_stats()


# ---- built by the job ------------------------------------------------------


def make_judge(rm: store.RewardModel, sharder: Sharder, *, max_slots: int,
               steps_per_call: int) -> CotJudge:
  """A CotJudge with its own engine on `sharder`'s mesh; the params placed
  in the engine's shardings once."""
  cache = rm.template.max_input_len + rm.max_new_tokens
  judge_cfg = SamplerConfig(max_slots=max_slots, cache_len=cache,
                            steps_per_call=steps_per_call)
  sampler = make_sampler(rm.model, judge_cfg, sharder)
  params, _ = handoff.place_params(rm.params, sampler.engine.param_shardings)
  return CotJudge(sampler=sampler, sampler_params=params,
                  tokenizer=rm.tokenizer, template=rm.template,
                  max_new_tokens=rm.max_new_tokens)


def make_scorer(rm: store.RewardModel, sharder: Sharder, *, batch_rows: int
                ) -> value_train.ValueScorer:
  return value_train.ValueScorer(
      rm.params, model_cfg=rm.model, sharder=sharder, n_rows=batch_rows,
      row_len=rm.template.max_input_len, pad_id=rm.tokenizer.pad_id)


def reward_from_model(reward: str, rm: store.RewardModel, sharder: Sharder,
                      cfg: RewardModelConfig, verifier: RewardFn,
                      decided: Callable[[RewardResult], bool] =
                      verifier_decided) -> RewardFn:
  """The RL reward `reward` (one of registry.MODEL_REWARDS) on a loaded
  model."""
  kind = rm_kind(reward)
  if kind is None:
    raise ValueError(f"{reward!r} is not a reward-model reward")
  if rm.kind != kind:
    raise ValueError(f"reward {reward!r} needs a {kind} reward model, "
                     f"config.reward_model.path={cfg.path!r} holds a "
                     f"{rm.kind} model")
  audit = verifier if cfg.audit else None
  if kind == "value":
    model = ValueRMReward(make_scorer(rm, sharder, batch_rows=cfg.batch_rows),
                          tokenizer=rm.tokenizer, template=rm.template,
                          logit_offset=rm.logit_offset,
                          threshold=cfg.threshold, audit=audit)
  else:
    model = CotRMReward(make_judge(rm, sharder, max_slots=cfg.max_slots,
                                   steps_per_call=cfg.steps_per_call),
                        audit=audit)
  if reward.startswith("verifier_or_"):
    return VerifierFirst(verifier, model, decided)
  return model


def build_reward(reward: str, cfg: RewardModelConfig, sharder: Sharder,
                 verifier: RewardFn, task_tokenizer: Any) -> RewardFn:
  """What the job calls: the reward model in `cfg.path`, checked against
  the task's tokenizer, as the RL reward `reward`."""
  rm = store.load(cfg.path, sharder)
  check_tokenizer(rm.tokenizer, task_tokenizer, cfg.path)
  return reward_from_model(reward, rm, sharder, cfg, verifier)


def make_model_reward(name: str, *, sharder: Sharder, verifier: RewardFn,
                      model: store.RewardModel | None = None, path: str = "",
                      **options: Any) -> RewardFn:
  """The reward-model reward `name` (one of registry.MODEL_REWARDS) by name,
  like `rewards.registry.make_reward` for the verifiers: from a loaded
  `model` or a reward-model directory `path` (launch/train_rm.py); other
  options are RewardModelConfig's fields.

    make_model_reward("rm_value", sharder=s, verifier=v, path="/runs/rm/value")
    make_model_reward("verifier_or_rm_cot", sharder=s, verifier=v, model=cot)
  """
  cfg = RewardModelConfig(path=path, **options)
  if model is None:
    if not path:
      raise ValueError(f"reward {name!r} needs a reward model: pass path "
                       f"(a directory from launch/train_rm.py) or model")
    model = store.load(path, sharder)
  return reward_from_model(name, model, sharder, cfg, verifier)


def check_tokenizer(rm_tok: Any, task_tok: Any, where: str) -> None:
  """The reward model reads responses the policy wrote: a word tokenizer
  must extend the task's (same ids for the task's words)."""
  words = getattr(task_tok, "words", None)
  if words is not None and tuple(getattr(rm_tok, "words", ()))[
      :len(words)] != tuple(words):
    raise ValueError(f"{where}: the reward model's word tokenizer does not "
                     f"extend the task's (different ids for the same words)")
