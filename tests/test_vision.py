"""Vision input (image understanding): the SigLIP tower against
transformers' SiglipVisionModel, its pieces against direct computations,
the projector's pixel shuffle, the placeholder merge and its host-side
checker, HF import / export, and sharded init on the 8 fake CPU devices.
All models are tiny, random and built in the test (no downloads)."""

from __future__ import annotations

import json
import os

import jax
import jax.numpy as jnp
import numpy as np
import pytest
import torch
import transformers
from safetensors.numpy import load_file, save_file

from kimi_jax.model.hf import HFCheckpointError
from kimi_jax.sharding import MeshConfig, Sharder, make_mesh
from kimi_jax.vision import hf as vision_hf
from kimi_jax.vision import merge, projector, tower
from kimi_jax.vision.config import VisionConfig

# Numerics on host inputs (see tests/conftest.py).
pytestmark = pytest.mark.host_inputs

_HF_SIZES = dict(image_size=32, patch_size=8, hidden_size=64,
                 num_hidden_layers=2, num_attention_heads=4,
                 intermediate_size=128, layer_norm_eps=1e-5)
_RUN = dict(lm_d_model=48, image_token_id=7, pool=2, max_images=3)


def _cfg(**overrides) -> VisionConfig:
  values = dict(image_size=16, patch_size=4, d_model=32, n_layers=2,
                n_heads=4, mlp_dim=64, lm_d_model=48, image_token_id=7,
                pool=2, max_images=3)
  values.update(overrides)
  return VisionConfig(**values)


def _init(module, cfg: VisionConfig, seed: int, std: float = 0.02):
  """Random params of `module` (tower or projector) drawn with numpy, norms
  and biases included: quicker than compiling `init_params` here."""
  rng = np.random.RandomState(seed)
  shapes = module.param_shapes(cfg)
  return jax.tree.map(
      lambda s: jnp.asarray(std * rng.normal(size=s), jnp.float32), shapes,
      is_leaf=lambda x: isinstance(x, tuple))


def _randomise(model: torch.nn.Module) -> torch.nn.Module:
  """Every parameter random, norms and biases off their 1 / 0 init, so a
  wrong layout of any tensor shows."""
  with torch.no_grad():
    for name, p in model.named_parameters():
      if "norm" in name and name.endswith("weight"):
        p.copy_(1.0 + 0.3 * torch.randn_like(p))
      else:
        p.normal_(0.0, 0.2)
  return model.eval()


def _pixels(n: int, size: int, seed: int = 0) -> np.ndarray:
  rng = np.random.RandomState(seed)
  return rng.uniform(-1.0, 1.0, (n, size, size, 3)).astype(np.float32)


def _hf_hidden(model: torch.nn.Module, pixels_NxHxWxC: np.ndarray
               ) -> np.ndarray:
  with torch.no_grad():
    x = torch.from_numpy(pixels_NxHxWxC.transpose(0, 3, 1, 2).copy())
    return model(pixel_values=x).last_hidden_state.numpy()


# ---------------------------------------------------------------------------
# Config


def test_config_validates_and_names_keys():
  cfg = _cfg()
  assert (cfg.grid, cfg.n_patches, cfg.tokens_per_image) == (4, 16, 4)
  assert cfg.merged_dim == 128 and cfg.projector_hidden == 128
  assert _cfg(image_size=48, patch_size=4, pool=3).tokens_per_image == 16
  with pytest.raises(ValueError, match=r"vision\.image_size \(18\) must be "
                     r"divisible by vision\.patch_size \(4\)"):
    _cfg(image_size=18)
  with pytest.raises(ValueError, match=r"vision\.pool \(3\) must divide the "
                     r"patch grid .* = 4"):
    _cfg(pool=3)
  with pytest.raises(ValueError, match=r"vision\.d_model \(32\).*"
                     r"vision\.n_heads \(5\)"):
    _cfg(n_heads=5)
  with pytest.raises(ValueError, match=r"vision\.max_images"):
    _cfg(max_images=0)
  with pytest.raises(ValueError, match=r"vision\.image_token_id"):
    _cfg(image_token_id=-1)
  with pytest.raises(ValueError, match=r"vision\.compute_dtype"):
    _cfg(compute_dtype="float64")
  values = dict(image_size=16, patch_size=4, d_model=32, n_layers=2,
                n_heads=4, mlp_dim=64, lm_d_model=48, image_token_id=7)
  assert VisionConfig.from_mapping(values) == VisionConfig(**values)
  with pytest.raises(ValueError, match=r"\['vision\.pooling'\]"):
    VisionConfig.from_mapping({**values, "pooling": 2})
  del values["lm_d_model"]
  with pytest.raises(ValueError, match=r"missing .*\['vision\.lm_d_model'\]"):
    VisionConfig.from_mapping(values)


# ---------------------------------------------------------------------------
# Tower pieces against direct computations


def test_patch_embedding_equals_a_strided_conv():
  cfg = _cfg()
  params = _init(tower, cfg, 1)
  rng = np.random.RandomState(1)
  params["patch_bias"] = jnp.asarray(rng.normal(size=32), jnp.float32)
  pixels = _pixels(3, 16)
  ours = np.asarray(tower.embed_patches(params, pixels, cfg))
  conv = jax.lax.conv_general_dilated(
      jnp.asarray(pixels), params["patch_embed"], window_strides=(4, 4),
      padding="VALID", dimension_numbers=("NHWC", "HWIO", "NHWC"),
      precision=jax.lax.Precision.HIGHEST)
  want = (np.asarray(conv).reshape(3, 16, 32) +
          np.asarray(params["patch_bias"])[None, None] +
          np.asarray(params["pos_embed"])[None])
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


def test_attention_equals_numpy_softmax():
  rng = np.random.RandomState(2)
  q, k, v = (rng.normal(size=(2, 9, 3, 8)).astype(np.float32)
             for _ in range(3))
  ours = np.asarray(tower.attention(q, k, v))
  q64, k64, v64 = (x.astype(np.float64) for x in (q, k, v))
  want = np.zeros_like(q64)
  for n in range(2):
    for h in range(3):
      s = q64[n, :, h] @ k64[n, :, h].T / np.sqrt(8)
      p = np.exp(s - s.max(axis=1, keepdims=True))
      want[n, :, h] = (p / p.sum(axis=1, keepdims=True)) @ v64[n, :, h]
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)


def test_pixel_shuffle_equals_a_loop():
  rng = np.random.RandomState(3)
  g, pool, D = 6, 3, 5
  patches = rng.normal(size=(2, g * g, D)).astype(np.float32)
  ours = np.asarray(projector.pixel_shuffle(patches, pool))
  c = g // pool
  want = np.zeros((2, c * c, pool * pool * D), np.float32)
  for n in range(2):
    for r in range(c):
      for col in range(c):
        parts = []
        for i in range(pool):
          for j in range(pool):
            parts.append(patches[n, (r * pool + i) * g + col * pool + j])
        want[n, r * c + col] = np.concatenate(parts)
  np.testing.assert_array_equal(ours, want)


def test_embed_images_shape_and_projector_mlp():
  cfg = _cfg()
  vp = _init(tower, cfg, 0, 0.3)
  # Weights large enough that GELU's exact and tanh forms differ.
  pp = _init(projector, cfg, 1, 0.3)
  pp["b1"] = jnp.full_like(pp["b1"], 0.1)
  pp["b2"] = jnp.full_like(pp["b2"], -0.2)
  pixels = _pixels(2, 16)
  out = np.asarray(projector.embed_images(vp, pp, pixels, cfg))
  assert out.shape == (2, cfg.tokens_per_image, cfg.lm_d_model)
  merged = np.asarray(projector.pixel_shuffle(tower.encode(vp, pixels, cfg),
                                              cfg.pool)).astype(np.float64)
  h = merged @ np.asarray(pp["w1"], np.float64) + np.asarray(pp["b1"])
  from scipy.special import erf  # exact GELU, as torch.nn.GELU()
  h = 0.5 * h * (1 + erf(h / np.sqrt(2)))
  want = h @ np.asarray(pp["w2"], np.float64) + np.asarray(pp["b2"])
  assert np.abs(want).max() > 1.0
  np.testing.assert_allclose(out, want, rtol=1e-5, atol=1e-5)


# ---------------------------------------------------------------------------
# Hugging Face parity, import and export


def test_encode_matches_transformers_and_export_round_trips(tmp_path):
  torch.manual_seed(0)
  hf_cfg = transformers.SiglipVisionConfig(**_HF_SIZES)
  model = _randomise(transformers.SiglipVisionModel(hf_cfg))
  model.save_pretrained(tmp_path / "hf")  # with the pooling head
  pixels = _pixels(3, 32)
  want = _hf_hidden(model, pixels)

  cfg = vision_hf.vision_config_from_hf(str(tmp_path / "hf"), **_RUN)
  assert (cfg.d_model, cfg.n_layers, cfg.n_heads, cfg.mlp_dim,
          cfg.image_size, cfg.patch_size, cfg.norm_eps) == (
              64, 2, 4, 128, 32, 8, 1e-5)
  params = vision_hf.load_vision_hf(str(tmp_path / "hf"), cfg)
  ours = np.asarray(jax.jit(lambda p, x: tower.encode(p, x, cfg))(params,
                                                                  pixels))
  assert ours.shape == (3, 16, 64)
  np.testing.assert_allclose(ours, want, rtol=1e-5, atol=1e-5)

  vision_hf.export_vision_hf(params, cfg, str(tmp_path / "out"))
  back, info = transformers.SiglipVisionModel.from_pretrained(
      str(tmp_path / "out"), output_loading_info=True)
  assert not any(info.values()), info
  np.testing.assert_allclose(_hf_hidden(back.eval(), pixels), want,
                             rtol=1e-5, atol=1e-5)
  # And ours reads its own export back to the same params.
  again = vision_hf.load_vision_hf(str(tmp_path / "out"), cfg)
  for (path, a), (_, b) in zip(
      jax.tree_util.tree_flatten_with_path(params)[0],
      jax.tree_util.tree_flatten_with_path(again)[0]):
    np.testing.assert_array_equal(np.asarray(a), np.asarray(b),
                                  err_msg=jax.tree_util.keystr(path))


def test_loads_the_vision_tower_of_a_full_siglip_model(tmp_path):
  torch.manual_seed(1)
  config = transformers.SiglipConfig(
      text_config=dict(vocab_size=32, hidden_size=16, intermediate_size=32,
                       num_hidden_layers=1, num_attention_heads=2,
                       max_position_embeddings=8),
      vision_config=_HF_SIZES)
  model = _randomise(transformers.SiglipModel(config))
  model.save_pretrained(tmp_path)
  names = load_file(str(tmp_path / "model.safetensors"))
  assert "vision_model.embeddings.patch_embedding.weight" in names
  pixels = _pixels(2, 32, seed=5)
  want = _hf_hidden(model.vision_model, pixels)
  cfg = vision_hf.vision_config_from_hf(str(tmp_path), **_RUN)
  params = vision_hf.load_vision_hf(str(tmp_path), cfg)
  np.testing.assert_allclose(np.asarray(tower.encode(params, pixels, cfg)),
                             want, rtol=1e-5, atol=1e-5)


def _export_small(tmp_path) -> tuple[VisionConfig, str]:
  cfg = _cfg()
  path = str(tmp_path / "ckpt")
  vision_hf.export_vision_hf(_init(tower, cfg, 0), cfg, path)
  return cfg, path


def test_hf_errors_name_the_file_and_tensor(tmp_path):
  cfg, path = _export_small(tmp_path)
  file = os.path.join(path, "model.safetensors")
  tensors = load_file(file)
  name = "vision_model.encoder.layers.1.mlp.fc1.weight"

  bad = dict(tensors)
  bad[name] = np.zeros((64, 31), np.float32)
  save_file(bad, file)
  with pytest.raises(HFCheckpointError, match=(
      rf"{file}: tensor {name} has shape \(64, 31\), expected \(64, 32\)")):
    vision_hf.load_vision_hf(path, cfg)

  bad = dict(tensors)
  bad["vision_model.encoder.layers.2.mlp.fc1.weight"] = tensors[name]
  save_file(bad, file)
  with pytest.raises(HFCheckpointError, match=(
      r"unexpected tensor\(s\) \['vision_model\.encoder\.layers\.2\.mlp\."
      r"fc1\.weight \(in model\.safetensors\)'\]")):
    vision_hf.load_vision_hf(path, cfg)

  bad = dict(tensors)
  del bad[name]
  save_file(bad, file)
  with pytest.raises(HFCheckpointError, match=rf"missing .*{name}"):
    vision_hf.load_vision_hf(path, cfg)

  save_file(tensors, file)
  with pytest.raises(HFCheckpointError, match=(
      r"vision\.mlp_dim=96 disagrees .*config\.json \(intermediate_size "
      r"gives 64\)")):
    vision_hf.load_vision_hf(path, _cfg(mlp_dim=96))
  with pytest.raises(HFCheckpointError, match=r"vision\.d_model=16 disagrees"):
    vision_hf.vision_config_from_hf(path, d_model=16, **_RUN)
  with pytest.raises(ValueError, match=r"unknown vision config keys: "
                     r"\['vision\.patch'\]"):
    vision_hf.vision_config_from_hf(path, patch=8, **_RUN)
  with pytest.raises(HFCheckpointError, match="already holds a checkpoint"):
    vision_hf.export_vision_hf(_init(tower, cfg, 0), cfg, path)

  config_path = os.path.join(path, "config.json")
  with open(config_path) as f:
    hf_config = json.load(f)
  with pytest.raises(HFCheckpointError, match=(
      rf"{config_path}: hidden_act 'gelu' is not supported")):
    vision_hf.vision_config_from_hf({**hf_config, "hidden_act": "gelu"},
                                    source=config_path, **_RUN)
  with pytest.raises(HFCheckpointError, match=r"model_type 'clip'"):
    vision_hf.vision_config_from_hf({**hf_config, "model_type": "clip"},
                                    **_RUN)


# ---------------------------------------------------------------------------
# Placeholder merge


def test_merge_places_images_at_their_placeholders_only():
  IMG, P, D = 7, 4, 3
  i = IMG
  tokens = np.array([
      [1, i, i, i, i, 2, i, i, i, i, 3, 4, 5, 6],   # two images
      [1, 2, 3, 4, 5, 6, 8, 9, 1, 2, 3, 4, 5, 6],   # none
      [1, 2, i, i, i, i, 3, 4, 5, 6, 8, 9, 1, 2],   # slot masked out
  ], np.int32)
  B, T = tokens.shape
  rng = np.random.RandomState(4)
  text = rng.normal(size=(B, T, D)).astype(np.float32)
  images = rng.normal(size=(B, 3, P, D)).astype(np.float32)
  images[0, 2] = np.nan  # padded slots must never be read
  images[1] = np.nan
  images[2] = np.nan
  mask = np.array([[True, True, False], [False] * 3, [False] * 3])
  out = np.asarray(jax.jit(merge.merge_image_embeddings,
                           static_argnums=4)(text, tokens, images, mask, IMG))
  want = text.copy()
  want[0, 1:5] = images[0, 0]
  want[0, 6:10] = images[0, 1]
  np.testing.assert_array_equal(out, want)

  # Gradients: the merged output's cotangent W reaches image j patch k only
  # from its position, and the text only where no image was placed.
  images = np.nan_to_num(images)
  W = rng.normal(size=(B, T, D)).astype(np.float32)
  loss = lambda t, im: jnp.sum(merge.merge_image_embeddings(
      t, tokens, im, mask, IMG) * W)
  g_text, g_images = jax.grad(loss, argnums=(0, 1))(text, images)
  want_images = np.zeros_like(images)
  want_images[0, 0] = W[0, 1:5]
  want_images[0, 1] = W[0, 6:10]
  np.testing.assert_array_equal(np.asarray(g_images), want_images)
  want_text = W.copy()
  want_text[0, 1:5] = 0
  want_text[0, 6:10] = 0
  np.testing.assert_array_equal(np.asarray(g_text), want_text)


def test_check_placeholders_raises_naming_the_row():
  cfg = _cfg(max_images=2)  # 4 placeholders per image, id 7
  i = 7
  merge.check_placeholders([1, i, i, i, i, 2, i, i, i, i, 3], 2, cfg, "x")
  merge.check_placeholders([1, i, i, i, i, i, i, i, i, 3], 2, cfg, "x")
  merge.check_placeholders([1, 2, 3], 0, cfg, "x")
  with pytest.raises(ValueError, match=(
      r"^data\.jsonl line 3: 4 image placeholder tokens \(id 7\) for 2 "
      r"image\(s\); expected 2 x vision\.tokens_per_image=4 = 8$")):
    merge.check_placeholders([1, i, i, i, i, 2], 2, cfg, "data.jsonl line 3")
  with pytest.raises(ValueError, match=r"^row 5: 4 image placeholder"):
    merge.check_placeholders([i, i, i, i], 0, cfg, "row 5")
  with pytest.raises(ValueError, match=(
      r"^f line 1: the run .* at token 6 has 3, not a multiple of "
      r"vision\.tokens_per_image=4")):
    # 8 placeholders for 2 images, but the second image is split.
    merge.check_placeholders([1, i, i, i, i, 2, i, i, i, 3, i], 2, cfg,
                             "f line 1")
  with pytest.raises(ValueError, match=(
      r"^f line 2: 3 images, more than vision\.max_images=2$")):
    merge.check_placeholders([i] * 12, 3, cfg, "f line 2")


# ---------------------------------------------------------------------------
# Sharded


def test_sharded_init_and_encode_equal_single_device(tmp_path):
  cfg = _cfg()
  sharder = Sharder(make_mesh(MeshConfig(data=2, fsdp=2, tensor=2)))
  # Larger than the default std, so the outputs are far from zero.
  vp = tower.init_sharded(cfg, 3, sharder, std=0.2)
  pp = projector.init_sharded(cfg, 4, sharder, std=0.2)
  # Created sharded: fsdp splits `embed`, tensor splits heads and mlp.
  wq = vp["layers"]["wq"]
  assert wq.sharding.shard_shape(wq.shape) == (2, 16, 2, 8)
  assert vp["pos_embed"].sharding.shard_shape((16, 32)) == (16, 16)
  assert pp["w1"].sharding.shard_shape((128, 128)) == (64, 64)

  pixels = _pixels(4, 16, seed=6)
  fn = lambda v, p, x, s: projector.embed_images(v, p, x, cfg, sharder=s)
  x = jax.device_put(pixels, sharder.data_sharding(pixels.shape,
                                                   ("batch", None, None,
                                                    None)))
  sharded = jax.jit(lambda v, p, x: fn(v, p, x, sharder))(vp, pp, x)
  assert len(sharded.sharding.device_set) == 8
  one = jax.devices()[0]
  host = lambda t: jax.tree.map(lambda a: jax.device_put(np.asarray(a), one),
                                t)
  single = jax.jit(lambda v, p, x: fn(v, p, x, None))(
      host(vp), host(pp), jax.device_put(pixels, one))
  assert np.abs(np.asarray(single)).max() > 1.0
  np.testing.assert_allclose(np.asarray(sharded), np.asarray(single),
                             rtol=1e-5, atol=1e-5)

  # The HF loader places each param in the same shardings.
  vision_hf.export_vision_hf(vp, cfg, str(tmp_path))
  loaded = vision_hf.load_vision_hf(str(tmp_path), cfg, sharder=sharder)
  for (path, a), (_, b) in zip(jax.tree_util.tree_flatten_with_path(vp)[0],
                               jax.tree_util.tree_flatten_with_path(loaded)[0]):
    assert b.sharding == a.sharding, jax.tree_util.keystr(path)
    np.testing.assert_array_equal(np.asarray(b), np.asarray(a))
