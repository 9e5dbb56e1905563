"""Loading experiment configs and applying `--config.a.b=value` overrides.

An experiment is a Python file with `get_config(arg=None)` returning an
`ml_collections.ConfigDict`. The loader locks it, so assigning a key that does
not exist fails, and ConfigDict's type safety rejects a value of the wrong
type; both errors are re-raised naming the key. Library code never receives
the ConfigDict: each part converts its section into a frozen dataclass.
"""

from __future__ import annotations

import ast
import dataclasses
import importlib.util
import os
from typing import Any, Iterable, Sequence

import ml_collections


class ConfigError(ValueError):
  """A config file or override is invalid; the message names the key."""


def _import_file(path: str):
  if not os.path.isfile(path):
    raise ConfigError(f"config file not found: {path}")
  name = "kimi_jax_experiment_" + os.path.splitext(os.path.basename(path))[0]
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
  """Converts `value` to the type of `current`, or raises naming `key`."""
  if current is None or value is None:
    return value
  if isinstance(current, bool):
    if isinstance(value, bool):
      return value
  elif isinstance(current, int):
    if isinstance(value, int) and not isinstance(value, bool):
      return value
  elif isinstance(current, float):
    if isinstance(value, (int, float)) and not isinstance(value, bool):
      return float(value)
  elif isinstance(current, str):
    if isinstance(value, str):
      return value
    return str(value) if isinstance(value, (int, float)) else _bad(key,
                                                                     current,
                                                                     value)
  elif isinstance(current, (tuple, list)):
    if isinstance(value, (tuple, list)):
      return type(current)(value)
    if isinstance(value, str):
      return type(current)(v.strip() for v in value.split(",") if v.strip())
  else:
    return value
  return _bad(key, current, value)


def _bad(key: str, current: Any, value: Any):
  raise ConfigError(f"--config.{key}: expected {type(current).__name__} "
                    f"(current value {current!r}), got {value!r}")


def apply_override(config: ml_collections.ConfigDict, key: str,
                   text: str) -> None:
  """Sets config[key] (dotted) from its command-line text, type-checked."""
  parts = key.split(".")
  node = config
  for i, part in enumerate(parts[:-1]):
    if not isinstance(node, ml_collections.ConfigDict) or part not in node:
      raise ConfigError(f"--config.{key}: unknown key "
                        f"{'.'.join(parts[:i + 1])!r}")
    node = node[part]
  leaf = parts[-1]
  if not isinstance(node, ml_collections.ConfigDict) or leaf not in node:
    raise ConfigError(f"--config.{key}: unknown key {key!r}")
  if isinstance(node[leaf], ml_collections.ConfigDict):
    raise ConfigError(f"--config.{key}: is a section; set one of its keys "
                      f"({sorted(node[leaf].keys())})")
  value = _coerce(key, node[leaf], _parse_value(text))
  try:
    node[leaf] = value
  except (TypeError, AttributeError, KeyError) as exc:
    raise ConfigError(f"--config.{key}: {exc}") from exc


def load_config(path: str, overrides: Iterable[str] | dict[str, Any] = (),
                arg: str | None = None) -> ml_collections.ConfigDict:
  """Loads `path`'s get_config(arg), locks it and applies overrides.

  `overrides` is either command-line style strings ("rl.tau=0.5" or
  "--config.rl.tau=0.5") or a dict {"rl.tau": 0.5} (notebooks).
  """
  if ":" in path and not os.path.exists(path):
    path, arg = path.split(":", 1)
  module = _import_file(path)
  config = module.get_config(arg) if arg is not None else module.get_config()
  if not isinstance(config, ml_collections.ConfigDict):
    raise ConfigError(f"{path}: get_config() must return a ConfigDict")
  config.lock()
  items = overrides.items() if isinstance(overrides, dict) else (
      _split_override(o) for o in overrides)
  for key, value in items:
    apply_override(config, key, value if isinstance(value, str) else repr(
        value))
  return config


def _split_override(text: str) -> tuple[str, str]:
  text = text[len("--config."):] if text.startswith("--config.") else text
  if "=" not in text:
    raise ConfigError(f"override {text!r} must look like "
                      f"--config.some.key=value")
  key, value = text.split("=", 1)
  return key, value


def split_config_args(argv: Sequence[str]) -> tuple[list[str], list[str]]:
  """Separates `--config.x=y` overrides from the other command-line args."""
  overrides, rest = [], []
  it = iter(argv)
  for arg in it:
    if arg.startswith("--config.") and "=" not in arg:
      overrides.append(arg + "=" + next(it, ""))
    elif arg.startswith("--config."):
      overrides.append(arg)
    else:
      rest.append(arg)
  return overrides, rest


def to_dataclass(cls, section: ml_collections.ConfigDict | dict,
                 prefix: str):
  """Builds frozen dataclass `cls` from a config section, naming bad keys."""
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
