"""Every experiment config loads, validates and builds its model abstractly;
overrides are type-checked by key."""

from __future__ import annotations

import glob
import math
import os

import jax
import jax.numpy as jnp
import pytest

from kimi_jax.config import ConfigError, load_config, to_dataclass
from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig, count_params
from kimi_jax.rl.config import RLConfig
from kimi_jax.rl.prompt_sampling import PromptSamplingConfig
from kimi_jax.sampler.engine import EngineConfig

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
EXPERIMENTS = sorted(
    p for p in glob.glob(os.path.join(ROOT, "experiments", "*.py"))
    if not os.path.basename(p).startswith("_"))
TINY = os.path.join(ROOT, "experiments", "tiny.py")
QWEN_7B = os.path.join(ROOT, "experiments", "qwen2_5_7b.py")
# Every experiment and its tiny variant ("path:tiny"; tiny.py is its own).
SCALED = [p for p in EXPERIMENTS if p != TINY]
VARIANTS = EXPERIMENTS + [p + ":tiny" for p in SCALED]


def _ids(paths):
  return [os.path.relpath(p, ROOT) for p in paths]


def test_the_qwen_experiments_are_listed():
  names = {os.path.basename(p) for p in EXPERIMENTS}
  assert {"tiny.py", "qwen2_5_1_5b.py", "qwen2_5_7b.py",
          "qwen2_5_32b.py"} <= names


def _keys(config) -> dict[str, set[str]]:
  return {k: (set(v.keys()) if hasattr(v, "keys") else None)
          for k, v in config.items()}


@pytest.mark.parametrize("path", VARIANTS, ids=_ids(VARIANTS))
def test_config_has_tiny_layout_and_validates(path):
  config = load_config(path)
  reference = _keys(load_config(TINY))
  got = _keys(config)
  # The task section depends on the task; every other key is read by the run.
  reference.pop("task"), got.pop("task")
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
