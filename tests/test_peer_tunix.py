"""benchmarks/sampler_tunix.py: Tunix's Qwen2 module given kimi_jax's
weights computes the same logits, and Tunix's sampler drawing greedily from
it continues a prompt as kimi_jax's model does. Skipped without Tunix
(an optional dependency, requirements-peer.txt); slow tier, as importing
Tunix alone takes seconds."""

import importlib.util
import os
import sys

import jax
import jax.numpy as jnp
import numpy as np
import pytest

# Tunix's model and sampler move host values to the device implicitly.
pytestmark = [
    pytest.mark.slow, pytest.mark.host_inputs,
    pytest.mark.skipif(importlib.util.find_spec("tunix") is None,
                       reason="Tunix not installed (requirements-peer.txt)")]

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "benchmarks"))

import sampler_tunix  # noqa: E402
from kimi_jax.model import transformer  # noqa: E402
from kimi_jax.model.config import ModelConfig  # noqa: E402

CFG = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                  n_kv_heads=2, head_dim=8, mlp_dim=64, tie_embeddings=True,
                  qkv_bias=True, max_seq_len=32)


@pytest.fixture(autouse=True)
def tunix_broadcasts():
  """Tunix's code broadcasts across ranks implicitly."""
  with jax.numpy_rank_promotion("allow"):
    yield


def varied_params(cfg: ModelConfig, seed: int = 0):
  """Random weights with non-zero biases and norm scales away from 1, so
  that a misplaced bias or norm changes the logits."""
  params = transformer.init_params(cfg, jax.random.key(seed), std=0.2)
  leaves, treedef = jax.tree_util.tree_flatten_with_path(params)
  keys = jax.random.split(jax.random.key(seed + 1), len(leaves))
  out = []
  for (path, x), key in zip(leaves, keys):
    name = jax.tree_util.keystr(path)
    noise = 0.3 * jax.random.normal(key, x.shape, x.dtype)
    if "norm" in name:
      x = x + noise
    elif name.endswith(("['bq']", "['bk']", "['bv']")):
      x = noise
    out.append(x)
  return jax.tree_util.tree_unflatten(treedef, out)


def tunix_of(cfg, params):
  qwen2, _ = sampler_tunix.tunix_modules()
  return sampler_tunix.tunix_model(qwen2, cfg, params)


@pytest.mark.parametrize("tied", [True, False])
def test_same_logits_as_kimi_jax(tied):
  cfg = CFG if tied else ModelConfig(**{**CFG.__dict__,
                                        "tie_embeddings": False})
  params = varied_params(cfg)
  prompt = tuple(np.random.default_rng(0).integers(0, cfg.vocab_size, 12))
  gap = sampler_tunix.logit_gap(cfg, params, tunix_of(cfg, params), prompt)
  assert gap <= sampler_tunix.LOGIT_TOLERANCE


def test_a_misplaced_bias_shows_in_the_logits():
  """The check can fail: Tunix given k's bias as v's differs."""
  params = varied_params(CFG)
  prompt = tuple(np.random.default_rng(0).integers(0, CFG.vocab_size, 12))
  model = tunix_of(CFG, params)
  attn = model.layers[0].attn
  attn.v_bias.set_value(attn.k_bias.get_value())
  gap = sampler_tunix.logit_gap(CFG, params, model, prompt)
  assert gap > 100 * sampler_tunix.LOGIT_TOLERANCE


def greedy_reference(cfg, params, prompt, n: int) -> list[int]:
  """Greedy continuation by kimi_jax's full forward over the padded row."""
  T = len(prompt) + n
  fwd = jax.jit(lambda p, t: transformer.forward(
      p, t, jnp.arange(T)[None], jnp.ones_like(t), cfg=cfg)[0])
  row = np.zeros((1, T), np.int32)
  row[0, :len(prompt)] = prompt
  for i in range(len(prompt), T):
    row[0, i] = int(jnp.argmax(fwd(params, row)[0, i - 1]))
  return row[0, len(prompt):].tolist()


def test_tunix_greedy_continues_as_kimi_jax():
  """Tunix's sampler (its prefill, cache and decode loop) over the mapped
  weights draws kimi_jax's greedy tokens, through the id tokenizer."""
  _, tunix_sampler = sampler_tunix.tunix_modules()
  params = varied_params(CFG)
  rng = np.random.default_rng(1)
  prompts = [tuple(int(t) for t in rng.integers(0, CFG.vocab_size, 8))
             for _ in range(2)]
  n = 10
  sampler = tunix_sampler.Sampler(
      tunix_of(CFG, params), sampler_tunix.IdTokenizer(CFG.vocab_size),
      tunix_sampler.CacheConfig(cache_size=8 + n, num_layers=CFG.n_layers,
                                num_kv_heads=CFG.n_kv_heads,
                                head_dim=CFG.head_dim))
  out = sampler([" ".join(map(str, p)) for p in prompts],
                max_generation_steps=n, max_prompt_length=8,
                temperature=0.0)
  for prompt, tokens in zip(prompts, out.tokens):
    assert tokens.tolist() == greedy_reference(CFG, params, prompt, n)
