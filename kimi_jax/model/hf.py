"""Hugging Face interop: `config.json` + safetensors <-> params.

HF stores each layer's linear maps as torch `[out, in]` matrices with heads
flattened; our params are stacked over layers with heads as their own axis
(see `transformer.param_shapes`). Parameters are loaded one at a time, layer by
layer, straight into this host's shards of their `NamedSharding`: host memory
peaks around the local shards of one parameter plus one layer's tensor.

Supported (kimi_jax/model/families.py): `LlamaForCausalLM`,
`Qwen2ForCausalLM` (q/k/v biases) and `Qwen3ForCausalLM` (q/k norms), each
with default, linear, llama3 or yarn rotary scaling, `Qwen3MoeForCausalLM`
(mixture-of-experts layers, one tensor per expert as the Hub stores them)
and `Gemma3ForCausalLM` (interleaved sliding-window layers, Gemma norms,
GeGLU).
`model_config_from_hf` / `merge_model_config` give a run its model section
from a checkpoint; `export_hf_directory` writes a complete HF directory
(weights, tokenizer, chat template, generation config).
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import math
import os
import shutil
from typing import Any, Iterator, Mapping

import jax
import numpy as np
from jax.experimental import multihost_utils
from safetensors import safe_open
from safetensors.numpy import save_file

from kimi_jax.model.config import ModelConfig
# The architecture names and the error type are part of this module's API.
from kimi_jax.model import moe
from kimi_jax.model.families import (FAMILIES, GEMMA3, LLAMA, QWEN2,  # noqa
                                     QWEN3, QWEN3_MOE, Family,
                                     HFCheckpointError, architecture_of,
                                     default_architecture)
from kimi_jax.model.tokenizer import load_hf_tokenizer
from kimi_jax.model.transformer import Params, param_shapes, param_shardings
from kimi_jax.sharding import Sharder

SUPPORTED_ARCHITECTURES = tuple(FAMILIES)
_DEFAULT_RMS_EPS = 1e-6

CONFIG_FILE = "config.json"
SINGLE_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"


# ---------------------------------------------------------------------------
# config.json


def _architecture(hf_config: Mapping[str, Any], source: str) -> str:
  archs = hf_config.get("architectures")
  if archs:
    if len(archs) != 1 or archs[0] not in SUPPORTED_ARCHITECTURES:
      raise HFCheckpointError(
          f"{source}: unsupported architecture {archs}; supported: "
          f"{list(SUPPORTED_ARCHITECTURES)}")
    return archs[0]
  by_type = {f.model_type: a for a, f in FAMILIES.items()}
  model_type = hf_config.get("model_type")
  if model_type not in by_type:
    raise HFCheckpointError(
        f"{source}: no `architectures` and unsupported model_type "
        f"{model_type!r}; supported: {list(SUPPORTED_ARCHITECTURES)}")
  return by_type[model_type]


def _required(hf_config: Mapping[str, Any], key: str, source: str) -> Any:
  if hf_config.get(key) is None:
    raise HFCheckpointError(f"{source}: missing required key {key!r}")
  return hf_config[key]


def config_from_hf(hf_config: Mapping[str, Any], *,
                   source: str = CONFIG_FILE) -> ModelConfig:
  """ModelConfig of a supported `config.json` (already parsed): the keys
  every family shares, then the family's own (families.py).

  `source` only names the file in error messages.
  """
  family = FAMILIES[_architecture(hf_config, source)]
  act = hf_config.get(family.activation_key) or next(iter(
      family.activations))
  if act not in family.activations:
    raise HFCheckpointError(
        f"{source}: {family.activation_key} {act!r} is not supported "
        f"(only {', '.join(family.activations)})")
  if hf_config.get("mlp_bias"):
    raise HFCheckpointError(f"{source}: mlp_bias=true is not supported")
  d_model = int(_required(hf_config, "hidden_size", source))
  n_heads = int(_required(hf_config, "num_attention_heads", source))
  max_positions = int(hf_config.get("max_position_embeddings") or
                      family.max_positions)
  fields = dict(
      vocab_size=int(_required(hf_config, "vocab_size", source)),
      d_model=d_model,
      n_layers=int(_required(hf_config, "num_hidden_layers", source)),
      n_heads=n_heads,
      n_kv_heads=int(hf_config.get("num_key_value_heads") or n_heads),
      head_dim=int(hf_config.get("head_dim") or family.head_dim or
                   d_model // n_heads),
      mlp_dim=int(_required(hf_config, "intermediate_size", source)),
      norm_eps=float(hf_config.get("rms_norm_eps", _DEFAULT_RMS_EPS)),
      tie_embeddings=bool(hf_config.get("tie_word_embeddings",
                                        family.tie_embeddings)),
      mlp_activation=family.activations[act],
      max_seq_len=max_positions)
  fields.update(family.read(hf_config, source, max_positions))
  try:
    return ModelConfig(**fields)
  except ValueError as exc:
    raise HFCheckpointError(f"{source}: {exc}") from None


def model_config_from_hf(path: str) -> ModelConfig:
  """ModelConfig of the Hugging Face directory `path` (its config.json).

  Raises HFCheckpointError naming the file (and key) when config.json is
  missing, not JSON, or describes a model we do not implement.
  """
  raw = read_config_json(path, "init_from_hf must name a Hugging Face "
                              "model directory")
  return config_from_hf(raw, source=os.path.join(path, CONFIG_FILE))


def read_config_json(path: str, expected: str) -> dict[str, Any]:
  """The JSON object in `path`/config.json; raises HFCheckpointError naming
  the file when it is missing (`expected` says what should be there), not
  JSON, or not an object."""
  config_path = os.path.join(path, CONFIG_FILE)
  if not os.path.isfile(config_path):
    raise HFCheckpointError(f"{config_path}: not found; {expected}")
  with open(config_path) as f:
    try:
      raw = json.load(f)
    except json.JSONDecodeError as exc:
      raise HFCheckpointError(f"{config_path}: not valid JSON ({exc})"
                              ) from None
  if not isinstance(raw, dict):
    raise HFCheckpointError(f"{config_path}: expected a JSON object")
  return raw


# Fields the run chooses (precision, memory, sequence length); every other
# ModelConfig field is architecture and comes from the checkpoint.
RUN_SETTINGS = ("param_dtype", "compute_dtype", "matmul_dtype", "remat",
                "max_seq_len", "router_aux_loss_coef")
# Where each architecture field lives in config.json, for error messages.
_HF_KEYS = {
    "vocab_size": "vocab_size", "d_model": "hidden_size",
    "n_layers": "num_hidden_layers", "n_heads": "num_attention_heads",
    "n_kv_heads": "num_key_value_heads", "head_dim": "head_dim",
    "mlp_dim": "intermediate_size", "rope_theta": "rope_theta",
    "norm_eps": "rms_norm_eps", "tie_embeddings": "tie_word_embeddings",
    "qkv_bias": "architectures", "qk_norm": "architectures",
    "norm_offset": "architectures", "post_norms": "architectures",
    "embed_scale": "architectures", "mlp_activation": "hidden_act",
    "query_pre_attn_scalar": "query_pre_attn_scalar",
    "final_logit_softcap": "final_logit_softcapping",
    "rope_scaling": "rope_parameters", "layer_types": "layer_types",
    "sliding_window": "sliding_window",
    "sliding_rope_theta": "rope_local_base_freq",
    "n_experts": "num_experts", "n_experts_per_token": "num_experts_per_tok",
    "expert_mlp_dim": "moe_intermediate_size",
    "norm_topk_prob": "norm_topk_prob", "dense_layers": "mlp_only_layers",
}


def _same(a: Any, b: Any) -> bool:
  if isinstance(a, float) or isinstance(b, float):
    return math.isclose(float(a), float(b), rel_tol=1e-9, abs_tol=0.0)
  return a == b


def merge_model_config(checkpoint: ModelConfig, explicit: Mapping[str, Any],
                       *, source: str = CONFIG_FILE) -> ModelConfig:
  """The checkpoint's architecture with the run's explicit `model.*` values.

  explicit: the `config.model` keys the user set (e.g. on the command line).
    Run settings (RUN_SETTINGS) replace the checkpoint's; an architecture
    key must equal the checkpoint's value, or this raises naming
    `config.model.<key>` and the config.json key it disagrees with.
  source: names the checkpoint in error messages.
  """
  fields = {f.name for f in dataclasses.fields(ModelConfig)}
  unknown = sorted(set(explicit) - fields)
  if unknown:
    raise HFCheckpointError(f"config.model: unknown keys {unknown} (known: "
                            f"{sorted(fields)})")
  for key, value in explicit.items():
    if key in RUN_SETTINGS:
      continue
    ours = getattr(checkpoint, key)
    if not _same(value, ours):
      raise HFCheckpointError(
          f"config.model.{key}={value!r} disagrees with the checkpoint "
          f"{source} ({_HF_KEYS[key]} gives {ours!r}); drop the override "
          f"or point init_from_hf at a matching checkpoint")
  return dataclasses.replace(
      checkpoint, **{k: v for k, v in explicit.items() if k in RUN_SETTINGS})


def config_to_hf(cfg: ModelConfig, architecture: str | None = None
                 ) -> dict[str, Any]:
  """config.json contents that transformers loads as the same model.

  architecture: default `families.default_architecture(cfg)`. Raises
  HFCheckpointError naming the fields that family cannot express (the
  written config must read back as the same model)."""
  arch = architecture or default_architecture(cfg)
  if arch not in SUPPORTED_ARCHITECTURES:
    raise HFCheckpointError(f"export: unsupported architecture {arch!r}; "
                            f"supported: {list(SUPPORTED_ARCHITECTURES)}")
  family = FAMILIES[arch]
  out = {
      "architectures": [arch],
      "model_type": family.model_type,
      "vocab_size": cfg.vocab_size,
      "hidden_size": cfg.d_model,
      "intermediate_size": cfg.mlp_dim,
      "num_hidden_layers": cfg.n_layers,
      "num_attention_heads": cfg.n_heads,
      "num_key_value_heads": cfg.n_kv_heads,
      "head_dim": cfg.head_dim,
      "max_position_embeddings": cfg.max_seq_len,
      "rms_norm_eps": cfg.norm_eps,
      "tie_word_embeddings": cfg.tie_embeddings,
      "torch_dtype": cfg.param_dtype,
      **family.write(cfg),
  }
  ours, back = architecture_of(cfg), architecture_of(
      config_from_hf(out, source=f"export as {arch}"))
  wrong = [f"{k}={ours[k]!r}" for k in ours if not _same(ours[k], back[k])]
  if wrong:
    raise HFCheckpointError(f"export: {arch} cannot express this model's "
                            f"{', '.join(wrong)}")
  return out


# ---------------------------------------------------------------------------
# Tensor layout table


@dataclasses.dataclass(frozen=True)
class _Layout:
  """How one (per-layer) param maps to an HF tensor.

  kind "same": identical array. "flat": HF flattens it (q/k/v biases).
  "linear": a torch Linear weight [out, in]; our array is [*in, *out] with the
  first `n_in` dims as inputs (e.g. wq [D, H, Dh] -> q_proj [H*Dh, D]).
  """

  kind: str
  n_in: int = 1

  def hf_shape(self, ours: tuple[int, ...]) -> tuple[int, ...]:
    if self.kind == "same":
      return ours
    if self.kind == "flat":
      return (math.prod(ours),)
    return (math.prod(ours[self.n_in:]), math.prod(ours[:self.n_in]))

  def to_hf(self, x: np.ndarray) -> np.ndarray:
    if self.kind == "linear":
      in_size = math.prod(x.shape[:self.n_in])
      return np.ascontiguousarray(x.reshape(in_size, -1).T)
    return np.ascontiguousarray(x.reshape(self.hf_shape(x.shape)))

  def to_ours(self, x: np.ndarray, ours: tuple[int, ...]) -> np.ndarray:
    return (x.T if self.kind == "linear" else x).reshape(ours)


_SAME, _FLAT, _LINEAR = _Layout("same"), _Layout("flat"), _Layout("linear")

# How each layer param is stored (the names are the family's); norms (of
# every kind) are stored as they are.
_LAYER_LAYOUTS = {
    "wq": _LINEAR, "wk": _LINEAR, "wv": _LINEAR, "bq": _FLAT, "bk": _FLAT,
    "bv": _FLAT, "wo": _Layout("linear", n_in=2), "w_gate": _LINEAR,
    "w_up": _LINEAR, "w_down": _LINEAR, "router": _LINEAR,
    "expert_gate": _LINEAR, "expert_up": _LINEAR, "expert_down": _LINEAR,
}
_TOP_TENSORS = (
    ("embed", "model.embed_tokens.weight", _SAME),
    ("final_norm", "model.norm.weight", _SAME),
    ("lm_head", "lm_head.weight", _LINEAR),
)
# Non-parameter buffers some older checkpoints carry.
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)


@dataclasses.dataclass(frozen=True)
class _Entry:
  """One of our params: its path, per-layer shape and HF tensor names.

  hf_names: one per layer (or a single name). A layer's entry may be None
  (that layer does not use the param: zeros, nothing stored) or a tuple
  of names, one per expert, stacked along the slice's leading axis.
  """

  path: tuple[str, ...]
  shape: tuple[int, ...]          # full (stacked) shape
  hf_names: tuple[Any, ...]
  layout: _Layout

  @property
  def stacked(self) -> bool:
    return self.path[0] == "layers"

  @property
  def slice_shape(self) -> tuple[int, ...]:
    return self.shape[1:] if self.stacked else self.shape

  def tensors(self) -> Iterator[tuple[int, int | None, str]]:
    """(layer, expert or None, HF name) of every stored tensor."""
    for i, names in enumerate(self.hf_names):
      if isinstance(names, tuple):
        yield from ((i, j, n) for j, n in enumerate(names))
      elif names is not None:
        yield i, None, names

  def tensor_shape(self, expert: int | None) -> tuple[int, ...]:
    """Our shape of one stored tensor (one expert's without the E axis)."""
    return self.slice_shape[1:] if expert is not None else self.slice_shape

  def read(self, reader: "_Reader", names: Any, dtype) -> np.ndarray:
    """Our slice of one layer (or the whole unstacked param)."""
    if names is None:
      return np.zeros(self.slice_shape, dtype)
    if isinstance(names, tuple):
      one = self.slice_shape[1:]
      return np.stack([self.layout.to_ours(
          reader.read(n, self.layout.hf_shape(one)), one) for n in names])
    return self.layout.to_ours(
        reader.read(names, self.layout.hf_shape(self.slice_shape)),
        self.slice_shape)


def _entries(cfg: ModelConfig, family: Family) -> list[_Entry]:
  """Every param of `cfg` with its HF names in `family`."""
  shapes = param_shapes(cfg)
  out = []
  named = dict(family.layer_tensors)
  unnamed = sorted(set(shapes["layers"]) - set(named))
  if unnamed:
    raise HFCheckpointError(f"{family.architecture} has no tensors for the "
                            f"layer params {unnamed}")
  for ours, hf in family.layer_tensors:
    if ours in shapes["layers"]:
      names = tuple(_layer_names(cfg, ours, hf, i)
                    for i in range(cfg.n_layers))
      out.append(_Entry(("layers", ours), shapes["layers"][ours], names,
                        _LAYER_LAYOUTS.get(ours, _SAME)))
  for ours, hf, layout in _TOP_TENSORS:
    if ours in shapes:
      out.append(_Entry((ours,), shapes[ours], (hf,), layout))
  return out


def _layer_names(cfg: ModelConfig, ours: str, hf: str, layer: int) -> Any:
  """Layer `layer`'s HF name(s) of param `ours`: None where the layer does
  not use it, one per expert where `hf` names an expert ({j})."""
  if not moe.layer_uses(cfg, ours, layer):
    return None
  name = f"model.layers.{layer}.{hf}"
  if "{j}" in hf:
    return tuple(name.format(j=j) for j in range(cfg.n_experts))
  return name


def set_path(tree: dict, path: tuple[str, ...], value: Any) -> None:
  for key in path[:-1]:
    tree = tree.setdefault(key, {})
  tree[path[-1]] = value


def get_path(tree: Mapping, path: tuple[str, ...]) -> Any:
  for key in path:
    tree = tree[key]
  return tree


# ---------------------------------------------------------------------------
# Loading


def _tensor_files(path: str) -> dict[str, str]:
  """HF tensor name -> safetensors file name (relative to `path`)."""
  index_path = os.path.join(path, INDEX_FILE)
  single_path = os.path.join(path, SINGLE_FILE)
  if os.path.exists(index_path):
    with open(index_path) as f:
      weight_map = json.load(f)["weight_map"]
    for file in sorted(set(weight_map.values())):
      if not os.path.exists(os.path.join(path, file)):
        raise HFCheckpointError(f"{index_path} names {file}, which does not "
                                f"exist")
    return dict(weight_map)
  if os.path.exists(single_path):
    with safe_open(single_path, framework="numpy") as f:
      return {name: SINGLE_FILE for name in f.keys()}
  raise HFCheckpointError(f"{path}: neither {SINGLE_FILE} nor {INDEX_FILE} "
                          f"found")


class _Reader:
  """Lazily opened safetensors files; reads one tensor at a time."""

  def __init__(self, path: str, files: Mapping[str, str],
               stack: contextlib.ExitStack):
    self._path, self._files, self._stack = path, files, stack
    self._open: dict[str, Any] = {}

  def where(self, name: str) -> str:
    return os.path.join(self._path, self._files[name])

  def _handle(self, name: str) -> Any:
    file = self._files[name]
    if file not in self._open:
      self._open[file] = self._stack.enter_context(
          safe_open(os.path.join(self._path, file), framework="numpy"))
    return self._open[file]

  def read(self, name: str, shape: tuple[int, ...]) -> np.ndarray:
    """The tensor, after checking its shape (before reading its data)."""
    handle = self._handle(name)
    got = tuple(handle.get_slice(name).get_shape())
    if got != shape:
      raise HFCheckpointError(f"{self.where(name)}: tensor {name} has shape "
                              f"{got}, expected {shape}")
    return handle.get_tensor(name)


def _check_names(entries: list[_Entry], files: Mapping[str, str], path: str,
                 tied: bool) -> None:
  expected = {n for e in entries for _, _, n in e.tensors()}
  missing = sorted(expected - set(files))
  if missing:
    raise HFCheckpointError(
        f"{path}: missing tensor(s) {missing[:5]}"
        f"{' ...' if len(missing) > 5 else ''} ({len(missing)} in all)")
  allowed_extra = {"lm_head.weight"} if tied else set()
  unexpected = sorted(n for n in set(files) - expected - allowed_extra
                      if not n.endswith(_IGNORED_SUFFIXES))
  if unexpected:
    shown = [f"{n} (in {files[n]})" for n in unexpected[:5]]
    raise HFCheckpointError(
        f"{path}: unexpected tensor(s) {shown}"
        f"{' ...' if len(unexpected) > 5 else ''} ({len(unexpected)} in all)")


def _bounds(index: tuple[slice, ...], shape: tuple[int, ...]
            ) -> tuple[tuple[int, int], ...]:
  return tuple(s.indices(n)[:2] for s, n in zip(index, shape))


def _slices(bounds: tuple[tuple[int, int], ...]) -> tuple[slice, ...]:
  return tuple(slice(lo, hi) for lo, hi in bounds)


def _read_sharded(entry: _Entry, reader: _Reader, dtype: np.dtype,
                  sharding: jax.sharding.Sharding) -> jax.Array:
  """One param, built from this host's distinct shards.

  HF tensors are read one layer at a time and each is copied into every local
  shard that covers it, so host memory holds this host's shards of one param
  plus one layer (replicas on several devices share one buffer).
  """
  index_map = sharding.addressable_devices_indices_map(entry.shape)
  bounds = {d: _bounds(idx, entry.shape) for d, idx in index_map.items()}
  buffers = {b: np.empty([hi - lo for lo, hi in b], dtype)
             for b in set(bounds.values())}
  for i, names in enumerate(entry.hf_names):
    part = entry.read(reader, names, dtype)
    for b, buf in buffers.items():
      if not entry.stacked:
        buf[...] = part[_slices(b)]
      elif b[0][0] <= i < b[0][1]:
        buf[i - b[0][0]] = part[_slices(b[1:])]
    del part
  arrays = [jax.device_put(buffers[bounds[d]], d) for d in index_map]
  return jax.make_array_from_single_device_arrays(entry.shape, sharding,
                                                  arrays)


def _check_tied_head(reader: _Reader, files: Mapping[str, str],
                     cfg: ModelConfig) -> None:
  """A tied checkpoint may still store lm_head.weight; it must equal embed."""
  name = "lm_head.weight"
  if name in files:
    shape = (cfg.vocab_size, cfg.d_model)
    head = reader.read(name, shape)
    if not np.array_equal(head, reader.read("model.embed_tokens.weight",
                                            shape)):
      raise HFCheckpointError(
          f"{reader.where(name)}: tie_word_embeddings=true but {name} differs "
          f"from model.embed_tokens.weight")


def load_hf_checkpoint(path: str, *, sharder: Sharder | None = None,
                       param_dtype: str | None = None
                       ) -> tuple[ModelConfig, Params]:
  """Reads a supported HF directory into (ModelConfig, params).

  Args:
    path: directory with config.json and model.safetensors (or sharded
      safetensors with model.safetensors.index.json).
    sharder: when given, every param is placed directly in its sharding (each
      device receives only its shard); otherwise on the default device.
    param_dtype: "float32" | "bfloat16" | "float16"; default float32 (which
      holds bf16/fp16 checkpoints exactly).

  Raises HFCheckpointError naming the tensor and file on missing, unexpected
  or wrongly shaped tensors, and ShardingError naming a param that cannot be
  sharded as the rules say.
  """
  config_path = os.path.join(path, CONFIG_FILE)
  with open(config_path) as f:
    raw = json.load(f)
  cfg = config_from_hf(raw, source=config_path)
  family = FAMILIES[_architecture(raw, config_path)]
  if param_dtype is not None:
    cfg = dataclasses.replace(cfg, param_dtype=param_dtype)
  # Shardings first: a param that cannot divide fails before any reading.
  if sharder is None:
    device = jax.sharding.SingleDeviceSharding(jax.devices()[0])
    shardings = jax.tree_util.tree_map(lambda _: device, param_shapes(cfg),
                                       is_leaf=lambda x: isinstance(x, tuple))
  else:
    shardings = param_shardings(cfg, sharder)
  entries = _entries(cfg, family)
  files = _tensor_files(path)
  _check_names(entries, files, path, cfg.tie_embeddings)
  dtype = np.dtype(cfg.param_jnp_dtype)
  params: Params = {}
  with contextlib.ExitStack() as stack:
    reader = _Reader(path, files, stack)
    if cfg.tie_embeddings:
      _check_tied_head(reader, files, cfg)
    for entry in entries:
      set_path(params, entry.path, _read_sharded(
          entry, reader, dtype, get_path(shardings, entry.path)))
  return cfg, params


# ---------------------------------------------------------------------------
# Export


def _check_params(params: Params, entries: list[_Entry]) -> None:
  check_param_shapes(params, {e.path: e.shape for e in entries},
                     "params")


def check_param_shapes(params: Any, want: Mapping[tuple[str, ...],
                                                  tuple[int, ...]],
                       what: str) -> None:
  """Raises HFCheckpointError unless `params` has exactly the paths of
  `want`, each with its shape: an export writes nothing half-right."""
  got = {tuple(k.key for k in path): tuple(np.shape(leaf)) for path, leaf in
         jax.tree_util.tree_flatten_with_path(params)[0]}
  if set(got) != set(want):
    raise HFCheckpointError(
        f"export: {what} tree has {sorted(set(got) - set(want))} extra and "
        f"{sorted(set(want) - set(got))} missing for this config")
  for p, shape in want.items():
    if got[p] != shape:
      raise HFCheckpointError(f"export: {what}{list(p)} has shape "
                              f"{got[p]}, config expects {shape}")


def to_host(x: jax.Array) -> np.ndarray:
  """Gathers one (possibly sharded) array to this host."""
  if isinstance(x, jax.Array) and not x.is_fully_addressable:
    return np.asarray(multihost_utils.process_allgather(x, tiled=True))
  return np.asarray(jax.device_get(x))


def _plan_files(items: list[tuple[str, int]], max_shard_bytes: int | None
                ) -> list[list[str]]:
  """Greedy grouping of (name, nbytes) into files of <= max_shard_bytes."""
  if max_shard_bytes is None:
    return [[n for n, _ in items]]
  groups: list[list[str]] = [[]]
  size = 0
  for name, nbytes in items:
    if groups[-1] and size + nbytes > max_shard_bytes:
      groups.append([])
      size = 0
    groups[-1].append(name)
    size += nbytes
  return groups


def _hf_tensors(params: Params, entries: list[_Entry]
                ) -> Iterator[tuple[str, np.ndarray]]:
  """(HF name, array) in order, gathering one param at a time."""
  for entry in entries:
    host = to_host(get_path(params, entry.path))
    for i, j, name in entry.tensors():
      part = host[i] if entry.stacked else host
      yield name, entry.layout.to_hf(part if j is None else part[j])
    del host


def export_hf_checkpoint(params: Params, cfg: ModelConfig, path: str, *,
                         max_shard_bytes: int | None = None,
                         architecture: str | None = None) -> None:
  """Writes params as an HF directory `transformers` can load.

  architecture: default `families.default_architecture(cfg)` (Gemma3 for
  Gemma features, else Qwen3 with q/k norms, Qwen2 with q/k/v biases,
  Llama). Files larger than max_shard_bytes are split into
  model-0000k-of-0000n.safetensors with model.safetensors.index.json. Tensors
  keep the params' dtype. Host memory peaks around one file plus one param.
  """
  hf_config = config_to_hf(cfg, architecture)
  entries = _entries(cfg, FAMILIES[hf_config["architectures"][0]])
  _check_params(params, entries)
  items = []
  for e in entries:
    itemsize = np.dtype(get_path(params, e.path).dtype).itemsize
    items.extend((n, math.prod(e.tensor_shape(j)) * itemsize)
                 for _, j, n in e.tensors())
  groups = _plan_files(items, max_shard_bytes)
  if jax.process_index() != 0:
    # Other hosts take part in the gathers only.
    for _ in _hf_tensors(params, entries):
      pass
    return
  if os.path.isdir(path) and any(
      f in (CONFIG_FILE, INDEX_FILE) or f.endswith(".safetensors")
      for f in os.listdir(path)):
    # Old shards or a stale index would mix with (or shadow) the new files.
    raise HFCheckpointError(f"export: {path} already holds a checkpoint; "
                            f"export to a new or empty directory")
  os.makedirs(path, exist_ok=True)
  with open(os.path.join(path, CONFIG_FILE), "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  tensors = _hf_tensors(params, entries)
  if len(groups) == 1:
    file_names = [SINGLE_FILE]
  else:
    file_names = [f"model-{k + 1:05d}-of-{len(groups):05d}.safetensors"
                  for k in range(len(groups))]
  weight_map, total = {}, 0
  for file, group in zip(file_names, groups):
    batch = {}
    for expected in group:
      name, array = next(tensors)
      assert name == expected, (name, expected)  # same order as the plan
      batch[name] = array
      weight_map[name] = file
      total += array.nbytes
    save_file(batch, os.path.join(path, file), metadata={"format": "pt"})
    del batch
  if len(groups) > 1:
    with open(os.path.join(path, INDEX_FILE), "w") as f:
      json.dump({"metadata": {"total_size": total}, "weight_map": weight_map},
                f, indent=2, sort_keys=True)


# ---------------------------------------------------------------------------
# A complete Hugging Face directory: weights, tokenizer, generation config

# Tokenizer and chat-template files copied from the source checkpoint.
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json",
                   "special_tokens_map.json", "added_tokens.json",
                   "chat_template.jinja", "chat_template.json", "vocab.json",
                   "merges.txt", "tokenizer.model")
CHAT_TEMPLATE_DIR = "additional_chat_templates"
GENERATION_CONFIG = "generation_config.json"
# config.json keys the source checkpoint decides and the run does not change.
_KEPT_SOURCE_KEYS = ("bos_token_id", "eos_token_id", "pad_token_id",
                     "max_position_embeddings")


def _read_source_config(source_dir: str) -> dict[str, Any]:
  path = os.path.join(source_dir, CONFIG_FILE)
  if not os.path.isfile(path):
    return {}
  with open(path) as f:
    return json.load(f)


def _generation_config(source_dir: str) -> dict[str, Any]:
  """The source's generation_config.json, or one made from its tokenizer's
  special ids (every stop id as eos_token_id)."""
  path = os.path.join(source_dir, GENERATION_CONFIG)
  if os.path.isfile(path):
    with open(path) as f:
      return json.load(f)
  tok = load_hf_tokenizer(source_dir)
  out = {"eos_token_id": list(tok.stop_ids), "pad_token_id": tok.pad_id}
  if tok.bos_id is not None:
    out["bos_token_id"] = tok.bos_id
  return out


def export_hf_directory(params: Params, cfg: ModelConfig, path: str, *,
                        source_dir: str | None = None,
                        max_shard_bytes: int | None = None) -> None:
  """Writes a Hugging Face directory that `transformers` (and vLLM, SGLang,
  ...) loads as is: config.json and safetensors (`export_hf_checkpoint`),
  plus, from `source_dir` (the checkpoint the run started from), the
  tokenizer files, chat templates and generation_config.json.

  The source decides the architecture name and the config.json keys the run
  does not change (special token ids, max_position_embeddings). Without a
  source only the weights and config.json are written (a model trained from
  random init has no HF tokenizer). A source without generation_config.json
  gets one from its tokenizer's eos / pad / bos ids.
  """
  source = _read_source_config(source_dir) if source_dir else {}
  architecture = (_architecture(source, os.path.join(source_dir, CONFIG_FILE))
                  if source else None)
  export_hf_checkpoint(params, cfg, path, max_shard_bytes=max_shard_bytes,
                       architecture=architecture)
  if jax.process_index() != 0 or not source_dir:
    return
  config_path = os.path.join(path, CONFIG_FILE)
  with open(config_path) as f:
    hf_config = json.load(f)
  hf_config.update({k: source[k] for k in _KEPT_SOURCE_KEYS if k in source})
  with open(config_path, "w") as f:
    json.dump(hf_config, f, indent=2, sort_keys=True)
  copied = [name for name in TOKENIZER_FILES
            if os.path.isfile(os.path.join(source_dir, name))]
  if "tokenizer.json" not in copied and "tokenizer.model" not in copied:
    raise HFCheckpointError(f"{source_dir}: no tokenizer.json or "
                            f"tokenizer.model to export with the weights")
  for name in copied:
    shutil.copyfile(os.path.join(source_dir, name), os.path.join(path, name))
  extra = os.path.join(source_dir, CHAT_TEMPLATE_DIR)
  if os.path.isdir(extra):
    shutil.copytree(extra, os.path.join(path, CHAT_TEMPLATE_DIR))
  with open(os.path.join(path, GENERATION_CONFIG), "w") as f:
    json.dump(_generation_config(source_dir), f, indent=2, sort_keys=True)
