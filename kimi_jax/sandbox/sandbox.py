"""The in-process sandbox: validates requests, runs them isolated, classifies."""

from __future__ import annotations

import os
import re
import shutil
import signal
import threading
import weakref
from concurrent.futures import ThreadPoolExecutor
from typing import Sequence

from kimi_jax.sandbox import isolation, seccomp
from kimi_jax.sandbox.runner import RawOutcome, Watch, sealed_memfd, supervise
from kimi_jax.sandbox.types import (MAIN_FILE, MAX_LIMITS, ExecRequest,
                                    ExecResult, RequestCaps, SandboxLimits,
                                    SandboxRequestError, sandbox_error,
                                    validate_limits, validate_request)

DEFAULT_PYTHON_FLAGS = ("-E", "-s", "-S", "-B")  # no env, no site, no .pyc
DEFAULT_CPP_FLAGS = ("-std=c++17", "-O2", "-pipe")

# How each runtime reports running out of address space.
_OOM_PATTERNS = re.compile(
    rb"(^|\n)MemoryError|std::bad_alloc|JavaScript heap out of memory|"
    rb"Fatal process out of memory|Fatal process OOM|"
    rb"Array buffer allocation failed|Cannot allocate memory|"
    rb"could not allocate memory|memory exhausted")
_SIGXCPU = int(signal.SIGXCPU)


def _text(data: bytes) -> str:
  return data.decode("utf-8", errors="replace")


def _signal_of(returncode: int | None) -> int | None:
  """bwrap reports a child killed by signal N as exit status 128+N."""
  if returncode is not None and 128 < returncode < 128 + 65:
    return returncode - 128
  return None


def classify(raw: RawOutcome, language: str, limits: SandboxLimits) -> ExecResult:
  """Maps what happened to a status; pure, so it is unit-testable."""
  started = raw.status.startswith(isolation.STARTED_MARK)
  compile_out = raw.status[len(isolation.STARTED_MARK):]
  compiled = language != "cpp" or compile_out.endswith(isolation.COMPILED_MARK)
  stdout, stderr = _text(raw.stdout), _text(raw.stderr)
  wall = raw.wall_s

  def result(status: str, exit_code: int | None, err: str = stderr) -> ExecResult:
    return ExecResult(status, exit_code, stdout, err, wall, raw.truncated)

  if raw.killed == "output_limit":
    return result("output_limit", None)
  if raw.killed == "memory_limit":
    return result("memory_limit", None, stderr + "\nkilled by the sandbox: "
                  f"memory above {limits.memory_mb} MiB")
  if raw.killed == "compile_timeout":
    return result("compile_error", None, _text(compile_out) +
                  f"\ncompilation exceeded {limits.compile_wall_time_s}s")
  if raw.killed == "timeout":
    return result("timeout", None)
  if not started:  # bwrap itself failed before our driver ran
    return result("sandbox_error", None, f"sandbox setup failed: {stderr}")
  if (raw.returncode == isolation.DRIVER_FAIL_RC and
      stderr.startswith(isolation.DRIVER_FAIL_PREFIX)):
    return result("sandbox_error", None)
  if not compiled:
    sig = _signal_of(raw.returncode)
    why = f"\ncompiler killed by signal {sig}" if sig else ""
    return result("compile_error", raw.returncode, _text(compile_out) + why)
  sig = _signal_of(raw.returncode)
  exit_code = -sig if sig else raw.returncode
  if raw.returncode == 0:
    return result("ok", 0)
  # The CPU rlimit: SIGXCPU at the soft limit, SIGKILL at the hard one (for
  # programs that catch SIGXCPU), or a parent dying of its child's limit.
  # The watchdog can miss the child's last moments on a loaded host, so a
  # failed run whose tree (reaped children included) used the limit counts
  # too; not for C++, whose tree time includes the compiler's.
  tree_at_limit = language != "cpp" and raw.cpu_s >= limits.cpu_time_s
  if (sig == _SIGXCPU or raw.cpu_limit_hit or tree_at_limit or
      (sig == signal.SIGKILL and raw.cpu_s >= limits.cpu_time_s)):
    return result("timeout", exit_code)
  if _OOM_PATTERNS.search(raw.stderr[-4096:]):
    return result("memory_limit", exit_code)
  return result("runtime_error", exit_code)


class Sandbox:
  """Runs untrusted Python / C++ / JavaScript in throwaway bubblewrap sandboxes.

  Thread-safe; at most `max_workers` sandboxes run at once (extra `run` calls
  wait). Raises SandboxUnavailableError if bubblewrap is missing.
  """

  def __init__(self, limits: SandboxLimits | None = None, max_workers: int = 4,
               caps: RequestCaps | None = None,
               max_limits: SandboxLimits = MAX_LIMITS,
               python: str | None = None, node: str | None = None,
               gxx: str | None = None,
               python_flags: Sequence[str] = DEFAULT_PYTHON_FLAGS,
               cpp_flags: Sequence[str] = DEFAULT_CPP_FLAGS,
               host_uid: int = isolation.DEFAULT_HOST_UID,
               seccomp_filter: bool = True, memory_poll_s: float = 0.01):
    if not isinstance(max_workers, int) or max_workers < 1:
      raise SandboxRequestError("max_workers", "must be a positive integer")
    self.limits = validate_limits(limits or SandboxLimits(), max_limits)
    self.max_limits = max_limits
    self.caps = caps or RequestCaps()
    self.max_workers = max_workers
    self.toolchain = isolation.find_toolchain(python, node, gxx)
    self._root = isolation.make_prepared_root(self.toolchain.gxx)
    self._finalizer = weakref.finalize(self, shutil.rmtree, self._root, True)
    self._prefix = isolation.bwrap_prefix(self.toolchain, self._root, host_uid)
    self._seccomp = seccomp.build_filter() if seccomp_filter else None
    if not 0 < memory_poll_s <= 1:
      raise SandboxRequestError("memory_poll_s", "must be in (0, 1]")
    self._memory_poll_s = memory_poll_s
    self._python_flags = tuple(python_flags)
    self._cpp_flags = tuple(cpp_flags)
    self._slots = threading.BoundedSemaphore(max_workers)
    self._pool: ThreadPoolExecutor | None = None
    self._pool_lock = threading.Lock()

  # -- public API -------------------------------------------------------------

  def run(self, request: ExecRequest) -> ExecResult:
    """Runs one request; invalid requests raise SandboxRequestError."""
    validate_request(request, self.caps, self.max_limits)
    with self._slots:
      try:
        return self._run_valid(request)
      except SandboxRequestError:
        raise
      except Exception as e:  # never let a host-side hiccup escape as a crash
        return sandbox_error(f"{type(e).__name__}: {e}")

  def run_batch(self, requests: Sequence[ExecRequest]) -> list[ExecResult]:
    """Runs requests concurrently (max_workers at a time), order preserved.
    All requests are validated first; one invalid request raises."""
    requests = list(requests)
    if len(requests) > self.caps.max_batch:
      raise SandboxRequestError(
          "requests", f"{len(requests)} exceeds the batch cap of "
          f"{self.caps.max_batch}")
    for i, req in enumerate(requests):
      try:
        validate_request(req, self.caps, self.max_limits)
      except SandboxRequestError as e:
        raise SandboxRequestError(f"requests[{i}].{e.field}",
                                  str(e).split(": ", 1)[1]) from e
    if len(requests) <= 1:
      return [self.run(r) for r in requests]
    return list(self._executor().map(self.run, requests))

  def close(self) -> None:
    if self._pool is not None:
      self._pool.shutdown(wait=True)
    self._finalizer()

  def __enter__(self) -> "Sandbox":
    return self

  def __exit__(self, *exc) -> None:
    self.close()

  # -- internals --------------------------------------------------------------

  def _executor(self) -> ThreadPoolExecutor:
    with self._pool_lock:
      if self._pool is None:
        self._pool = ThreadPoolExecutor(self.max_workers,
                                        thread_name_prefix="sandbox")
      return self._pool

  def _run_valid(self, req: ExecRequest) -> ExecResult:
    limits = req.limits or self.limits
    runtime = self.toolchain.runtime(req.language)
    if runtime is None:
      return sandbox_error(f"no runtime for {req.language} on this host")
    fds: list[int] = []
    try:
      files: list[tuple[int, str]] = []
      for name, content in req.files.items():
        fds.append(sealed_memfd(name, content.encode("utf-8")))
        files.append((fds[-1], name))
      main = MAIN_FILE[req.language]
      fds.append(sealed_memfd(main, req.source.encode("utf-8")))
      files.append((fds[-1], main))
      seccomp_fd = None
      if self._seccomp is not None:
        fds.append(sealed_memfd("seccomp", self._seccomp))
        seccomp_fd = fds[-1]
      stdin_fd = None
      if req.stdin:
        fds.append(sealed_memfd("stdin", req.stdin.encode("utf-8")))
        stdin_fd = fds[-1]
      script = isolation.driver_script(req.language, self.toolchain, limits,
                                       stdin_fd, self._python_flags,
                                       self._cpp_flags)
      argv = [*self._prefix,
              *isolation.bwrap_run_args(limits, files, seccomp_fd),
              "--", "/bin/sh", "-c", script]
      raw = supervise(
          argv, env={"PATH": "/usr/bin:/bin"},
          pass_fds=tuple(fds), wall_s=limits.wall_time_s,
          compile_wall_s=(limits.compile_wall_time_s
                          if req.language == "cpp" else None),
          max_output_bytes=limits.max_output_bytes,
          watch=Watch(memory_bytes=limits.memory_mb << 20,
                      compile_memory_bytes=limits.compile_memory_mb << 20,
                      cpu_soft_s=isolation.cpu_rlimit_s(limits.cpu_time_s),
                      poll_s=self._memory_poll_s))
    finally:
      for fd in fds:
        os.close(fd)
    return classify(raw, req.language, limits)
