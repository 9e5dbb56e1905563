"""Hugging Face interop: SigLIP vision `config.json` + safetensors <-> params.

Reads the vision tower of a `SiglipVisionModel` directory (config.json of
model_type `siglip_vision_model`) or of a full `SiglipModel` (model_type
`siglip`, the tower under `vision_config`). Tensor names may carry the
`vision_model.` prefix (SiglipModel, and SiglipVisionModel as transformers
4.x saves it) or none (SiglipVisionModel as 5.x saves it). Ignored: the
attention-pooling head (`head.*`), the text tower and the logit scale and
bias of a full SiglipModel. Everything else must match exactly.

`export_vision_hf` writes a `SiglipVisionModel` directory without the
head (`vision_use_head: false`) that transformers 4.x and 5.x load. The
projector has no SigLIP counterpart and is not exported.

HF stores linear maps as torch `[out, in]` matrices with heads flattened and
the patch conv as `[D, C, p, p]`; our layouts are in `tower.param_shapes`.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
from typing import Any, Mapping

import jax
import numpy as np
from safetensors.numpy import save_file

from kimi_jax.model import hf as model_hf
from kimi_jax.model.hf import HFCheckpointError, _Reader, _tensor_files
from kimi_jax.sharding import Sharder, host_to_global
from kimi_jax.vision import tower
from kimi_jax.vision.config import VisionConfig

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
VISION_MODEL_TYPE = "siglip_vision_model"
FULL_MODEL_TYPE = "siglip"
PREFIX = "vision_model."

# transformers' SiglipVisionConfig defaults, for keys a config.json omits.
_HF_DEFAULTS = {
    "hidden_size": 768, "intermediate_size": 3072, "num_hidden_layers": 12,
    "num_attention_heads": 12, "num_channels": 3, "image_size": 224,
    "patch_size": 16, "hidden_act": "gelu_pytorch_tanh",
    "layer_norm_eps": 1e-6,
}
# VisionConfig field -> SiglipVisionConfig key: the tower's architecture.
HF_KEYS = {
    "d_model": "hidden_size", "mlp_dim": "intermediate_size",
    "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "channels": "num_channels", "image_size": "image_size",
    "patch_size": "patch_size", "norm_eps": "layer_norm_eps",
}
_ACT = "gelu_pytorch_tanh"


# ---------------------------------------------------------------------------
# config.json


def _read_json(path: str) -> dict[str, Any]:
  return model_hf.read_config_json(
      path, "expected a Hugging Face SigLIP model directory")


def _vision_section(hf_config: Mapping[str, Any], source: str
                    ) -> tuple[Mapping[str, Any], str]:
  """The SiglipVisionConfig part of a config.json, and where it is."""
  model_type = hf_config.get("model_type")
  if model_type == VISION_MODEL_TYPE:
    return hf_config, source
  if model_type == FULL_MODEL_TYPE:
    section = hf_config.get("vision_config") or {}
    if not isinstance(section, dict):
      raise HFCheckpointError(f"{source}: vision_config must be an object")
    inner = section.get("model_type", VISION_MODEL_TYPE)
    if inner != VISION_MODEL_TYPE:
      raise HFCheckpointError(f"{source}: vision_config.model_type is "
                              f"{inner!r}, expected {VISION_MODEL_TYPE!r}")
    return section, f"{source} (vision_config)"
  raise HFCheckpointError(
      f"{source}: model_type {model_type!r} is not a SigLIP vision model; "
      f"supported: {VISION_MODEL_TYPE!r}, or {FULL_MODEL_TYPE!r} with a "
      f"vision_config")


def _square(value: Any, key: str, source: str) -> int:
  if isinstance(value, (list, tuple)):
    if len(value) != 2 or value[0] != value[1]:
      raise HFCheckpointError(f"{source}: {key}={value!r}; only square "
                              f"images and patches are supported")
    value = value[0]
  return int(value)


def tower_fields_from_hf(hf_config: Mapping[str, Any], *,
                         source: str = CONFIG_FILE) -> dict[str, Any]:
  """The VisionConfig tower fields (HF_KEYS) of a parsed config.json."""
  section, where = _vision_section(hf_config, source)
  get = lambda k: section.get(k, _HF_DEFAULTS[k])
  act = get("hidden_act")
  if act != _ACT:
    raise HFCheckpointError(f"{where}: hidden_act {act!r} is not supported "
                            f"(only {_ACT!r})")
  out = {}
  for field, key in HF_KEYS.items():
    value = get(key)
    if key in ("image_size", "patch_size"):
      out[field] = _square(value, key, where)
    elif field == "norm_eps":
      out[field] = float(value)
    else:
      out[field] = int(value)
  return out


def vision_config_from_hf(hf: str | Mapping[str, Any], *,
                          source: str = CONFIG_FILE, **settings: Any
                          ) -> VisionConfig:
  """VisionConfig of a SigLIP checkpoint plus the run's own settings.

  hf: a model directory, or its parsed config.json (`source` then names it
    in errors). The tower's architecture comes from the checkpoint.
  settings: the other `vision.*` keys (lm_d_model, image_token_id, pool,
    max_images, projector_dim, dtypes, remat). A tower key given here must
    equal the checkpoint's, or this raises naming `vision.<key>` and the
    config.json key.
  """
  if isinstance(hf, str):
    source = os.path.join(hf, CONFIG_FILE)
    hf = _read_json(hf)
  fields = tower_fields_from_hf(hf, source=source)
  # Unknown keys are not the checkpoint's: `from_mapping` names them.
  for key, value in settings.items():
    if key in fields and not math.isclose(float(value), float(fields[key]),
                                          rel_tol=1e-9, abs_tol=0.0):
      raise HFCheckpointError(
          f"vision.{key}={value!r} disagrees with the checkpoint {source} "
          f"({HF_KEYS[key]} gives {fields[key]!r})")
  return VisionConfig.from_mapping({**settings, **fields})


def vision_config_to_hf(cfg: VisionConfig) -> dict[str, Any]:
  """config.json of a head-less SiglipVisionModel with cfg's tower."""
  out = {key: getattr(cfg, field) for field, key in HF_KEYS.items()}
  out.update(architectures=["SiglipVisionModel"], model_type=VISION_MODEL_TYPE,
             hidden_act=_ACT, attention_dropout=0.0, vision_use_head=False,
             torch_dtype=cfg.param_dtype)
  return out


# ---------------------------------------------------------------------------
# Tensor layout table


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One of our params and its HF tensor(s).

  kind "same": identical array; "flat": HF flattens it (q/k/v biases);
  "linear": torch Linear weight [out, in], ours [*in, *out] with the first
  `n_in` dims as inputs; "conv": torch Conv2d weight [D, C, p, p], ours
  (p, p, C, D).
  """

  path: tuple[str, ...]
  hf: str               # name under the prefix; "{i}" marks the layer
  kind: str
  n_in: int = 1

  @property
  def stacked(self) -> bool:
    return self.path[0] == "layers"

  def names(self, prefix: str, n_layers: int) -> list[str]:
    if self.stacked:
      return [prefix + self.hf.format(i=i) for i in range(n_layers)]
    return [prefix + self.hf]

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "same":
      return ours
    if self.kind == "flat":
      return (math.prod(ours),)
    if self.kind == "conv":
      return (ours[3], ours[2], ours[0], ours[1])
    return (math.prod(ours[self.n_in:]), math.prod(ours[:self.n_in]))

  def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    if self.kind == "conv":
      return x.transpose(2, 3, 1, 0)
    return (x.T if self.kind == "linear" else x).reshape(ours)

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    if self.kind == "conv":
      out = x.transpose(3, 2, 0, 1)
    elif self.kind == "linear":
      out = x.reshape(math.prod(x.shape[:self.n_in]), -1).T
    else:
      out = x.reshape(self.hf_shape(x.shape))
    return np.ascontiguousarray(out)


_L = "encoder.layers.{i}."
_ENTRIES = (
    _Entry(("patch_embed",), "embeddings.patch_embedding.weight", "conv"),
    _Entry(("patch_bias",), "embeddings.patch_embedding.bias", "same"),
    _Entry(("pos_embed",), "embeddings.position_embedding.weight", "same"),
    _Entry(("layers", "attn_norm"), _L + "layer_norm1.weight", "same"),
    _Entry(("layers", "attn_norm_bias"), _L + "layer_norm1.bias", "same"),
    _Entry(("layers", "wq"), _L + "self_attn.q_proj.weight", "linear"),
    _Entry(("layers", "wk"), _L + "self_attn.k_proj.weight", "linear"),
    _Entry(("layers", "wv"), _L + "self_attn.v_proj.weight", "linear"),
    _Entry(("layers", "bq"), _L + "self_attn.q_proj.bias", "flat"),
    _Entry(("layers", "bk"), _L + "self_attn.k_proj.bias", "flat"),
    _Entry(("layers", "bv"), _L + "self_attn.v_proj.bias", "flat"),
    _Entry(("layers", "wo"), _L + "self_attn.out_proj.weight", "linear", 2),
    _Entry(("layers", "bo"), _L + "self_attn.out_proj.bias", "same"),
    _Entry(("layers", "mlp_norm"), _L + "layer_norm2.weight", "same"),
    _Entry(("layers", "mlp_norm_bias"), _L + "layer_norm2.bias", "same"),
    _Entry(("layers", "w_fc1"), _L + "mlp.fc1.weight", "linear"),
    _Entry(("layers", "b_fc1"), _L + "mlp.fc1.bias", "same"),
    _Entry(("layers", "w_fc2"), _L + "mlp.fc2.weight", "linear"),
    _Entry(("layers", "b_fc2"), _L + "mlp.fc2.bias", "same"),
    _Entry(("final_norm",), "post_layernorm.weight", "same"),
    _Entry(("final_norm_bias",), "post_layernorm.bias", "same"),
)
# Tensors a SigLIP checkpoint may hold that the tower does not use.
_IGNORED_PREFIXES = ("text_model.", "logit_scale", "logit_bias", "head.",
                     PREFIX + "head.")
_IGNORED_SUFFIXES = ("position_ids",)


# ---------------------------------------------------------------------------
# Loading


def _prefix(files: Mapping[str, str], path: str) -> str:
  probe = _ENTRIES[0].hf
  for prefix in (PREFIX, ""):
    if prefix + probe in files:
      return prefix
  raise HFCheckpointError(f"{path}: no vision tower tensors (neither "
                          f"{PREFIX + probe} nor {probe})")


def _check_names(expected: set[str], files: Mapping[str, str], path: str
                 ) -> None:
  missing = sorted(expected - set(files))
  if missing:
    raise HFCheckpointError(
        f"{path}: missing tensor(s) {missing[:5]}"
        f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
  unexpected = sorted(n for n in set(files) - expected
                      if not n.startswith(_IGNORED_PREFIXES)
                      and not n.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    shown = [f"{n} (in {files[n]})" for n in unexpected[:5]]
    raise HFCheckpointError(
        f"{path}: unexpected tensor(s) {shown}"
        f"{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)} in all)")


def load_vision_hf(path: str, cfg: VisionConfig, *,
                   sharder: Sharder | None = None) -> tower.Params:
  """The SigLIP vision tower of the HF directory `path` as tower params.

  cfg: e.g. `vision_config_from_hf(path, ...)`; its tower fields must equal
    the checkpoint's (raises naming `vision.<key>` otherwise). Params are
    cast to cfg.param_dtype.
  sharder: when given, each param is placed in its sharding (this host
    reads each tensor whole: vision towers are small); otherwise on the
    default device.

  Raises HFCheckpointError naming the file and tensor on missing,
  unexpected or wrongly shaped tensors.
  """
  config_path = os.path.join(path, CONFIG_FILE)
  fields = tower_fields_from_hf(_read_json(path), source=config_path)
  for key, value in fields.items():
    if not math.isclose(float(getattr(cfg, key)), float(value),
                        rel_tol=1e-9, abs_tol=0.0):
      raise HFCheckpointError(
          f"vision.{key}={getattr(cfg, key)!r} disagrees with the checkpoint "
          f"{config_path} ({HF_KEYS[key]} gives {value!r})")
  shapes = tower.param_shapes(cfg)
  if sharder is None:
    device = jax.devices()[0]
    place = lambda x, entry: jax.device_put(x, device)
  else:
    shardings = tower.param_shardings(cfg, sharder)
    place = lambda x, entry: host_to_global(
        x, model_hf.get_path(shardings, entry.path))
  files = _tensor_files(path)
  prefix = _prefix(files, path)
  _check_names({n for e in _ENTRIES for n in e.names(prefix, cfg.n_layers)},
               files, path)
  dtype = np.dtype(cfg.param_jnp_dtype)
  params: tower.Params = {}
  with contextlib.ExitStack() as stack:
    reader = _Reader(path, files, stack)
    for entry in _ENTRIES:
      shape = model_hf.get_path(shapes, entry.path)
      one = shape[1:] if entry.stacked else shape
      parts = [entry.to_ours(reader.read(name, entry.hf_shape(one)), one)
               for name in entry.names(prefix, cfg.n_layers)]
      x = np.stack(parts) if entry.stacked else parts[0]
      model_hf.set_path(params, entry.path, place(x.astype(dtype), entry))
  return params


# ---------------------------------------------------------------------------
# Export


def _check_params(params: tower.Params, cfg: VisionConfig) -> None:
  want = jax.tree_util.tree_flatten_with_path(
      tower.param_shapes(cfg), is_leaf=lambda x: isinstance(x, tuple))[0]
  model_hf.check_param_shapes(
      params, {tuple(k.key for k in p): tuple(s) for p, s in want},
      "vision params")


def export_vision_hf(params: tower.Params, cfg: VisionConfig, out_dir: str
                     ) -> None:
  """Writes the tower as a head-less SiglipVisionModel directory
  (config.json, model.safetensors; tensors keep the params' dtype) that
  `SiglipVisionModel.from_pretrained(out_dir)` loads. Every process takes
  part in the gathers; process 0 writes."""
  _check_params(params, cfg)
  tensors = {}
  for entry in _ENTRIES:
    host = model_hf.to_host(model_hf.get_path(params, entry.path))
    names = entry.names(PREFIX, cfg.n_layers)
    for i, name in enumerate(names):
      tensors[name] = entry.to_hf(host[i] if entry.stacked else host)
  if jax.process_index() != 0:
    return
  if os.path.isdir(out_dir) and any(
      f == CONFIG_FILE or f.endswith(".safetensors")
      for f in os.listdir(out_dir)):
    raise HFCheckpointError(f"export: {out_dir} already holds a checkpoint; "
                            f"export to a new or empty directory")
  os.makedirs(out_dir, exist_ok=True)
  with open(os.path.join(out_dir, CONFIG_FILE), "w") as f:
    json.dump(vision_config_to_hf(cfg), f, indent=2, sort_keys=True)
  save_file(tensors, os.path.join(out_dir, SINGLE_FILE),
            metadata={"format": "pt"})
