"""Every experiment config loads, validates and builds its model abstractly;
overrides are type-checked by key."""

from __future__ import annotations

import dataclasses
import glob
import json
import math
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from experiments import _common
from kimi_jax.infra.config import ConfigError, load_config, to_dataclass
from kimi_jax.job.experiment import explicit_model_keys, parse_config
from kimi_jax.long2short import config as l2s_config
from kimi_jax.long2short import pipeline
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig, count_params
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.prompt_sampling import PromptSamplingConfig
from kimi_jax.sampler.engine import EngineConfig
from kimi_jax.sharding import MeshConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
# Not experiments but configs over tiny.py with sections of their own:
# ablations.py holds sweeps (a base and its arms, tested in
# tests/test_ablation.py); rm_tiny.py a study (warm start, reward-model
# training, RL arms; tested in tests/test_reward_models.py); gym_tiny.py a
# pipeline of two main-job runs between data stages (its `:micro` variant
# runs end to end in tests/test_gym_pipeline.py), and so is reflect_tiny.py
# (tests/test_reflect.py); long2short_reflect.py is long2short over that
# pipeline (tests/test_long2short_reflect.py).
NOT_EXPERIMENTS = ("ablations.py", "rm_tiny.py", "gym_tiny.py",
                   "reflect_tiny.py", "long2short_reflect.py")
EXPERIMENTS = sorted(
    p for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))
    if not os.path.basename(p).startswith("_")
    and os.path.basename(p) not in NOT_EXPERIMENTS)
TINY = os.path.join(ROOT, "experiments", "tiny.py")
LONG2SHORT = os.path.join(ROOT, "experiments", "long2short_tiny.py")
VISION = os.path.join(ROOT, "experiments", "vision_tiny.py")
QWEN_7B = os.path.join(ROOT, "experiments", "qwen2_5_7b.py")
QWEN_1_5B = os.path.join(ROOT, "experiments", "qwen2_5_1_5b.py")
QWEN3_8B = os.path.join(ROOT, "experiments", "qwen3_8b.py")
LLAMA3_1_8B = os.path.join(ROOT, "experiments", "llama3_1_8b.py")
GEMMA3_4B = os.path.join(ROOT, "experiments", "gemma3_4b.py")
# Every experiment and its tiny variant ("path:tiny"; tiny.py and the
# tiny-sized long2short and vision experiments are their own).
SCALED = [p for p in EXPERIMENTS if p not in (TINY, LONG2SHORT, VISION)]
VARIANTS = EXPERIMENTS + [p + ":tiny" for p in SCALED] + [
    QWEN_7B + ":128k", QWEN3_8B + ":128k"]
# The real path at toy sizes: its model comes from init_from_hf.
SMOKE = [p + ":cpu_smoke" for p in SCALED]


def _ids(paths):
  return [os.path.relpath(p, ROOT) for p in paths]


def test_the_qwen_experiments_are_listed():
  names = {os.path.basename(p) for p in EXPERIMENTS}
  assert {"tiny.py", "qwen2_5_1_5b.py", "qwen2_5_7b.py",
          "qwen2_5_32b.py", "qwen3_8b.py", "llama3_1_8b.py",
          "gemma3_4b.py"} <= names


def _keys(config) -> dict[str, set[str]]:
  return {k: (set(v.keys()) if hasattr(v, "keys") else None)
          for k, v in config.items()}


@pytest.mark.parametrize("path", VARIANTS + SMOKE, ids=_ids(VARIANTS + SMOKE))
def test_config_has_tiny_layout_and_validates(path):
  config = load_config(path)
  reference = _keys(load_config(TINY))
  got = _keys(config)
  # The task section depends on the task; every other key is read by the run.
  reference.pop("task"), got.pop("task")
  # A family's own model keys (Qwen3's qk_norm, Gemma's sliding layers,
  # rope scaling, ...) are ModelConfig fields tiny.py leaves at defaults.
  extra = got["model"] - reference["model"] - {"vision"}
  assert extra <= {f.name for f in dataclasses.fields(ModelConfig)}, extra
  got["model"] -= extra
  # A vision experiment's model has a vision tower (typed below).
  if "vision" in got["model"]:
    got["model"].discard("vision")
    assert to_dataclass(ModelConfig, config.model,
                        "model").vision.tokens_per_image > 0
  # A long2short experiment adds its own sections (typed and checked there).
  if any(k in got for k in l2s_config.SECTIONS):
    l2s_config.check_long2short(l2s_config.l2s_config(config),
                                parse_config(pipeline.job_sections(config)))
    for k in l2s_config.SECTIONS:
      got.pop(k)
  assert got == reference
  model = to_dataclass(ModelConfig, config.model, "model")
  rl = to_dataclass(RLConfig, config.rl, "rl")
  to_dataclass(PromptSamplingConfig, config.prompt_sampling, "prompt_sampling")
  s = config.sampler
  engine = EngineConfig(max_slots=s.max_slots, cache_len=s.cache_len,
                        prefill_buckets=tuple(s.prefill_buckets))
  assert engine.cache_len <= model.max_seq_len
  assert rl.max_response_len < engine.cache_len  # room for the prompt
  assert rl.train_len_buckets[-1] <= model.max_seq_len


@pytest.mark.parametrize("path", VARIANTS, ids=_ids(VARIANTS))
def test_config_builds_abstractly(path):
  config = load_config(path)
  cfg = to_dataclass(ModelConfig, config.model, "model")
  params = jax.eval_shape(lambda: transformer.init_params(
      cfg, jax.random.key(0)))
  n = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  assert n == count_params(cfg)
  assert {leaf.dtype for leaf in jax.tree.leaves(params)} == {
      jnp.dtype(cfg.param_jnp_dtype)}
  tokens = jax.ShapeDtypeStruct((2, 16), jnp.int32)
  logits, _ = jax.eval_shape(
      lambda p, t: transformer.forward(p, t, t, t, cfg=cfg), params, tokens)
  assert logits.shape == (2, 16, cfg.vocab_size)


@pytest.mark.parametrize("path", SCALED, ids=_ids(SCALED))
def test_tiny_variant_is_tiny_of_the_same_family(path):
  full = to_dataclass(ModelConfig, load_config(path).model, "model")
  tiny = to_dataclass(ModelConfig, load_config(path + ":tiny").model, "model")
  assert count_params(tiny) < 1_000_000
  assert (tiny.param_dtype, tiny.compute_dtype) == ("float32", "float32")
  assert tiny.n_heads // tiny.n_kv_heads == full.n_heads // full.n_kv_heads
  assert (tiny.tie_embeddings, tiny.qkv_bias, tiny.remat) == (
      full.tie_embeddings, full.qkv_bias, full.remat)
  for name in _common.FAMILY_FIELDS:
    assert getattr(tiny, name) == getattr(full, name), name
  assert (tiny.query_pre_attn_scalar or tiny.head_dim) / tiny.head_dim == (
      full.query_pre_attn_scalar or full.head_dim) / full.head_dim
  # Both attention kinds of an interleaved family, with a window that cuts.
  assert set(tiny.layer_kinds) == set(full.layer_kinds)
  if tiny.windowed:
    assert tiny.sliding_window < tiny.max_seq_len


def test_qwen2_5_7b_128k_uses_context_parallelism():
  config = load_config(QWEN_7B + ":128k")
  assert config.model.max_seq_len == 131072
  assert config.sampler.cache_len == 131072
  assert config.rl.train_len_buckets[-1] == 131072
  assert config.mesh.context > 1
  # 128 chips (v5p:4x4x8): data takes what fsdp x context x tensor leave.
  mesh = to_dataclass(MeshConfig, config.mesh, "mesh").resolve(128)
  assert mesh == dict(data=1, fsdp=8, context=4, tensor=4, expert=1)


def test_qwen3_8b_128k_uses_yarn_and_context_parallelism():
  config = load_config(QWEN3_8B + ":128k")
  cfg = to_dataclass(ModelConfig, config.model, "model")
  assert cfg.max_seq_len == config.sampler.cache_len == 131072
  # Qwen's YaRN for Qwen3 past 32k: factor 4 over 32768 positions.
  assert (cfg.rope_scaling.rope_type, cfg.rope_scaling.factor,
          cfg.rope_scaling.original_max_position_embeddings) == (
              "yarn", 4.0, 32768)
  assert cfg.rope_scaling.factor * 32768 == cfg.max_seq_len
  mesh = to_dataclass(MeshConfig, config.mesh, "mesh").resolve(128)
  assert mesh == dict(data=1, fsdp=8, context=4, tensor=4, expert=1)
  assert config.task.thinking == "on"


# Hugging Face config.json of the released checkpoints (Gemma 3 4B: the
# text_config of gemma-3-4b-it, as a text-only Gemma3ForCausalLM).
PUBLIC_CONFIGS = {
    QWEN3_8B: {
        "architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3",
        "vocab_size": 151936, "hidden_size": 4096, "num_hidden_layers": 36,
        "num_attention_heads": 32, "num_key_value_heads": 8, "head_dim": 128,
        "intermediate_size": 12288, "hidden_act": "silu",
        "max_position_embeddings": 40960, "rms_norm_eps": 1e-6,
        "rope_theta": 1000000, "rope_scaling": None,
        "attention_bias": False, "use_sliding_window": False,
        "tie_word_embeddings": False},
    LLAMA3_1_8B: {
        "architectures": ["LlamaForCausalLM"], "model_type": "llama",
        "vocab_size": 128256, "hidden_size": 4096, "num_hidden_layers": 32,
        "num_attention_heads": 32, "num_key_value_heads": 8,
        "intermediate_size": 14336, "hidden_act": "silu",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-5,
        "rope_theta": 500000.0, "rope_scaling": {
            "rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
            "high_freq_factor": 4.0,
            "original_max_position_embeddings": 8192},
        "attention_bias": False, "mlp_bias": False,
        "tie_word_embeddings": False},
    GEMMA3_4B: {
        "architectures": ["Gemma3ForCausalLM"], "model_type": "gemma3_text",
        "vocab_size": 262208, "hidden_size": 2560, "num_hidden_layers": 34,
        "num_attention_heads": 8, "num_key_value_heads": 4, "head_dim": 256,
        "intermediate_size": 10240,
        "hidden_activation": "gelu_pytorch_tanh",
        "max_position_embeddings": 131072, "rms_norm_eps": 1e-6,
        "query_pre_attn_scalar": 256, "sliding_window": 1024,
        "sliding_window_pattern": 6, "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "rope_scaling": {"rope_type": "linear", "factor": 8.0}},
}


@pytest.mark.parametrize("path", sorted(PUBLIC_CONFIGS),
                         ids=_ids(sorted(PUBLIC_CONFIGS)))
def test_model_section_is_the_released_checkpoints(path):
  """The file's model section (what the plan and a run without a checkpoint
  build) is the architecture the released config.json reads as."""
  from kimi_jax.model import families, hf
  ours = to_dataclass(ModelConfig, load_config(path).model, "model")
  theirs = hf.config_from_hf(PUBLIC_CONFIGS[path])
  assert families.architecture_of(ours) == families.architecture_of(theirs)
  # The export writes the released rope scaling, key for key.
  written = hf.config_to_hf(ours)
  assert written["architectures"] == PUBLIC_CONFIGS[path]["architectures"]
  assert written.get("rope_scaling") == PUBLIC_CONFIGS[path].get(
      "rope_scaling")
  # kv heads divide over `tensor`, query heads too.
  tensor = load_config(path).mesh.tensor
  assert ours.n_kv_heads % tensor == 0 and ours.n_heads % tensor == 0


def test_unknown_variant_is_rejected():
  with pytest.raises(ValueError, match="'huge'"):
    load_config(QWEN_7B + ":huge")


def test_qwen2_5_7b_has_7_6b_params():
  cfg = to_dataclass(ModelConfig, load_config(QWEN_7B).model, "model")
  params = transformer.abstract_params(cfg)
  n = sum(math.prod(leaf.shape) for leaf in jax.tree.leaves(params))
  assert abs(n - 7.6e9) / 7.6e9 < 0.01, n
  assert "lm_head" in params  # 7B does not tie embeddings
  assert params["layers"]["wk"].shape == (28, 3584, 4, 128)


def test_override_unknown_key_is_rejected_naming_it():
  with pytest.raises(ConfigError, match=r"model\.n_layerz"):
    load_config(QWEN_7B, ["model.n_layerz=3"])


def test_override_wrong_type_is_rejected_naming_it():
  with pytest.raises(ConfigError, match=r"model\.n_layers.*'abc'"):
    load_config(QWEN_7B, ["--config.model.n_layers=abc"])


def test_valid_override_is_applied():
  config = load_config(QWEN_7B, ["model.n_layers=3", "--config.rl.tau=0.5",
                                 "init_from_hf=/models/qwen"])
  assert config.model.n_layers == 3
  assert config.rl.tau == 0.5
  assert config.init_from_hf == "/models/qwen"
  assert load_config(QWEN_7B).model.n_layers == 28


def test_string_override_keeps_its_text():
  # A JSON value for a string key is the text itself, as on the command
  # line, so an unrelated error is still the one reported.
  options = '{"spell_backward": {"min_word_len": 3, "max_word_len": 7}}'
  config = load_config("experiments/gym_tiny.py",
                       [f"gym.options_json={options}", "seed=3",
                        "task.reward=1e-4"])
  assert config.gym.options_json == options
  assert config.task.reward == "1e-4"
  with pytest.raises(ConfigError, match=r"rl\.warmup_stepz"):
    load_config("experiments/gym_tiny.py", [f"gym.options_json={options}",
                                            "rl.warmup_stepz=4"])


@pytest.mark.parametrize("path", SCALED, ids=_ids(SCALED))
def test_qwen_real_path_defaults(path):
  from kimi_jax import sft as sft_lib
  from kimi_jax import train_step as ts
  config = load_config(path)
  sft = to_dataclass(sft_lib.SFTConfig, config.sft, "sft")
  # Report 2.5.2: 2e-5 -> 2e-6, then re-warmed 1e-5 -> 1e-6.
  lr = ts.learning_rate_schedule(sft.optimizer())
  end1 = sft.steps - sft.stage2_steps
  peak2 = end1 + sft.stage2_warmup_steps
  got = jax.jit(jax.vmap(lr))(jax.device_put(np.asarray(
      [sft.warmup_steps, end1, peak2, sft.steps], np.int32)))
  np.testing.assert_allclose(np.asarray(got), [2e-5, 2e-6, 1e-5, 1e-6],
                             rtol=1e-3)
  assert config.rl.train_on_old_segments  # the tiny study (docs/loop.md)
  assert config.task.chat_template and config.task.system_prompt == ""
  for key in ("train_path", "eval_path"):
    assert key in config.task
  assert "train_path" in config.sft and "init_from_hf" in config


# ---------------------------------------------------------------------------
# The model section of a run from a Hugging Face checkpoint


def _checkpoint_dir(path, **changes) -> str:
  """A small Qwen2 checkpoint's config.json (the config check reads no
  weights)."""
  os.makedirs(path, exist_ok=True)
  config = {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2",
            "vocab_size": 512, "hidden_size": 64, "intermediate_size": 96,
            "num_hidden_layers": 2, "num_attention_heads": 4,
            "num_key_value_heads": 2, "max_position_embeddings": 512,
            "rms_norm_eps": 1e-5, "rope_theta": 10000.0,
            "tie_word_embeddings": True, **changes}
  with open(os.path.join(path, "config.json"), "w") as f:
    json.dump(config, f)
  return str(path)


def _smoke(tmp_path, path=QWEN_1_5B, **overrides):
  data = tmp_path / "d.jsonl"
  data.write_text(json.dumps({"prompt": "1+1?", "answer": "2",
                              "response": "2"}) + "\n")
  values = {"init_from_hf": _checkpoint_dir(tmp_path / "hf"),
            "task.train_path": str(data), "task.eval_path": str(data),
            "sft.train_path": str(data),
            # A dense checkpoint: no experts to replay (an MoE experiment's
            # cpu_smoke replays them; tests/test_real_path_moe.py).
            "rl.routing_replay": False, **overrides}
  return load_config(path + ":cpu_smoke", values)


CHECKPOINT_MODEL = ModelConfig(
    vocab_size=512, d_model=64, n_layers=2, n_heads=4, n_kv_heads=2,
    head_dim=16, mlp_dim=96, rope_theta=10000.0, norm_eps=1e-5,
    tie_embeddings=True, qkv_bias=True,
    # The run settings are cpu_smoke's.
    max_seq_len=512, param_dtype="float32", compute_dtype="float32",
    remat=False)


@pytest.mark.parametrize("path", SCALED, ids=_ids(SCALED))
def test_cpu_smoke_takes_its_model_from_the_checkpoint(path, tmp_path):
  cfg = parse_config(_smoke(tmp_path, path), n_devices=1)
  assert cfg.model == CHECKPOINT_MODEL
  assert (cfg.sft.steps, cfg.rl.iterations, cfg.log.plots) == (2, 2, False)
  assert cfg.sampler.cache_len <= 512 and cfg.rl.prompts_per_iteration <= 4
  assert cfg.task.reward == "math" and cfg.task.chat_template


def test_explicit_model_overrides_must_agree_with_the_checkpoint(tmp_path):
  def parse(**overrides):
    return parse_config(_smoke(tmp_path, **overrides), n_devices=1,
                        explicit_model=explicit_model_keys(overrides))

  # Run settings may differ from the checkpoint's.
  cfg = parse(**{"model.param_dtype": "bfloat16", "model.remat": True,
                 "model.max_seq_len": 1024})
  assert (cfg.model.param_dtype, cfg.model.remat, cfg.model.max_seq_len) == (
      "bfloat16", True, 1024)
  assert parse(**{"model.n_layers": 2}).model == CHECKPOINT_MODEL
  # 28 is the placeholder's value in the file, but set explicitly it is a
  # claim about the checkpoint, and a wrong one.
  with pytest.raises(ConfigError, match=r"config\.model\.n_layers=28 "
                     r"disagrees with the checkpoint .*num_hidden_layers "
                     r"gives 2"):
    parse(**{"model.n_layers": 28})
  with pytest.raises(ConfigError, match=r"config\.model\.tie_embeddings"):
    parse(**{"model.tie_embeddings": False})
  # The cross-section checks see the merged model.
  with pytest.raises(ConfigError, match=r"config\.sampler\.cache_len \(512\) "
                     r"exceeds config\.model\.max_seq_len \(128\)"):
    parse(**{"model.max_seq_len": 128})


@pytest.mark.slow  # writes two transformers checkpoints
def test_a_long_stage_extends_a_checkpoint_without_rotary_scaling(tmp_path):
  """qwen3_8b.py:128k from a Qwen3 checkpoint without YaRN gets the
  experiment's YaRN (the config.json edit Qwen's model card asks for); a
  checkpoint with scaling of its own keeps it."""
  from tests.hf_dirs import make_family_dir
  data = tmp_path / "d.jsonl"
  data.write_text(json.dumps({"prompt": "1+1?", "answer": "2",
                              "response": "2"}) + "\n")
  config = load_config(f"{QWEN3_8B}:128k", {
      "init_from_hf": make_family_dir(tmp_path / "plain", "qwen3"),
      "task.train_path": str(data), "task.eval_path": str(data),
      "sft.train_path": str(data)})
  cfg = parse_config(config, n_devices=128)
  assert (cfg.model.rope_scaling.rope_type, cfg.model.rope_scaling.factor,
          cfg.model.rope_scaling.original_max_position_embeddings) == (
              "yarn", 4.0, 32768)
  assert cfg.model.max_seq_len == 131072
  with config.unlocked():
    config.init_from_hf = make_family_dir(tmp_path / "scaled", "qwen3_yarn")
  own = parse_config(config, n_devices=128).model.rope_scaling
  assert own.original_max_position_embeddings == 64  # the checkpoint's


def test_explicit_model_keys_from_flags_or_overrides():
  assert explicit_model_keys({"model.n_layers": 3, "rl.tau": 0.5,
                              "model.remat": True}) == ("n_layers", "remat")
  assert explicit_model_keys(["--config.model.d_model=8", "sft.steps=1",
                              "model.d_model=8"]) == ("d_model",)


def test_an_unusable_checkpoint_is_rejected_naming_it(tmp_path):
  with pytest.raises(ConfigError, match=r"config\.init_from_hf: task 'jsonl' "
                     r"needs a Hugging Face directory"):
    parse_config(_smoke(tmp_path, init_from_hf=""))
  gpt2 = _checkpoint_dir(tmp_path / "gpt2", architectures=["GPT2LMHeadModel"])
  with pytest.raises(ConfigError, match=r"gpt2/config\.json: unsupported "
                     r"architecture \['GPT2LMHeadModel'\]"):
    parse_config(_smoke(tmp_path, init_from_hf=gpt2))
  with pytest.raises(ConfigError, match=r"nowhere/config\.json: not found"):
    parse_config(_smoke(tmp_path, init_from_hf=str(tmp_path / "nowhere")))
