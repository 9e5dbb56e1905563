"""Command-line flags for every sandbox limit (server and `sandbox_run.py`).

One flag per `SandboxLimits` field, generated from the dataclass so a new
limit is settable from the command line without touching the launchers:
`cpu_time_s` -> `--cpu-time-s`.
"""

from __future__ import annotations

import argparse
import dataclasses

from kimi_jax.sandbox.types import SandboxLimits


def flag_name(field: str) -> str:
  return "--" + field.replace("_", "-")


def add_limit_flags(parser: argparse.ArgumentParser,
                    defaults: SandboxLimits | None = None) -> None:
  """Adds `--<limit>` for each SandboxLimits field (default: its default)."""
  defaults = defaults or SandboxLimits()
  group = parser.add_argument_group(
      "limits", "per-execution limits (see docs/sandbox.md)")
  for f in dataclasses.fields(SandboxLimits):
    value = getattr(defaults, f.name)
    group.add_argument(flag_name(f.name), dest=f.name, type=type(value),
                       default=value, help="default %(default)s")


def limits_from_args(args: argparse.Namespace) -> SandboxLimits:
  return SandboxLimits(**{f.name: getattr(args, f.name)
                          for f in dataclasses.fields(SandboxLimits)})


def add_sandbox_flags(parser: argparse.ArgumentParser) -> None:
  """Flags of the Sandbox itself (not per execution)."""
  parser.add_argument("--no-seccomp", action="store_true",
                      help="run without the seccomp filter (debugging only)")
  parser.add_argument("--memory-poll-s", type=float, default=0.01,
                      help="how often the memory watchdog samples the "
                      "sandbox (default %(default)s)")
  parser.add_argument("--host-uid", type=int, default=None,
                      help="host uid the sandbox runs as when started as "
                      "root (default 64000)")
