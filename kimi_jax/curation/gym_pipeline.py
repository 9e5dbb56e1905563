"""From raw reasoning-gym problems to an RL-trained policy in one job
(report 2.1, 2.2, 2.5.2, then 2.3): what `python launch/tpu_run.py --config
experiments/gym_tiny.py --workdir W` runs when the config has a `pipeline`
section.

Stages, each in its own place under W and skipped when a rerun finds it
finished (a killed stage resumes: the two training runs from their Orbax
checkpoints, the data stages from scratch):

  data/      raw train, held-out, validation (gym.val_size > 0) and
             vanilla-SFT problems from the generators, and the tokenizer
             built on them (text_tokenizer)
  vanilla/   vanilla SFT (report 2.5.2, stage one) on worked solutions,
             some step by step under a cue, some direct
  data/      curation with the vanilla model (report 2.1): format, dedup,
             tags, easy-to-hack (no-CoT guesses), pass rate and difficulty
  data/      long-CoT warm-up rows by rejection sampling the vanilla model
             under the cue (report 2.2)
  rl/        the main job from the vanilla policy: long-CoT SFT on the
             warm-up rows, then RL on the curated prompts with prioritized
             sampling starting from the measured pass rates
  summary.json  curation and warm-up counts, vanilla_eval, warmstart_eval
             (after the long-CoT SFT) and final_eval, per task; with a
             validation set also vanilla_val, warmstart_val and final_val
             (RL's periodic evaluations then read it, not the held-out set)

`pipeline.curate=False` is the same run without curation: RL trains on the
raw problems. The warm-up rows are built alike in both (by default from
the problems that pass curation's data-quality steps), so the two runs
share their warm start and differ only in the RL prompt set.
"""

from __future__ import annotations

import dataclasses
import json
import os
import random
import shutil
import tempfile
import time
from typing import Any, Callable

import jax
import ml_collections
import numpy as np

from kimi_jax.curation import text_tokenizer, warmup
from kimi_jax.curation import config as tools_config
from kimi_jax.curation import curate as curate_lib
from kimi_jax.curation.gym_problems import (GymConfig, problem_sets,
                                            validation_set, vanilla_problems)
from kimi_jax.curation.policy import load_policy
from kimi_jax.data import records as records_lib
from kimi_jax.data import reflect
from kimi_jax.infra import workdir_lock
from kimi_jax.infra.config import ConfigError, to_dataclass
from kimi_jax.infra.console import log
from kimi_jax.infra.files import write_json
from kimi_jax.job import run as job_lib
from kimi_jax.job.experiment import ExperimentConfig, parse_config
from kimi_jax.long2short import policies
from kimi_jax.rewards.base import RewardFn
from kimi_jax.rewards.gym_solutions import solution
from kimi_jax.sft import STOP_METRICS

SECTIONS = ("pipeline", "gym", "curate", "warmup")
WARMUP_SOURCES = ("clean", "curated", "train")
SUMMARY_FILE = "summary.json"


@dataclasses.dataclass(frozen=True)
class PipelineConfig:
  """The `pipeline` section (values ours; the report gives none for a
  model this small).

  vanilla_sft_steps: steps of the vanilla SFT stage (its learning rates:
    the job's sft section); with `vanilla_stop_at_val`, the most it
    may take.
  vanilla_stop_at_val: 0 (off), or the validation `vanilla_stop_metric`
    ("pass_at_1" or "greedy_accuracy") at which the vanilla stage ends,
    checked every `vanilla_check_every` steps (sft.stop_at_val): a model
    learns a task like copying letters suddenly, after a number of steps
    that differs from seed to seed, so a fixed count leaves one seed's
    model unable to start and another's with nothing left for RL to gain
    (docs/gym_pipeline.md, measured). Needs `gym.val_size` > 0.
  sft_problems: vanilla-SFT problems per dataset, drawn past the train and
    held-out items of each generator.
  direct_fraction: share of them answered directly; the rest are solved
    step by step, their prompt followed by `cot_cue`.
  cot_cue: what asks the model for steps (the "prompt engineering" of
    report 2.2 for a model that has only seen this cue).
  cued_fraction: share of the worked solutions whose prompt carries
    `cot_cue`; the rest answer the plain prompt step by step, so plain
    prompts see both modes and the long-CoT stage (plain prompts, worked
    answers) is not the first time the model reads a problem without the
    cue before its steps (measured: docs/gym_pipeline.md).
  long_cot_sft_steps: steps of the long-CoT SFT on the warm-up rows, at the
    start of the main job: `long_cot_warmup_steps` up to
    `long_cot_learning_rate`, then down to a tenth of it.
  curate: False runs the same pipeline without curation.
  warmup_from: which prompts the warm-up rows are sampled for. "clean"
    (the default): the train problems that pass curation's data-quality
    steps (format, dedup against themselves and the held-out and
    validation problems), in their train order, whether or not `curate`
    is on: report 2.2 builds its warm-up set apart from the RL prompts, the
    difficulty steps are about what RL learns from (2.1), not about which
    worked solutions are worth imitating, and so a run and the same run
    without curation share their warm-up rows and warm start. "curated":
    the RL prompt set (the raw problems when `curate` is off). "train":
    every raw train problem, unfiltered.
  min_word_fraction: the tokenizer's word threshold (text_tokenizer).
  """

  vanilla_sft_steps: int = 300
  vanilla_stop_at_val: float = 0.0
  vanilla_stop_metric: str = "pass_at_1"
  vanilla_check_every: int = 25
  sft_problems: int = 400
  direct_fraction: float = 0.5
  cot_cue: str = "\nThink step by step."
  cued_fraction: float = 1.0
  long_cot_sft_steps: int = 100
  # Report 2.5.2's second stage re-warms to 1e-5 and decays to 1e-6 (a
  # tenth); for a model this small, ours: this peak, a tenth at the end.
  long_cot_learning_rate: float = 5e-4
  long_cot_warmup_steps: int = 5
  curate: bool = True
  warmup_from: str = "clean"
  min_word_fraction: float = 0.1

  def __post_init__(self):
    if self.vanilla_sft_steps < 1 or self.sft_problems < 1:
      raise ValueError("pipeline.vanilla_sft_steps and sft_problems must be "
                       ">= 1")
    if not 0 <= self.vanilla_stop_at_val <= 1:
      raise ValueError("pipeline.vanilla_stop_at_val must be in [0, 1] "
                       "(0: off)")
    if self.vanilla_stop_metric not in STOP_METRICS:
      raise ValueError(f"pipeline.vanilla_stop_metric must be one of "
                       f"{STOP_METRICS}, got {self.vanilla_stop_metric!r}")
    if self.vanilla_check_every < 1:
      raise ValueError("pipeline.vanilla_check_every must be >= 1")
    if self.long_cot_sft_steps < 0:
      raise ValueError("pipeline.long_cot_sft_steps must be >= 0")
    for key in ("direct_fraction", "cued_fraction"):
      if not 0 <= getattr(self, key) <= 1:
        raise ValueError(f"pipeline.{key} must be in [0, 1]")
    if self.warmup_from not in WARMUP_SOURCES:
      raise ValueError(f"pipeline.warmup_from must be one of "
                       f"{WARMUP_SOURCES}, got {self.warmup_from!r}")


# What each stage reads and writes, relative to the workdir.
FILES = {"train": "data/train.jsonl", "eval": "data/eval.jsonl",
         "val": "data/val.jsonl",
         "sft": "data/vanilla_sft.jsonl", "tokenizer": "tokenizer",
         "curated": "data/curated.jsonl",
         "clean": "data/clean.jsonl",
         "rejected": "data/curated.rejected.jsonl",
         "curation": "data/curation.json",
         "curate_journal": "data/curated.journal.jsonl",
         "warmup": "data/warmup.jsonl",
         "warmup_report": "data/warmup.json",
         "warmup_journal": "data/warmup.journal.jsonl",
         "data_done": "data/problems.json",
         "vanilla": "vanilla", "rl": "rl"}


@dataclasses.dataclass(frozen=True)
class Paths:
  """`Paths(W).train` etc.: the absolute paths of FILES under W."""
  workdir: str

  def __getattr__(self, name: str) -> str:
    if name not in FILES:
      raise AttributeError(name)
    return os.path.join(self.workdir, FILES[name])


def is_pipeline(config: ml_collections.ConfigDict) -> bool:
  return "pipeline" in config


def pipeline_config(config: ml_collections.ConfigDict) -> PipelineConfig:
  return to_dataclass(PipelineConfig, config.pipeline, "pipeline")


def gym_config(config: ml_collections.ConfigDict) -> GymConfig:
  return to_dataclass(GymConfig, config.gym, "gym")


def job_config(config: ml_collections.ConfigDict, paths: Paths, *,
               stage: str) -> ml_collections.ConfigDict:
  """The main-job config of a training stage ("vanilla" or "rl"): the
  config without the pipeline's sections, its data paths filled in."""
  pipe = pipeline_config(config)
  out = ml_collections.ConfigDict(
      {k: v for k, v in config.to_dict().items() if k not in SECTIONS})
  out.task.tokenizer = paths.tokenizer
  out.task.eval_path = paths.eval
  out.task.val_path = paths.val if gym_config(config).has_val() else ""
  if stage == "vanilla":
    out.task.train_path = paths.train
    out.sft.steps = pipe.vanilla_sft_steps
    out.sft.stop_at_val = pipe.vanilla_stop_at_val
    out.sft.stop_metric = pipe.vanilla_stop_metric
    out.sft.check_every = pipe.vanilla_check_every
    out.sft.train_path = paths.sft
    out.rl.iterations = 0
    out.rl.eval_every = 0
    out.prompt_sampling.initial_success_field = ""
  elif stage == "rl":
    out.task.train_path = paths.curated if pipe.curate else paths.train
    out.sft.steps = pipe.long_cot_sft_steps
    out.sft.train_path = paths.warmup
    out.sft.learning_rate = pipe.long_cot_learning_rate
    out.sft.warmup_steps = pipe.long_cot_warmup_steps
    out.sft.final_learning_rate = pipe.long_cot_learning_rate / 10
    out.sft.stop_at_val = 0.0
    if not pipe.curate:
      out.prompt_sampling.initial_success_field = ""
  else:
    raise ValueError(f"unknown stage {stage!r}")
  return out


def check(config: ml_collections.ConfigDict) -> dict[str, ExperimentConfig]:
  """Every section typed and both training stages' configs valid, before
  anything runs (the data files they name need not exist yet). Returns
  the typed config of each training stage ("vanilla", "rl")."""
  pipe, gym = pipeline_config(config), gym_config(config)
  if pipe.vanilla_stop_at_val and not gym.has_val():
    raise ConfigError("pipeline.vanilla_stop_at_val checks a "
                      "validation set: set gym.val_size > 0")
  tools_config.curate_config(config)
  tools_config.warmup_config(config)
  with tempfile.TemporaryDirectory() as scratch:
    paths = Paths(scratch)
    for name in ("train", "eval", "val", "sft", "curated", "warmup"):
      os.makedirs(os.path.dirname(getattr(paths, name)), exist_ok=True)
      open(getattr(paths, name), "w").close()  # stand-ins, checked unread
    return {stage: parse_config(job_config(config, paths, stage=stage))
            for stage in ("vanilla", "rl")}


# ---- the data stage -----------------------------------------------------------


def sft_rows(records: list[dict], pipe: PipelineConfig, seed: int
             ) -> list[dict]:
  """Vanilla SFT rows: direct answers to plain prompts for a
  `direct_fraction` of the problems (a seeded choice), worked solutions for
  the rest, to the cued prompt for a `cued_fraction` of them and to the
  plain prompt otherwise. Table-inversion problems (kimi_jax/data/
  reflect.py) answer the plain prompt with a short search and the cued one
  with the full search."""
  rng, cue_rng = random.Random(seed), random.Random(seed + 1)
  # The table-inversion task's plain worked solutions draw a search budget.
  budget_rng = np.random.default_rng([seed, 3])
  rows = []
  for record in records:
    direct = rng.random() < pipe.direct_fraction
    # Its own stream: the direct choices do not depend on cued_fraction.
    cued = not direct and cue_rng.random() < pipe.cued_fraction
    prompt = record["prompt"] + (pipe.cot_cue if cued else "")
    if reflect.DATASET in record:
      # A short search for the plain prompt, the full one under the cue.
      style = "direct" if direct else "cued" if cued else "plain"
      response = reflect.worked_solution(record, style, budget_rng)
    else:
      response = solution(record, "direct" if direct else "cot")
    rows.append({"id": record["id"], "prompt": prompt, "response": response})
  return rows


def stage_data(config: ml_collections.ConfigDict, paths: Paths) -> dict:
  if os.path.exists(paths.data_done):
    with open(paths.data_done) as f:
      return json.load(f)
  pipe, gym = pipeline_config(config), gym_config(config)
  train, held = problem_sets(gym)
  val = validation_set(gym)
  sft = sft_rows(vanilla_problems(gym, pipe.sft_problems), pipe,
                 int(config.seed))
  groups: dict[str, list[str]] = {}
  for row in train:
    name = reflect.DATASET if reflect.DATASET in row else row["rg"]["dataset"]
    groups.setdefault(name, []).append(row["prompt"])
  groups["vanilla_sft"] = [r["prompt"] for r in sft]
  text_tokenizer.build_for(groups, paths.tokenizer, pipe.min_word_fraction)
  sets = [(paths.train, train), (paths.eval, held), (paths.sft, sft)]
  for path, rows in sets + ([(paths.val, val)] if val else []):
    curate_lib.write_jsonl(path, rows)
  info = {"train": len(train), "eval": len(held), "vanilla_sft": len(sft),
          "datasets": gym.names()}
  if val:
    info["val"] = len(val)
  _write_json(paths.data_done, info)
  return info


# ---- curation and warm-up data -----------------------------------------------


def _policy(paths: Paths):
  return load_policy(workdir=paths.vanilla)


def guarded_records(paths: Paths, fields) -> list[dict]:
  """The problems no RL prompt may repeat: the held-out ones, and the
  validation ones when there are any (curation's dedup drops repeats)."""
  return [r for path in (paths.eval, paths.val) if os.path.exists(path)
          for r in records_lib.load_prompt_source(path, fields)]


def stage_curate(config: ml_collections.ConfigDict, paths: Paths,
                 policy: Callable[[], Any], reward: RewardFn) -> dict | None:
  if not pipeline_config(config).curate:
    return None
  if os.path.exists(paths.curation):
    with open(paths.curation) as f:
      return json.load(f)
  cfg = tools_config.curate_config(config)
  # Finished chunks of model answers survive a kill mid-stage.
  journal = tools_config.model_journal(paths.curate_journal, policy(),
                                       config)
  result = curate_lib.curate(paths.train, cfg, policy=policy(),
                             reward=reward,
                             held_out=guarded_records(paths, cfg.fields()),
                             journal=journal,
                             progress=bool(config.log.progress))
  # The report is written last: its presence marks the stage finished.
  return curate_lib.write_outputs(result, paths.curated, paths.rejected,
                                  paths.curation)


def quality_only(cfg: curate_lib.CurateConfig) -> curate_lib.CurateConfig:
  """`cfg` with every step that asks the model or caps the set switched
  off: what is left judges the data (format, dedup, tags), not what RL
  should learn from."""
  return dataclasses.replace(cfg, easy_to_hack=False, pass_rate=False,
                             max_per_tag=0, bucket_shares=(),
                             answer_shift=False)


def clean_records(config: ml_collections.ConfigDict, paths: Paths
                  ) -> list[dict]:
  """The train problems that pass curation's data-quality steps, in train
  order, written to W/data/clean.jsonl for inspection. Model-free, so a
  run and the same run without curation get the same list."""
  cfg = quality_only(tools_config.curate_config(config))
  result = curate_lib.curate(paths.train, cfg,
                             held_out=guarded_records(paths, cfg.fields()))
  curate_lib.write_jsonl(paths.clean, [r.output() for r in result.kept])
  return [r.record for r in result.kept]


def warmup_records(config: ml_collections.ConfigDict, paths: Paths
                   ) -> tuple[list[dict], str]:
  """(the records the warm-up rows are sampled for, where they are from),
  per `pipeline.warmup_from`."""
  pipe = pipeline_config(config)
  if pipe.warmup_from == "clean":
    return clean_records(config, paths), paths.clean
  path = (paths.curated if pipe.warmup_from == "curated" and pipe.curate
          else paths.train)
  fields = tools_config.curate_config(config).fields()
  return list(records_lib.load_prompt_source(path, fields)), path


def stage_warmup(config: ml_collections.ConfigDict, paths: Paths,
                 policy: Callable[[], Any], reward: RewardFn) -> dict:
  if os.path.exists(paths.warmup_report):
    with open(paths.warmup_report) as f:
      return json.load(f)
  cfg = tools_config.warmup_config(config)
  records, source = warmup_records(config, paths)
  journal = tools_config.model_journal(paths.warmup_journal, policy(),
                                       config)
  result = warmup.rejection_sample(records, cfg, policy=policy(),
                                   reward=reward, journal=journal,
                                   progress=bool(config.log.progress))
  if not result.rows:
    raise ConfigError("warm-up: no verified response to train on; see "
                      "the acceptance rates (more vanilla_sft_steps, or "
                      "more warmup.samples)")
  curate_lib.write_jsonl(paths.warmup, result.rows)
  report = dict(result.report(), input=source, output=paths.warmup)
  _write_json(paths.warmup_report, report)
  return report


# ---- the two training runs ------------------------------------------------------


def small_curated_set(kept: int, prompts_per_iteration: int) -> str | None:
  """A warning when curation left fewer prompts than one RL iteration
  draws: RL on a set that small learns its prompts and loses held-out
  accuracy (measured: docs/gym_pipeline.md)."""
  if kept >= prompts_per_iteration:
    return None
  return (f"{kept} curated prompts, fewer than one RL iteration draws "
          f"(rl.prompts_per_iteration={prompts_per_iteration}); more raw "
          f"problems (gym.size) give RL more to learn from")


def verifier_mismatch(data_reward: str, task_reward: str) -> str | None:
  """A warning when the data stages (curation's pass rates, the warm-up's
  rejection sampling) verify with another reward than RL and evaluation."""
  if data_reward == task_reward:
    return None
  return (f"curation and warm-up verify with config.reward.name="
          f"{data_reward!r}, RL and evaluation with config.task.reward="
          f"{task_reward!r}; set both to judge the data and the policy alike")


def _train(config: ml_collections.ConfigDict, workdir: str,
           init_from: str | None = None) -> dict:
  done = policies.stage_done(workdir)
  if done is not None:
    return done["summary"]
  init = None if init_from is None else (
      lambda job: policies.read_policy(init_from, policies.param_shardings(
          job.cfg, job.sharder))[0])
  summary = job_lib.train_and_evaluate(config, workdir, init_params=init)
  policies.mark_done(workdir, {"summary": summary})
  return summary


def _write_json(path: str, value: Any) -> None:
  if jax.process_index() == 0:
    write_json(path, value)


def _curation_summary(report: dict | None) -> dict:
  if report is None:
    return {"enabled": False}
  return {"enabled": True, "rows": report["rows"], "kept": report["kept"],
          "dropped": report["dropped"],
          "dropped_by_reason": report["dropped_by_reason"],
          "accounted": report.get("accounted"),
          "answer_shift_warnings": curate_lib.shift_warnings(report)}


def _warmup_summary(report: dict) -> dict:
  keys = ("prompts", "responses", "correct", "acceptance_rate", "rows",
          "acceptance_by_tag", "examples")
  return {k: report[k] for k in keys if k in report}


def _validation_summary(vanilla: dict, final: dict) -> dict:
  """The validation evaluations (runs with `gym.val_size` > 0)."""
  if "final_val" not in final:
    return {}
  return {"vanilla_val": vanilla.get("final_val"),
          "warmstart_val": final["warmstart_val"],
          "final_val": final["final_val"]}


def first_stages(config: ml_collections.ConfigDict, paths: Paths,
                 timed: Callable[[str, Callable[[], Any]], Any] = (
                     lambda name, fn: fn())) -> tuple[dict, dict]:
  """The data and vanilla-SFT stages (finished ones skipped): what every
  later stage starts from. Returns their records."""
  data = timed("data", lambda: stage_data(config, paths))
  val = f"{data['val']} validation / " if data.get("val") else ""
  log(f"gym pipeline: {data['train']} train / {data['eval']} held-out / "
      f"{val}{data['vanilla_sft']} vanilla-SFT problems")
  vanilla = timed("vanilla_sft", lambda: _train(
      job_config(config, paths, stage="vanilla"), paths.vanilla))
  return data, vanilla


def run_first_stages(config: ml_collections.ConfigDict, workdir: str
                     ) -> None:
  """Only the data and vanilla-SFT stages, into `workdir` (shared by the
  arms of an ablation that change nothing these stages read)."""
  check(config)
  os.makedirs(workdir, exist_ok=True)
  first_stages(config, Paths(workdir))


def first_stages_done(workdir: str) -> bool:
  paths = Paths(workdir)
  return (os.path.exists(paths.data_done) and
          policies.stage_done(paths.vanilla) is not None)


def copy_first_stages(source: str, target: str) -> None:
  """Starts pipeline workdir `target` from the finished data and vanilla
  stages of `source`, as if its own run had stopped right after them (the
  later stages then run in `target` as always). The copied vanilla run's
  config.json names `target`'s files (its tokenizer is what curation and
  the warm-up data load), so `source` may be deleted afterwards."""
  if not first_stages_done(source):
    raise FileNotFoundError(f"{source}: the data and vanilla stages have "
                            f"not finished")
  src, dst = Paths(source), Paths(target)
  os.makedirs(os.path.dirname(dst.data_done), exist_ok=True)
  for name in ("train", "eval", "val", "sft"):
    if name != "val" or os.path.exists(src.val):
      shutil.copyfile(getattr(src, name), getattr(dst, name))
  for name in ("tokenizer", "vanilla"):
    # Whole or not at all: what a killed copy left is replaced.
    shutil.rmtree(getattr(dst, name), ignore_errors=True)
    shutil.copytree(getattr(src, name), getattr(dst, name),
                    ignore=shutil.ignore_patterns(workdir_lock.LOCK_NAME))
  config_path = os.path.join(dst.vanilla, "config.json")
  with open(config_path) as f:
    config = json.load(f)
  write_json(config_path, repoint(config, source, target))
  # The data-stage marker last: with it the copy is complete.
  shutil.copyfile(src.data_done, dst.data_done)


def repoint(node: Any, old: str, new: str) -> Any:
  """`node` (JSON values) with every path under directory `old` moved to
  the same place under `new`."""
  if isinstance(node, dict):
    return {k: repoint(v, old, new) for k, v in node.items()}
  if isinstance(node, list):
    return [repoint(v, old, new) for v in node]
  old, new = old.rstrip(os.sep), new.rstrip(os.sep)
  if isinstance(node, str) and (node == old or node.startswith(old + os.sep)):
    return new + node[len(old):]
  return node


@workdir_lock.exclusive
def run(config: ml_collections.ConfigDict, workdir: str) -> dict:
  """Every stage (finished ones skipped); returns W/summary.json's content.
  A second job on the same workdir stops with `WorkdirBusyError`."""
  t0 = time.perf_counter()
  check(config)
  # Built before any stage: a bad reward section fails in seconds.
  reward = tools_config.make_reward(config)
  paths = Paths(workdir)
  os.makedirs(workdir, exist_ok=True)
  seconds: dict[str, float] = {}

  def timed(name: str, fn: Callable[[], Any]) -> Any:
    t = time.perf_counter()
    out = fn()
    seconds[name] = round(time.perf_counter() - t, 1)
    return out

  warning = verifier_mismatch(str(config.reward.name),
                              str(config.task.reward))
  if warning:
    log(f"gym pipeline: warning: {warning}")
  data, vanilla = first_stages(config, paths, timed)
  cache: dict[str, Any] = {}

  def policy():
    if "policy" not in cache:
      cache["policy"] = _policy(paths)
    return cache["policy"]

  curation = timed("curate", lambda: stage_curate(config, paths, policy,
                                                     reward))
  if curation is not None:
    log(f"gym pipeline: curation kept {curation['kept']} of "
        f"{curation['rows']} ({curation['dropped_by_reason']})")
    warning = small_curated_set(curation["kept"],
                                config.rl.prompts_per_iteration)
    if warning:
      log(f"gym pipeline: warning: {warning}")
    for warning in curate_lib.shift_warnings(curation):
      log(f"gym pipeline: warning: {warning}")
  warm = timed("warmup", lambda: stage_warmup(config, paths, policy, reward))
  log(f"gym pipeline: warm-up accepted {warm['correct']} of "
      f"{warm['responses']} responses, {warm['rows']} rows")
  cache.clear()
  final = timed("rl", lambda: _train(job_config(config, paths, stage="rl"),
                                     paths.rl, init_from=paths.vanilla))
  summary = {"curation": _curation_summary(curation),
             "warmup": _warmup_summary(warm),
             "vanilla_sft_steps": vanilla.get("sft_steps"),
             "vanilla_eval": vanilla["final_eval"],
             "warmstart_eval": final["warmstart_eval"],
             "final_eval": final["final_eval"],
             "gain": (final["final_eval"]["pass_at_1"] -
                      final["warmstart_eval"]["pass_at_1"]),
             **_validation_summary(vanilla, final),
             "data": data, "seconds": dict(seconds, total=round(
                 time.perf_counter() - t0, 1))}
  _write_json(os.path.join(workdir, SUMMARY_FILE), summary)
  log(f"gym pipeline: held-out pass@1 vanilla "
      f"{summary['vanilla_eval']['pass_at_1']:.3f}, warm start "
      f"{summary['warmstart_eval']['pass_at_1']:.3f}, after RL "
      f"{summary['final_eval']['pass_at_1']:.3f}")
  return summary
