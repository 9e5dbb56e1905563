"""Tunix's sampler on the peer workload, for a side-by-side row.

The same Qwen2-shaped model is built as Tunix's own `Qwen2` module
(tunix.models.qwen2) and given kimi_jax's weights: every array maps onto
one Tunix parameter as it is (the q/k/v biases flattened from (heads,
head_dim) to heads x head_dim), and the two models' logits on a prompt
must agree to `LOGIT_TOLERANCE` before anything is timed. Tunix's
`Sampler` then draws the same requests (same prompts, 32 tokens, 128 new
ones, temperature 1, top_p 1, no top-k, log-probs returned), the whole
call timed as kimi_jax's is, after warm-up calls, nothing compiled
inside a timed call; `benchmarks/sampler.py --part peer` alternates the
two samplers' calls. Tunix runs all its decode steps in
one jitted loop, attends over the whole cache at every step and runs one
decode step more than it returns (its loop also draws a token past the
last); kimi_jax's sampler returns to the host every `steps_per_call` steps
and checks for repeats.

Tunix's sampler takes strings, so the prompts go in as their token ids
written out ("17 402 ..."), through a tokenizer that reads them back; its
pad and end ids are the vocabulary size, a token the model never draws
(so no sequence ends early and no drawn token is read as padding).

Tunix is optional (requirements-peer.txt); without it `prepared`
returns None and says why.
"""

from __future__ import annotations

import functools
import sys
import time
from typing import Any, Callable

import jax
import jax.numpy as jnp
import numpy as np

from kimi_jax.model import transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.sampler.sampling import SamplingParams
from sampler_workloads import (CACHE_LEN, NEW_TOKENS, PROMPT_LEN,
                               requests)
from timing import no_compiles

LOGIT_TOLERANCE = 1e-4
# Tunix's model in bfloat16 against kimi_jax's float32 logits: bfloat16's
# rounding (about 1e-2 on this workload); the float32 check above is what
# shows the weights sit where they should.
BF16_LOGIT_TOLERANCE = 5e-2


@functools.cache
def tunix_modules():
  """(Tunix's qwen2 model module, its sampler module), or None and a
  reason printed once when Tunix is not installed."""
  try:
    from tunix.generate import sampler as tunix_sampler
    from tunix.models.qwen2 import model as tunix_qwen2
  except ImportError as e:
    print(f"[peer] no Tunix row: {e} (pip install --no-deps -r "
          f"requirements-peer.txt)", file=sys.stderr)
    return None
  return tunix_qwen2, tunix_sampler


def tunix_config(qwen2, cfg: ModelConfig, dtype=jnp.float32):
  """Tunix's Qwen2 config of the same model, its weights and computation
  in `dtype` throughout."""
  unsupported = dict(qk_norm=cfg.qk_norm, post_norms=cfg.post_norms,
                     windowed=cfg.windowed, rope_scaling=cfg.rope_scaling,
                     norm_offset=cfg.norm_offset, embed_scale=cfg.embed_scale,
                     softcap=cfg.final_logit_softcap)
  if any(unsupported.values()) or not cfg.qkv_bias:
    raise ValueError(f"Tunix's Qwen2 has none of {unsupported} and always "
                     f"has qkv biases (qkv_bias={cfg.qkv_bias})")
  return qwen2.ModelConfig(
      num_layers=cfg.n_layers, vocab_size=cfg.vocab_size,
      embed_dim=cfg.d_model, hidden_dim=cfg.mlp_dim, num_heads=cfg.n_heads,
      head_dim=cfg.head_dim, num_kv_heads=cfg.n_kv_heads,
      rope_theta=cfg.rope_theta, norm_eps=cfg.norm_eps,
      use_tied_embedding=cfg.tie_embeddings, dtype=dtype,
      param_dtype=dtype)


def tunix_model(qwen2, cfg: ModelConfig, params, dtype=jnp.float32):
  """Tunix's Qwen2 module holding kimi_jax's `params` (copies in
  `dtype`)."""
  from flax import nnx
  model = qwen2.Qwen2(tunix_config(qwen2, cfg, dtype), rngs=nnx.Rngs(0))
  put = lambda var, x: var.set_value(jnp.asarray(x, dtype))
  put(model.embedder.input_embedding, params["embed"])
  put(model.final_norm.w, params["final_norm"])
  if not cfg.tie_embeddings:
    put(model.lm_head.w, params["lm_head"])
  for l, layer in enumerate(model.layers):
    p = {name: x[l] for name, x in params["layers"].items()}
    attn, mlp = layer.attn, layer.mlp
    put(layer.input_layernorm.w, p["attn_norm"])
    put(layer.post_attention_layernorm.w, p["mlp_norm"])
    for proj, name in ((attn.q_proj, "wq"), (attn.k_proj, "wk"),
                       (attn.v_proj, "wv"), (attn.o_proj, "wo")):
      put(proj.w, p[name])
    for bias, name in ((attn.q_bias, "bq"), (attn.k_bias, "bk"),
                       (attn.v_bias, "bv")):
      put(bias, p[name].reshape(-1))
    for proj, name in ((mlp.gate_proj, "w_gate"), (mlp.up_proj, "w_up"),
                       (mlp.down_proj, "w_down")):
      put(proj.kernel, p[name])
  return model


def logit_gap(cfg: ModelConfig, params, model, prompt) -> float:
  """Largest |difference| of the two models' logits over one prompt."""
  tokens = jnp.asarray([prompt], jnp.int32)
  T = tokens.shape[1]
  positions = jnp.arange(T)[None]
  ours, _ = jax.jit(lambda p, t: transformer.forward(
      p, t, positions, jnp.ones_like(t), cfg=cfg))(params, tokens)
  causal = jnp.tril(jnp.ones((T, T), bool))[None]
  theirs, _ = model(tokens, positions, None, causal)
  return float(jnp.max(jnp.abs(ours - theirs)))


class IdTokenizer:
  """A tokenizer over token ids written out as decimal words."""

  def __init__(self, vocab_size: int):
    self.vocab_size = vocab_size

  def encode(self, text: str, **_) -> list[int]:
    return [int(w) for w in text.split()]

  def decode(self, ids, **_) -> str:
    return " ".join(str(int(i)) for i in ids)

  def bos_id(self):
    return None  # no BOS prepended

  def eos_id(self) -> int:
    return self.vocab_size

  def pad_id(self) -> int:
    return self.vocab_size


def prepared(cfg: ModelConfig, params, batch: int, dtype=jnp.float32
             ) -> tuple[Callable[[], Any], float] | None:
  """Tunix's sampler on the peer requests of `batch`, its model in `dtype`,
  warmed up: (a call that draws them all, the logit gap); None when Tunix
  is not installed."""
  modules = tunix_modules()
  if modules is None:
    return None
  qwen2, tunix_sampler = modules
  model = tunix_model(qwen2, cfg, params, dtype)
  reqs = requests(cfg, batch, [NEW_TOKENS] * batch,
                  lambda i: SamplingParams(seed=i), seed=1)
  gap = logit_gap(cfg, params, model, reqs[0].prompt)
  tolerance = (LOGIT_TOLERANCE if dtype == jnp.float32 else
               BF16_LOGIT_TOLERANCE)
  if not gap <= tolerance:
    raise AssertionError(f"Tunix's Qwen2 logits ({jnp.dtype(dtype).name}) "
                         f"differ from kimi_jax's by {gap:.2e} > "
                         f"{tolerance}")
  sampler = tunix_sampler.Sampler(
      model, IdTokenizer(cfg.vocab_size),
      tunix_sampler.CacheConfig(cache_size=CACHE_LEN,
                                num_layers=cfg.n_layers,
                                num_kv_heads=cfg.n_kv_heads,
                                head_dim=cfg.head_dim))
  prompts = [" ".join(str(t) for t in r.prompt) for r in reqs]

  def call():
    return sampler(prompts, max_generation_steps=NEW_TOKENS,
                   max_prompt_length=PROMPT_LEN, temperature=1.0, top_p=1.0,
                   top_k=None, seed=0, return_logprobs=True)

  # Two warm-up calls: the second compiles one small eager op of Tunix's
  # (a scalar comparison) that the first does not reach.
  call()
  call()
  return call, gap


def timed(call: Callable[[], Any], batch: int) -> float:
  """Seconds of one call of `prepared`'s, which must not compile and must
  draw every token."""
  with no_compiles(f"tunix b{batch}"):
    start = time.perf_counter()
    out = call()
    seconds = time.perf_counter() - start
  tokens = sum(len(t) for t in out.tokens)
  if tokens != batch * NEW_TOKENS:
    raise AssertionError(f"Tunix drew {tokens} tokens, expected "
                         f"{batch * NEW_TOKENS}")
  return seconds


def row(batch: int, runs_s: list[float], gap: float) -> dict:
  """The Tunix row of `batch` from its timed calls (median)."""
  wall = float(np.median(runs_s))
  tokens = batch * NEW_TOKENS
  return dict(batch=batch, tokens=tokens, seconds=wall,
              tokens_per_s=tokens / wall, runs_s=list(runs_s), logit_gap=gap)
