"""The main job: supervised warm start, then Kimi k1.5 RL, resumable.

`train_and_evaluate(config, workdir)` is what `launch/tpu_run.py` calls, and
what a notebook calls. Rerunning with the same workdir resumes from the last
Orbax checkpoint: stage, step, params, optimizer, replay buffer, prompt
statistics and the ledger of trained groups all come back.
"""

from __future__ import annotations

import dataclasses
import os
import time
from typing import Any

import jax
import ml_collections

from kimi_jax import checkpoint as ckpt_lib
from kimi_jax.console import log, progress
from kimi_jax import metrics as metrics_lib
from kimi_jax import sft as sft_lib
from kimi_jax import train_step as ts
from kimi_jax.config import ConfigError, to_dataclass
from kimi_jax.data import tasks as tasks_lib
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.rl import prompt_sampling, rollout
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.loop import RLLoop
from kimi_jax.sampler.driver import Sampler
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.repetition import RepeatConfig
from kimi_jax.sharding import (MeshConfig, Sharder, make_mesh,
                               process_local_to_global, process_rows,
                               rules_from_config)


@dataclasses.dataclass(frozen=True)
class RunConfig:
  """The whole experiment, typed. Built once from the ConfigDict."""

  seed: int
  model: ModelConfig
  mesh: MeshConfig
  rules: tuple
  task: dict
  sft: sft_lib.SFTConfig
  engine: EngineConfig
  sampling: rollout.SamplingSettings
  repeat: RepeatConfig
  rl: RLConfig
  prompt_sampling: prompt_sampling.PromptSamplingConfig
  checkpoint_every: int
  max_to_keep: int
  progress: bool
  plots: bool
  init_from_hf: str


def parse_config(config: ml_collections.ConfigDict) -> RunConfig:
  """Validates every section; errors name the offending key."""
  s = config.sampler
  known_sampler = {"max_slots", "cache_len", "prefill_buckets",
                   "prefill_batch_buckets", "temperature", "top_k", "top_p",
                   "repeat_ngram", "repeat_times"}
  unknown = sorted(set(s.keys()) - known_sampler)
  if unknown:
    raise ConfigError(f"config.sampler: unknown keys {unknown}")
  model = to_dataclass(ModelConfig, config.model, "model")
  rl = to_dataclass(RLConfig, config.rl, "rl")
  engine = to_dataclass(EngineConfig, dict(
      max_slots=s.max_slots, cache_len=s.cache_len,
      prefill_buckets=tuple(s.prefill_buckets) or None,
      prefill_batch_buckets=tuple(s.get("prefill_batch_buckets", ())) or None),
      "sampler")
  if engine.cache_len > model.max_seq_len:
    raise ConfigError(f"config.sampler.cache_len ({engine.cache_len}) exceeds "
                      f"config.model.max_seq_len ({model.max_seq_len})")
  if rl.max_response_len >= engine.cache_len:
    raise ConfigError(f"config.rl.max_response_len ({rl.max_response_len}) "
                      f"leaves no room for the prompt in "
                      f"config.sampler.cache_len ({engine.cache_len})")
  wave = rl.prompts_per_iteration * rl.samples_per_prompt
  if rl.queued_prompts and wave > engine.max_slots:
    raise ConfigError(
        f"config.rl.queued_prompts: a queue needs one wave of "
        f"rl.prompts_per_iteration x rl.samples_per_prompt ({wave}) to fit "
        f"config.sampler.max_slots ({engine.max_slots}); the rollout window "
        f"would leave the rest unstarted")
  if rl.train_len_buckets and rl.train_len_buckets[-1] > model.max_seq_len:
    raise ConfigError("config.rl.train_len_buckets: largest bucket exceeds "
                      "config.model.max_seq_len")
  if config.checkpoint.every_iterations <= 0:
    raise ConfigError("config.checkpoint.every_iterations must be positive")
  return RunConfig(
      seed=int(config.seed), model=model,
      mesh=to_dataclass(MeshConfig, config.mesh, "mesh"),
      rules=rules_from_config(config.sharding.rules),
      task=dict(config.task), sft=to_dataclass(sft_lib.SFTConfig, config.sft,
                                                "sft"),
      engine=engine,
      sampling=to_dataclass(rollout.SamplingSettings, dict(
          temperature=s.temperature, top_k=s.top_k, top_p=s.top_p),
                            "sampler"),
      repeat=to_dataclass(RepeatConfig, dict(ngram=s.repeat_ngram,
                                             times=s.repeat_times),
                          "sampler.repeat"),
      rl=rl,
      prompt_sampling=to_dataclass(prompt_sampling.PromptSamplingConfig,
                                   config.prompt_sampling, "prompt_sampling"),
      checkpoint_every=int(config.checkpoint.every_iterations),
      max_to_keep=int(config.checkpoint.max_to_keep),
      progress=bool(config.log.progress), plots=bool(config.log.plots),
      init_from_hf=str(config.init_from_hf))


@dataclasses.dataclass
class Setup:
  """Everything built once per run."""

  cfg: RunConfig
  sharder: Sharder
  task: tasks_lib.Task
  tokenizer: Any
  optimizer_sft: Any
  optimizer_rl: Any
  shardings: ts.TrainState  # with the RL optimizer's state
  shardings_sft: ts.TrainState
  engine: Engine
  sampler: Sampler
  checkpointer: ckpt_lib.Checkpointer
  metrics: metrics_lib.MetricsWriter
  workdir: str


def build(config: ml_collections.ConfigDict, workdir: str) -> Setup:
  cfg = parse_config(config)
  sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
  hf_tokenizer = None
  if cfg.init_from_hf:
    from kimi_jax.model import tokenizer as tok_lib
    hf_tokenizer = tok_lib.load_hf_tokenizer(cfg.init_from_hf)
  task = tasks_lib.make_task(cfg.task, cfg.seed, hf_tokenizer)
  tokenizer = task.tokenizer
  if tokenizer.vocab_size > cfg.model.vocab_size:
    raise ConfigError(f"config.model.vocab_size ({cfg.model.vocab_size}) is "
                      f"smaller than the tokenizer's ({tokenizer.vocab_size})")
  opt_sft = ts.make_optimizer(ts.OptimizerConfig(
      learning_rate=cfg.sft.learning_rate, warmup_steps=cfg.sft.warmup_steps,
      weight_decay=cfg.sft.weight_decay, grad_clip=cfg.sft.grad_clip))
  opt_rl = ts.make_optimizer(ts.OptimizerConfig(
      learning_rate=cfg.rl.learning_rate, grad_clip=cfg.rl.grad_clip))
  shardings = ts.state_shardings(opt_rl, cfg.model, sharder)
  shardings_sft = ts.state_shardings(opt_sft, cfg.model, sharder)
  n_batch_shards = sharder.axis_size(sharder.rule_map["batch"])
  rows = cfg.rl.minibatch_prompts * cfg.rl.samples_per_prompt
  if rows % n_batch_shards or cfg.sft.batch_size % n_batch_shards:
    raise ConfigError(
        f"config.rl.minibatch_prompts x samples_per_prompt ({rows}) and "
        f"config.sft.batch_size ({cfg.sft.batch_size}) must divide over the "
        f"{n_batch_shards} batch shards of the mesh, or every device would "
        f"hold the whole batch")
  engine = Engine(cfg.model, cfg.engine, sharder=sharder)
  sampler = Sampler(engine, repeat=cfg.repeat)
  os.makedirs(workdir, exist_ok=True) if "://" not in workdir else None
  checkpointer = ckpt_lib.Checkpointer(os.path.join(workdir, "checkpoints"),
                                       max_to_keep=cfg.max_to_keep)
  metrics = metrics_lib.MetricsWriter(workdir,
                                      enabled=jax.process_index() == 0)
  if jax.process_index() == 0 and hasattr(tokenizer, "save"):
    tokenizer.save(workdir)
  return Setup(cfg, sharder, task, tokenizer, opt_sft, opt_rl, shardings,
               shardings_sft, engine, sampler, checkpointer, metrics, workdir)


def initial_params(setup: Setup):
  cfg = setup.cfg
  if cfg.init_from_hf:
    from kimi_jax.model import hf
    hf_cfg, params = hf.load_hf_checkpoint(
        cfg.init_from_hf, sharder=setup.sharder,
        param_dtype=cfg.model.param_dtype)
    arch = ("vocab_size", "d_model", "n_layers", "n_heads", "n_kv_heads",
            "head_dim", "mlp_dim", "tie_embeddings", "qkv_bias")
    wrong = [f"model.{k}: config {getattr(cfg.model, k)} vs checkpoint "
             f"{getattr(hf_cfg, k)}" for k in arch
             if getattr(cfg.model, k) != getattr(hf_cfg, k)]
    if wrong:
      raise ConfigError(f"config does not match {cfg.init_from_hf}: " +
                        "; ".join(wrong))
    return params
  return transformer.init_sharded(cfg.model, jax.random.key(cfg.seed),
                                  setup.sharder)


def _host_state(stage: str, **kw) -> dict:
  return dict(stage=stage, **kw)


def evaluate(setup: Setup, params, seed_offset: int) -> rollout.EvalResult:
  cfg = setup.cfg
  setup.engine.load_params(params)
  return rollout.evaluate(
      setup.sampler, setup.task.eval, setup.task.encode_prompt,
      setup.task.reward, setup.tokenizer, samples=cfg.rl.eval_samples,
      max_response_len=cfg.rl.max_response_len, seed=cfg.seed + seed_offset,
      settings=cfg.sampling)


def run_sft(setup: Setup, state: ts.TrainState, start_step: int,
            host: dict) -> ts.TrainState:
  """Stage one: supervised warm start, checkpointed on the way."""
  cfg = setup.cfg
  if setup.task.warmstart is None:
    raise ConfigError(f"config.sft.steps > 0 but task {setup.task.name!r} "
                      "has no warm-start data")
  pairs = sft_lib.encode_texts(setup.task.warmstart(cfg.seed),
                               setup.tokenizer, setup.task.encode_prompt)
  dataset = sft_lib.make_dataset(pairs, cfg.sft, setup.tokenizer.pad_id,
                                 cfg.seed)
  shapes = {k: (cfg.sft.batch_size,) + v.shape
            for k, v in dataset[0].items()}
  batch_sh = ts.batch_shardings(setup.sharder, shapes)
  rows = process_rows(batch_sh["tokens"], shapes["tokens"])
  loss_fn = lambda p, b: ts.cross_entropy_loss(p, b, cfg=cfg.model,
                                               sharder=setup.sharder)
  step_fn, counter = ts.jit_train_step(loss_fn, setup.optimizer_sft,
                                       setup.shardings_sft, batch_sh)
  every = max(1, cfg.sft.steps // 4)
  t0 = time.perf_counter()
  for step in progress(range(start_step, cfg.sft.steps), cfg.sft.steps,
                        "warm start (SFT)", cfg.progress, start_step):
    local = sft_lib.load_rows(dataset, step, cfg.sft.batch_size, rows)
    batch = {k: process_local_to_global(v, batch_sh[k], shapes[k])
             for k, v in local.items()}
    state, m = step_fn(state, batch)
    if (step + 1) % 10 == 0 or step + 1 == cfg.sft.steps:
      m = jax.device_get(m)
      if not m["finite"]:
        raise ts.NonFiniteError(
            f"SFT step {step}: loss={m['loss']} grad_norm={m['grad_norm']}; "
            "the update was not applied; the last good checkpoint is kept")
      setup.metrics.write(step + 1, "sft", dict(
          loss=m["loss"], grad_norm=m["grad_norm"],
          param_norm=m["param_norm"],
          steps_per_s=(step + 1 - start_step) / (time.perf_counter() - t0)))
    if (step + 1) % every == 0 and step + 1 < cfg.sft.steps:
      setup.checkpointer.save(step + 1, params=state.params,
                              opt_state=state.opt_state,
                              host=_host_state("sft", sft_step=step + 1,
                                               **host))
  log(f"warm start: {cfg.sft.steps} steps, compiled {counter.count}x")
  return state


def train_and_evaluate(config: ml_collections.ConfigDict, workdir: str
                       ) -> dict:
  """Runs (or resumes) the whole job; returns the final summary."""
  setup = build(config, workdir)
  cfg = setup.cfg
  ckpt = setup.checkpointer
  latest = ckpt.latest_step()
  abstract = transformer.abstract_params(cfg.model)
  if latest is None:
    params = initial_params(setup)
    state = ts.create_state(params, setup.optimizer_sft,
                            setup.shardings_sft)
    host = _host_state("sft", sft_step=0)
    resumed_stage = None
    log(f"new run in {workdir}")
  else:
    host = ckpt.restore_host(latest)
    resumed_stage = host["stage"]
    # The optimizer state of the stage the checkpoint was written in.
    optimizer, shardings = ((setup.optimizer_sft, setup.shardings_sft)
                            if host["stage"] == "sft" else
                            (setup.optimizer_rl, setup.shardings))
    params, opt_state, host = ckpt.restore(
        latest, params_like=abstract, params_shardings=shardings.params,
        opt_state_like=jax.eval_shape(optimizer.init, abstract),
        opt_state_shardings=shardings.opt_state)
    state = ts.create_state(params, setup.optimizer_sft,
                            setup.shardings_sft)
    if opt_state is not None and host["stage"] == "sft":
      state = state.replace(opt_state=opt_state)
    log(f"resuming {workdir} from checkpoint {latest} "
         f"(stage {host['stage']})")
    if jax.process_index() == 0:
      it = int(host.get("iteration", 0))
      limits = ({"sft": cfg.sft.steps, "eval": it, "rl": it}
                if host["stage"] == "rl" else
                {"sft": int(host.get("sft_step", 0))})
      metrics_lib.drop_after(setup.metrics.path, limits)

  if host["stage"] == "sft":
    if cfg.sft.steps > 0:
      state = run_sft(setup, state, int(host.get("sft_step", 0)), {})
    warm = evaluate(setup, state.params, seed_offset=1)
    warm_d = dataclasses.asdict(warm)
    setup.metrics.write(0, "eval", warm_d)
    log(f"warm-start held-out pass@1 {warm.pass_at_1:.3f} "
         f"(greedy {warm.greedy_accuracy:.3f}, mean length "
         f"{warm.mean_length:.1f})")
    host = _host_state("rl", iteration=0, warmstart_eval=warm_d)
    ckpt.save(_rl_step(cfg, 0), params=state.params, host=host)

  loop = RLLoop(setup, host)
  rl_opt_state = opt_state if resumed_stage == "rl" else None
  summary = loop.run(state.params, rl_opt_state)
  setup.metrics.close()
  ckpt.close()
  return summary


def _rl_step(cfg: RunConfig, iteration: int) -> int:
  """Checkpoint step numbers: SFT steps first, then one per RL iteration."""
  return cfg.sft.steps + 1 + iteration
