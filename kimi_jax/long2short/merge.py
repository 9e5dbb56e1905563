"""Model merging (report 2.4): "we merge the two models by simply averaging
their weights", generalised to an interpolation weight alpha:

  merged = alpha * long + (1 - alpha) * short       (alpha = 0.5: averaging)

weight by weight, in float32, cast back to each weight's dtype. alpha = 1
gives the long model and alpha = 0 the short one, exactly. The two models
must share the architecture (and, to merge usefully, an ancestor: here both
are fine-tuned from the same base, docs/long2short.md).

Sources are run workdirs (config.json + checkpoints/, the latest step) or
Hugging Face directories (config.json + safetensors), both of one kind. Two
workdirs merge into a policy workdir (`policies.write_policy`, with the long
run's config); two Hugging Face directories into a Hugging Face directory
(tokenizer files copied from the long one, when it has them).
"""

from __future__ import annotations

import functools
import json
import os
from typing import Any

import jax
import jax.numpy as jnp

from kimi_jax.job import workdir as workdir_lib
from kimi_jax.long2short import policies
from kimi_jax.model import hf
from kimi_jax.sharding import Sharder, make_mesh


class MergeError(ValueError):
  """The two models cannot be merged; the message says why."""


def _mix(long_leaf, short_leaf, *, alpha: float):
  mixed = (alpha * long_leaf.astype(jnp.float32) +
           (1.0 - alpha) * short_leaf.astype(jnp.float32))
  return mixed.astype(long_leaf.dtype)


def interpolate(long_params: Any, short_params: Any, alpha: float) -> Any:
  """alpha * long + (1 - alpha) * short, leaf by leaf, in the long params'
  shardings (jitted; alpha is a compile-time constant)."""
  if not 0.0 <= alpha <= 1.0:
    raise MergeError(f"alpha must be in [0, 1], got {alpha}")
  long_leaves = jax.tree_util.tree_flatten_with_path(long_params)[0]
  short_leaves = jax.tree_util.tree_flatten_with_path(short_params)[0]
  if jax.tree.structure(long_params) != jax.tree.structure(short_params):
    raise MergeError(
        f"the models have different parameter trees: "
        f"{[jax.tree_util.keystr(p) for p, _ in long_leaves]} vs "
        f"{[jax.tree_util.keystr(p) for p, _ in short_leaves]}")
  for (path, a), (_, b) in zip(long_leaves, short_leaves):
    if a.shape != b.shape:
      raise MergeError(f"{jax.tree_util.keystr(path)}: shape {a.shape} "
                       f"(long) vs {b.shape} (short)")
  shardings = jax.tree.map(lambda x: x.sharding, long_params)
  fn = jax.jit(lambda a, b: jax.tree.map(
      functools.partial(_mix, alpha=alpha), a, b), out_shardings=shardings)
  return fn(long_params, short_params)


def source_kind(path: str) -> str:
  """"workdir" (a run: config.json with a model section, checkpoints/) or
  "hf" (a Hugging Face directory: config.json with model_type)."""
  config_path = os.path.join(path, "config.json")
  if not os.path.isfile(config_path):
    raise MergeError(f"{path}: no config.json; expected a run workdir or a "
                     f"Hugging Face directory")
  with open(config_path) as f:
    config = json.load(f)
  if isinstance(config.get("model"), dict) and os.path.isdir(
      os.path.join(path, "checkpoints")):
    return "workdir"
  if "model_type" in config or "architectures" in config:
    return "hf"
  raise MergeError(f"{config_path}: neither a run's config (model section "
                   f"and checkpoints/) nor a Hugging Face config "
                   f"(model_type)")


def merge_sources(long_path: str, short_path: str, out: str, *,
                  alpha: float) -> str:
  """Merges two run workdirs or two Hugging Face directories into `out`;
  returns the kind written ("workdir" or "hf")."""
  kinds = (source_kind(long_path), source_kind(short_path))
  if kinds[0] != kinds[1]:
    raise MergeError(f"cannot merge a {kinds[0]} ({long_path}) with a "
                     f"{kinds[1]} ({short_path}); export the run with "
                     f"launch/export_hf.py first")
  if kinds[0] == "workdir":
    config, cfg = workdir_lib.load_run(long_path)
    sharder = Sharder(make_mesh(cfg.mesh), cfg.rules)
    shardings = policies.param_shardings(cfg, sharder)
    long_params, _ = policies.read_policy(long_path, shardings)
    short_params, short_cfg = policies.read_policy(short_path, shardings)
    if short_cfg.model != cfg.model:
      raise MergeError(f"{short_path}: model section differs from "
                       f"{long_path}'s: {short_cfg.model} vs {cfg.model}")
    policies.write_policy(out, config, interpolate(long_params, short_params,
                                                   alpha))
    return "workdir"
  long_cfg, long_params = hf.load_hf_checkpoint(long_path)
  short_cfg, short_params = hf.load_hf_checkpoint(short_path)
  if long_cfg != short_cfg:
    raise MergeError(f"{short_path}: architecture differs from "
                     f"{long_path}'s: {short_cfg} vs {long_cfg}")
  has_tokenizer = any(os.path.isfile(os.path.join(long_path, name))
                      for name in ("tokenizer.json", "tokenizer.model"))
  hf.export_hf_directory(interpolate(long_params, short_params, alpha),
                         long_cfg, out,
                         source_dir=long_path if has_tokenizer else None)
  return "hf"
