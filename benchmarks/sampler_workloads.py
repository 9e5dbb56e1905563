"""The sampler benchmark's workloads: its models (the tiny experiment's and
a Qwen2-shaped one) and its request sets of random prompts."""

from __future__ import annotations

import os

import numpy as np

from kimi_jax.infra.config import load_config
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.driver import SampleRequest

PROMPT_LEN, NEW_TOKENS = 32, 128
# Decode steps per host round trip (sampler.steps_per_call in the configs).
DEFAULT_STEPS = 16
CACHE_LEN = PROMPT_LEN + NEW_TOKENS
QWEN_SHAPED = ModelConfig(vocab_size=512, d_model=256, n_layers=4, n_heads=8,
                          n_kv_heads=2, head_dim=32, mlp_dim=1024,
                          tie_embeddings=True, qkv_bias=True,
                          max_seq_len=CACHE_LEN)
FALLBACK_TINY = ModelConfig(vocab_size=64, d_model=64, n_layers=2, n_heads=4,
                            n_kv_heads=2, head_dim=16, mlp_dim=256,
                            max_seq_len=CACHE_LEN)
# The models a child process (benchmarks/child.py) is named by.
MODELS = {"qwen2-shaped": QWEN_SHAPED, "fallback-tiny": FALLBACK_TINY}


def tiny_config() -> tuple[str, ModelConfig]:
  path = os.path.join(os.path.dirname(__file__), "..", "experiments",
                      "tiny.py")
  if not os.path.exists(path):
    return "tiny (fallback)", FALLBACK_TINY
  config = load_config(path, {"model.max_seq_len": CACHE_LEN})
  return "tiny", ModelConfig.from_mapping(config.model.to_dict())


def requests(cfg: ModelConfig, n: int, lengths: list[int], sampling,
             seed: int = 0) -> list[SampleRequest]:
  rng = np.random.default_rng(seed)
  return [SampleRequest(i, tuple(int(t) for t in rng.integers(
      0, cfg.vocab_size, PROMPT_LEN)), max_new_tokens=lengths[i],
                        sampling=sampling(i)) for i in range(n)]
