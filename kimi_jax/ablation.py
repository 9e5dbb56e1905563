"""Ablations: the arms of a comparison, each run with several seeds, and the
results aggregated with error bars.

An ablation config (`experiments/ablations.py`) holds a `base` experiment,
its `arms` (name -> the keys that arm changes, as a nested section that
mirrors the base, e.g. `arms.rest.rl.loss = "rest"`) and the `seed_key` that
tells seeds apart. `Ablation.plan(workdir, seeds)` lists one run per arm and
seed, seeds `first_seed` .. `first_seed + seeds - 1`, in
`workdir/<arm>/seed<seed>/`; `run_sweep` runs those without a `summary.json`
through the main job (an interrupted one resumes from its own checkpoint);
`aggregate` reads every finished run back and reports the mean and the
sample standard deviation over seeds, per arm, of the final held-out metrics
and of the per-iteration curves; `plot` draws the curves with a band of one
standard deviation.

Runs of different seeds never share a file, so sweeps over disjoint seed
ranges (`first_seed`) may run at the same time on one workdir, e.g. one
process per seed on a machine with more cores; `--aggregate_only` then
aggregates them all. Processes over different arms (`--arms`) of one seed
share that seed's warm start: the first to reach it runs it while the
others wait on its lock (kimi_jax/workdir_lock.py), then reuse it. Two
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
(kimi_jax/gym_pipeline.py: data, vanilla SFT, curation, warm-up data, the
main job), e.g. curation on against off. Their shared part is the data and
vanilla-SFT stages: when no arm changes what those read (besides the keys
above, `curate.*`, `warmup.*`, `pipeline.curate`, `pipeline.warmup_from`
and `pipeline.long_cot_*`), they run once per seed in
`workdir/warm_start/seed<seed>/` and each arm's run starts from a copy of
them. A run's metrics are then its main job's, `<run>/rl/metrics.jsonl`.

Every arm also reports its gain, final minus warm-start held-out pass@1 per
seed, mean ± std.
"""

from __future__ import annotations

import dataclasses
import json
import os
import re
import time
from typing import Any, Callable, Iterable, Mapping, Sequence

import ml_collections
import numpy as np

from kimi_jax import workdir_lock
from kimi_jax.config import ConfigError, set_key
from kimi_jax.files import write_json

SUMMARY = "summary.json"
METRICS = "metrics.jsonl"
RESULTS = "ablation.json"
FIGURE = "ablation.png"
SPEC = "ablation_config.json"
TIMING = "ablation_run.json"
WARM_START_DIR = "warm_start"

# Held-out metrics of `summary.json`'s final evaluation, reported per arm.
FINAL_METRICS = ("pass_at_1", "greedy_accuracy", "mean_length")
# Per-iteration keys of the RL rows and the evaluation rows of metrics.jsonl.
RL_CURVES = ("accuracy", "reward", "length_mean")
EVAL_CURVES = ("pass_at_1", "greedy_accuracy", "mean_length")
# Keys that neither stage one nor the warm-start evaluation reads: arms that
# change only these can share one warm start per seed. The evaluation reads
# rl.eval_samples and rl.max_response_len; the replay buffer saved with the
# warm start is shaped by rl.samples_per_prompt and rl.max_wait_iterations.
_SHAREABLE_PREFIXES = ("rl.", "prompt_sampling.")
_NOT_SHAREABLE = ("rl.eval_samples", "rl.max_response_len",
                  "rl.samples_per_prompt", "rl.max_wait_iterations")
# Keys of a pipeline config that its data and vanilla-SFT stages do not
# read (they are read by curation, the warm-up data and the main job).
_PIPELINE_SHAREABLE = ("curate.", "warmup.", "pipeline.curate",
                       "pipeline.warmup_from", "pipeline.long_cot_")
_ARM_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]*$")


def flatten(section: Mapping[str, Any], prefix: str = "") -> dict[str, Any]:
  """A nested section as {dotted.key: value}, in insertion order."""
  out = {}
  for key, value in section.items():
    if isinstance(value, (ml_collections.ConfigDict, Mapping)):
      out.update(flatten(value, f"{prefix}{key}."))
    else:
      out[f"{prefix}{key}"] = value
  return out


def nest(overrides: Mapping[str, Any]) -> ml_collections.ConfigDict:
  """{dotted.key: value} as a nested ConfigDict (the inverse of flatten),
  keys in the given order."""
  out = ml_collections.ConfigDict(sort_keys=False)
  for dotted, value in overrides.items():
    node = out
    *parents, leaf = dotted.split(".")
    for part in parents:
      if part not in node:
        node[part] = ml_collections.ConfigDict(sort_keys=False)
      node = node[part]
    node[leaf] = value
  return out


@dataclasses.dataclass(frozen=True)
class Run:
  """One main-job run: an arm with one seed."""

  arm: str
  seed: int  # the value given to the seed key; the directory seed<seed>
  workdir: str

  @property
  def finished(self) -> bool:
    return os.path.exists(os.path.join(self.workdir, SUMMARY))


@dataclasses.dataclass(frozen=True)
class Ablation:
  """An ablation config, checked: every arm's keys exist in the base."""

  name: str
  description: str
  base: ml_collections.ConfigDict
  arms: tuple[tuple[str, dict[str, Any]], ...]
  seed_key: str
  first_seed: int

  @property
  def arm_names(self) -> tuple[str, ...]:
    return tuple(name for name, _ in self.arms)

  def overrides(self, arm: str) -> dict[str, Any]:
    for name, overrides in self.arms:
      if name == arm:
        return dict(overrides)
    raise KeyError(f"ablation {self.name!r} has no arm {arm!r} (arms: "
                   f"{list(self.arm_names)})")

  def plan(self, workdir: str, seeds: int) -> list[Run]:
    """Every (arm, seed) run, seed-major: after the first len(arms) runs
    each arm has one seed, so a partial sweep already compares arms."""
    if seeds < 1:
      raise ValueError(f"--seeds must be >= 1, got {seeds}")
    return [Run(arm, seed, os.path.join(workdir, arm, f"seed{seed}"))
            for seed in range(self.first_seed, self.first_seed + seeds)
            for arm in self.arm_names]

  def run_config(self, run: Run) -> ml_collections.ConfigDict:
    """The base config with the arm's keys and the seed set."""
    return self._config(self.overrides(run.arm), run.seed, f"arms.{run.arm}")

  def _config(self, overrides: Mapping[str, Any], seed: int, where: str
              ) -> ml_collections.ConfigDict:
    config = ml_collections.ConfigDict(self.base.to_dict())
    config.lock()
    for key, value in overrides.items():
      try:
        set_key(config, key, value)
      except ConfigError as exc:
        raise ConfigError(f"ablation {self.name!r}, {where}.{key}: {exc}"
                          ) from exc
    set_key(config, self.seed_key, seed)
    return config

  @property
  def pipeline(self) -> bool:
    """Whether each run is the whole gym pipeline, not the main job."""
    return "pipeline" in self.base

  @property
  def shares_warm_start(self) -> bool:
    """True when no arm changes a key that the shared part reads: stage
    one and its evaluation, or a pipeline's data and vanilla stages (see
    the module doc)."""
    extra = _PIPELINE_SHAREABLE if self.pipeline else ()
    return all(k.startswith(extra) or
               (k.startswith(_SHAREABLE_PREFIXES) and k not in _NOT_SHAREABLE)
               for _, overrides in self.arms for k in overrides)

  def metrics_path(self, run: Run) -> str:
    """The run's per-iteration metrics (a pipeline's: its main job's)."""
    return os.path.join(run.workdir, *(("rl",) if self.pipeline else ()),
                        METRICS)

  def warm_start_config(self, seed: int) -> ml_collections.ConfigDict:
    """The base config for a shared warm start: one RL iteration (the main
    job always runs some), no plots. (A pipeline's shared data and vanilla
    stages run no RL; these keys leave them as they are.)"""
    return self._config({"rl.iterations": 1, "rl.eval_every": 0,
                         "log.plots": False}, seed, "warm_start")

  def to_json(self) -> dict[str, Any]:
    """What defines the sweep's runs (first_seed only picks which)."""
    return {"name": self.name, "description": self.description,
            "seed_key": self.seed_key,
            "arms": {name: overrides for name, overrides in self.arms},
            "base": json.loads(self.base.to_json_best_effort())}


def parse_ablation(config: ml_collections.ConfigDict) -> Ablation:
  """The typed ablation; errors name the config key."""
  for key in ("name", "base", "arms", "seed_key"):
    if key not in config:
      raise ConfigError(f"ablation config: missing key {key!r}")
  arms = tuple((str(name), flatten(section))
               for name, section in config.arms.items())
  if len(arms) < 2:
    raise ConfigError(f"config.arms: an ablation needs at least two arms, "
                      f"got {[a for a, _ in arms]}")
  for name, _ in arms:
    if not _ARM_NAME.match(name) or name == WARM_START_DIR:
      raise ConfigError(f"config.arms.{name}: an arm name must be a plain "
                        f"directory name (letters, digits, _ -), not "
                        f"{WARM_START_DIR!r}")
  seen = {}
  for name, overrides in arms:
    key = json.dumps(overrides, sort_keys=True, default=str)
    if key in seen:
      raise ConfigError(f"config.arms.{name}: same settings as arm "
                        f"{seen[key]!r}")
    seen[key] = name
  ablation = Ablation(
      name=str(config.name), description=str(config.get("description", "")),
      base=config.base, arms=arms, seed_key=str(config.seed_key),
      first_seed=int(config.get("first_seed", 0)))
  # Every arm's keys exist in the base and have its types (errors name
  # config.arms.<arm>.<key>).
  for name, _ in arms:
    ablation.run_config(Run(name, ablation.first_seed, ""))
  return ablation


# ---- running -----------------------------------------------------------------

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
  import jax
  from kimi_jax import checkpoint as ckpt_lib
  from kimi_jax import metrics as metrics_lib
  from kimi_jax.model import transformer
  from kimi_jax.workdir import load_run

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
  """The checkpoint step of the warm-started policy (kimi_jax.job.rl_step
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
  if run_fn is None and ablation.pipeline:
    from kimi_jax.gym_pipeline import run as run_fn
  elif run_fn is None:
    from kimi_jax.job import train_and_evaluate as run_fn
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
  from kimi_jax import gym_pipeline
  if gym_pipeline.first_stages_done(run.workdir):
    return  # a resumed run
  source = os.path.join(workdir, WARM_START_DIR, f"seed{run.seed}")
  with workdir_lock.held(source, wait=True):  # as for the warm start
    if not gym_pipeline.first_stages_done(source):
      log(f"[data and vanilla SFT seed{run.seed}] {source}")
      gym_pipeline.run_first_stages(ablation.warm_start_config(run.seed),
                                    source)
  gym_pipeline.copy_first_stages(source, run.workdir)


# ---- aggregation ---------------------------------------------------------------


def mean_std(values: Sequence[float]) -> tuple[float, float | None]:
  """Mean and sample standard deviation (ddof=1; None for one value)."""
  x = np.asarray(values, np.float64)
  if x.size == 0:
    raise ValueError("mean_std of no values")
  return float(x.mean()), (float(x.std(ddof=1)) if x.size > 1 else None)


def _stat(values: Sequence[float]) -> dict[str, Any]:
  mean, std = mean_std(values)
  return {"mean": mean, "std": std, "values": [float(v) for v in values]}


def _curve(series: Sequence[Mapping[int, float]]) -> dict[str, Any]:
  """Mean and std per step over the steps every seed has."""
  steps = sorted(set.intersection(*(set(s) for s in series)))
  stats = [mean_std([s[t] for s in series]) for t in steps]
  return {"steps": steps, "mean": [m for m, _ in stats],
          "std": [s for _, s in stats]}


def read_run(run: Run, metrics_path: str) -> dict[str, Any]:
  """A finished run's final evaluation and per-iteration curves (from
  `metrics_path`: `Ablation.metrics_path(run)`)."""
  from kimi_jax.metrics import read_jsonl
  with open(os.path.join(run.workdir, SUMMARY)) as f:
    summary = json.load(f)
  rows = read_jsonl(metrics_path)
  curves = {}
  for stage, keys in (("rl", RL_CURVES), ("eval", EVAL_CURVES),
                      ("val", EVAL_CURVES)):
    for key in keys:
      curves[f"{stage}/{key}"] = {
          int(r["step"]): float(r[key]) for r in rows
          if r.get("stage") == stage and isinstance(r.get(key), (int, float))}
  timing_path = os.path.join(run.workdir, TIMING)
  seconds = None
  if os.path.exists(timing_path):
    with open(timing_path) as f:
      seconds = json.load(f)["seconds"]
  return {"final": summary["final_eval"],
          "warm_start": summary.get("warmstart_eval"),
          # Runs with a validation set (task.val_path, gym.val_size).
          "final_val": summary.get("final_val"),
          "iterations": summary.get("iterations"), "curves": curves,
          "seconds": seconds}


def aggregate(ablation: Ablation, plan: Sequence[Run]) -> dict[str, Any]:
  """Per arm, over its finished seeds: mean ± std of the final held-out
  pass@1, greedy accuracy and mean response tokens (and of the final
  validation ones, `final_val`, when the runs have a validation set), and
  of every curve.

  The arms of one seed share the task, the initial weights and the warm
  start, so each arm after the first also gets `vs_reference`: mean ± std
  over the seeds both finished of (this arm - the first arm) per seed, a
  paired difference, less noisy than comparing the two means."""
  arms = {}
  finals: dict[str, dict[int, Mapping[str, float]]] = {}
  for arm in ablation.arm_names:
    runs = [r for r in plan if r.arm == arm and r.finished]
    if not runs:
      arms[arm] = {"seeds": [], "n_seeds": 0}
      continue
    data = [read_run(r, ablation.metrics_path(r)) for r in runs]
    finals[arm] = {r.seed: d["final"] for r, d in zip(runs, data)}
    keys = sorted(set.intersection(*(set(d["curves"]) for d in data)))
    arms[arm] = {
        "overrides": ablation.overrides(arm),
        "seeds": [r.seed for r in runs], "n_seeds": len(runs),
        "final": {k: _stat([d["final"][k] for d in data])
                  for k in FINAL_METRICS},
        "warm_start": ({k: _stat([d["warm_start"][k] for d in data])
                        for k in FINAL_METRICS}
                       if all(d["warm_start"] for d in data) else None),
        # After RL minus before it, per seed: what RL added.
        "gain": (_stat([d["final"]["pass_at_1"] -
                        d["warm_start"]["pass_at_1"] for d in data])
                 if all(d["warm_start"] for d in data) else None),
        "final_val": ({k: _stat([d["final_val"][k] for d in data])
                       for k in FINAL_METRICS}
                      if all(d["final_val"] for d in data) else None),
        "curves": {k: _curve([d["curves"][k] for d in data]) for k in keys
                   if all(d["curves"][k] for d in data)},
        "run_seconds": [d["seconds"] for d in data],
    }
  reference = ablation.arm_names[0]
  for arm in ablation.arm_names[1:]:
    seeds = sorted(set(finals.get(arm, {})) & set(finals.get(reference, {})))
    if seeds:
      arms[arm]["vs_reference"] = {
          "reference": reference, "seeds": seeds,
          **{k: _stat([finals[arm][s][k] - finals[reference][s][k]
                       for s in seeds]) for k in FINAL_METRICS}}
  return {"ablation": ablation.name, "description": ablation.description,
          "seed_key": ablation.seed_key, "std": "sample (ddof=1) over seeds",
          "arms": arms}


def _fmt(stat: Mapping[str, Any], digits: int) -> str:
  std = stat["std"]
  return (f"{stat['mean']:.{digits}f} ± {std:.{digits}f}" if std is not None
          else f"{stat['mean']:.{digits}f}")


def _signed(stat: Mapping[str, Any], digits: int) -> str:
  return ("+" if stat["mean"] >= 0 else "") + _fmt(stat, digits)


def _curve_at(curve: Mapping[str, Any] | None, step: int
              ) -> Mapping[str, Any] | None:
  if not curve or step not in curve["steps"]:
    return None
  i = curve["steps"].index(step)
  return {"mean": curve["mean"][i], "std": curve["std"][i]}


def markdown_table(results: Mapping[str, Any], early_step: int | None = None
                   ) -> str:
  """One row per arm: its settings and the final metrics, mean ± std;
  `early_step` adds pass@1 at that iteration (how fast it learns): held
  out, or validation when the runs have it (their periodic evaluations
  read it); left out when no run evaluated there. The paired difference
  to the first arm follows the final pass@1."""
  arms = results["arms"]
  reference = next(iter(arms))
  val = any(a.get("final_val") for a in arms.values())
  early_key = "val/pass_at_1" if val else "eval/pass_at_1"
  early = ({arm: _curve_at(a["curves"].get(early_key), early_step)
            for arm, a in arms.items() if a["n_seeds"]}
           if early_step is not None else {})
  if not any(early.values()):
    early_step = None  # no run evaluated at that iteration: no empty column
  head = ["arm", "settings", "seeds"]
  if early_step is not None:
    head.append(f"{'validation ' if val else ''}pass@1 at iteration "
                f"{early_step}")
  warm = any(a.get("gain") for a in arms.values())
  if warm:
    head.append("warm-start pass@1")
  head.append("final held-out pass@1")
  if warm:
    head.append("gain (final - warm start)")
  head += [f"Δ pass@1 vs {reference} (paired)", "greedy accuracy",
           "mean response tokens"]
  if val:
    head.append("final validation pass@1")
  lines = ["| " + " | ".join(head) + " |", "|" + "---|" * len(head)]
  for arm, a in arms.items():
    if not a["n_seeds"]:
      lines.append(f"| {arm} | | 0 |" + " |" * (len(head) - 3))
      continue
    settings = ", ".join(f"`{k}={v}`" for k, v in a["overrides"].items()
                         ) or "(base)"
    f = a["final"]
    cells = [arm, settings, str(a["n_seeds"])]
    if early_step is not None:
      cells.append(_fmt(early[arm], 3) if early[arm] else "")
    paired = a.get("vs_reference")
    if warm:
      cells.append(_fmt(a["warm_start"]["pass_at_1"], 3)
                   if a.get("gain") else "")
    cells.append(_fmt(f["pass_at_1"], 3))
    if warm:
      cells.append(_signed(a["gain"], 3) if a.get("gain") else "")
    cells += [_signed(paired["pass_at_1"], 3) if paired else "—",
              _fmt(f["greedy_accuracy"], 3), _fmt(f["mean_length"], 1)]
    if val:
      cells.append(_fmt(a["final_val"]["pass_at_1"], 3)
                   if a.get("final_val") else "")
    lines.append("| " + " | ".join(cells) + " |")
  return "\n".join(lines)


# (panel title, curve key) of the figure; the validation panel only when
# the runs have a validation set (their periodic evaluations read it).
PANELS = (("held-out pass@1", "eval/pass_at_1"),
          ("held-out greedy accuracy", "eval/greedy_accuracy"),
          ("training accuracy", "rl/accuracy"),
          ("training response length (tokens)", "rl/length_mean"))
VAL_PANEL = ("validation pass@1", "val/pass_at_1")


def plot(results: Mapping[str, Any], path: str, *,
         smooth: int = 5) -> str | None:
  """Curves per arm, mean over seeds with a ±1 std band; training curves
  averaged over a trailing window of `smooth` iterations (both the mean and
  the band), evaluation curves as measured."""
  arms = {a: d for a, d in results["arms"].items() if d["n_seeds"]}
  if not arms:
    return None
  import matplotlib
  matplotlib.use("Agg")
  import matplotlib.pyplot as plt
  panels = PANELS + ((VAL_PANEL,) if any(
      VAL_PANEL[1] in d["curves"] for d in arms.values()) else ())
  fig, axes = plt.subplots(1, len(panels), figsize=(4.6 * len(panels), 3.6),
                           squeeze=False)
  colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
  for ax, (title, key) in zip(axes.flat, panels):
    for i, (arm, data) in enumerate(arms.items()):
      curve = data["curves"].get(key)
      if not curve or not curve["steps"]:
        continue
      x = np.asarray(curve["steps"], np.float64)
      mean = np.asarray(curve["mean"], np.float64)
      std = np.asarray([s if s is not None else 0.0 for s in curve["std"]],
                       np.float64)
      if key.startswith("rl/") and smooth > 1:
        mean, std = _trailing_mean(mean, smooth), _trailing_mean(std, smooth)
      color = colors[i % len(colors)]
      ax.plot(x, mean, color=color, marker="." if len(x) < 20 else None,
              label=f"{arm} (n={data['n_seeds']})")
      ax.fill_between(x, mean - std, mean + std, color=color, alpha=0.2,
                      linewidth=0)
    ax.set_title(title + (f" ({smooth}-iter mean)" if key.startswith("rl/")
                          and smooth > 1 else ""), fontsize=10)
    ax.set_xlabel("RL iteration")
    ax.grid(alpha=0.3)
  axes.flat[0].legend(fontsize=8)
  fig.suptitle(f"ablation: {results['ablation']} (mean ± 1 std over seeds)")
  fig.tight_layout()
  fig.savefig(path, dpi=100)
  plt.close(fig)
  return path


def _trailing_mean(x: np.ndarray, window: int) -> np.ndarray:
  c = np.cumsum(np.concatenate([[0.0], x]))
  idx = np.arange(1, x.size + 1)
  lo = np.maximum(idx - window, 0)
  return (c[idx] - c[lo]) / (idx - lo)


def write_results(ablation: Ablation, workdir: str, plan: Sequence[Run]
                  ) -> dict[str, Any]:
  """`workdir/ablation.json` and `workdir/ablation.png`; returns the
  results."""
  results = aggregate(ablation, plan)
  write_json(os.path.join(workdir, RESULTS), results)
  plot(results, os.path.join(workdir, FIGURE))
  return results


def load_ablation(spec: str, overrides: Iterable[str] | Mapping[str, Any] = ()
                  ) -> Ablation:
  """`experiments/ablations.py:loss` (and overrides such as
  `{"base.rl.iterations": 10}`), parsed."""
  from kimi_jax.config import load_config
  return parse_ablation(load_config(spec, overrides))
