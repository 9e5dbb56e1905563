"""The long2short experiment: stages in one workdir, then the comparison.

  WORKDIR/base            SFT on plain chains from the seeded init: the
                          common ancestor of the long and short models
  WORKDIR/long            the main job (kimi_jax.job.train_and_evaluate)
                          from base: long-CoT warm start, then RL
  WORKDIR/short_baseline  the same recipe on short answers
  WORKDIR/merge           alpha * long + (1 - alpha) * short
  WORKDIR/samples.json    n responses of the long model per train prompt
  WORKDIR/shortest_rs     the long model, SFT on each prompt's shortest
                          correct response
  WORKDIR/dpo             the long model, DPO on shortest-correct vs
                          incorrect / > 1.5x longer pairs
  WORKDIR/l2s_rl          the main job from the long model, no SFT, with
                          the `l2s_rl` keys replacing `rl`'s
  WORKDIR/long2short.json every model on the same held-out problems
  WORKDIR/token_efficiency.png

A gym-pipeline config (`pipeline` section, experiments/long2short_reflect.py)
takes its two models from the pipeline (kimi_jax/curation/gym_pipeline.py)
instead, and trains no base: its vanilla model is the common ancestor.

  WORKDIR/long            the gym pipeline; the long model is its RL stage,
                          WORKDIR/long/rl, and the other stages read its
                          data (train prompts, held-out and validation)
  WORKDIR/short_baseline  the same pipeline from a copy of long's data and
                          vanilla stages, its warm-up rows sampled for the
                          plain prompt (`short_pipeline_config`); the
                          policy: WORKDIR/short_baseline/rl

Each stage's directory is a run workdir (`policies`): export, sampling and
resuming work on it. A stage that finished leaves `stage.json` (a pipeline,
`summary.json`) and is skipped when the command is run again; the main-job
stages resume from their checkpoints, a pipeline from its finished stages;
the others restart. `l2s.long_workdir` / `l2s.short_workdir` take existing
runs instead of training them (then no base is trained).
"""

from __future__ import annotations

import dataclasses
import functools
import json
import os
import shutil
import time
from typing import Any, Callable, Mapping, Sequence

import jax
import ml_collections
import numpy as np

from kimi_jax import sft as sft_lib
from kimi_jax import train_step as ts
from kimi_jax.curation import gym_pipeline
from kimi_jax.curation.curate import write_jsonl
from kimi_jax.data import pointer_chase, reflect, tasks
from kimi_jax.data.journal import CHUNK_PROMPTS, Journal, ModelCalls, digest
from kimi_jax.infra import workdir_lock
from kimi_jax.infra import metrics as metrics_lib
from kimi_jax.infra.config import ConfigError
from kimi_jax.infra.console import log
from kimi_jax.infra.files import write_json
from kimi_jax.job import run as job_lib
from kimi_jax.job import workdir as workdir_lib
from kimi_jax.job.experiment import ExperimentConfig, parse_config
from kimi_jax.long2short import dpo, merge, policies, report, samples, shortest
from kimi_jax.long2short.config import (Long2ShortConfig, SECTIONS,
                                        check_long2short, l2s_config)
from kimi_jax.rl.evaluation import Evaluator
from kimi_jax.sharding import batch_shardings, place_batch
from kimi_jax.step_loop import Cycle, Progress, discard, run_steps, settings_key

RESULT_FILE = "long2short.json"
FIGURE_FILE = "token_efficiency.png"
# The short-only baseline's warm-up section of a gym pipeline
# (short_pipeline_config).
SHORT_WARMUP = {"template": "{prompt}", "keep": "shortest",
                "accept": "answer"}
# Shortest rejection sampling's SFT rows, in its stage directory.
RS_ROWS_FILE = "sft_rows.jsonl"


# ---- configs of the stages ----------------------------------------------------


def job_sections(config: ml_collections.ConfigDict
                 ) -> ml_collections.ConfigDict:
  """The main-job config: `config` without the long2short sections (an
  unlocked copy)."""
  return ml_collections.ConfigDict(
      {k: v for k, v in config.to_dict().items() if k not in SECTIONS})


def _copy(config: ml_collections.ConfigDict) -> ml_collections.ConfigDict:
  return ml_collections.ConfigDict(config.to_dict())


def _plain_chains(job_config: ml_collections.ConfigDict
                  ) -> ml_collections.ConfigDict:
  """`job_config` with the task's warm start on plain chains (no detours,
  no rechecks, no direct answers)."""
  c = _copy(job_config)
  c.task.update(dict(cot_style="plain", detour_rate=0.0, max_detours=0,
                     recheck_rate=0.0, max_rechecks=0, direct_fraction=0.0))
  return c


def short_config(job_config: ml_collections.ConfigDict,
                 l2s: Long2ShortConfig) -> ml_collections.ConfigDict:
  """The short-only recipe: the same job, its warm start on
  `l2s.short_cot_style` answers ("direct": the answer alone; "plain": the
  plain chain)."""
  c = _plain_chains(job_config)
  if l2s.l2s.short_cot_style == "direct":
    c.task.direct_fraction = 1.0
  return c


def base_config(job_config: ml_collections.ConfigDict,
                l2s: Long2ShortConfig) -> ml_collections.ConfigDict:
  """The common ancestor: SFT on plain chains (where the hidden permutation
  is learned), `l2s.base_sft_steps` steps in rows of `l2s.base_seq_len`,
  the job's SFT settings otherwise."""
  c = _plain_chains(job_config)
  c.sft.steps = l2s.l2s.base_sft_steps
  c.sft.seq_len = l2s.l2s.base_seq_len
  return c


def rs_config(job_config: ml_collections.ConfigDict,
              l2s: Long2ShortConfig, rows_path: str = ""
              ) -> ml_collections.ConfigDict:
  """Shortest rejection sampling's SFT, on the long run's config, reading
  the selected rows from `rows_path` ("": a task with warm-start pairs of
  its own, which `sft_policy`'s texts replace)."""
  c = _copy(job_config)
  rs = l2s.shortest_rs
  c.sft.update(dict(steps=rs.steps, batch_size=rs.batch_size,
                    learning_rate=rs.learning_rate,
                    warmup_steps=rs.warmup_steps, decay="constant",
                    stage2_steps=0, train_path=rows_path))
  return c


def l2s_rl_config(job_config: ml_collections.ConfigDict,
                  l2s: Long2ShortConfig) -> ml_collections.ConfigDict:
  """The second RL phase: no SFT; `l2s_rl` keys replace `rl`'s."""
  c = _copy(job_config)
  # No SFT; the job still builds the SFT optimizer, whose decay must fit
  # the 0 steps.
  c.sft.update(dict(steps=0, decay="constant"))
  c.rl.update(l2s.l2s_rl.rl_overrides())
  return c


def short_pipeline_config(sections: ml_collections.ConfigDict
                          ) -> ml_collections.ConfigDict:
  """The short-only recipe of a gym-pipeline config: the same stages and
  settings, the warm-up rows sampled from the vanilla model for the plain
  prompt (no `pipeline.cot_cue`, so its short mode answers) and each
  prompt's shortest right answer kept. Answers are judged alone: a bare
  answer or a short search ending in a guess has no checked path for a
  step check to verify."""
  c = _copy(sections)
  c.warmup.update(SHORT_WARMUP)
  return c


def check(config: ml_collections.ConfigDict) -> Long2ShortConfig:
  """Every section typed and the long2short ones related to the job's,
  before anything runs; returns the long2short sections. Raises
  ConfigError (or ValueError) naming the key."""
  l2s = l2s_config(config)
  sections = job_sections(config)
  from_pipeline = gym_pipeline.is_pipeline(sections)
  if from_pipeline:
    names = gym_pipeline.gym_config(sections).names()
    if tuple(names) != (reflect.DATASET,):
      raise ConfigError(
          f"config.gym.datasets: long2short on a gym pipeline needs the "
          f"shortest correct response of each held-out problem, which the "
          f"{reflect.DATASET!r} task defines; got {list(names)}")
    job = gym_pipeline.check(sections)["rl"]
  else:
    job = parse_config(sections)
  check_long2short(l2s, job, pipeline=from_pipeline)
  return l2s


def shortest_solution_tokens(record: Mapping[str, Any]) -> int:
  """Tokens of the shortest correct response to `record`, eos included:
  the task's own (the plain chain of pointer chasing, the bare answer of
  table inversion)."""
  if reflect.DATASET in record:
    return reflect.minimal_length(record)
  return pointer_chase.minimal_length(record)


# ---- stages -----------------------------------------------------------------------


@dataclasses.dataclass
class Context:
  """What every stage shares: configs, the workdir, a job built on the long
  run's config (its sampler and sharder serve sampling, DPO and the
  evaluation of every model), stage timings."""

  config: ml_collections.ConfigDict  # the main-job sections
  cfg: ExperimentConfig
  l2s: Long2ShortConfig
  workdir: str
  seconds: dict[str, float] = dataclasses.field(default_factory=dict)
  _tools: job_lib.Job | None = None

  def path(self, name: str) -> str:
    return os.path.join(self.workdir, name)

  @property
  def tools(self) -> job_lib.Job:
    if self._tools is None:
      self._tools = job_lib.build(self.cfg, self.path("eval"))
    return self._tools

  def shardings(self) -> Any:
    return policies.param_shardings(self.cfg, self.tools.sharder)

  def params(self, workdir: str) -> Any:
    """A fresh copy of a stage's policy (fresh: train steps donate their
    state, and a stage must not consume another's params)."""
    return policies.read_policy(workdir, self.shardings())[0]


def _timed(seconds: dict[str, float], name: str, fn: Callable[[], Any]
           ) -> Any:
  t0 = time.perf_counter()
  out = fn()
  seconds[name] = time.perf_counter() - t0
  return out


def _fresh(path: str) -> None:
  """A pipeline-run stage restarts from nothing."""
  if jax.process_index() == 0 and os.path.exists(path):
    shutil.rmtree(path)


def sft_policy(config: ml_collections.ConfigDict, workdir: str,
               params: Any, texts: list[tuple[str, str]] | None = None
               ) -> Any:
  """The job's SFT stage (`kimi_jax.job.run.run_sft`) on `config`'s sft
  section from `params`, on the task's warm-start pairs or on `texts`
  (prompt, response) pairs; writes the result as a policy in `workdir`."""
  cfg = parse_config(config, jax.device_count())
  job = job_lib.build(cfg, workdir)
  if texts is not None:
    task = dataclasses.replace(job.task, warmstart=lambda seed: texts)
    job = dataclasses.replace(job, task=task, sft_data=sft_lib.make_sft_data(
        cfg.sft, task, cfg.task, cfg.seed, vision=cfg.model.vision))
  optimizer = job_lib.sft_optimizer(cfg)
  shardings = ts.state_shardings(optimizer, cfg.model, job.sharder)
  state = ts.create_state(params, optimizer, shardings)
  state = job_lib.run_sft(job, state, 0, None, optimizer, shardings)
  job.metrics.close()
  job.checkpointer.close()
  policies.write_policy(workdir, config, state.params)
  return state.params


def stage_base(ctx: Context) -> str:
  path = ctx.path("base")
  if policies.stage_done(path) is None:
    _fresh(path)
    config = base_config(ctx.config, ctx.l2s)
    cfg = parse_config(config, jax.device_count())
    log(f"long2short: base, {cfg.sft.steps} SFT steps on "
        f"{cfg.task.cot_style} chains")
    tools = ctx.tools
    init = job_lib.initial_params(dataclasses.replace(tools, cfg=cfg))
    _timed(ctx.seconds, "base", lambda: sft_policy(config, path, init))
    policies.mark_done(path, {"seconds": ctx.seconds["base"]})
  return path


def _main_job(ctx: Context, name: str, config: ml_collections.ConfigDict,
              init_from: str | None) -> str:
  """A main-job run in WORKDIR/name (resumed if it was interrupted),
  starting from `init_from`'s policy when given."""
  path = ctx.path(name)
  if policies.stage_done(path) is None:
    log(f"long2short: {name} (main job)"
        + (f" from {init_from}" if init_from else ""))
    init = None if init_from is None else (
        lambda job: policies.read_policy(init_from, policies.param_shardings(
            job.cfg, job.sharder))[0])
    summary = _timed(ctx.seconds, name, lambda: job_lib.train_and_evaluate(
        config, path, init_params=init))
    policies.mark_done(path, {"seconds": ctx.seconds[name],
                              "final_eval": summary["final_eval"]})
  return path


def stage_long(ctx: Context, base: str | None) -> str:
  if ctx.l2s.l2s.long_workdir:
    return ctx.l2s.l2s.long_workdir
  return _main_job(ctx, "long", _copy(ctx.config), base)


def stage_short(ctx: Context, base: str | None) -> str:
  if ctx.l2s.l2s.short_workdir:
    return ctx.l2s.l2s.short_workdir
  return _main_job(ctx, "short_baseline", short_config(ctx.config, ctx.l2s),
                   base)


def task_models(sections: ml_collections.ConfigDict, l2s: Long2ShortConfig,
                workdir: str) -> tuple[Context, str, str]:
  """A main-job config's long and short-only models (trained from a base
  unless both are given) and the context of the later stages."""
  ctx = Context(sections, parse_config(sections, jax.device_count()), l2s,
                workdir)
  need_base = not (l2s.l2s.long_workdir and l2s.l2s.short_workdir)
  base = stage_base(ctx) if need_base and l2s.l2s.base_sft_steps else None
  return ctx, stage_long(ctx, base), stage_short(ctx, base)


def _pipeline_done(workdir: str) -> bool:
  return os.path.isfile(os.path.join(workdir, gym_pipeline.SUMMARY_FILE))


def _given_pipeline(workdir: str, key: str) -> str:
  if not _pipeline_done(workdir):
    raise FileNotFoundError(f"config.l2s.{key}: {workdir} is not a finished "
                            f"gym pipeline (no {gym_pipeline.SUMMARY_FILE})")
  return workdir


def stage_long_pipeline(sections: ml_collections.ConfigDict,
                        l2s: Long2ShortConfig, workdir: str,
                        seconds: dict[str, float]) -> str:
  """The long model's gym pipeline in WORKDIR/long (its finished stages
  skipped, a killed one resumed); returns the pipeline workdir."""
  if l2s.l2s.long_workdir:
    return _given_pipeline(l2s.l2s.long_workdir, "long_workdir")
  path = os.path.join(workdir, "long")
  if not _pipeline_done(path):
    log("long2short: long (gym pipeline)")
    _timed(seconds, "long", lambda: gym_pipeline.run(sections, path))
  return path


def stage_short_pipeline(sections: ml_collections.ConfigDict,
                         l2s: Long2ShortConfig, workdir: str,
                         seconds: dict[str, float], long: str) -> str:
  """The short-only baseline's gym pipeline in WORKDIR/short_baseline:
  the long pipeline's data and vanilla stages copied (one ancestor for
  both models, which merging needs), the later stages run on
  `short_pipeline_config`; returns the pipeline workdir."""
  if l2s.l2s.short_workdir:
    return _given_pipeline(l2s.l2s.short_workdir, "short_workdir")
  path = os.path.join(workdir, "short_baseline")
  if _pipeline_done(path):
    return path
  log(f"long2short: short_baseline (gym pipeline from {long}'s data and "
      f"vanilla model, warm-up on the plain prompt)")

  def train() -> None:
    if not gym_pipeline.first_stages_done(path):
      gym_pipeline.copy_first_stages(long, path)
    gym_pipeline.run(short_pipeline_config(sections), path)

  _timed(seconds, "short_baseline", train)
  return path


def pipeline_models(sections: ml_collections.ConfigDict,
                    l2s: Long2ShortConfig, workdir: str
                    ) -> tuple[Context, str, str]:
  """A gym-pipeline config's long and short-only models (the RL stages of
  their pipelines) and the context of the later stages: the long model's
  own config, whose data (train prompts, held-out, validation) are the
  long pipeline's."""
  seconds: dict[str, float] = {}
  long = stage_long_pipeline(sections, l2s, workdir, seconds)
  short = stage_short_pipeline(sections, l2s, workdir, seconds, long)
  long_rl, short_rl = (gym_pipeline.Paths(d).rl for d in (long, short))
  config, cfg = workdir_lib.load_run(long_rl, jax.device_count())
  return Context(config, cfg, l2s, workdir, seconds), long_rl, short_rl


def stage_merge(ctx: Context, long: str, short: str) -> str:
  path = ctx.path("merge")
  if policies.stage_done(path) is None:
    _fresh(path)
    alpha = ctx.l2s.merge.alpha
    log(f"long2short: merge, {alpha} x long + {1 - alpha:g} x short")
    _timed(ctx.seconds, "merge", lambda: merge.merge_sources(
        long, short, path, alpha=alpha))
    policies.mark_done(path, {"alpha": alpha, "long": long, "short": short})
  return path


def stage_samples(ctx: Context, long: str) -> samples.Samples:
  """n responses of the long model per train prompt (shared by shortest
  rejection sampling and DPO); kept in WORKDIR/samples.json."""
  path = ctx.path("samples.json")
  task = ctx.tools.task
  l2s = ctx.l2s.l2s
  records = list(task.train)
  if l2s.sample_prompts:
    rng = np.random.default_rng([ctx.cfg.seed, 17])
    records = [records[i] for i in sorted(rng.choice(
        len(records), size=min(l2s.sample_prompts, len(records)),
        replace=False))]
  if os.path.isfile(path):
    with open(path) as f:
      data = json.load(f)
    by_id = {r["id"]: r for r in records}
    return samples.Samples(
        records=[by_id[i] for i in data["ids"]], prompts=data["prompts"],
        tokens=data["tokens"],
        lengths_PxN=np.asarray(data["lengths"], np.int32),
        correct_PxN=np.asarray(data["correct"], bool))
  log(f"long2short: sampling {l2s.samples_per_prompt} responses of the long "
      f"model for each of {len(records)} train prompts")
  # Finished chunks survive a kill: a rerun samples only the rest.
  journal = Journal(ctx.path("samples.journal.jsonl"),
                    context={"policy": os.path.abspath(long),
                             "task": ctx.cfg.task})
  out = _timed(ctx.seconds, "samples", lambda: samples.sample(
      ctx.tools.sampler, ctx.params(long), task, records,
      n=l2s.samples_per_prompt, max_response_len=ctx.cfg.rl.max_response_len,
      settings=ctx.cfg.sampler.sampling, seed=ctx.cfg.seed + 2,
      calls=ModelCalls(CHUNK_PROMPTS, journal, ctx.cfg.log.progress)))
  if jax.process_index() == 0:
    write_json(path, {
        "ids": [r["id"] for r in out.records], "prompts": out.prompts,
        "tokens": out.tokens, "lengths": out.lengths_PxN.tolist(),
        "correct": out.correct_PxN.tolist()})
  return out


def _untrained(ctx: Context, path: str, long: str, name: str, why: str
               ) -> str:
  """A method with nothing to train on keeps the long model, and says so
  (in the log, stage.json and long2short.json)."""
  log(f"long2short: {name}: {why}; its policy is the long model, untrained")
  policies.write_policy(path, ctx.config, ctx.params(long))
  return why


def stage_shortest_rs(ctx: Context, long: str, drawn: samples.Samples
                      ) -> str:
  path = ctx.path("shortest_rs")
  if policies.stage_done(path) is None:
    _fresh(path)
    rows = shortest.sft_rows(drawn, ctx.tools.task.tokenizer)
    record = {"examples": len(rows), "prompts": drawn.n_prompts}
    if rows:
      log(f"long2short: shortest rejection sampling, SFT on {len(rows)} "
          f"shortest correct responses ({drawn.n_prompts - len(rows)} "
          f"prompts without a correct one skipped)")
      rows_path = os.path.join(path, RS_ROWS_FILE)
      if jax.process_index() == 0:
        write_jsonl(rows_path, rows)
      # A task with warm-start pairs of its own takes the rows in their
      # place; a jsonl task reads them from the file, as a pipeline's
      # long-CoT SFT reads its warm-up rows.
      own = tasks.has_warmstart(ctx.cfg.task)
      config = rs_config(ctx.config, ctx.l2s, "" if own else rows_path)
      texts = [(r["prompt"], r["response"]) for r in rows] if own else None
      _timed(ctx.seconds, "shortest_rs", lambda: sft_policy(
          config, path, ctx.params(long), texts))
      record["seconds"] = ctx.seconds["shortest_rs"]
    else:
      record["untrained"] = _untrained(ctx, path, long, "shortest_rs", (
          "no sampled prompt has a correct response to fine-tune on"))
    policies.mark_done(path, record)
  return path


def train_dpo(ctx: Context, ref_params: Any, params: Any,
              pairs: list[dpo.Pair], metrics: metrics_lib.MetricsWriter,
              resume: Progress | None = None,
              earlier_rows: Sequence[dict] = ()) -> Any:
  """`dpo.steps` AdamW steps of the DPO loss against the frozen
  `ref_params`, from `params`; returns the trained params. With `resume`,
  a rerun continues from the last checkpoint (`kimi_jax.step_loop`), and
  the `earlier_rows` (the killed run's metrics) of the steps it does not
  repeat are written again before the new ones."""
  cfg, d = ctx.cfg, ctx.l2s.dpo
  sharder = ctx.tools.sharder
  shards = sharder.axis_size(sharder.rule_map["batch"])
  optimizer = ts.make_optimizer(d.optimizer())
  shardings = ts.state_shardings(optimizer, cfg.model, sharder)
  order = np.random.default_rng([cfg.seed, 23]).permutation(len(pairs))
  batches = dpo.make_batches(
      [pairs[i] for i in order], n_pairs=d.batch_pairs,
      n_rows=dpo.row_count(d.batch_pairs, shards), row_len=cfg.sft.seq_len,
      pad_id=ctx.tools.task.tokenizer.pad_id)
  # The frozen reference: log pi_ref(y|x) of every pair, once.
  ref_fn = jax.jit(functools.partial(dpo.pair_logp, cfg=cfg.model,
                                     sharder=sharder),
                   out_shardings=sharder.replicated())
  batches = [b.replace(ref_logp_Px2=np.asarray(jax.device_get(
      ref_fn(ref_params, place_batch(sharder, b))), np.float32))
             for b in batches]
  loss_fn = functools.partial(dpo.batch_loss, cfg=cfg.model, sharder=sharder,
                              beta=d.beta, nll_weight=d.nll_weight)
  step_fn, counter = ts.jit_train_step(
      loss_fn, optimizer, shardings, batch_shardings(sharder, batches[0]),
      matmul_dtype=cfg.model.matmul_jnp_dtype)
  state = ts.create_state(params, optimizer, shardings)
  earlier = list(earlier_rows)

  def keep_earlier(first_step: int) -> None:
    for row in earlier:
      if row["step"] <= first_step:
        metrics.write(row["step"], "dpo", {
            k: v for k, v in row.items() if k not in ("stage", "step")})
    earlier.clear()

  def read(step: int, m: Any, _) -> None:
    keep_earlier(step)
    _dpo_report(metrics, step, m)

  state = run_steps(step_fn, state, Cycle(batches), d.steps, sharder=sharder,
                    shardings=shardings, read=read, progress=resume,
                    what="DPO", bar=cfg.log.progress)
  keep_earlier(d.steps)  # a rerun that found every step done
  log(f"DPO: {d.steps} steps over {len(pairs)} pairs in {len(batches)} "
      f"batches, compiled {counter.count}x")
  return state.params


def _dpo_report(metrics: metrics_lib.MetricsWriter, step: int, m) -> None:
  m = jax.device_get(m)
  if not m["finite"]:
    raise ts.NonFiniteError(f"DPO step {step}: loss={m['loss']} grad_norm="
                            f"{m['grad_norm']}; the update was not applied")
  metrics.write(step + 1, "dpo", {k: float(v) for k, v in m.items()})


def stage_dpo(ctx: Context, long: str, drawn: samples.Samples) -> str:
  path = ctx.path("dpo")
  if policies.stage_done(path) is None:
    # A killed DPO run's metrics: kept for the steps a resume skips.
    earlier = [r for r in metrics_lib.read_jsonl(
        os.path.join(path, "metrics.jsonl")) if r.get("stage") == "dpo"]
    _fresh(path)
    pairs = dpo.all_pairs(drawn, long_ratio=ctx.l2s.dpo.long_ratio)
    record = {"pairs": len(pairs), "prompts": drawn.n_prompts}
    if pairs:
      log(f"long2short: DPO on {len(pairs)} pairs")
      os.makedirs(path, exist_ok=True)
      metrics = metrics_lib.MetricsWriter(path,
                                          enabled=jax.process_index() == 0)
      # Checkpoints beside the stage (which restarts from nothing), keyed
      # by everything the steps depend on.
      resume = Progress(path + ".progress", digest(
          long, settings_key(ctx.l2s.dpo), ctx.cfg.seed, ctx.cfg.model,
          ctx.cfg.sft.seq_len, pairs), ctx.l2s.dpo.checkpoint_every)
      params = _timed(ctx.seconds, "dpo", lambda: train_dpo(
          ctx, ctx.params(long), ctx.params(long), pairs, metrics, resume,
          earlier))
      metrics.close()
      policies.write_policy(path, ctx.config, params)
      discard(resume.directory)
      record["seconds"] = ctx.seconds["dpo"]
    else:
      record["untrained"] = _untrained(ctx, path, long, "dpo", (
          "the samples give no preference pair (no prompt with a correct "
          "response and an incorrect or a 1.5x longer one)"))
    policies.mark_done(path, record)
  return path


def stage_l2s_rl(ctx: Context, long: str) -> str:
  return _main_job(ctx, "l2s_rl", l2s_rl_config(ctx.config, ctx.l2s), long)


# ---- the comparison ---------------------------------------------------------------


def evaluate(ctx: Context, workdirs: dict[str, str]) -> dict[str, Any]:
  """Every model on the same held-out problems (and validation ones with
  `l2s.eval_val`); writes long2short.json and token_efficiency.png."""
  tools = ctx.tools
  # The held-out problems, and the validation ones when asked for (each
  # method's record then has them under "val").
  splits = ("eval", "val") if ctx.l2s.l2s.eval_val else ("eval",)
  evaluators = {split: Evaluator(
      tools.sampler, tools.task, samples=ctx.l2s.l2s.eval_samples,
      max_response_len=ctx.cfg.rl.max_response_len, seed=ctx.cfg.seed + 1,
      settings=ctx.cfg.sampler.sampling, split=split) for split in splits}
  methods = {}
  for name, path in workdirs.items():
    t0 = time.perf_counter()
    by_split = {split: report.method_record(e.sample(ctx.params(path)),
                                            e.records)
                for split, e in evaluators.items()}
    methods[name] = dict(by_split.pop("eval"), workdir=path, **by_split)
    note = (policies.stage_done(path) or {}).get("untrained")
    if note:
      methods[name]["untrained"] = note
    ctx.seconds[f"eval_{name}"] = time.perf_counter() - t0
    m = methods[name]
    val = (f"; validation pass@1 {m['val']['pass_at_1']:.3f}, mean tokens "
           f"{m['val']['mean_tokens']:.1f}" if "val" in m else "")
    log(f"long2short: {name}: pass@1 {m['pass_at_1']:.3f} (greedy "
        f"{m['greedy_accuracy']:.3f}), mean tokens {m['mean_tokens']:.1f}, "
        f"p90 {m['p90_tokens']:.0f}{val}")
  shortest_solution = float(np.mean([
      shortest_solution_tokens(r) for r in tools.task.eval]))
  result = {
      "methods": methods,
      "shortest_solution_tokens": shortest_solution,
      "targets": report.targets(methods, shortest_solution),
      "eval": {"problems": len(tools.task.eval),
               "samples_per_problem": ctx.l2s.l2s.eval_samples,
               "max_response_len": ctx.cfg.rl.max_response_len,
               **({"val_problems": len(tools.task.val)}
                  if "val" in splits else {})},
      "seconds": dict(ctx.seconds),
  }
  if jax.process_index() == 0:
    write_json(ctx.path(RESULT_FILE), result)
    report.plot_token_efficiency(methods, ctx.path(FIGURE_FILE))
  return result


def use_compile_cache(path: str) -> None:
  """Keeps every compiled program in `path` (JAX's persistent compilation
  cache): the long, short and long2short RL jobs and the evaluations compile
  the same programs, so the later ones load them. Process-wide; every
  program, however quick to compile (on a small CPU host the many small
  ones add up)."""
  from jax.experimental.compilation_cache import compilation_cache
  jax.config.update("jax_compilation_cache_dir", path)
  jax.config.update("jax_persistent_cache_min_compile_time_secs", 0.0)
  # A process that has compiled already decided it had no cache.
  compilation_cache.reset_cache()


@workdir_lock.exclusive
def run(config: ml_collections.ConfigDict, workdir: str) -> dict[str, Any]:
  """Every stage, then the comparison; returns long2short.json's content."""
  t0 = time.perf_counter()
  l2s = check(config)
  os.makedirs(workdir, exist_ok=True)
  sections = job_sections(config)
  models = (pipeline_models if gym_pipeline.is_pipeline(sections)
            else task_models)
  ctx, long, short = models(sections, l2s, workdir)
  drawn = stage_samples(ctx, long)
  workdirs = {"long": long, "short_baseline": short,
              "merge": stage_merge(ctx, long, short),
              "shortest_rs": stage_shortest_rs(ctx, long, drawn),
              "dpo": stage_dpo(ctx, long, drawn),
              "l2s_rl": stage_l2s_rl(ctx, long)}
  result = evaluate(ctx, workdirs)
  result["seconds"]["total"] = time.perf_counter() - t0
  if jax.process_index() == 0:
    write_json(ctx.path(RESULT_FILE), result)
  t = result["targets"]
  log(f"long2short: long/shortest-solution tokens "
      f"{t['long_over_shortest_solution']:.2f}; best method {t['best_method']}"
      f": pass@1 gap {t['best_pass_at_1_gap']:+.3f}, token ratio "
      f"{t['best_token_ratio']:.2f}; targets met: {t['met']}")
  return result
