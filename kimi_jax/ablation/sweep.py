"""The sweep: every run of an ablation's plan through the main job, resumed
where it stopped.

`run_sweep` runs the plan's runs without a `summary.json` through the main
job (an interrupted one resumes from its own checkpoint).

Runs of different seeds never share a file, so sweeps over disjoint seed
ranges (`first_seed`) may run at the same time on one workdir, e.g. one
process per seed on a machine with more cores; `--aggregate_only` then
aggregates them all. Processes over different arms (`--arms`) of one seed
share that seed's warm start: the first to reach it runs it while the
others wait on its lock (kimi_jax/infra/workdir_lock.py), then reuse it. Two
processes given the same run stop the second with a workdir error.

Shared warm start: when no arm changes anything the warm start reads (only
`rl.*` and `prompt_sampling.*` keys that the evaluation and the replay buffer
do not read), stage one is identical in every arm of a seed. `run_sweep`
then runs it once per seed (`workdir/warm_start/seed<seed>/`, a main-job run of
the base config with one RL iteration) and starts each arm's run from its
checkpoint of the warm-started policy, as if that run had been interrupted
right after stage one. The arm's run is the same main-job run either way
(tests/test_ablation.py checks that the metrics agree).

Pipeline ablations: a base with a `pipeline` section (experiments/
gym_tiny.py) runs each arm through the whole gym pipeline
(kimi_jax/curation/gym_pipeline.py: data, vanilla SFT, curation, warm-up
data, the main job), e.g. curation on against off. Their shared part is
the data and vanilla-SFT stages: when no arm changes what those read
(besides the keys above, `curate.*`, `warmup.*`, `pipeline.curate`,
`pipeline.warmup_from` and `pipeline.long_cot_*`), they run once per seed
in `workdir/warm_start/seed<seed>/` and each arm's run starts from a copy
of them. A run's metrics are then its main job's, `<run>/rl/metrics.jsonl`.
"""

from __future__ import annotations

import json
import os
import time
from typing import Any, Callable, Sequence

import jax
import ml_collections

from kimi_jax.ablation.spec import (METRICS, SPEC, SUMMARY, TIMING,
                                    WARM_START_DIR, Ablation, Run)
from kimi_jax.curation import gym_pipeline
from kimi_jax.infra import workdir_lock
from kimi_jax.infra import checkpoint as ckpt_lib
from kimi_jax.infra import metrics as metrics_lib
from kimi_jax.infra.config import ConfigError
from kimi_jax.infra.files import write_json
from kimi_jax.job.run import train_and_evaluate
from kimi_jax.job.workdir import load_run
from kimi_jax.model import transformer

RunFn = Callable[[ml_collections.ConfigDict, str], Any]


def check_spec(ablation: Ablation, workdir: str) -> None:
  """Writes the ablation's spec into a new sweep directory, or checks that
  an existing sweep ran the same one (a changed config would mix results)."""
  os.makedirs(workdir, exist_ok=True)
  path = os.path.join(workdir, SPEC)
  spec = json.loads(json.dumps(ablation.to_json(), default=str))
  if os.path.exists(path):
    with open(path) as f:
      old = json.load(f)
    if old != spec:
      changed = sorted(k for k in set(old) | set(spec)
                       if old.get(k) != spec.get(k))
      raise ConfigError(f"{path}: this sweep directory was started with a "
                        f"different ablation config (differs in {changed}); "
                        f"use a new --workdir")
    return
  write_json(path, spec)  # atomic: parallel sweeps write the same


def seed_warm_start(source_workdir: str, target_workdir: str, step: int
                    ) -> None:
  """Starts `target_workdir` from checkpoint `step` of `source_workdir` (the
  warm-started policy before RL) and its metrics up to that point, as if a
  run in `target_workdir` had been interrupted right after stage one."""
  _, cfg = load_run(source_workdir)
  source = ckpt_lib.Checkpointer(os.path.join(source_workdir, "checkpoints"),
                                 max_to_keep=None)
  target = ckpt_lib.Checkpointer(os.path.join(target_workdir, "checkpoints"),
                                 max_to_keep=None)
  try:
    if step not in source.all_steps():
      raise FileNotFoundError(f"{source_workdir}: no checkpoint step {step} "
                              f"(have {source.all_steps()})")
    abstract = transformer.abstract_params(cfg.model)
    replicated = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    params, _, host = source.restore(
        step, params_like=abstract,
        params_shardings=jax.tree.map(lambda _: replicated, abstract))
    if host.get("stage") != "rl" or host["loop"]["iteration"] != 0:
      raise ValueError(f"{source_workdir}: checkpoint {step} is not the "
                       f"warm-started policy (host {host.get('stage')!r})")
    target.save(step, params=params, host=host)
  finally:
    source.close()
    target.close()
  rows = [r for r in metrics_lib.read_jsonl(
      os.path.join(source_workdir, METRICS))
          if r.get("stage") == "sft" or (r.get("stage") == "eval" and
                                         r.get("step") == 0)]
  with open(os.path.join(target_workdir, METRICS), "w") as f:
    for r in rows:
      f.write(json.dumps(r, allow_nan=True) + "\n")


def _warm_start_step(config: ml_collections.ConfigDict) -> int:
  """The checkpoint step of the warm-started policy (kimi_jax.job.run.rl_step
  of iteration 0)."""
  return int(config.sft.steps) + 1


def run_sweep(ablation: Ablation, workdir: str, seeds: int, *,
              run_fn: RunFn | None = None,
              log: Callable[[str], None] = print,
              share_warm_start: bool | None = None,
              arms: Sequence[str] | None = None) -> list[Run]:
  """Runs every unfinished run of the plan, in order; returns the plan.

  run_fn(config, workdir): the main job (default
  `kimi_jax.job.train_and_evaluate`). A run with a `summary.json` is
  skipped; one without resumes from its own checkpoint if it has one.
  arms: only these arms' runs (e.g. one process per arm); None for all.
  """
  for arm in arms or ():
    ablation.overrides(arm)  # KeyError naming the known arms
  share = (ablation.shares_warm_start if share_warm_start is None else
           share_warm_start)
  if share and not ablation.shares_warm_start:
    raise ConfigError(f"ablation {ablation.name!r}: an arm changes a key the "
                      f"warm start reads; it cannot be shared")
  if run_fn is None:
    run_fn = gym_pipeline.run if ablation.pipeline else train_and_evaluate
  check_spec(ablation, workdir)
  plan = ablation.plan(workdir, seeds)
  todo = [r for r in plan if not r.finished and (arms is None or
                                                  r.arm in arms)]
  finished = sum(r.finished for r in plan)
  log(f"ablation {ablation.name}: {len(plan)} runs "
      f"({len(ablation.arms)} arms x {seeds} seeds), {finished} finished, "
      f"{len(todo)} to run"
      + (f" (arms {', '.join(arms)} only)" if arms else "")
      + ((" (shared data and vanilla SFT per seed)" if ablation.pipeline
          else " (shared warm start per seed)") if share and todo else ""))
  for i, run in enumerate(todo):
    config = ablation.run_config(run)
    os.makedirs(run.workdir, exist_ok=True)
    t0 = time.perf_counter()
    if share and ablation.pipeline:
      _share_first_stages(ablation, workdir, run, log)
    elif share and not os.path.isdir(os.path.join(run.workdir,
                                                  "checkpoints")):
      source = os.path.join(workdir, WARM_START_DIR, f"seed{run.seed}")
      # Processes for other arms of this seed wait here, then reuse it.
      with workdir_lock.held(source, wait=True):
        if not os.path.exists(os.path.join(source, SUMMARY)):
          log(f"[warm start seed{run.seed}] {source}")
          run_fn(ablation.warm_start_config(run.seed), source)
      seed_warm_start(source, run.workdir, _warm_start_step(config))
    log(f"[{i + 1}/{len(todo)}] {run.arm} {ablation.seed_key}={run.seed} "
        f"-> {run.workdir}")
    run_fn(config, run.workdir)
    write_json(os.path.join(run.workdir, TIMING),
                {"seconds": time.perf_counter() - t0})
  return plan


def _share_first_stages(ablation: Ablation, workdir: str, run: Run,
                        log: Callable[[str], None]) -> None:
  """A pipeline run's data and vanilla stages: copied from the seed's
  shared ones, which run first if they have not."""
  if gym_pipeline.first_stages_done(run.workdir):
    return  # a resumed run
  source = os.path.join(workdir, WARM_START_DIR, f"seed{run.seed}")
  with workdir_lock.held(source, wait=True):  # as for the warm start
    if not gym_pipeline.first_stages_done(source):
      log(f"[data and vanilla SFT seed{run.seed}] {source}")
      gym_pipeline.run_first_stages(ablation.warm_start_config(run.seed),
                                    source)
  gym_pipeline.copy_first_stages(source, run.workdir)
