"""The experiment's typed config: one frozen dataclass per section, and every
check that involves more than one section in one function.

`parse_config(config_dict)` is the boundary: after it nothing reads the
ConfigDict. Each section's own dataclass validates its fields (errors name
`config.section.key`); `check_experiment` validates how sections relate.

With `init_from_hf=DIR` the model section is the checkpoint's:
`DIR/config.json` gives the architecture, `config.model` the run settings
(dtypes, remat, max_seq_len), and a `config.model.*` key the user set
explicitly (`explicit_model`, see `explicit_model_keys`) must agree with the
checkpoint or the config is rejected naming the key. The rest of the
file's model section is a placeholder for runs without a checkpoint.
"""

from __future__ import annotations

import dataclasses
import os
from typing import Any, Iterable, Mapping

import ml_collections

from kimi_jax.data import pointer_chase
from kimi_jax.data.tasks import TaskConfig, check_data_config, task_config
from kimi_jax.infra.checkpoint import CheckpointConfig
from kimi_jax.infra.config import ConfigError, to_dataclass
from kimi_jax.infra.metrics import LogConfig
from kimi_jax.infra.wandb_log import MetricsConfig
from kimi_jax.model import hf
from kimi_jax.model.config import ModelConfig
from kimi_jax.reward_models.config import RewardModelConfig, rm_kind
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.prompt_sampling import PromptSamplingConfig
from kimi_jax.sampler.config import SamplerConfig
from kimi_jax.sft import SFTConfig
from kimi_jax.sharding import MeshConfig, rules_from_config

SECTIONS = ("model", "mesh", "sharding", "task", "sft", "sampler", "rl",
            "prompt_sampling", "checkpoint", "log")


@dataclasses.dataclass(frozen=True)
class ExperimentConfig:
  """A whole experiment, typed. `init_from_hf`: a local Hugging Face
  directory to start from instead of a random init ('' for none)."""

  seed: int
  init_from_hf: str
  model: ModelConfig
  mesh: MeshConfig
  rules: tuple
  task: TaskConfig
  sft: SFTConfig
  sampler: SamplerConfig
  rl: RLConfig
  prompt_sampling: PromptSamplingConfig
  checkpoint: CheckpointConfig
  log: LogConfig
  # Optional section: configs without it score with the task's verifier.
  reward_model: RewardModelConfig = RewardModelConfig()
  # Optional section: where metrics go besides JSONL and TensorBoard.
  metrics: MetricsConfig = MetricsConfig()


def explicit_model_keys(overrides: Iterable[str] | Mapping[str, Any]
                        ) -> tuple[str, ...]:
  """The `config.model` keys among command-line style overrides.

  overrides: a flat mapping (`{"model.n_layers": 3}`, what
  `ml_collections.config_flags.get_override_values` returns, or what
  `kimi_jax.infra.config.load_config` takes) or strings (`"model.n_layers=3"`,
  `"--config.model.n_layers=3"`).
  """
  keys = overrides.keys() if isinstance(overrides, Mapping) else (
      o.split("=", 1)[0] for o in overrides)
  out = []
  for key in keys:
    key = key[len("--config."):] if key.startswith("--config.") else key
    if key.startswith("model."):
      out.append(key[len("model."):])
  return tuple(dict.fromkeys(out))


def model_config(config: ml_collections.ConfigDict,
                 explicit_model: Iterable[str] = ()) -> ModelConfig:
  """The run's model: `config.model`, or with `init_from_hf` the
  checkpoint's architecture plus the run settings of `config.model` and the
  explicit `model.*` overrides (which must agree with the checkpoint)."""
  source = str(config.init_from_hf)
  if not source:
    return to_dataclass(ModelConfig, config.model, "model")
  section = dict(config.model.items())
  explicit = tuple(explicit_model)
  unknown = sorted(set(explicit) - set(section))
  if unknown:
    raise ConfigError(f"config.model: unknown keys {unknown}")
  chosen = {k: section[k] for k in hf.RUN_SETTINGS if k in section}
  chosen.update({k: section[k] for k in explicit})
  try:
    cfg = hf.merge_model_config(hf.model_config_from_hf(source), chosen,
                                source=source)
    return _extend_context(cfg, section.get("rope_scaling"))
  except (hf.HFCheckpointError, ValueError) as exc:
    raise ConfigError(f"config.init_from_hf={source}: {exc}") from None


def _extend_context(cfg: ModelConfig, scaling: Any) -> ModelConfig:
  """A checkpoint without rotary scaling, run with the experiment's
  `model.rope_scaling` (YaRN for a 32k model's 128k stage: the edit of
  config.json its model card asks for). A checkpoint with scaling of its
  own keeps it (a Llama 3.x checkpoint's llama3 rope)."""
  if not scaling or cfg.rope_scaling is not None:
    return cfg
  return dataclasses.replace(cfg, rope_scaling=dict(scaling.items()))


def as_run(config: ml_collections.ConfigDict, cfg: ExperimentConfig
           ) -> ml_collections.ConfigDict:
  """`config` with the model section the run uses (for a run from a Hugging
  Face checkpoint, the checkpoint's): what a workdir's config.json holds, so
  tools that read it back build the model that was trained."""
  out = ml_collections.ConfigDict(config.to_dict())
  out.model = ml_collections.ConfigDict(dataclasses.asdict(cfg.model))
  return out


def parse_config(config: ml_collections.ConfigDict,
                 n_devices: int | None = None, *,
                 explicit_model: Iterable[str] = ()) -> ExperimentConfig:
  """Every section typed and checked; errors name the offending key.

  n_devices: when known, the checks that need the mesh's size run too.
  explicit_model: the `config.model` keys the user set (see
    `explicit_model_keys`); with `init_from_hf` they must agree with the
    checkpoint, and the others come from it.
  """
  missing = [s for s in SECTIONS if s not in config]
  if missing:
    raise ConfigError(f"config: missing sections {missing}")
  try:
    rules = rules_from_config(config.sharding.rules)
  except ValueError as exc:
    raise ConfigError(f"config.{exc}") from exc
  cfg = ExperimentConfig(
      seed=int(config.seed), init_from_hf=str(config.init_from_hf),
      model=model_config(config, explicit_model),
      mesh=to_dataclass(MeshConfig, config.mesh, "mesh"),
      rules=rules,
      task=task_config(config.task),
      sft=to_dataclass(SFTConfig, config.sft, "sft"),
      sampler=to_dataclass(SamplerConfig, config.sampler, "sampler"),
      rl=to_dataclass(RLConfig, config.rl, "rl"),
      prompt_sampling=to_dataclass(PromptSamplingConfig,
                                   config.prompt_sampling, "prompt_sampling"),
      checkpoint=to_dataclass(CheckpointConfig, config.checkpoint,
                              "checkpoint"),
      log=to_dataclass(LogConfig, config.log, "log"),
      reward_model=(to_dataclass(RewardModelConfig, config.reward_model,
                                 "reward_model")
                    if "reward_model" in config else RewardModelConfig()),
      metrics=(to_dataclass(MetricsConfig, config.metrics, "metrics")
               if "metrics" in config else MetricsConfig()))
  check_experiment(cfg, n_devices)
  return cfg


def batch_shards(cfg: ExperimentConfig, n_devices: int) -> int:
  """How many ways the mesh splits the batch axis of activations."""
  sizes = cfg.mesh.resolve(n_devices)
  axes = dict(cfg.rules).get("batch") or ()
  axes = (axes,) if isinstance(axes, str) else tuple(axes)
  out = 1
  for a in axes:
    out *= sizes[a]
  return out


def check_experiment(cfg: ExperimentConfig, n_devices: int | None = None
                     ) -> None:
  """Every rule that relates two sections; raises ConfigError naming keys."""
  model, s, rl = cfg.model, cfg.sampler, cfg.rl

  def bad(msg: str) -> None:
    raise ConfigError(msg)

  if s.cache_len > model.max_seq_len:
    bad(f"config.sampler.cache_len ({s.cache_len}) exceeds "
        f"config.model.max_seq_len ({model.max_seq_len})")
  if rl.max_response_len >= s.cache_len:
    bad(f"config.rl.max_response_len ({rl.max_response_len}) leaves no room "
        f"for the prompt in config.sampler.cache_len ({s.cache_len})")
  wave = rl.prompts_per_iteration * rl.samples_per_prompt
  if rl.queued_prompts and wave > s.max_slots:
    bad(f"config.rl.queued_prompts: a queue needs one wave of "
        f"rl.prompts_per_iteration x rl.samples_per_prompt ({wave}) to fit "
        f"config.sampler.max_slots ({s.max_slots}); the rollout window would "
        f"leave the rest unstarted")
  if rl.routing_replay and not model.n_experts:
    bad("config.rl.routing_replay is set but config.model.n_experts is 0: "
        "a dense model has no experts to replay")
  if rl.train_len_buckets and rl.train_len_buckets[-1] > model.max_seq_len:
    bad(f"config.rl.train_len_buckets: largest bucket "
        f"({rl.train_len_buckets[-1]}) exceeds config.model.max_seq_len "
        f"({model.max_seq_len})")
  if cfg.sft.steps > 0 and cfg.sft.seq_len > model.max_seq_len:
    bad(f"config.sft.seq_len ({cfg.sft.seq_len}) exceeds "
        f"config.model.max_seq_len ({model.max_seq_len})")
  try:
    check_data_config(cfg.task, cfg.sft.steps, cfg.sft.train_path,
                      cfg.sft.stage2_train_path)
  except ValueError as exc:
    bad(str(exc))
  reward, rm_path = cfg.task.reward, cfg.reward_model.path
  if rm_kind(reward) and not rm_path:
    bad(f"config.reward_model.path: config.task.reward={reward!r} needs a "
        f"reward-model directory (written by launch/train_rm.py)")
  if rm_path and not rm_kind(reward):
    bad(f"config.reward_model.path is set but config.task.reward="
        f"{reward!r} uses no reward model")
  if rm_path and "://" not in rm_path and not os.path.isdir(rm_path):
    bad(f"config.reward_model.path: not a directory: {rm_path}")
  own_tokenizer = getattr(cfg.task, "tokenizer", "")
  if cfg.task.name == "jsonl" and not (cfg.init_from_hf or own_tokenizer):
    bad("config.init_from_hf: task 'jsonl' needs a Hugging Face directory "
        "(its tokenizer encodes the prompts), or config.task.tokenizer a "
        "tokenizer directory for a model trained from scratch")
  if cfg.init_from_hf and own_tokenizer:
    bad("config.task.tokenizer: set only without init_from_hf (the "
        "checkpoint brings its own tokenizer)")
  for msg in image_task_problems(cfg.task, model):
    bad(msg)
  if n_devices is None:
    return
  shards = batch_shards(cfg, n_devices)
  rows = rl.minibatch_prompts * rl.samples_per_prompt
  if rows % shards:
    bad(f"config.rl.minibatch_prompts x samples_per_prompt ({rows}) must "
        f"divide over the {shards} batch shards of the mesh, or every device "
        f"would hold the whole batch")
  if cfg.sft.steps and cfg.sft.batch_size % shards:
    bad(f"config.sft.batch_size ({cfg.sft.batch_size}) must divide over the "
        f"{shards} batch shards of the mesh")
  if s.max_slots % shards:
    bad(f"config.sampler.max_slots ({s.max_slots}) must divide over the "
        f"{shards} batch shards of the mesh")



def image_task_problems(task: TaskConfig, model: ModelConfig) -> list[str]:
  """Why a task's images do not fit the model's vision tower (none when
  they do, or when the task has no images)."""
  if not getattr(task, "image_fraction", 0):
    return []
  v = model.vision
  if v is None:
    return ["config.task.image_fraction > 0 needs a vision tower "
            "(config.model.vision)"]
  placeholder = pointer_chase.tokenizer(
      task.cot_style, images=True).encode(pointer_chase.IMAGE_WORD)[0]
  out = []
  for key, want, got in (
      ("image_token_id", placeholder, v.image_token_id),
      ("tokens_per_image", task.image_tokens, v.tokens_per_image),
      ("image_size", task.image_size, v.image_size),
      ("channels", 3, v.channels)):
    if want != got:
      out.append(f"config.model.vision.{key} is {got}, the task's images "
                 f"need {want} (config.task: image_size "
                 f"{task.image_size}, image_tokens {task.image_tokens}, "
                 f"RGB, placeholder id {placeholder})")
  return out
