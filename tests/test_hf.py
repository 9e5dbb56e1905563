"""Hugging Face interop: logit parity with transformers, import/export,
error messages, and tokenizer loading. All models are tiny, random and built
in the test (no downloads)."""

from __future__ import annotations

import json
import os
import shutil

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import tokenizers
import torch
import transformers
from safetensors import safe_open
from safetensors.numpy import load_file, save_file

from kimi_jax.model import hf, transformer
from kimi_jax.model.config import ModelConfig
from kimi_jax.model.tokenizer import Tokenizer, load_hf_tokenizer
from kimi_jax.sharding import (DEFAULT_RULES, MeshConfig, Sharder,
                               ShardingError, make_mesh)

# Numerics against transformers on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs

_COMMON = dict(vocab_size=96, hidden_size=64, num_hidden_layers=2,
               num_attention_heads=4, num_key_value_heads=2,
               intermediate_size=128, max_position_embeddings=128,
               rms_norm_eps=1e-5, rope_theta=5000.0)
TOKENS_BxT = np.random.RandomState(0).randint(0, 96, (2, 11))


def _hf_model(arch: str, tied: bool, seed: int = 0) -> torch.nn.Module:
  """A random HF model; norms and biases moved off their 1 / 0 init."""
  torch.manual_seed(seed)
  if arch == "qwen2":
    config = transformers.Qwen2Config(**_COMMON, tie_word_embeddings=tied)
    model = transformers.Qwen2ForCausalLM(config)
  else:  # Llama with head_dim != hidden / heads.
    config = transformers.LlamaConfig(**_COMMON, head_dim=24,
                                      tie_word_embeddings=tied)
    model = transformers.LlamaForCausalLM(config)
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name:
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  return model.eval()


def _hf_logits(model: torch.nn.Module) -> np.ndarray:
  with torch.no_grad():
    return model(torch.tensor(TOKENS_BxT)).logits.float().numpy()


def _our_logits(params, cfg: ModelConfig) -> np.ndarray:
  B, T = TOKENS_BxT.shape
  pos = np.broadcast_to(np.arange(T), (B, T))
  logits, _ = transformer.forward(params, TOKENS_BxT, pos,
                                  np.ones((B, T), np.int32), cfg=cfg)
  return np.asarray(logits)


def _assert_logits_close(ours: np.ndarray, ref: np.ndarray) -> None:
  assert np.abs(ref).max() > 1.0  # the comparison is not between near-zeros
  np.testing.assert_allclose(ours, ref, rtol=1e-4,
                             atol=1e-4 * np.abs(ref).max())


def _assert_trees_equal(a, b) -> None:
  flat_a = jax.tree_util.tree_flatten_with_path(a)[0]
  flat_b = jax.tree_util.tree_flatten_with_path(b)[0]
  assert [p for p, _ in flat_a] == [p for p, _ in flat_b]
  for (path, x), (_, y) in zip(flat_a, flat_b):
    assert x.dtype == y.dtype, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(x), np.asarray(y),
                                  err_msg=jax.tree_util.keystr(path))


@pytest.fixture(scope="module")
def qwen2_dir(tmp_path_factory):
  """An untied Qwen2 saved as one model.safetensors, and its HF logits."""
  model = _hf_model("qwen2", tied=False, seed=1)
  path = str(tmp_path_factory.mktemp("qwen2"))
  model.save_pretrained(path)
  return path, _hf_logits(model)


# --------------------------------------------------------------------------
# Import: parity with transformers


@pytest.mark.slow
@pytest.mark.parametrize("arch, tied", [("qwen2", True), ("qwen2", False),
                                        ("llama", False), ("llama", True)])
def test_loaded_checkpoint_logits_match_transformers(arch, tied, tmp_path):
  model = _hf_model(arch, tied)
  model.save_pretrained(tmp_path)
  cfg, params = hf.load_hf_checkpoint(str(tmp_path))
  assert (cfg.qkv_bias, cfg.tie_embeddings) == (arch == "qwen2", tied)
  assert (cfg.head_dim, cfg.rope_theta, cfg.norm_eps) == (
      16 if arch == "qwen2" else 24, 5000.0, 1e-5)
  assert ("lm_head" in params) == (not tied)
  _assert_logits_close(_our_logits(params, cfg), _hf_logits(model))


def test_sharded_safetensors_load_into_mesh(qwen2_dir, tmp_path):
  path, _ = qwen2_dir
  model = transformers.AutoModelForCausalLM.from_pretrained(path)
  model.save_pretrained(tmp_path, max_shard_size="20KB")
  assert os.path.exists(tmp_path / hf.INDEX_FILE)
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  cfg, sharded = hf.load_hf_checkpoint(str(tmp_path), sharder=sharder)
  _, single = hf.load_hf_checkpoint(path)
  _assert_trees_equal(sharded, single)
  wq = sharded["layers"]["wq"]  # [L, D, H, Dh]: D over fsdp, H over tensor
  assert wq.sharding == transformer.param_shardings(cfg, sharder)["layers"][
      "wq"]
  assert {s.data.shape for s in wq.addressable_shards} == {(2, 32, 2, 16)}
  # Layers split over `data` too: each device then reads one layer.
  rules = dict(DEFAULT_RULES, layers="data")
  by_layer = Sharder(sharder.mesh, tuple(rules.items()))
  _, layer_sharded = hf.load_hf_checkpoint(str(tmp_path), sharder=by_layer)
  _assert_trees_equal(layer_sharded, single)
  shards = layer_sharded["layers"]["w_down"].addressable_shards
  assert {s.data.shape for s in shards} == {(1, 64, 32)}


def test_load_in_bfloat16(qwen2_dir):
  path, ref = qwen2_dir
  cfg, params = hf.load_hf_checkpoint(path, param_dtype="bfloat16")
  assert cfg.param_dtype == "bfloat16"
  assert {x.dtype for x in jax.tree_util.tree_leaves(params)} == {
      jnp.dtype(jnp.bfloat16)}
  _, params32 = hf.load_hf_checkpoint(path)
  np.testing.assert_array_equal(
      params["layers"]["wq"],
      params32["layers"]["wq"].astype(jnp.bfloat16))


# --------------------------------------------------------------------------
# Export


def test_export_reload_round_trips_bitwise(qwen2_dir, tmp_path):
  cfg, params = hf.load_hf_checkpoint(qwen2_dir[0])
  hf.export_hf_checkpoint(params, cfg, str(tmp_path), max_shard_bytes=20_000)
  with open(tmp_path / hf.INDEX_FILE) as f:
    weight_map = json.load(f)["weight_map"]
  assert len(set(weight_map.values())) > 2
  for file in set(weight_map.values()):
    with safe_open(str(tmp_path / file), "numpy") as f:
      nbytes = sum(f.get_tensor(n).nbytes for n in f.keys())
      # Over the limit only when one tensor alone is (lm_head: 24576 bytes).
      assert nbytes <= 20_000 or len(f.keys()) == 1, file
      assert sorted(f.keys()) == sorted(
          n for n, v in weight_map.items() if v == file)
  cfg2, params2 = hf.load_hf_checkpoint(str(tmp_path))
  assert cfg2 == cfg
  _assert_trees_equal(params2, params)


def _random_params(cfg: ModelConfig, seed: int) -> transformer.Params:
  rng = np.random.RandomState(seed)

  def leaf(path, shape):
    base = 1.0 if "norm" in jax.tree_util.keystr(path) else 0.0
    return (base + 0.2 * rng.normal(size=shape)).astype(
        cfg.param_jnp_dtype)

  return jax.tree_util.tree_map_with_path(
      leaf, transformer.param_shapes(cfg),
      is_leaf=lambda x: isinstance(x, tuple))


def test_export_bfloat16_sharded_params_round_trips(tmp_path):
  cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=24, mlp_dim=128,
                    tie_embeddings=True, param_dtype="bfloat16")
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  params = jax.device_put(_random_params(cfg, seed=3),
                          transformer.param_shardings(cfg, sharder))
  hf.export_hf_checkpoint(params, cfg, str(tmp_path))
  with safe_open(str(tmp_path / hf.SINGLE_FILE), "numpy") as f:
    assert f.get_slice("model.embed_tokens.weight").get_dtype() == "BF16"
    assert "lm_head.weight" not in f.keys()
  cfg2, params2 = hf.load_hf_checkpoint(str(tmp_path),
                                        param_dtype="bfloat16")
  assert cfg2 == cfg
  _assert_trees_equal(params2, jax.device_get(params))


@pytest.mark.parametrize("qkv_bias, tied", [(True, False), (False, True)])
def test_exported_checkpoint_loads_in_transformers(qkv_bias, tied, tmp_path):
  cfg = ModelConfig(vocab_size=96, d_model=64, n_layers=2, n_heads=4,
                    n_kv_heads=2, head_dim=16 if qkv_bias else 24,
                    mlp_dim=128, rope_theta=5000.0, norm_eps=1e-5,
                    tie_embeddings=tied, qkv_bias=qkv_bias, max_seq_len=128)
  params = _random_params(cfg, seed=4)
  hf.export_hf_checkpoint(params, cfg, str(tmp_path), max_shard_bytes=50_000)
  model = transformers.AutoModelForCausalLM.from_pretrained(str(tmp_path))
  expected = "Qwen2ForCausalLM" if qkv_bias else "LlamaForCausalLM"
  assert type(model).__name__ == expected
  _assert_logits_close(_our_logits(params, cfg), _hf_logits(model.eval()))


def test_export_refuses_a_directory_with_a_checkpoint(qwen2_dir):
  cfg, params = hf.load_hf_checkpoint(qwen2_dir[0])
  with pytest.raises(hf.HFCheckpointError, match="already holds"):
    hf.export_hf_checkpoint(params, cfg, qwen2_dir[0])


# --------------------------------------------------------------------------
# Errors name the architecture / tensor / file


def _copy_with_tensors(src: str, dst: str, edit) -> str:
  shutil.copytree(src, dst)
  file = os.path.join(dst, hf.SINGLE_FILE)
  tensors = load_file(file)
  edit(tensors)
  save_file(tensors, file, metadata={"format": "pt"})
  return dst


def test_missing_tensor_is_named(qwen2_dir, tmp_path):
  name = "model.layers.1.mlp.up_proj.weight"
  path = _copy_with_tensors(qwen2_dir[0], str(tmp_path / "m"),
                            lambda t: t.pop(name))
  with pytest.raises(hf.HFCheckpointError, match=f"missing.*{name}"):
    hf.load_hf_checkpoint(path)


def test_wrong_shape_is_named_with_its_file(qwen2_dir, tmp_path):
  name = "model.layers.0.self_attn.k_proj.weight"

  def edit(t):
    t[name] = np.zeros((16, 64), np.float32)

  path = _copy_with_tensors(qwen2_dir[0], str(tmp_path / "m"), edit)
  with pytest.raises(hf.HFCheckpointError,
                     match=rf"model\.safetensors: tensor {name} has shape "
                     rf"\(16, 64\), expected \(32, 64\)"):
    hf.load_hf_checkpoint(path)


def test_unexpected_tensor_is_named(qwen2_dir, tmp_path):
  name = "model.layers.0.self_attn.o_proj.bias"

  def edit(t):
    t[name] = np.zeros((64,), np.float32)

  path = _copy_with_tensors(qwen2_dir[0], str(tmp_path / "m"), edit)
  with pytest.raises(hf.HFCheckpointError, match=f"unexpected.*{name}"):
    hf.load_hf_checkpoint(path)


def test_tied_config_with_a_different_lm_head_raises(qwen2_dir, tmp_path):
  path = str(tmp_path / "m")
  shutil.copytree(qwen2_dir[0], path)
  with open(os.path.join(path, hf.CONFIG_FILE)) as f:
    config = json.load(f)
  with open(os.path.join(path, hf.CONFIG_FILE), "w") as f:
    json.dump(dict(config, tie_word_embeddings=True), f)
  with pytest.raises(hf.HFCheckpointError,
                     match=r"lm_head\.weight differs from model\.embed_"):
    hf.load_hf_checkpoint(path)


def test_load_into_mesh_that_cannot_hold_a_param_names_it(qwen2_dir):
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=1, tensor=4)))
  # 4 query heads divide over tensor=4, the 2 kv heads do not.
  with pytest.raises(ShardingError, match=r"\['layers'\]\['bk'\]"):
    hf.load_hf_checkpoint(qwen2_dir[0], sharder=sharder)


def _config(**changes) -> dict:
  out = dict(_COMMON, architectures=["Qwen2ForCausalLM"], model_type="qwen2")
  out.update(changes)
  return out


@pytest.mark.parametrize("changes, pattern", [
    (dict(architectures=["MistralForCausalLM"]),
     r"my/config\.json: unsupported architecture \['MistralForCausalLM'\]"),
    (dict(rope_scaling={"rope_type": "dynamic", "factor": 4.0}),
     r"rope_scaling has rope type 'dynamic'; implemented: default, linear, "
     r"llama3, yarn"),
    (dict(rope_parameters={"rope_type": "longrope", "rope_theta": 5e3}),
     r"rope_parameters has rope type 'longrope'"),
    (dict(rope_parameters={"rope_type": "llama3", "rope_theta": 5e3,
                           "factor": 8.0, "high_freq_factor": 4.0}),
     r"rope_parameters: rope type 'llama3' needs low_freq_factor"),
    (dict(rope_parameters={"rope_type": "yarn", "factor": 4.0,
                           "partial_rotary_factor": 0.5}),
     r"partial_rotary_factor 0\.5"),
    (dict(architectures=["LlamaForCausalLM"], attention_bias=True),
     r"attention_bias=true"),
    (dict(hidden_act="gelu"), r"hidden_act 'gelu'"),
    (dict(intermediate_size=None), r"missing required key 'intermediate_"),
])
def test_unsupported_configs_raise(changes, pattern):
  with pytest.raises(hf.HFCheckpointError, match=pattern):
    hf.config_from_hf(_config(**changes), source="my/config.json")


def test_config_rope_theta_in_either_place():
  old_style = _config(rope_theta=1e6)  # transformers 4.x
  new_style = _config(rope_parameters={"rope_type": "default",
                                       "rope_theta": 1e6})
  new_style.pop("rope_theta")
  assert hf.config_from_hf(old_style).rope_theta == 1e6
  assert hf.config_from_hf(new_style).rope_theta == 1e6
  llama = dict(_COMMON, architectures=["LlamaForCausalLM"],
               attention_bias=False, num_key_value_heads=None)
  cfg = hf.config_from_hf(llama)
  assert (cfg.qkv_bias, cfg.n_kv_heads, cfg.max_seq_len) == (False, 4, 128)


# --------------------------------------------------------------------------
# Tokenizer


def _word_level(tmp_path) -> str:
  vocab = {"<pad>": 0, "<eos>": 1, "<unk>": 2, "hello": 3, "world": 4,
           "<im_end>": 5}
  tok = tokenizers.Tokenizer(tokenizers.models.WordLevel(vocab, "<unk>"))
  tok.pre_tokenizer = tokenizers.pre_tokenizers.Whitespace()
  tok.add_special_tokens(["<pad>", "<eos>", "<im_end>"])
  tok.save(str(tmp_path / "tokenizer.json"))
  return str(tmp_path)


def test_word_level_tokenizer_with_tokenizer_config(tmp_path):
  path = _word_level(tmp_path)
  with open(tmp_path / "tokenizer_config.json", "w") as f:
    json.dump({"eos_token": {"content": "<im_end>"}, "pad_token": "<pad>"}, f)
  with open(tmp_path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": 1}, f)  # tokenizer_config takes precedence
  tok = load_hf_tokenizer(path)
  assert isinstance(tok, Tokenizer)
  assert (tok.eos_id, tok.pad_id, tok.vocab_size) == (5, 0, 6)
  assert tok.encode("hello world hello") == [3, 4, 3]
  assert tok.encode("hello mars") == [3, 2]
  assert tok.decode([3, 4, 5, 0]) == "hello world"


def test_tokenizer_ids_from_generation_config(tmp_path):
  path = _word_level(tmp_path)
  with open(tmp_path / "generation_config.json", "w") as f:
    json.dump({"eos_token_id": [5, 1]}, f)
  tok = load_hf_tokenizer(path)
  assert (tok.eos_id, tok.pad_id) == (5, 5)  # no pad named: eos pads


def test_tokenizer_without_eos_raises(tmp_path):
  path = _word_level(tmp_path)
  with pytest.raises(ValueError, match="no eos"):
    load_hf_tokenizer(path)


def test_bpe_tokenizer_round_trips_text(tmp_path):
  tok = tokenizers.Tokenizer(tokenizers.models.BPE())
  tok.pre_tokenizer = tokenizers.pre_tokenizers.ByteLevel(
      add_prefix_space=False)
  tok.decoder = tokenizers.decoders.ByteLevel()
  trainer = tokenizers.trainers.BpeTrainer(
      vocab_size=300, special_tokens=["<|endoftext|>"],
      initial_alphabet=tokenizers.pre_tokenizers.ByteLevel.alphabet())
  text = ["the answer is 42.", "think step by step, then answer."] * 20
  tok.train_from_iterator(text, trainer)
  tok.save(str(tmp_path / "tokenizer.json"))
  with open(tmp_path / "config.json", "w") as f:
    json.dump({"eos_token_id": 0, "pad_token_id": 0}, f)
  loaded = load_hf_tokenizer(str(tmp_path))
  assert loaded.eos_id == loaded.pad_id == tok.token_to_id("<|endoftext|>")
  sample = "the answer, step by step: 7 × 6 = 42."
  ids = loaded.encode(sample)
  assert len(ids) < len(sample.encode())  # merges were applied
  assert loaded.decode(ids + [loaded.eos_id]) == sample


# --------------------------------------------------------------------------
# The run's model section from a checkpoint directory


def test_model_config_from_hf_dir(qwen2_dir, tmp_path):
  cfg = hf.model_config_from_hf(qwen2_dir[0])
  assert (cfg.vocab_size, cfg.d_model, cfg.n_layers, cfg.n_heads,
          cfg.n_kv_heads, cfg.head_dim, cfg.mlp_dim) == (96, 64, 2, 4, 2, 16,
                                                         128)
  assert (cfg.rope_theta, cfg.norm_eps, cfg.tie_embeddings, cfg.qkv_bias,
          cfg.max_seq_len) == (5000.0, 1e-5, False, True, 128)
  with pytest.raises(hf.HFCheckpointError, match=r"empty/config\.json: not "
                     r"found"):
    hf.model_config_from_hf(str(tmp_path / "empty"))
  bad = tmp_path / "bad"
  bad.mkdir()
  (bad / "config.json").write_text(json.dumps(_config(
      architectures=["GPT2LMHeadModel"])))
  with pytest.raises(hf.HFCheckpointError,
                     match=r"bad/config\.json: unsupported architecture "
                     r"\['GPT2LMHeadModel'\]"):
    hf.model_config_from_hf(str(bad))
  (bad / "config.json").write_text("{not json")
  with pytest.raises(hf.HFCheckpointError, match=r"bad/config\.json: not "
                     r"valid JSON"):
    hf.model_config_from_hf(str(bad))


def test_merge_model_config_keeps_architecture_and_run_settings():
  ckpt = hf.config_from_hf(_config())
  merged = hf.merge_model_config(ckpt, {
      "param_dtype": "bfloat16", "remat": True, "max_seq_len": 64,
      "n_layers": 2, "rope_theta": 5000, "qkv_bias": True}, source="D")
  assert merged == ModelConfig(**{
      **{f: getattr(ckpt, f) for f in ckpt.__dataclass_fields__},
      "param_dtype": "bfloat16", "remat": True, "max_seq_len": 64})
  for key, value, hf_key in (("n_layers", 3, "num_hidden_layers"),
                             ("rope_theta", 1e6, "rope_theta"),
                             ("qkv_bias", False, "architectures"),
                             ("tie_embeddings", True, "tie_word_embeddings")):
    with pytest.raises(hf.HFCheckpointError,
                       match=rf"config\.model\.{key}={value!r} disagrees "
                       rf"with the checkpoint D \({hf_key} gives"):
      hf.merge_model_config(ckpt, {key: value}, source="D")
  with pytest.raises(hf.HFCheckpointError, match=r"unknown keys \['layers'\]"):
    hf.merge_model_config(ckpt, {"layers": 3})
