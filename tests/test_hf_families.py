"""Every supported Hugging Face family against `transformers`: Qwen3 (q/k
norms, own head_dim), Llama 3.x rope scaling, YaRN (Qwen2 and Qwen3), Gemma
3 text (interleaved sliding-window layers, Gemma norms, GeGLU, scaled
embeddings, final-logit softcapping). Logits of the trainer's forward, the
prefill and the decode step, the engine's greedy tokens, and the export
round trip, all on tiny random models built in the test (tests/hf_dirs.py;
no downloads). Config parsing and rope frequencies are checked on their
own (fast)."""

from __future__ import annotations

import dataclasses
import functools
import json
import math

import jax
import numpy as np
from jax.sharding import PartitionSpec as P
import pytest
import torch
import transformers
from transformers import modeling_rope_utils

import hf_dirs
from kimi_jax.model import decode, families, hf, rope, transformer
from kimi_jax.model.config import FULL, SLIDING, ModelConfig, count_params
from kimi_jax.sampler import handoff
from kimi_jax.sampler.engine import Engine, EngineConfig
from kimi_jax.sampler.sampling import SamplingParams
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh

# Numerics against transformers on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs

NAMES = list(hf_dirs.TINY_FAMILIES)
WINDOWED = ["gemma3", "gemma3_softcap"]
B, T = 2, 12
TOKENS_BxT = np.random.RandomState(0).randint(0, 96, (B, T))


def _hf_logits(model, tokens_BxT) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(np.asarray(tokens_BxT))).logits.float().numpy()


def _assert_logits_close(ours, ref, err_msg="") -> None:
  """The tolerance of the parity tests in tests/test_hf.py."""
  ref = np.asarray(ref)
  assert np.abs(ref).max() > 1.0  # the comparison is not between near-zeros
  np.testing.assert_allclose(np.asarray(ours), ref, rtol=1e-4,
                             atol=1e-4 * np.abs(ref).max(), err_msg=err_msg)


@functools.lru_cache(maxsize=None)
def _family(name: str, root: str):
  """(HF model, its directory, our config and params, HF logits)."""
  model = hf_dirs.tiny_hf_model(name)
  path = f"{root}/{name}"
  model.save_pretrained(path)
  cfg, params = hf.load_hf_checkpoint(path)
  return model, path, cfg, params, _hf_logits(model, TOKENS_BxT)


@pytest.fixture(scope="module")
def family(tmp_path_factory):
  root = str(tmp_path_factory.mktemp("families"))
  return lambda name: _family(name, root)


def _positions(n_rows: int, n: int, start: int = 0) -> np.ndarray:
  return np.broadcast_to(np.arange(start, start + n, dtype=np.int32),
                         (n_rows, n)).copy()


@functools.partial(jax.jit, static_argnames="cfg")
def _forward(params, tokens, cfg):
  n_rows, n = tokens.shape
  pos = jax.numpy.broadcast_to(jax.numpy.arange(n), (n_rows, n))
  return transformer.forward(params, tokens, pos,
                             jax.numpy.ones((n_rows, n), jax.numpy.int32),
                             cfg=cfg)[0]


# --------------------------------------------------------------------------
# The trainer's forward


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_forward_matches_transformers(name, family):
  model, _, cfg, params, ref = family(name)
  expected = {"qwen3": dict(qk_norm=True, head_dim=24, qkv_bias=False),
              "llama3": dict(rope_scaling=rope.RopeScaling(
                  "llama3", 8.0, 64, low_freq_factor=1.0,
                  high_freq_factor=4.0)),
              "qwen2_yarn": dict(qkv_bias=True, rope_scaling=rope.RopeScaling(
                  "yarn", 4.0, 32)),
              "qwen3_yarn": dict(qk_norm=True, rope_scaling=rope.RopeScaling(
                  "yarn", 4.0, 64, beta_fast=8.0, beta_slow=2.0)),
              "qwen3_moe": dict(qk_norm=True, n_experts=8,
                                n_experts_per_token=2, expert_mlp_dim=32,
                                norm_topk_prob=True, dense_layers=()),
              "qwen3_moe_mixed": dict(n_experts=6, n_experts_per_token=3,
                                      norm_topk_prob=False,
                                      dense_layers=(0,)),
              "gemma3": dict(
                  norm_offset=1.0, post_norms=True, embed_scale=True,
                  mlp_activation="gelu_tanh", query_pre_attn_scalar=24.0,
                  tie_embeddings=True, sliding_window=4,
                  sliding_rope_theta=300.0, rope_theta=20000.0,
                  layer_types=(SLIDING, FULL, SLIDING),
                  rope_scaling=rope.RopeScaling("linear", 2.0)),
              "gemma3_softcap": dict(
                  final_logit_softcap=3.0, tie_embeddings=False,
                  layer_types=(SLIDING, SLIDING, FULL))}[name]
  assert {k: getattr(cfg, k) for k in expected} == expected
  _assert_logits_close(_forward(params, TOKENS_BxT, cfg), ref)
  # Unrolled layers (static kinds), and blockwise attention over several
  # blocks (the window then spans block boundaries).
  for changes in (dict(scan_layers=False),
                  dict(attention="blockwise", attention_block=4),
                  dict(attention="dot", remat=True)):
    _assert_logits_close(
        _forward(params, TOKENS_BxT, dataclasses.replace(cfg, **changes)),
        ref, err_msg=str(changes))


# --------------------------------------------------------------------------
# The sampler's prefill and decode step


@functools.partial(jax.jit, static_argnames="cfg")
def _prefill(params, tokens, segments, cache, cfg):
  x, cache = transformer.hidden_states(
      params, tokens, _positions(*tokens.shape), segments, cfg=cfg,
      cache=cache, prefill=True)
  return transformer.unembed(params, x, cfg=cfg), cache


@functools.partial(jax.jit, static_argnames="cfg")
def _decode(decode_params, tokens_B, lengths_B, cache, cfg):
  return decode.decode_step(decode_params, tokens_B, lengths_B, cache,
                                 cfg=cfg)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_prefill_then_decode_match_transformers(name, family):
  """Rows of 7 and 5 prompt tokens, right-padded, prefilled into a cache of
  16 entries; then one decode step per token to the end of the rows."""
  _, _, cfg, params, ref = family(name)
  lengths = np.array([7, 5], np.int32)
  P, S = int(lengths.max()), 16
  tokens = np.where(np.arange(P)[None] < lengths[:, None],
                    TOKENS_BxT[:, :P], 0)
  segments = (np.arange(P)[None] < lengths[:, None]).astype(np.int32)
  logits, cache = _prefill(params, tokens, segments,
                           transformer.init_cache(cfg, B, S), cfg)
  for b in range(B):
    _assert_logits_close(logits[b, :lengths[b]], ref[b, :lengths[b]],
                         err_msg=f"prefill row {b}")
  np.testing.assert_array_equal(cache.lengths, lengths)
  if cfg.windowed:  # sliding layers keep a ring of the window only
    n_sliding = cfg.layer_kinds.count(SLIDING)
    assert cache.local_k.shape == (n_sliding, B, cfg.sliding_window,
                                   cfg.n_kv_heads, cfg.head_dim)
    assert cache.k.shape[0] == cfg.n_layers - n_sliding
  decode_params = decode.to_decode_params(params)
  dcache = decode.to_decode_cache(cache)
  pos = lengths.copy()
  for step in range(T - int(lengths.min())):
    # A row already at the end decodes a repeat of its last token,
    # unchecked (as a finished slot in the engine).
    tokens = TOKENS_BxT[np.arange(B), np.minimum(pos, T - 1)]
    logits, dcache = _decode(decode_params, tokens, pos, dcache, cfg)
    for b in range(B):
      if pos[b] < T:
        _assert_logits_close(logits[b, 0], ref[b, pos[b]],
                             err_msg=f"decode row {b} position {pos[b]}")
    pos = np.minimum(pos + 1, T)
  back = decode.from_decode_cache(dcache, pos)
  assert jax.tree.structure(back) == jax.tree.structure(cache)


@functools.partial(jax.jit, static_argnames=("cfg", "prefill"))
def _cached_forward(params, tokens, start, cache, cfg, prefill):
  n_rows, n = tokens.shape
  pos = start + jax.numpy.broadcast_to(jax.numpy.arange(n), (n_rows, n))
  return transformer.forward(params, tokens, pos,
                             jax.numpy.ones((n_rows, n), jax.numpy.int32),
                             cfg=cfg, cache=cache, prefill=prefill)


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_forward_over_a_cache_in_chunks_matches_transformers(name, family):
  """A prefill of 5, then chunks of 1, 5 (longer than the window: only its
  last window of keys stays in a sliding layer's ring) and 1 tokens."""
  _, _, cfg, params, ref = family(name)
  cache = transformer.init_cache(cfg, B, 16)
  for start, end in ((0, 5), (5, 6), (6, 11), (11, 12)):
    logits, cache = _cached_forward(params, TOKENS_BxT[:, start:end], start,
                                    cache, cfg, start == 0)
    _assert_logits_close(logits, ref[:, start:end],
                         err_msg=f"tokens {start}:{end}")
  np.testing.assert_array_equal(cache.lengths, [T, T])


# --------------------------------------------------------------------------
# The engine: greedy tokens and log-probs of a windowed model


@pytest.mark.slow
@pytest.mark.parametrize("on_mesh", [False, True])
def test_engine_greedy_decode_of_gemma3_matches_transformers(family,
                                                             on_mesh):
  """Prompts longer and shorter than the window, prefilled in buckets
  longer than it, decoded greedily; then a slot freed and reused by a
  short prompt (its ring still holds the old sequence's keys). Every token
  is transformers' argmax after the same prefix, every log-prob its
  log-softmax there. On a mesh the slots of the rings split over the batch
  axes and their kv heads over `tensor`."""
  model, _, cfg, params, _ = family("gemma3")
  sharder = (Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
             if on_mesh else None)
  engine = Engine(cfg, EngineConfig(max_slots=4, cache_len=32,
                                    prefill_buckets=(8, 16)),
                  sharder=sharder)
  params = handoff.place_params(params, engine.param_shardings)[0]
  state = engine.init_decode_state()
  # Per sliding layer a ring of the window per slot: B x K x R x Dh.
  assert state.cache.local_v[0].shape[2] == cfg.sliding_window
  if on_mesh:
    assert state.cache.local_v[0].sharding.spec == P(
        ("data", "fsdp"), "tensor", None, None)
  greedy = SamplingParams(greedy=True)
  prompts = {0: [int(t) for t in TOKENS_BxT[0, :10]],
             1: [int(t) for t in TOKENS_BxT[1, :3]]}
  seqs, logps = {}, {}

  def admit(slot_prompts, state):
    slots = list(slot_prompts)
    prefix = engine.prefill_batch(params, [slot_prompts[s] for s in slots],
                                  [greedy] * len(slots), [0] * len(slots))
    for i, s in enumerate(slots):
      seqs[s] = list(slot_prompts[s]) + [int(prefix.token[i])]
      logps[s] = [float(prefix.logprob[i])]
    return engine.insert_batch(prefix, state, slots)

  def decode(state, n):
    state, tokens_NxB, logp_NxB = engine.generate(params, state, n)
    for s in seqs:
      seqs[s] += [int(t) for t in np.asarray(tokens_NxB)[:, s]]
      logps[s] += [float(x) for x in np.asarray(logp_NxB)[:, s]]
    return state

  def check(slot, n_prompt):
    seq = seqs[slot]
    logits = _hf_logits(model, np.asarray(seq)[None, :-1])[0, n_prompt - 1:]
    logp = torch.log_softmax(torch.tensor(logits), -1).numpy()
    response = seq[n_prompt:]
    np.testing.assert_array_equal(response, logits.argmax(-1))
    np.testing.assert_allclose(
        logps[slot], logp[np.arange(len(response)), response], rtol=1e-4,
        atol=1e-4 * np.abs(logits).max())

  state = decode(admit(prompts, state), 9)
  check(0, 10)
  check(1, 3)
  state = engine.free_slots(state, [False, True, False, False])
  short = [int(t) for t in TOKENS_BxT[0, 4:6]]
  seqs.pop(1)
  state = decode(admit({1: short}, state), 6)
  check(1, 2)
  check(0, 10)


# --------------------------------------------------------------------------
# Export: our params as an HF directory transformers loads


@pytest.mark.slow
@pytest.mark.parametrize("name", NAMES)
def test_export_round_trips_through_transformers(name, family, tmp_path):
  model, _, cfg, params, ref = family(name)
  hf.export_hf_checkpoint(params, cfg, str(tmp_path))
  loaded = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  assert type(loaded).__name__ == type(model).__name__
  _assert_logits_close(_hf_logits(loaded.eval(), TOKENS_BxT), ref)
  cfg2, params2 = hf.load_hf_checkpoint(str(tmp_path))
  assert cfg2 == cfg
  for a, b in zip(jax.tree.leaves(params2), jax.tree.leaves(params)):
    np.testing.assert_array_equal(a, b)


# --------------------------------------------------------------------------
# config.json (fast)


def _gemma3_4x_config(**changes) -> dict:
  """A Gemma 3 text config.json as transformers 4.x wrote it."""
  out = dict(architectures=["Gemma3ForCausalLM"], model_type="gemma3_text",
             vocab_size=96, hidden_size=48, num_hidden_layers=8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16,
             intermediate_size=96, hidden_activation="gelu_pytorch_tanh",
             max_position_embeddings=4096, rms_norm_eps=1e-6,
             query_pre_attn_scalar=16, sliding_window=512,
             sliding_window_pattern=6, rope_theta=1e6,
             rope_local_base_freq=1e4,
             rope_scaling={"rope_type": "linear", "factor": 8.0},
             final_logit_softcapping=None, attn_logit_softcapping=None)
  out.update(changes)
  return out


def test_gemma3_config_of_transformers_4():
  cfg = hf.config_from_hf(_gemma3_4x_config())
  assert cfg.layer_kinds == (SLIDING,) * 5 + (FULL,) + (SLIDING,) * 2
  assert (cfg.rope_theta, cfg.sliding_rope_theta, cfg.sliding_window) == (
      1e6, 1e4, 512)
  assert cfg.rope_scaling == rope.RopeScaling("linear", 8.0)
  assert (cfg.tie_embeddings, cfg.norm_offset, cfg.query_pre_attn_scalar,
          cfg.max_seq_len) == (True, 1.0, 16.0, 4096)
  # What export writes reads back as the same model.
  assert hf.config_from_hf(hf.config_to_hf(cfg)) == cfg


@pytest.mark.parametrize("changes, pattern", [
    (dict(attn_logit_softcapping=50.0),
     r"my/config\.json: attn_logit_softcapping=50\.0 is not supported"),
    (dict(use_bidirectional_attention=True), r"use_bidirectional_attention"),
    (dict(rope_scaling=None, rope_parameters={
        "sliding_attention": {"rope_type": "yarn", "factor": 2.0},
        "full_attention": {"rope_type": "default"}}),
     r"rope_parameters\.sliding_attention has rope type 'yarn'"),
    (dict(hidden_activation="gelu"), r"hidden_activation 'gelu' is not "
     r"supported \(only gelu_pytorch_tanh\)"),
    (dict(architectures=["Gemma3ForConditionalGeneration"]),
     r"unsupported architecture \['Gemma3ForConditionalGeneration'\]"),
    (dict(layer_types=["sliding_attention"] * 8, sliding_window=None),
     r"sliding_attention layers need a sliding_window"),
])
def test_unsupported_gemma3_configs_raise(changes, pattern):
  with pytest.raises(hf.HFCheckpointError, match=pattern):
    hf.config_from_hf(_gemma3_4x_config(**changes), source="my/config.json")


def _qwen_config(**changes) -> dict:
  out = dict(architectures=["Qwen2ForCausalLM"], vocab_size=96,
             hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, intermediate_size=128,
             max_position_embeddings=131072, rope_theta=1e6)
  out.update(changes)
  return out


def test_yarn_config_defaults_follow_transformers():
  # Qwen2.5's model card: the 4.x spelling, no beta or attention factor.
  cfg = hf.config_from_hf(_qwen_config(rope_scaling={
      "type": "yarn", "factor": 4.0,
      "original_max_position_embeddings": 32768}))
  assert cfg.rope_scaling == rope.RopeScaling("yarn", 4.0, 32768)
  assert cfg.rope_scaling.cos_sin_scale == pytest.approx(
      0.1 * math.log(4.0) + 1)
  # No factor: max_position_embeddings / original; mscale over
  # mscale_all_dim gives the attention factor.
  cfg = hf.config_from_hf(_qwen_config(rope_parameters={
      "rope_type": "yarn", "rope_theta": 1e6, "mscale": 2.0,
      "mscale_all_dim": 1.0, "original_max_position_embeddings": 32768}))
  assert cfg.rope_scaling.factor == 4.0
  assert cfg.rope_scaling.attention_factor == pytest.approx(
      (0.2 * math.log(4.0) + 1) / (0.1 * math.log(4.0) + 1))
  # Qwen3 reads its own head_dim default (128), not hidden / heads.
  qwen3 = _qwen_config(architectures=["Qwen3ForCausalLM"])
  assert hf.config_from_hf(qwen3).head_dim == 128


def test_model_config_sections_before_and_after_the_family_fields():
  """A model section saved before the family fields existed parses as the
  model it was; a Gemma-style config survives asdict -> JSON -> back."""
  old = {"vocab_size": 64, "d_model": 32, "n_layers": 2, "n_heads": 4,
         "n_kv_heads": 2, "head_dim": 8, "mlp_dim": 64,
         "rope_theta": 10000.0, "qkv_bias": True}
  cfg = ModelConfig.from_mapping(old)
  assert (cfg.qk_norm, cfg.norm_offset, cfg.rope_scaling, cfg.layer_kinds,
          cfg.windowed) == (False, 0.0, None, (FULL, FULL), False)
  gemma = hf.config_from_hf(_gemma3_4x_config())
  saved = json.loads(json.dumps(dataclasses.asdict(gemma)))
  assert isinstance(saved["rope_scaling"], dict)
  assert ModelConfig.from_mapping(saved) == gemma
  assert count_params(gemma) == sum(
      math.prod(s) for s in jax.tree.leaves(
          transformer.param_shapes(gemma),
          is_leaf=lambda x: isinstance(x, tuple)))


@pytest.mark.parametrize("changes, pattern", [
    (dict(layer_types=(FULL,)), r"layer_types has 1 entries for "
     r"model\.n_layers=2"),
    (dict(layer_types=(FULL, "local")), r"unknown kinds \['local'\]"),
    (dict(layer_types=(FULL, SLIDING)), r"sliding_window is None"),
    (dict(mlp_activation="relu"), r"mlp_activation must be one of"),
    (dict(rope_scaling={"rope_type": "llama3", "factor": 8.0}),
     r"rope_type 'llama3' needs original_max_position_embeddings"),
    (dict(rope_scaling={"rope_type": "ntk", "factor": 2.0}),
     r"rope_type must be one of"),
])
def test_model_config_rejects_bad_family_fields(changes, pattern):
  base = dict(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
              n_kv_heads=2, head_dim=8, mlp_dim=64)
  with pytest.raises(ValueError, match=pattern):
    ModelConfig.from_mapping({**base, **changes})


def test_export_picks_the_family_and_refuses_what_it_cannot_express():
  base = ModelConfig(vocab_size=64, d_model=32, n_layers=2, n_heads=4,
                     n_kv_heads=2, head_dim=8, mlp_dim=64)
  qwen3 = dataclasses.replace(base, qk_norm=True)
  assert hf.config_to_hf(qwen3)["architectures"] == ["Qwen3ForCausalLM"]
  assert hf.config_to_hf(dataclasses.replace(
      base, rope_scaling=rope.RopeScaling("yarn", 4.0, 1024)))[
          "architectures"] == ["LlamaForCausalLM"]
  with pytest.raises(hf.HFCheckpointError,
                     match=r"LlamaForCausalLM cannot express this model's "
                     r"qk_norm=True"):
    hf.config_to_hf(qwen3, "LlamaForCausalLM")
  windowed = dataclasses.replace(base, layer_types=(SLIDING, FULL),
                                 sliding_window=8)
  # Sliding layers are Gemma 3's; the rest of this model is not.
  with pytest.raises(hf.HFCheckpointError, match=r"Gemma3ForCausalLM cannot "
                     r"express this model's qk_norm=False, norm_offset=0\.0"):
    hf.config_to_hf(windowed)


# --------------------------------------------------------------------------
# Rotary frequencies against transformers' own functions (fast)


@pytest.mark.parametrize("section", [
    {"rope_type": "linear", "factor": 3.0},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 256},
    {"rope_type": "yarn", "factor": 4.0,
     "original_max_position_embeddings": 512},
    {"rope_type": "yarn", "factor": 16.0, "beta_fast": 16.0,
     "beta_slow": 2.0, "truncate": False, "attention_factor": 1.3,
     "original_max_position_embeddings": 512},
])
def test_rope_frequencies_equal_transformers(section):
  config = transformers.LlamaConfig(
      hidden_size=256, num_attention_heads=4, head_dim=64,
      max_position_embeddings=4096,
      rope_parameters={"rope_theta": 500000.0, **section})
  inv_freq, attention_factor = modeling_rope_utils.ROPE_INIT_FUNCTIONS[
      section["rope_type"]](config)
  scaling = families.rope_scaling_from_hf(section, 4096, "test")
  ours = np.asarray(rope.inv_frequencies(64, 500000.0, scaling))
  np.testing.assert_allclose(ours, inv_freq.numpy(), rtol=1e-6)
  assert (scaling.cos_sin_scale or 1.0) == pytest.approx(attention_factor)
  # The rewrite changes some frequencies and keeps others.
  plain = np.asarray(rope.inv_frequencies(64, 500000.0))
  assert np.any(ours != plain) and (section["rope_type"] == "linear" or
                                    np.any(ours == plain))
