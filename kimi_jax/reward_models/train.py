"""`launch/train_rm.py`: labelled data from a policy, both reward models,
and their honest evaluation (`rm_eval.json`).

  1. the policy (a run's checkpoint, or `init_from_hf`) answers prompts of
     the task's training split (`rm_data.samples_per_prompt` each) and of
     its held-out split; the task's verifier labels every response
     (labelled/train.jsonl, labelled/eval.jsonl);
  2. the classic model (value head on the policy's weights) trains on the
     training labels with the binary or pairwise loss (`rm_value`);
  3. the CoT model (the policy's weights) trains by SFT on rejection-sampled
     rationales that end in the label (`rm_cot`, cot_train.py);
  4. both judge the held-out responses: accuracy, precision and recall
     against the verifier's labels. With a hand-labelled set
     (`rm_data.hand_labelled`, every row `hidden`: never trained on), the
     verifier itself is measured against the human labels too, and so are
     the models where they can read it.

Outputs in the work directory: value/ and cot/ (reward-model directories,
kimi_jax/reward_models/store.py), labelled/*.jsonl, rm_eval.json.

A rerun loses nothing already finished: the labelling resumes from its
journal, a model whose directory holds the digest of everything it was
trained from (policy, model, task, seed, its config section, its training
examples) is read back instead of trained again, and a model's training
continues from its last checkpoint in WORKDIR/{value,cot}.progress
(`kimi_jax/step_loop.py`).
"""

from __future__ import annotations

import dataclasses
import json
import os
import time
from typing import Any, Sequence

import jax
import ml_collections
import numpy as np

from kimi_jax.data import tasks as tasks_lib
from kimi_jax.data.journal import CHUNK_PROMPTS, Journal, ModelCalls, digest
from kimi_jax.infra import workdir_lock
from kimi_jax.infra.config import ConfigError, to_dataclass
from kimi_jax.infra.console import log
from kimi_jax.infra.files import write_json
from kimi_jax.job import workdir as workdir_lib
from kimi_jax.job.experiment import ExperimentConfig, parse_config
from kimi_jax.model import hf, transformer
from kimi_jax.model.tokenizer import load_hf_tokenizer
from kimi_jax.reward_models import (cot_model, cot_train, labelled, store,
                                    value_model, value_train)
from kimi_jax.reward_models import template as template_lib
from kimi_jax.reward_models.agreement import agreement
from kimi_jax.reward_models.value_data import Scored, pairs
from kimi_jax.rewards.base import score_all
from kimi_jax.rewards.registry import make_reward
from kimi_jax.sampler import handoff
from kimi_jax.sampler.build import make_sampler
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sharding import Sharder, make_mesh
from kimi_jax.step_loop import Progress, discard, final_loss, settings_key

MODELS = ("value", "cot")
EVAL_FILE = "rm_eval.json"


@dataclasses.dataclass(frozen=True)
class RMDataConfig:
  """`config.rm_data`: the labelled data and the reward models' input.

  samples_per_prompt: responses drawn per prompt; train_prompts /
  eval_prompts: how many prompts of each split (0: all); temperature: of
  the policy's draws; max_response_len: of a draw (0: rl.max_response_len);
  max_input_len / min_response_tokens / instruction: the template
  (template.py); hand_labelled: a JSONL of hidden hand-labelled rows and
  hand_verifier the registry reward measured on it; models: which to train.
  """

  samples_per_prompt: int = 4
  train_prompts: int = 0
  eval_prompts: int = 0
  temperature: float = 1.0
  max_response_len: int = 0
  max_input_len: int = 64
  min_response_tokens: int = 16
  instruction: str = ""
  hand_labelled: str = ""
  hand_verifier: str = "math"
  models: tuple[str, ...] = MODELS

  def __post_init__(self):
    if self.samples_per_prompt < 1:
      raise ValueError("config.rm_data.samples_per_prompt must be >= 1")
    if self.train_prompts < 0 or self.eval_prompts < 0:
      raise ValueError("config.rm_data.train_prompts / eval_prompts must be "
                       ">= 0 (0: all)")
    bad = sorted(set(self.models) - set(MODELS))
    if bad or not self.models:
      raise ValueError(f"config.rm_data.models must name some of {MODELS}, "
                       f"got {self.models}")
    if self.hand_labelled and not os.path.isfile(self.hand_labelled):
      raise ValueError(f"config.rm_data.hand_labelled: file not found: "
                       f"{self.hand_labelled}")

  @property
  def template(self) -> template_lib.RMTemplate:
    return template_lib.RMTemplate(
        instruction=self.instruction, max_input_len=self.max_input_len,
        min_response_tokens=self.min_response_tokens)


@dataclasses.dataclass(frozen=True)
class RMTrainSetup:
  """The typed sections train_rm reads."""

  experiment: ExperimentConfig
  data: RMDataConfig
  value: value_train.ValueTrainConfig
  cot: cot_train.CotTrainConfig

  def section(self, kind: str) -> Any:
    """The training section of reward model `kind` ("value" or "cot")."""
    return self.value if kind == "value" else self.cot


def parse(config: ml_collections.ConfigDict) -> RMTrainSetup:
  """The experiment and the rm_data / rm_value / rm_cot sections (missing
  sections take their defaults)."""
  section = lambda name: config[name] if name in config else {}
  setup = RMTrainSetup(
      experiment=parse_config(config, jax.device_count()),
      data=to_dataclass(RMDataConfig, section("rm_data"), "rm_data"),
      value=to_dataclass(value_train.ValueTrainConfig, section("rm_value"),
                         "rm_value"),
      cot=to_dataclass(cot_train.CotTrainConfig, section("rm_cot"),
                       "rm_cot"))
  d, m = setup.data, setup.experiment.model
  cache = d.max_input_len + setup.cot.max_new_tokens
  if "cot" in d.models and cache > m.max_seq_len:
    raise ConfigError(f"config.rm_data.max_input_len ({d.max_input_len}) + "
                      f"config.rm_cot.max_new_tokens "
                      f"({setup.cot.max_new_tokens}) exceed "
                      f"config.model.max_seq_len ({m.max_seq_len})")
  if "value" in d.models and setup.value.row_len < d.max_input_len:
    raise ConfigError(f"config.rm_value.row_len ({setup.value.row_len}) is "
                      f"shorter than config.rm_data.max_input_len "
                      f"({d.max_input_len})")
  if "cot" in d.models and setup.cot.row_len < cache:
    raise ConfigError(f"config.rm_cot.row_len ({setup.cot.row_len}) is "
                      f"shorter than an input plus its rationale ({cache})")
  return setup


def _subset(records: Sequence[dict], n: int, seed: int) -> list[dict]:
  if not n or n >= len(records):
    return list(records)
  idx = np.sort(np.random.default_rng([seed, 17]).permutation(
      len(records))[:n])
  return [records[i] for i in idx]


def policy_params(cfg: ExperimentConfig, sharder: Sharder,
                  policy_workdir: str, policy_step: int | None
                  ) -> tuple[Any, str]:
  """The policy's params (trainer shardings) and where they came from."""
  shardings = transformer.param_shardings(cfg.model, sharder)
  if policy_workdir:
    _, run_cfg = workdir_lib.load_run(policy_workdir)
    if run_cfg.model != cfg.model:
      raise ConfigError(f"{policy_workdir}: its model section differs from "
                        f"this config's")
    params, step = workdir_lib.restore_params(policy_workdir, run_cfg,
                                              shardings, policy_step)
    return params, f"{policy_workdir} step {step}"
  if cfg.init_from_hf:
    _, params = hf.load_hf_checkpoint(cfg.init_from_hf, sharder=sharder,
                                      param_dtype=cfg.model.param_dtype)
    return params, cfg.init_from_hf
  raise ConfigError("train_rm needs a policy: --policy_workdir (a run's "
                    "workdir) or config.init_from_hf")


def _items(examples: Sequence[labelled.LabelledExample]
           ) -> list[cot_model.JudgeItem]:
  return [cot_model.JudgeItem(e.question, e.reference, e.response, e.id)
          for e in examples]


def _write_json(path: str, data: Any) -> None:
  if jax.process_index() == 0:
    write_json(path, data)


class Trainer:
  """What both models share: mesh, tokenizer, template, base params."""

  def __init__(self, setup: RMTrainSetup, workdir: str, *,
               policy_workdir: str = "", policy_step: int | None = None):
    self.setup, self.workdir = setup, workdir
    cfg = setup.experiment
    self.sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
    hf_tok = None
    if cfg.init_from_hf:
      hf_tok = load_hf_tokenizer(cfg.init_from_hf)
    self.task = tasks_lib.make_task(cfg.task, cfg.seed, hf_tok)
    self.template = setup.data.template
    self.tokenizer = template_lib.rm_tokenizer(
        self.task.tokenizer, self.template.words + cot_model.RATIONALE_WORDS
        + cot_model.VERDICT_WORDS)
    if self.tokenizer.vocab_size > cfg.model.vocab_size:
      raise ConfigError(
          f"the reward models' tokenizer ({self.tokenizer.vocab_size} ids "
          f"with the template's words) exceeds config.model.vocab_size "
          f"({cfg.model.vocab_size})")
    self.params, self.policy = policy_params(cfg, self.sharder,
                                             policy_workdir, policy_step)
    self._judge_sampler: Sampler | None = None

  # ---- data ---------------------------------------------------------------

  def labelled_data(self) -> tuple[list[labelled.LabelledExample],
                                   list[labelled.LabelledExample]]:
    cfg, d = self.setup.experiment, self.setup.data
    sampler = make_sampler(cfg.model, cfg.sampler, self.sharder)
    params, _ = handoff.place_params(self.params,
                                     sampler.engine.param_shardings)
    settings = dataclasses.replace(cfg.sampler.sampling,
                                   temperature=d.temperature)
    out = []
    for split, records, n, seed in (
        ("train", self.task.train, d.train_prompts, cfg.seed),
        ("eval", self.task.eval, d.eval_prompts, cfg.seed + 1)):
      t0 = time.perf_counter()
      # Finished chunks survive a kill: a rerun samples only the rest.
      journal = Journal(
          os.path.join(self.workdir, "labelled", f"{split}.journal.jsonl"),
          context={"policy": self.policy, "task": cfg.task})
      examples = labelled.sample_and_label(
          sampler=sampler, sampler_params=params,
          records=_subset(records, n, seed),
          encode_prompt=self.task.encode_prompt,
          tokenizer=self.task.tokenizer, verifier=self.task.reward,
          samples=d.samples_per_prompt,
          max_response_len=d.max_response_len or cfg.rl.max_response_len,
          settings=settings, seed=seed,
          calls=ModelCalls(CHUNK_PROMPTS, journal, cfg.log.progress))
      if journal.reused:
        log(f"labelled {split}: {journal.reused} chunks read back from "
            f"{journal.path}")
      labelled.save_jsonl(examples, os.path.join(self.workdir, "labelled",
                                                 f"{split}.jsonl"))
      log(f"labelled {split}: {len(examples)} responses, "
          f"{np.mean([e.label for e in examples]):.3f} correct "
          f"({time.perf_counter() - t0:.0f} s)")
      out.append(examples)
    return out[0], out[1]

  def encode(self, ex: labelled.LabelledExample) -> template_lib.RMInput:
    return template_lib.encode(self.template, self.tokenizer, ex.question,
                               ex.reference, ex.response, ex.id)

  # ---- the classic model --------------------------------------------------

  def train_value(self, train: Sequence[labelled.LabelledExample],
                  progress: Progress | None = None) -> store.RewardModel:
    cfg, vc = self.setup.experiment, self.setup.value
    scored = [Scored(self.encode(e).ids, e.label) for e in train]
    if vc.loss == "bce":
      units = [(s,) for s in scored]
    else:
      units = pairs(scored, [e.record_id for e in train], cfg.seed)
    t0 = time.perf_counter()
    params, hist = value_train.train(
        value_model.init_params(self.params, cfg.model), units,
        model_cfg=cfg.model, cfg=vc, sharder=self.sharder,
        pad_id=self.tokenizer.pad_id, seed=cfg.seed, progress=progress)
    offset = 0.0
    if vc.loss == "bradley_terry":
      logits = self.scorer(params).logits([s.ids for s in scored])
      offset = value_model.fit_offset(logits, [s.label for s in scored])
    report = {"loss": vc.loss, "units": len(units), "steps": vc.steps,
              "final_loss": final_loss(hist),
              "seconds": time.perf_counter() - t0}
    return store.RewardModel(kind="value", model=cfg.model,
                             template=self.template, tokenizer=self.tokenizer,
                             params=params, logit_offset=offset,
                             report=report)

  def scorer(self, params: Any) -> value_train.ValueScorer:
    return value_train.ValueScorer(
        params, model_cfg=self.setup.experiment.model, sharder=self.sharder,
        n_rows=self.setup.value.batch_rows,
        row_len=self.setup.value.row_len, pad_id=self.tokenizer.pad_id)

  def value_predictions(self, rm: store.RewardModel,
                        examples: Sequence[labelled.LabelledExample]
                        ) -> np.ndarray:
    """P(correct) of each example."""
    logits = self.scorer(rm.params).logits(
        [self.encode(e).ids for e in examples])
    return value_train.sigmoid(logits + rm.logit_offset)

  # ---- the CoT model ------------------------------------------------------

  def judge_for(self, params: Any) -> cot_model.CotJudge:
    cfg, cc = self.setup.experiment, self.setup.cot
    if self._judge_sampler is None:
      # The policy sampler's repeat detector and steps per call on a
      # cache sized for verdicts, with its default prefill buckets.
      judge_cfg = dataclasses.replace(
          cfg.sampler, max_slots=cc.max_slots,
          cache_len=self.template.max_input_len + cc.max_new_tokens,
          prefill_buckets=(), prefill_batch_buckets=())
      self._judge_sampler = make_sampler(cfg.model, judge_cfg, self.sharder)
    placed, _ = handoff.place_params(
        params, self._judge_sampler.engine.param_shardings)
    return cot_model.CotJudge(sampler=self._judge_sampler,
                              sampler_params=placed,
                              tokenizer=self.tokenizer,
                              template=self.template,
                              max_new_tokens=cc.max_new_tokens)

  def train_cot(self, train: Sequence[labelled.LabelledExample],
                progress: Progress | None = None) -> store.RewardModel:
    cfg, cc = self.setup.experiment, self.setup.cot
    t0 = time.perf_counter()
    params, report = cot_train.train(
        self.params, train, judge_for=self.judge_for, model_cfg=cfg.model,
        cfg=cc, sharder=self.sharder, pad_id=self.tokenizer.pad_id,
        seed=cfg.seed, progress=progress)
    report["seconds"] = time.perf_counter() - t0
    return store.RewardModel(kind="cot", model=cfg.model,
                             template=self.template, tokenizer=self.tokenizer,
                             params=params, max_new_tokens=cc.max_new_tokens,
                             report=report)

  def cot_predictions(self, rm: store.RewardModel,
                      examples: Sequence[labelled.LabelledExample]
                      ) -> list[cot_model.Judgment]:
    judged, _ = self.judge_for(rm.params).judge(_items(examples))
    return [j for (j,) in judged]


def _model_eval(pred: Sequence[bool], examples, seconds: float,
                **extra: Any) -> dict[str, Any]:
  out = agreement(pred, [e.label for e in examples])
  out.update(seconds=seconds, **extra)
  return out


def _hand_set(path: str) -> list[labelled.LabelledExample]:
  rows = labelled.load_jsonl(path)
  visible = [e.id for e in rows if not e.hidden]
  if visible:
    raise ValueError(f"{path}: hand-labelled rows must be hidden "
                     f"(evaluation only); not hidden: {visible[:5]}")
  return rows


def verifier_vs_hand(path: str, verifier_name: str) -> dict[str, Any]:
  """A registry reward (math-verify) against a hand-labelled set: agreement
  and every disagreement."""
  hand = _hand_set(path)
  records = [{"id": e.id, "prompt": e.question, "answer": e.reference}
             for e in hand]
  # Accuracy, not speed, is measured here: a generous per-item budget so a
  # loaded machine's start-up cannot turn into "timeout" verdicts.
  options = {"timeout_s": 60.0} if verifier_name == "math" else {}
  verifier = make_reward(verifier_name, **options)
  try:
    verdicts = score_all(verifier, records, [e.response for e in hand])
  finally:
    close = getattr(verifier, "close", None)
    if close is not None:
      close()
  return {"path": path, "verifier": verifier_name,
          "verifier_vs_hand": agreement([v.correct for v in verdicts],
                                        [e.label for e in hand]),
          "disagreements": [
              {"id": e.id, "hand": e.label, "verifier": v.correct,
               "error": v.error} for e, v in zip(hand, verdicts)
              if v.correct != e.label]}


def _hand_eval(trainer: Trainer, d: RMDataConfig, models: dict[str, Any]
               ) -> dict[str, Any]:
  """The verifier, and the models that can read the set, against hand
  labels."""
  out = verifier_vs_hand(d.hand_labelled, d.hand_verifier)
  hand = _hand_set(d.hand_labelled)
  truth = [e.label for e in hand]
  for kind, rm in models.items():
    try:
      if kind == "value":
        pred = list(trainer.value_predictions(rm, hand) >= 0.5)
      else:
        pred = [j.verdict.correct for j in trainer.cot_predictions(rm, hand)]
    except ValueError as exc:  # e.g. a word tokenizer cannot read LaTeX
      out[f"{kind}_vs_hand"] = {"skipped": str(exc)[:200]}
      continue
    out[f"{kind}_vs_hand"] = agreement(pred, truth)
  return out


def training_digest(setup: RMTrainSetup, policy: str, kind: str,
                    train: Sequence[labelled.LabelledExample]) -> str:
  """What a trained model depends on, as one digest."""
  cfg = setup.experiment
  return digest(kind, policy, cfg.model, cfg.task, cfg.seed, setup.data,
                settings_key(setup.section(kind)),
                [(e.id, e.response, e.label) for e in train])


def finished_model(path: str, key: str, sharder: Sharder
                   ) -> store.RewardModel | None:
  """The model in `path` if it was trained from `key`, else None (a
  directory from other inputs is removed, so a save killed half way can
  never pass for a finished model)."""
  try:
    meta = store.read_meta(path)
  except (FileNotFoundError, ValueError, json.JSONDecodeError):
    meta = None
  if meta is not None and meta.get("report", {}).get("digest") == key:
    return store.load(path, sharder)
  discard(path)
  return None


def _train_or_reuse(trainer: Trainer, kind: str,
                    train: Sequence[labelled.LabelledExample]
                    ) -> tuple[store.RewardModel, bool]:
  """(the model, whether it was read back from an earlier run)."""
  path = os.path.join(trainer.workdir, kind)
  key = training_digest(trainer.setup, trainer.policy, kind, train)
  rm = finished_model(path, key, trainer.sharder)
  if rm is not None:
    log(f"{kind} RM: read back from {path} (trained from the same inputs)")
    return rm, True
  progress = Progress(path + ".progress", key,
                      trainer.setup.section(kind).checkpoint_every)
  rm = trainer.train_value(train, progress) if kind == "value" else \
      trainer.train_cot(train, progress)
  rm = dataclasses.replace(rm, report={**rm.report, "digest": key})
  # rm.json is written last, so only a finished save carries the digest.
  store.save(path, rm, tokenizer_dir=trainer.setup.experiment.init_from_hf)
  discard(progress.directory)
  return rm, False


@workdir_lock.exclusive
def train_reward_models(config: ml_collections.ConfigDict, workdir: str, *,
                        policy_workdir: str = "",
                        policy_step: int | None = None) -> dict[str, Any]:
  """Everything in the module doc; returns what rm_eval.json holds."""
  setup = parse(config)
  d = setup.data
  os.makedirs(workdir, exist_ok=True)
  t_start = time.perf_counter()
  trainer = Trainer(setup, workdir, policy_workdir=policy_workdir,
                    policy_step=policy_step)
  train, held = trainer.labelled_data()
  train = labelled.training_examples(train)
  result: dict[str, Any] = {
      "policy": trainer.policy,
      "template": dataclasses.asdict(trainer.template),
      "data": {"train": len(train), "eval": len(held),
               "train_correct": float(np.mean([e.label for e in train])),
               "eval_correct": float(np.mean([e.label for e in held])),
               "eval_truncated": sum(trainer.encode(e).truncated
                                     for e in held)}}
  models: dict[str, store.RewardModel] = {}
  predictions: list[dict[str, Any]] = [
      {"id": e.id, "label": e.label} for e in held]
  if "value" in d.models:
    rm, reused = _train_or_reuse(trainer, "value", train)
    t0 = time.perf_counter()
    probs = trainer.value_predictions(rm, held)
    result["value"] = _model_eval(list(probs >= 0.5), held,
                                  time.perf_counter() - t0,
                                  train=rm.report, reused=reused)
    for row, p in zip(predictions, probs):
      row["value_p"] = float(p)
    models["value"] = rm
    log(f"value RM held-out accuracy {result['value']['accuracy']:.4f}")
  if "cot" in d.models:
    rm, reused = _train_or_reuse(trainer, "cot", train)
    t0 = time.perf_counter()
    judged = trainer.cot_predictions(rm, held)
    statuses = [j.verdict.status for j in judged]
    result["cot"] = _model_eval(
        [j.verdict.correct for j in judged], held, time.perf_counter() - t0,
        malformed=statuses.count("malformed"),
        missing=statuses.count("missing"), train=rm.report, reused=reused)
    for row, j in zip(predictions, judged):
      row.update(cot_verdict=j.verdict.status == "ok" and j.verdict.correct,
                 cot_status=j.verdict.status, cot_text=j.text)
    models["cot"] = rm
    log(f"CoT RM held-out accuracy {result['cot']['accuracy']:.4f}")
  if d.hand_labelled:
    result["hand_labelled"] = _hand_eval(trainer, d, models)
  result["seconds"] = time.perf_counter() - t_start
  if jax.process_index() == 0:
    with open(os.path.join(workdir, "labelled", "eval_predictions.jsonl"),
              "w") as f:
      for row in predictions:
        f.write(json.dumps(row) + "\n")
  _write_json(os.path.join(workdir, EVAL_FILE), result)
  return result
