"""Request / result types of the code sandbox and their validation.

Everything here is pure data: the in-process `Sandbox`, the HTTP server and the
HTTP `SandboxClient` all speak these types, so callers can swap transports.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass, field
from typing import Any, Mapping

LANGUAGES = ("python", "cpp", "javascript")
# Name of the program file inside the working directory, per language.
MAIN_FILE = {"python": "main.py", "cpp": "main.cpp", "javascript": "main.js"}
STATUSES = ("ok", "runtime_error", "timeout", "memory_limit", "output_limit",
            "compile_error", "sandbox_error")


class SandboxRequestError(ValueError):
  """A request the sandbox refuses; the message names the offending field."""

  def __init__(self, field_name: str, message: str):
    super().__init__(f"{field_name}: {message}")
    self.field = field_name


class SandboxUnavailableError(RuntimeError):
  """The host lacks what isolation needs (bubblewrap, a runtime)."""


@dataclass(frozen=True)
class SandboxLimits:
  """Per-execution resource limits (rlimits apply to every sandboxed process)."""
  cpu_time_s: float = 5.0  # RLIMIT_CPU (rounded up to whole seconds)
  wall_time_s: float = 10.0  # whole-sandbox kill after this
  memory_mb: int = 512  # RLIMIT_AS per process
  max_processes: int = 64  # RLIMIT_NPROC, counted inside the sandbox only
  max_file_size_mb: int = 16  # RLIMIT_FSIZE
  max_open_files: int = 64  # RLIMIT_NOFILE
  tmpfs_size_mb: int = 64  # size cap of the private working directory
  max_output_bytes: int = 1 << 20  # per stream (stdout, stderr); then kill
  # The C++ compile step runs in the same sandbox under its own limits.
  compile_cpu_time_s: float = 20.0
  compile_wall_time_s: float = 30.0
  compile_memory_mb: int = 2048

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)


# Upper bounds a request may ask for (per-request limits are clamped by these).
MAX_LIMITS = SandboxLimits(
    cpu_time_s=120.0, wall_time_s=300.0, memory_mb=8192, max_processes=512,
    max_file_size_mb=1024, max_open_files=4096, tmpfs_size_mb=2048,
    max_output_bytes=256 << 20, compile_cpu_time_s=120.0,
    compile_wall_time_s=300.0, compile_memory_mb=8192)

_INT_LIMIT_FIELDS = ("memory_mb", "max_processes", "max_file_size_mb",
                     "max_open_files", "tmpfs_size_mb", "max_output_bytes",
                     "compile_memory_mb")
# Minimums that keep the runtimes themselves alive (python needs a few fds).
_MIN_LIMITS = {"memory_mb": 16, "max_processes": 1, "max_open_files": 8,
               "tmpfs_size_mb": 1, "compile_memory_mb": 64}


@dataclass(frozen=True)
class RequestCaps:
  """Size caps on what a request may carry (checked before anything runs)."""
  max_source_bytes: int = 1 << 20
  max_stdin_bytes: int = 16 << 20
  max_files: int = 32
  max_files_bytes: int = 16 << 20  # all extra files together
  max_batch: int = 1024  # requests in one run_batch call


@dataclass(frozen=True)
class ExecRequest:
  language: str
  source: str
  stdin: str = ""
  files: Mapping[str, str] = field(default_factory=dict)
  limits: SandboxLimits | None = None

  def to_dict(self) -> dict[str, Any]:
    return {"language": self.language, "source": self.source,
            "stdin": self.stdin, "files": dict(self.files),
            "limits": None if self.limits is None else self.limits.to_dict()}


@dataclass(frozen=True)
class ExecResult:
  status: str
  exit_code: int | None
  stdout: str
  stderr: str
  wall_s: float
  truncated: bool = False

  @property
  def ok(self) -> bool:
    return self.status == "ok"

  def to_dict(self) -> dict[str, Any]:
    return dataclasses.asdict(self)

  @staticmethod
  def from_dict(d: Mapping[str, Any]) -> "ExecResult":
    return ExecResult(status=str(d["status"]), exit_code=d.get("exit_code"),
                      stdout=str(d.get("stdout", "")),
                      stderr=str(d.get("stderr", "")),
                      wall_s=float(d.get("wall_s", 0.0)),
                      truncated=bool(d.get("truncated", False)))


def sandbox_error(message: str, wall_s: float = 0.0) -> ExecResult:
  return ExecResult("sandbox_error", None, "", message, wall_s, False)


def _is_number(x: Any) -> bool:
  return isinstance(x, (int, float)) and not isinstance(x, bool)


def validate_limits(limits: SandboxLimits, ceiling: SandboxLimits = MAX_LIMITS,
                    prefix: str = "limits") -> SandboxLimits:
  """Checks types and ranges; returns the limits unchanged or raises."""
  if not isinstance(limits, SandboxLimits):
    raise SandboxRequestError(prefix, "must be a SandboxLimits")
  for f in dataclasses.fields(SandboxLimits):
    name = f"{prefix}.{f.name}"
    value = getattr(limits, f.name)
    if not _is_number(value) or not math.isfinite(value):
      raise SandboxRequestError(name, f"must be a finite number, got {value!r}")
    if f.name in _INT_LIMIT_FIELDS and int(value) != value:
      raise SandboxRequestError(name, f"must be an integer, got {value!r}")
    low = _MIN_LIMITS.get(f.name, 0)
    if value <= 0 or value < low:
      raise SandboxRequestError(name, f"must be >= {max(low, 1e-3)}, got {value!r}")
    high = getattr(ceiling, f.name)
    if value > high:
      raise SandboxRequestError(name, f"must be <= {high}, got {value!r}")
  return limits


def _utf8_len(s: str, field_name: str) -> int:
  try:
    return len(s.encode("utf-8"))
  except UnicodeEncodeError as e:  # lone surrogates cannot reach a file
    raise SandboxRequestError(field_name, f"not encodable as UTF-8: {e}") from e


def _check_file_name(name: Any) -> None:
  field_name = f"files[{name!r}]"
  if not isinstance(name, str) or not name:
    raise SandboxRequestError(field_name, "file name must be a non-empty string")
  # One flat directory: no separators, no dot names, nothing the driver uses.
  if "/" in name or "\0" in name or name in (".", "..") or len(name) > 128:
    raise SandboxRequestError(field_name, "file name must be a plain name "
                              "(no '/', not '.'/'..', at most 128 chars)")
  if name.startswith(".kimi"):
    raise SandboxRequestError(field_name, "names starting with '.kimi' are "
                              "reserved")


def validate_request(req: ExecRequest, caps: RequestCaps,
                     ceiling: SandboxLimits = MAX_LIMITS) -> None:
  """Raises SandboxRequestError naming the first bad field."""
  if not isinstance(req, ExecRequest):
    raise SandboxRequestError("request", "must be an ExecRequest")
  if req.language not in LANGUAGES:
    raise SandboxRequestError(
        "language", f"unknown language {req.language!r}; expected one of "
        f"{list(LANGUAGES)}")
  if not isinstance(req.source, str):
    raise SandboxRequestError("source", "must be a string")
  n = _utf8_len(req.source, "source")
  if n > caps.max_source_bytes:
    raise SandboxRequestError(
        "source", f"{n} bytes exceeds the cap of {caps.max_source_bytes}")
  if not isinstance(req.stdin, str):
    raise SandboxRequestError("stdin", "must be a string")
  n = _utf8_len(req.stdin, "stdin")
  if n > caps.max_stdin_bytes:
    raise SandboxRequestError(
        "stdin", f"{n} bytes exceeds the cap of {caps.max_stdin_bytes}")
  if not isinstance(req.files, Mapping):
    raise SandboxRequestError("files", "must be a mapping name -> content")
  if len(req.files) > caps.max_files:
    raise SandboxRequestError(
        "files", f"{len(req.files)} files exceeds the cap of {caps.max_files}")
  total = 0
  for name, content in req.files.items():
    _check_file_name(name)
    if name == MAIN_FILE[req.language]:
      raise SandboxRequestError(f"files[{name!r}]", "clashes with the program "
                                "file; pass the program as `source`")
    if not isinstance(content, str):
      raise SandboxRequestError(f"files[{name!r}]", "content must be a string")
    total += _utf8_len(content, f"files[{name!r}]")
  if total > caps.max_files_bytes:
    raise SandboxRequestError(
        "files", f"{total} bytes in total exceeds the cap of "
        f"{caps.max_files_bytes}")
  if req.limits is not None:
    validate_limits(req.limits, ceiling)


def limits_from_dict(d: Any, base: SandboxLimits,
                     prefix: str = "limits") -> SandboxLimits:
  """Builds limits from a (partial) JSON object on top of `base`."""
  if not isinstance(d, Mapping):
    raise SandboxRequestError(prefix, "must be an object")
  known = {f.name for f in dataclasses.fields(SandboxLimits)}
  for key in d:
    if key not in known:
      raise SandboxRequestError(f"{prefix}.{key}", "unknown limit")
  return dataclasses.replace(base, **dict(d))


def request_from_dict(d: Any, base_limits: SandboxLimits,
                      prefix: str = "request") -> ExecRequest:
  """Parses one JSON request object (type checks only; see validate_request)."""
  if not isinstance(d, Mapping):
    raise SandboxRequestError(prefix, "must be a JSON object")
  allowed = {"language", "source", "stdin", "files", "limits"}
  for key in d:
    if key not in allowed:
      raise SandboxRequestError(f"{key}", "unknown field")
  for key in ("language", "source"):
    if key not in d:
      raise SandboxRequestError(key, "missing required field")
  for key in ("language", "source", "stdin"):
    if key in d and not isinstance(d[key], str):
      raise SandboxRequestError(key, "must be a string")
  files = d.get("files") or {}
  if not isinstance(files, Mapping):
    raise SandboxRequestError("files", "must be an object name -> content")
  limits = d.get("limits")
  return ExecRequest(
      language=d["language"], source=d["source"], stdin=d.get("stdin", ""),
      files=dict(files),
      limits=None if limits is None else limits_from_dict(limits, base_limits))
