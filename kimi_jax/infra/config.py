"""Experiment configs: `get_config(arg)` files, overrides, typed sections.

An experiment is a Python file (a module of the `experiments` package) with
`get_config(arg=None)` returning an `ml_collections.ConfigDict`; `path:arg`
picks a variant, big_vision style. Command-line tools take it with
`ml_collections.config_flags` (`--config experiments/tiny.py:micro
--config.rl.tau=0.5`, see `define_config_flag`); notebooks and tests call
`load_config(path, overrides)`. Either way the config is locked, so an
unknown key fails, and ConfigDict's type safety rejects a value of the wrong
type; errors name the full key. Library code never receives the ConfigDict:
`kimi_jax.job.experiment.parse_config` turns each section into a frozen
dataclass at the boundary (`to_dataclass`).
"""

from __future__ import annotations

import ast
import dataclasses
import difflib
import importlib.util
import os
import sys
from typing import Any, Iterable, Mapping, Sequence

import ml_collections


class ConfigError(ValueError):
  """A config file or override is invalid; the message names the key."""


def _split_spec(spec: str) -> tuple[str, str | None]:
  """`path.py:variant` -> (path, variant); a path containing ':' stays."""
  if ":" in spec and not os.path.exists(spec):
    path, arg = spec.rsplit(":", 1)
    return path, arg
  return spec, None


def _import_file(path: str):
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  name = "_kimi_jax_config_" + os.path.splitext(os.path.basename(path))[0]
  spec = importlib.util.spec_from_file_location(name, path)
  module = importlib.util.module_from_spec(spec)
  spec.loader.exec_module(module)
  if not hasattr(module, "get_config"):
    raise ConfigError(f"{path} defines no get_config()")
  return module


def _parse_value(text: str) -> Any:
  """Python literal if it parses as one, else the raw string."""
  lowered = text.strip().lower()
  if lowered in ("true", "false"):
    return lowered == "true"
  if lowered in ("none", "null"):
    return None
  try:
    return ast.literal_eval(text)
  except (ValueError, SyntaxError):
    return text


def _coerce(key: str, current: Any, value: Any) -> Any:
  """`value` as the type of `current`, or ConfigError naming `key`.

  The rules of ml_collections' own flag parsing: ints widen to floats, a
  comma-separated string becomes a tuple, nothing else converts.
  """
  if current is None or value is None:
    return value
  ok = {bool: lambda v: isinstance(v, bool),
        int: lambda v: isinstance(v, int) and not isinstance(v, bool),
        float: lambda v: isinstance(v, (int, float)) and not isinstance(
            v, bool),
        str: lambda v: isinstance(v, (str, int, float)) and not isinstance(
            v, bool)}
  for kind, accepts in ok.items():
    if isinstance(current, kind):
      if accepts(value):
        return kind(value) if kind in (float, str) else value
      break
  else:
    if isinstance(current, (tuple, list)):
      if isinstance(value, (tuple, list)):
        return type(current)(value)
      if isinstance(value, str):
        return type(current)(_parse_value(v.strip()) for v in value.split(",")
                             if v.strip())
    else:
      return value
  raise ConfigError(f"--config.{key}: expected {type(current).__name__} "
                    f"(current value {current!r}), got {value!r}")


def _close_keys(config: ml_collections.ConfigDict, key: str) -> str:
  flat = list(_flat_keys(config))
  close = difflib.get_close_matches(key, flat, n=1)
  return f" (did you mean {close[0]!r}?)" if close else ""


def _flat_keys(config: ml_collections.ConfigDict, prefix: str = ""
               ) -> Iterable[str]:
  for k, v in config.items():
    if isinstance(v, ml_collections.ConfigDict):
      yield from _flat_keys(v, f"{prefix}{k}.")
    else:
      yield f"{prefix}{k}"


def set_key(config: ml_collections.ConfigDict, key: str, value: Any) -> None:
  """config[key] = value for a dotted key, type-checked, errors naming it."""
  node = config
  parts = key.split(".")
  for part in parts[:-1]:
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f"--config.{key}: unknown key {key!r}"
                        f"{_close_keys(config, key)}")
    node = node[part]
  leaf = parts[-1]
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
    raise ConfigError(f"--config.{key}: unknown key {key!r}"
                      f"{_close_keys(config, key)}")
  if isinstance(node[leaf], ml_collections.ConfigDict):
    raise ConfigError(f"--config.{key}: is a section; set one of its keys "
                      f"({sorted(node[leaf].keys())})")
  # A string key keeps the text as given (ml_collections' flags do the
  # same), so a JSON or tuple-looking value is not parsed into another type.
  if isinstance(value, str) and not isinstance(node[leaf], str):
    value = _parse_value(value)
  try:
    node[leaf] = _coerce(key, node[leaf], value)
  except (TypeError, AttributeError, KeyError) as exc:
    raise ConfigError(f"--config.{key}: {exc}") from exc


def apply_overrides(config: ml_collections.ConfigDict,
                    overrides: Iterable[str] | Mapping[str, Any]) -> None:
  """Applies `{"rl.tau": 0.5}` or `["rl.tau=0.5", "--config.rl.tau=0.5"]`."""
  items = overrides.items() if isinstance(overrides, Mapping) else (
      _split_override(o) for o in overrides)
  for key, value in items:
    set_key(config, key, value)


def _split_override(text: str) -> tuple[str, str]:
  text = text[len("--config."):] if text.startswith("--config.") else text
  if "=" not in text:
    raise ConfigError(f"override {text!r} must look like "
                      f"--config.some.key=value")
  key, value = text.split("=", 1)
  return key, value


def load_config(spec: str,
                overrides: Iterable[str] | Mapping[str, Any] = ()
                ) -> ml_collections.ConfigDict:
  """`spec`'s get_config(variant), locked, with `overrides` applied.

  spec: `experiments/tiny.py` or `experiments/tiny.py:micro`.
  """
  path, arg = _split_spec(spec)
  module = _import_file(path)
  try:
    config = module.get_config(arg)
  except ValueError as exc:
    raise ConfigError(f"{spec}: {exc}") from exc
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{path}: get_config() must return a ConfigDict")
  config.lock()
  apply_overrides(config, overrides)
  return config


def define_config_flag(name: str = "config"):
  """The `--config FILE[:variant]` flag with `--config.a.b=value` overrides
  (ml_collections.config_flags); returns its FlagHolder."""
  from ml_collections import config_flags
  return config_flags.DEFINE_config_file(
      name, None, "experiment file with get_config(arg), e.g. "
      "experiments/tiny.py or experiments/tiny.py:micro; override any key "
      "with --config.section.key=value", lock_config=True)


def parse_flags(argv: Sequence[str]) -> list[str]:
  """absl's flag parsing with config errors as one clear line.

  Pass as `app.run(main, flags_parser=parse_flags)`. config_flags reports an
  unknown key as a bare AttributeError; this names the override instead.
  """
  from absl import flags
  try:
    return flags.FLAGS(list(argv))
  except Exception as exc:  # noqa: BLE001 - rewritten below, then exit
    sys.exit(f"config error: {explain_flag_error(argv, exc)}")


def explain_flag_error(argv: Sequence[str], exc: BaseException) -> str:
  """Which `--config...` argument caused `exc`, re-checked with our loader."""
  spec = None
  overrides = []
  args = list(argv[1:])
  for i, arg in enumerate(args):
    if arg.startswith("--config="):
      spec = arg.split("=", 1)[1]
    elif arg == "--config" and i + 1 < len(args):
      spec = args[i + 1]
    elif arg.startswith("--config."):
      overrides.append(arg)
  if spec is not None:
    try:
      load_config(spec, overrides)
    except ConfigError as named:
      return str(named)
  return f"{type(exc).__name__}: {exc}"


def to_dataclass(cls, section: ml_collections.ConfigDict | Mapping[str, Any],
                 prefix: str):
  """Frozen dataclass `cls` from a config section; errors name the key."""
  values = dict(section.items() if hasattr(section, "items") else section)
  fields = {f.name for f in dataclasses.fields(cls)}
  unknown = sorted(set(values) - fields)
  if unknown:
    raise ConfigError(f"config.{prefix}: unknown keys {unknown} "
                      f"(known: {sorted(fields)})")
  clean = {k: (tuple(v) if isinstance(v, list) else v)
           for k, v in values.items()}
  try:
    return cls(**clean)
  except (TypeError, ValueError) as exc:
    msg = str(exc)
    raise ConfigError(msg if f"{prefix}." in msg else
                      f"config.{prefix}: {msg}") from exc


def from_dataclass(cls, **changes) -> ml_collections.ConfigDict:
  """A config section holding `cls`'s defaults with `changes` (validated by
  constructing `cls`): the inverse of `to_dataclass`, for experiment files
  whose sections are typed configs of the library."""
  return ml_collections.ConfigDict(dataclasses.asdict(cls(**changes)))
