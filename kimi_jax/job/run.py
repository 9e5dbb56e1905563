"""The main job: supervised warm start, then Kimi k1.5 RL, resumable.

`train_and_evaluate(config, workdir)` is what `launch/tpu_run.py` calls, and
what a notebook calls. Rerunning with the same workdir resumes from the last
Orbax checkpoint: stage, step, params, optimizer, the SFT data position and
the RL loop's state (replay buffer, prompt statistics, counters) all come
back.

Checkpoint steps: SFT step n is step n; RL iteration i is step
`sft.steps + 1 + i` (step sft.steps + 1 is the warm-started policy before
any RL), so steps grow monotonically across stages. The host item of a
checkpoint is `{"stage": "sft", "sft_step": n, "data": <PackedBatches
state>}` or `{"stage": "rl", "loop": <LoopState JSON>}`.

A run from a Hugging Face checkpoint (`init_from_hf`) ends by writing the
policy to `WORKDIR/hf_export/` (a directory `transformers` loads); other
runs write no export (their tokenizer is not a Hugging Face one;
`launch/export_hf.py` can still write their weights and config.json).
"""

from __future__ import annotations

import dataclasses
import json
import os
import shutil
import time
from typing import Any, Callable, Iterable

import jax
import ml_collections
import numpy as np

from kimi_jax import sft as sft_lib
from kimi_jax import train_step as ts
from kimi_jax.data import tasks as tasks_lib
from kimi_jax.evaluation import in_training
from kimi_jax.infra import workdir_lock
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra import metrics as metrics_lib
from kimi_jax.infra.config import ConfigError
from kimi_jax.infra.console import log, progress
from kimi_jax.job.experiment import ExperimentConfig, as_run, parse_config
from kimi_jax.model import hf, transformer
from kimi_jax.reward_models import serving
from kimi_jax.rewards import registry
from kimi_jax.rl.evaluation import Evaluator
from kimi_jax.rl.learner import Learner
from kimi_jax.rl.loop import RLLoop
from kimi_jax.rl.loop_state import LoopState
from kimi_jax.sampler.build import make_sampler
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine
from kimi_jax.sharding import Sharder, batch_shardings, make_mesh, place_batch
from kimi_jax.token_rows import empty_rows, image_slots

# Where a run from a Hugging Face checkpoint writes its final policy.
EXPORT_DIR = "hf_export"


def rl_step(cfg: ExperimentConfig, iteration: int) -> int:
  """Checkpoint step of RL iteration `iteration` (see the module doc)."""
  return cfg.sft.steps + 1 + iteration


@dataclasses.dataclass(frozen=True)
class Job:
  """Everything built once per run."""

  cfg: ExperimentConfig
  workdir: str
  sharder: Sharder
  task: tasks_lib.Task
  engine: Engine
  sampler: Sampler
  learner: Learner
  evaluator: Evaluator
  checkpointer: ckpt_lib.Checkpointer
  metrics: metrics_lib.MetricsWriter
  # The SFT stage's packed batches (None when sft.steps == 0).
  sft_data: sft_lib.SFTData | None = None
  # The same evaluation on the task's validation set (None without one).
  validator: Evaluator | None = None
  # rl.eval_benchmarks at every held-out evaluation (None: none named).
  benchmarks: Any = None

  def save_iteration(self, loop_state: LoopState, train: ts.TrainState
                     ) -> None:
    """The loop's IterationSaver: one durable step per saved iteration."""
    self.checkpointer.save(
        rl_step(self.cfg, loop_state.iteration), params=train.params,
        opt_state=train.opt_state,
        host={"stage": "rl", "loop": loop_state.to_json()})

  def rl_loop(self) -> RLLoop:
    return RLLoop(rl=self.cfg.rl, seed=self.cfg.seed,
                  settings=self.cfg.sampler.sampling, task=self.task,
                  sampler=self.sampler, learner=self.learner)

  def initial_loop_state(self, warmstart_eval=None, warmstart_val=None
                         ) -> LoopState:
    rl = self.cfg.rl
    return LoopState.initial(
        group_size=rl.samples_per_prompt,
        max_wait_iterations=rl.max_wait_iterations, records=self.task.train,
        prompt_sampling=self.cfg.prompt_sampling,
        warmstart_eval=warmstart_eval, warmstart_val=warmstart_val)

  def validate(self, params, step: int) -> dict | None:
    """The validation evaluation of `params`, logged at `step` (kind
    "val"); None when the task has no validation set."""
    if self.validator is None:
      return None
    result = dataclasses.asdict(self.validator(params))
    self.metrics.write(step, "val", result)
    log(f"validation pass@1 {result['pass_at_1']:.3f} (greedy "
        f"{result['greedy_accuracy']:.3f}, {result['n_problems']} problems)")
    return result

  def run_benchmarks(self, params, step: int) -> None:
    """rl.eval_benchmarks' pass@1 of `params`, logged at `step` (stage
    "benchmarks"); nothing when it names none."""
    if self.benchmarks is None:
      return
    result = self.benchmarks(params)
    self.metrics.write(step, "benchmarks", result)
    log("benchmarks: " + ", ".join(f"{k} {v:.3f}" for k, v in
                                   result.items()))

  def restore_loop_state(self, data: dict) -> LoopState:
    rl = self.cfg.rl
    return LoopState.from_json(
        data, group_size=rl.samples_per_prompt,
        max_wait_iterations=rl.max_wait_iterations, records=self.task.train,
        prompt_sampling=self.cfg.prompt_sampling)


def build(cfg: ExperimentConfig, workdir: str) -> Job:
  sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
  hf_tokenizer = tasks_lib.hf_tokenizer(cfg.init_from_hf, cfg.task)
  # Every data file is read and checked before anything starts (the
  # reward's worker processes, the weights): the SFT set here, the prompt
  # sets in make_task before its reward.
  sft_file = (sft_lib.sft_source(cfg.sft)
              if cfg.sft.steps > 0 and cfg.sft.train_path else None)
  stage2_file = (sft_lib.sft_source(cfg.sft, cfg.sft.stage2_train_path)
                 if cfg.sft.steps > 0 and cfg.sft.stage2_train_path else None)
  task = tasks_lib.make_task(
      cfg.task, cfg.seed, hf_tokenizer,
      max_prompt_tokens=cfg.sampler.cache_len - cfg.rl.max_response_len,
      vision=cfg.model.vision)
  if task.tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"config.model.vocab_size ({cfg.model.vocab_size}) is "
                      f"smaller than the tokenizer's "
                      f"({task.tokenizer.vocab_size})")
  sft_data = (sft_lib.make_sft_data(cfg.sft, task, cfg.task, cfg.seed,
                                     source=sft_file,
                                     stage2_source=stage2_file,
                                     vision=cfg.model.vision)
              if cfg.sft.steps > 0 else None)
  sampler = make_sampler(cfg.model, cfg.sampler, sharder,
                         record_experts=cfg.rl.routing_replay)
  learner = Learner(cfg.model, cfg.rl, sharder,
                    cache_len=cfg.sampler.cache_len)
  # Held-out evaluation always uses the task's own verifier; RL may score
  # with a reward model instead (on this mesh, weights frozen).
  eval_task, task = task, _with_reward_model(cfg, task, sharder)
  evaluator = Evaluator(sampler, eval_task, samples=cfg.rl.eval_samples,
                        max_response_len=cfg.rl.max_response_len,
                        seed=cfg.seed + 1, settings=cfg.sampler.sampling)
  validator = (dataclasses.replace(evaluator, split="val")
               if len(eval_task.val) else None)
  benchmarks = in_training.build(cfg, eval_task, sampler)
  if "://" not in workdir:
    os.makedirs(workdir, exist_ok=True)
  checkpointer = ckpt_lib.Checkpointer(
      os.path.join(workdir, "checkpoints"),
      max_to_keep=cfg.checkpoint.max_to_keep)
  metrics = metrics_lib.MetricsWriter(
      workdir, enabled=jax.process_index() == 0, wandb=cfg.metrics,
      run_config=_flat_config(cfg) if cfg.metrics.wandb_project else None)
  if jax.process_index() == 0 and hasattr(task.tokenizer, "save"):
    task.tokenizer.save(workdir)
  return Job(cfg, workdir, sharder, task, sampler.engine, sampler, learner,
             evaluator, checkpointer, metrics, sft_data, validator,
             benchmarks)


def _flat_config(cfg: ExperimentConfig) -> dict[str, Any]:
  """The experiment as `section.key: value` (what W&B shows as the run's
  config)."""
  out = {"seed": cfg.seed, "init_from_hf": cfg.init_from_hf}
  for f in dataclasses.fields(cfg):
    value = getattr(cfg, f.name)
    if dataclasses.is_dataclass(value):
      for k, v in dataclasses.asdict(value).items():
        out[f"{f.name}.{k}"] = v if isinstance(
            v, (int, float, str, bool, type(None))) else str(v)
  return out


def data_metrics(job: Job) -> dict[str, int]:
  """Rows read, kept and skipped of every data file the run loaded."""
  reports = dict(job.task.reports)
  if job.sft_data is not None and job.sft_data.report is not None:
    reports["sft_train"] = job.sft_data.report
  if job.sft_data is not None and job.sft_data.stage2_report is not None:
    reports["sft_stage2"] = job.sft_data.stage2_report
  return {f"{name}_{k}": v for name, report in reports.items()
          for k, v in report.as_metrics().items()}


def _with_reward_model(cfg: ExperimentConfig, task: tasks_lib.Task,
                       sharder: Sharder) -> tasks_lib.Task:
  """The task with its RL reward swapped for the reward model that
  config.task.reward names (kimi_jax/reward_models); the task as is
  otherwise."""
  if not registry.needs_model(cfg.task.reward):
    return task
  reward = serving.build_reward(cfg.task.reward, cfg.reward_model, sharder,
                                verifier=task.reward,
                                task_tokenizer=task.tokenizer)
  log(f"RL reward: {cfg.task.reward} from {cfg.reward_model.path}")
  return dataclasses.replace(task, reward=reward)


def initial_params(job: Job):
  """The policy a new run starts from: the Hugging Face checkpoint (whose
  config.json the model section already came from), or a seeded init."""
  cfg = job.cfg
  if cfg.init_from_hf:
    _, params = hf.load_hf_checkpoint(
        cfg.init_from_hf, sharder=job.sharder,
        param_dtype=cfg.model.param_dtype)
    return params
  return transformer.init_sharded(cfg.model, cfg.seed, job.sharder)


def _learning_rates(optimizer_cfg: ts.OptimizerConfig, steps: int
                    ) -> np.ndarray:
  """The learning rate each of `steps` updates uses, for the metrics."""
  schedule = ts.learning_rate_schedule(optimizer_cfg)
  counts = jax.device_put(np.arange(steps, dtype=np.int32))
  return np.asarray(jax.jit(jax.vmap(schedule))(counts))


def _sft_host(step: int, data: sft_lib.SFTData) -> dict:
  host = {"stage": "sft", "sft_step": step, "data": data.batches.get_state()}
  if data.stage2 is not None:
    host["data2"] = data.stage2.get_state()
  return host


def run_sft(job: Job, state: ts.TrainState, start_step: int,
            data_state: dict | None, optimizer,
            shardings: ts.TrainState, stage2_state: dict | None = None
            ) -> ts.TrainState:
  """Stage one: supervised warm start on packed rows, checkpointed on the
  way with the data position, so a resumed stage sees the same batches.
  With `sft.stage2_train_path` the last `sft.stage2_steps` steps draw from
  that set instead (the long-CoT stage); its position is `stage2_state`.
  With `sft.stop_at_val` the stage ends at the first validation check
  that reaches it; the checkpoint of that step says so (`sft_stopped`), so
  a resumed job does not train on (`sft_steps_trained` reads how far it
  went).

  A step's metrics are read back after the next step is dispatched.
  """
  cfg = job.cfg
  data = job.sft_data
  if start_step:
    if data_state is None or (data.stage2 is not None and
                              stage2_state is None):
      raise ValueError(
          f"{job.workdir}: the SFT checkpoint at step {start_step} holds no "
          f"data position (written by an older version, or before "
          f"sft.stage2_train_path was set); start a new workdir")
    data.batches.set_state(data_state)
    if data.stage2 is not None:
      data.stage2.set_state(stage2_state)
  rows_sh = batch_shardings(job.sharder, empty_rows(
      cfg.sft.batch_size, cfg.sft.seq_len, job.task.tokenizer.pad_id,
      image_slots(cfg.model.vision)))
  loss_fn = lambda p, rows: ts.cross_entropy_loss(p, rows, cfg=cfg.model,
                                                  sharder=job.sharder)
  step_fn, counter = ts.jit_train_step(
      loss_fn, optimizer, shardings, rows_sh,
      matmul_dtype=cfg.model.matmul_jnp_dtype)
  lr = _learning_rates(cfg.sft.optimizer(), cfg.sft.steps)
  every = max(1, cfg.sft.steps // 4)
  target, check_every = cfg.sft.stop_at_val, cfg.sft.check_every
  if target and job.validator is None:
    raise ConfigError("sft.stop_at_val needs a validation set "
                      "(task.val_path, or task.val_fraction for pointer "
                      "chasing)")
  t0 = time.perf_counter()
  pending = None

  def report(step: int, m: dict[str, Any], data: dict[str, float]) -> None:
    m = jax.device_get(m)
    if not m["finite"]:
      raise ts.NonFiniteError(
          f"SFT step {step}: loss={m['loss']} grad_norm={m['grad_norm']}; "
          "the update was not applied; the last good checkpoint is kept")
    job.metrics.write(step + 1, "sft", dict(
        loss=m["loss"], grad_norm=m["grad_norm"],
        param_norm=m["param_norm"], learning_rate=float(lr[step]),
        steps_per_s=(step + 1 - start_step) / (time.perf_counter() - t0),
        **data))

  # The bar counts to sft.steps; a stage that stops early ends short of it.
  label = "warm start (SFT" + (
      f"; ends early at validation {cfg.sft.stop_metric} >= {target:g}"
      if target else "") + ")"
  for step in progress(range(start_step, cfg.sft.steps), cfg.sft.steps,
                       label, cfg.log.progress, start_step):
    batches = data.batches_at(step, cfg.sft)
    before = batches.position
    host = next(batches)
    state, metrics = step_fn(state, place_batch(job.sharder,
                                                sft_lib.token_rows(host)))
    if pending is not None:
      report(*pending)
    pending = (step, metrics, dict(
        examples=batches.position - before,
        data_stage=1 if batches is data.batches else 2,
        loss_tokens=float(host["mask"].sum()),
        row_fill=float((host["segment_ids"] > 0).mean())))
    done = step + 1
    stop = (target and done % check_every == 0 and done < cfg.sft.steps
            and reached(job, state.params, done, target,
                        cfg.sft.stop_metric))
    if stop or (done % every == 0 and done < cfg.sft.steps):
      report(*pending)
      pending = None
      job.checkpointer.save(done, params=state.params,
                            opt_state=state.opt_state,
                            host=dict(_sft_host(done, data),
                                      sft_stopped=bool(stop)))
    if stop:
      break
  else:
    done = cfg.sft.steps
  if pending is not None:
    report(*pending)
  packed = data.batches.position + (data.stage2.position
                                    if data.stage2 is not None else 0)
  log(f"warm start: {done} steps ({packed} examples packed), "
      f"compiled {counter.count}x")
  return state


def reached(job: Job, params, step: int, target: float,
            metric: str = "pass_at_1") -> bool:
  """Whether the validation `metric` of `params` reaches `target` (an SFT
  stage's stopping check at `step`, logged as stage "sft_val")."""
  result = dataclasses.asdict(job.validator(params))
  job.metrics.write(step, "sft_val", result)
  log(f"SFT step {step}: validation pass@1 {result['pass_at_1']:.3f}, "
      f"greedy {result['greedy_accuracy']:.3f} (stops at {metric} >= "
      f"{target:g})")
  return result[metric] >= target


def sft_optimizer(cfg: ExperimentConfig):
  """The SFT optimizer, with the schedule of SFTConfig.optimizer."""
  return ts.make_optimizer(cfg.sft.optimizer())


def export_policy(job: Job, params) -> str | None:
  """Writes `params` to WORKDIR/hf_export as a Hugging Face directory (runs
  from a Hugging Face checkpoint only); returns its path, or None.

  Every process takes part (the weights are gathered one at a time);
  process 0 writes. A rerun replaces the previous export: the new one is
  written next to it and swapped in once complete.
  """
  cfg = job.cfg
  if not cfg.init_from_hf:
    return None
  if "://" in job.workdir:
    log(f"no export to the remote workdir {job.workdir}: run "
        f"launch/export_hf.py --workdir {job.workdir} --out LOCAL_DIR")
    return None
  out = os.path.join(job.workdir, EXPORT_DIR)
  partial = out + ".partial"
  if jax.process_index() == 0 and os.path.exists(partial):
    shutil.rmtree(partial)
  hf.export_hf_directory(params, cfg.model, partial,
                         source_dir=cfg.init_from_hf)
  if jax.process_index() == 0:
    if os.path.exists(out):
      shutil.rmtree(out)
    os.replace(partial, out)
  log(f"exported the policy to {out} (Hugging Face format)")
  return out


def _write_summary(job: Job, loop_state: LoopState, final: dict,
                   final_val: dict | None, export: str | None) -> dict:
  summary = {"sft_steps": sft_steps_trained(job.metrics.path),
             "warmstart_eval": loop_state.warmstart_eval,
             "final_eval": final,
             "compiles": job.rl_loop().compile_counts(),
             "counters": dataclasses.asdict(loop_state.counters),
             "iterations": loop_state.iteration,
             "hf_export": export}
  if job.validator is not None:
    summary.update(warmstart_val=loop_state.warmstart_val,
                   final_val=final_val)
  if jax.process_index() == 0:
    with open(os.path.join(job.workdir, "summary.json"), "w") as f:
      json.dump(summary, f, indent=2)
    if job.cfg.log.plots:
      metrics_lib.plot_run(job.metrics.path, job.workdir)
  return summary


def sft_steps_trained(metrics_path: str) -> int:
  """Steps the SFT stage trained: fewer than sft.steps when it stopped at
  sft.stop_at_val."""
  return max((int(r["step"]) for r in metrics_lib.read_jsonl(metrics_path)
              if r.get("stage") == "sft"), default=0)


def _save_config(config: ml_collections.ConfigDict, workdir: str) -> None:
  """The experiment as run, so tools (export, sampling) can rebuild it."""
  if jax.process_index() != 0:
    return
  with open(os.path.join(workdir, "config.json"), "w") as f:
    f.write(config.to_json_best_effort(indent=2))


@workdir_lock.exclusive
def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str, *,
                       explicit_model: Iterable[str] = (),
                       init_params: Callable[[Job], Any] | None = None
                       ) -> dict:
  """Runs (or resumes) the whole job; returns the final summary.

  explicit_model: the `config.model` keys the user set (see
  `kimi_jax.job.experiment.explicit_model_keys`); with `init_from_hf` the model
  section comes from the checkpoint and these must agree with it.
  init_params: `fn(job) -> params` that a new run starts from instead of
  the config's own init (a second RL phase from an earlier run's policy,
  kimi_jax/long2short); a resumed run takes its checkpoint as always.
  A second job on the same workdir stops with `WorkdirBusyError`
  (kimi_jax/infra/workdir_lock.py).
  """
  cfg = parse_config(config, jax.device_count(),
                     explicit_model=explicit_model)
  job = build(cfg, workdir)
  _save_config(as_run(config, cfg), workdir)
  sft_opt = sft_optimizer(cfg)
  sft_shardings = ts.state_shardings(sft_opt, cfg.model, job.sharder)
  latest = job.checkpointer.latest_step()
  if latest is None:
    host, state = _new_run(job, init_params, sft_opt, sft_shardings)
    log(f"new run in {workdir}")
  else:
    host, params, opt_state = _restore(job, latest, sft_opt, sft_shardings)
    log(f"resuming {workdir} from checkpoint {latest} "
        f"(stage {host['stage']})")
    if jax.process_index() == 0:
      _drop_metrics_after(job, host)
    if host["stage"] == "sft":
      state = ts.create_state(params, sft_opt, sft_shardings)
      if opt_state is not None:
        state = state.replace(opt_state=opt_state)

  if host["stage"] == "sft":
    loop_state, train = _warm_start(job, state, host, sft_opt, sft_shardings)
  else:
    loop_state = job.restore_loop_state(host["loop"])
    train = job.learner.init_state(params, opt_state)
  loop_state, train, final, final_val = _reinforce(job, loop_state, train)
  export = export_policy(job, train.params)
  summary = _write_summary(job, loop_state, final, final_val, export)
  if job.benchmarks is not None:
    job.benchmarks.close()
  job.metrics.close()
  job.checkpointer.close()
  return summary


def _new_run(job: Job, init_params: Callable[[Job], Any] | None, sft_opt,
             sft_shardings: ts.TrainState) -> tuple[dict, ts.TrainState]:
  """A new run's host state and SFT state, at the config's initial
  parameters or `init_params(job)`; logs the data metrics."""
  host = {"stage": "sft", "sft_step": 0}
  if data_metrics(job):
    job.metrics.write(0, "data", data_metrics(job))
  start = initial_params if init_params is None else init_params
  return host, ts.create_state(start(job), sft_opt, sft_shardings)


def _restore(job: Job, step: int, sft_opt, sft_shardings: ts.TrainState
             ) -> tuple[dict, Any, Any]:
  """(host state, params, optimizer state) of checkpoint `step`, with the
  optimizer of the stage the checkpoint was written in."""
  host = job.checkpointer.restore_host(step)
  optimizer, shardings = ((sft_opt, sft_shardings)
                          if host["stage"] == "sft" else
                          (job.learner.optimizer, job.learner.shardings))
  abstract = transformer.abstract_params(job.cfg.model)
  params, opt_state, host = job.checkpointer.restore(
      step, params_like=abstract, params_shardings=shardings.params,
      opt_state_like=jax.eval_shape(optimizer.init, abstract),
      opt_state_shardings=shardings.opt_state)
  return host, params, opt_state


def _drop_metrics_after(job: Job, host: dict) -> None:
  """Drops the metrics a resumed run logs again: those past the
  checkpoint with host state `host`."""
  cfg = job.cfg
  it = int(host["loop"]["iteration"]) if host["stage"] == "rl" else 0
  # The final evaluation (at step rl.iterations) is run again, except
  # in an SFT-only run, whose final one is the warm start's (kept).
  last_eval = (it if it < cfg.rl.iterations or cfg.rl.iterations == 0
               else it - 1)
  # A stage that stopped early logged no step past its stop.
  limits = ({"data": 0, "sft": cfg.sft.steps, "sft_val": cfg.sft.steps,
             "eval": last_eval, "val": last_eval, "benchmarks": last_eval,
             "rl": it}
            if host["stage"] == "rl" else
            {"data": 0, "sft": int(host.get("sft_step", 0)),
             "sft_val": int(host.get("sft_step", 0))})
  metrics_lib.drop_after(job.metrics.path, limits)


def _warm_start(job: Job, state: ts.TrainState, host: dict, sft_opt,
                sft_shardings: ts.TrainState) -> tuple[LoopState, Any]:
  """The SFT stage (what is left of it), its evaluation and the checkpoint
  RL starts from; returns RL's initial loop state and train state."""
  cfg = job.cfg
  if cfg.sft.steps > 0 and not host.get("sft_stopped"):
    state = run_sft(job, state, int(host.get("sft_step", 0)),
                    host.get("data"), sft_opt, sft_shardings,
                    stage2_state=host.get("data2"))
  warm = dataclasses.asdict(job.evaluator(state.params))
  job.metrics.write(0, "eval", warm)
  job.run_benchmarks(state.params, 0)
  # An SFT-only job (the gym pipeline's vanilla stage) has no RL to warm.
  label = ("warm-start held-out pass@1" if cfg.rl.iterations > 0 else
           "held-out pass@1 after SFT")
  log(f"{label} {warm['pass_at_1']:.3f} "
      f"(greedy {warm['greedy_accuracy']:.3f}, mean length "
      f"{warm['mean_length']:.1f})")
  loop_state = job.initial_loop_state(
      warmstart_eval=warm, warmstart_val=job.validate(state.params, 0))
  job.checkpointer.save(rl_step(cfg, 0), params=state.params,
                        host={"stage": "rl", "loop": loop_state.to_json()})
  return loop_state, job.learner.init_state(state.params)


def _reinforce(job: Job, loop_state: LoopState, train: Any
               ) -> tuple[LoopState, Any, dict, dict | None]:
  """The RL stage (none in an SFT-only job) and the final evaluations;
  returns (loop state, train state, held-out eval, validation eval)."""
  cfg = job.cfg
  loop = job.rl_loop()
  if cfg.rl.iterations == 0:
    # Supervised warm start only: the warm-start evaluation is the final one.
    final = dict(loop_state.warmstart_eval)
    final_val = loop_state.warmstart_val
  else:
    # Periodic evaluations read the validation set when there is one, so
    # the held-out set is only read before and after RL.
    loop_state, train = loop.run(
        loop_state, train, evaluate=job.validator or job.evaluator,
        saver=job, metrics=job.metrics,
        checkpoint_every=cfg.checkpoint.every_iterations,
        show_progress=cfg.log.progress,
        eval_kind="eval" if job.validator is None else "val",
        benchmarks=job.benchmarks)
    final = dataclasses.asdict(job.evaluator(train.params))
    job.metrics.write(loop_state.iteration, "eval", final)
    job.run_benchmarks(train.params, loop_state.iteration)
    final_val = job.validate(train.params, loop_state.iteration)
    log(f"final held-out pass@1 {final['pass_at_1']:.3f} (greedy "
        f"{final['greedy_accuracy']:.3f}); compilations: "
        f"{loop.compile_counts()}")
  return loop_state, train, final, final_val
