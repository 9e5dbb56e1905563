"""Run untrusted-input checks in worker processes under hard deadlines.

Used by the math reward: parsing and comparing a model's answer can take
unbounded time (a sympy power tower spends minutes in big-integer C code) or
memory, and math-verify's own timeout relies on `signal.alarm`, which only
works in the main thread and cannot interrupt a long C call. So every check
runs in a worker process and the pool enforces the deadline from outside: a
worker that overruns is SIGKILLed and its item scores "timeout".

Start-up is paid once. A *template* process (a plain `python -c` child, not
multiprocessing: spawn re-imports the caller's `__main__`, fork would copy a
process holding JAX threads) imports the check's module and runs its warm-up;
workers are then `fork()`ed from the template in milliseconds. Killing a
worker therefore costs the next item almost nothing, and every item's time
from dispatch to verdict stays within `timeout_s` (the check itself gets
`timeout_s - margin_s`).

Protocol: parent <-> template is a Unix stream socket carrying one byte plus a
socket fd per fork request (SCM_RIGHTS). The forked worker sends its own
pidfd over that socket (so the parent can kill it without pid-reuse races),
then serves `multiprocessing.connection` messages: a task tuple in, a result
dict out.
"""

from __future__ import annotations

import collections
import dataclasses
import importlib
import multiprocessing.connection
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any, Callable, Sequence

# Directory holding the `kimi_jax` package, put on the template's PYTHONPATH.
_PACKAGE_ROOT = os.path.dirname(os.path.dirname(os.path.dirname(
    os.path.abspath(__file__))))
_READY = b"R"
_FORK = b"F"


@dataclasses.dataclass(frozen=True)
class PoolConfig:
  """What the workers run and under which limits.

  target: "module:function"; each task tuple is called as `function(*task)`
    and must return a dict (an exception becomes `{"correct": False,
    "error": ...}`).
  warm_up: optional "module:function" run once in the template, so forked
    workers start with warm caches (the LaTeX parser's first parse of a shape
    costs seconds).
  timeout_s: wall-clock budget of one item from dispatch to verdict.
  margin_s: part of the budget kept for killing and reporting; the check
    itself is cut at `timeout_s - margin_s`.
  memory_limit_mb: address-space cap of each worker (None: none).
  startup_timeout_s: how long the first call waits for the template.
  """

  target: str
  warm_up: str | None = None
  num_workers: int = 2
  timeout_s: float = 5.0
  margin_s: float = 0.25
  memory_limit_mb: int | None = 4096
  startup_timeout_s: float = 120.0

  def __post_init__(self):
    if self.num_workers < 1:
      raise ValueError(f"num_workers must be >= 1, got {self.num_workers}")
    if not 0 <= self.margin_s < self.timeout_s:
      raise ValueError(f"need 0 <= margin_s < timeout_s, got margin_s="
                       f"{self.margin_s}, timeout_s={self.timeout_s}")


def _resolve(spec: str) -> Callable[..., Any]:
  module, _, name = spec.partition(":")
  return getattr(importlib.import_module(module), name)


# ----------------------------------------------------------------------------
# Inside the template and the workers.


def _serve(sock: socket.socket, target: Callable[..., Any]) -> None:
  """Worker loop: receive a task tuple, send back the check's dict."""
  conn = multiprocessing.connection.Connection(sock.detach())
  while True:
    try:
      task = conn.recv()
    except EOFError:
      return
    if task is None:
      return
    try:
      out = target(*task)
    except MemoryError:
      out = {"correct": False, "error": "memory limit"}
    except BaseException as exc:  # noqa: BLE001 - report, keep serving
      out = {"correct": False, "error": f"{type(exc).__name__}: "
             f"{str(exc)[:200]}"}
    conn.send(out)


def _become_worker(control: socket.socket, sock: socket.socket,
                   target: Callable[..., Any],
                   memory_limit_mb: int | None) -> None:
  control.close()
  signal.signal(signal.SIGCHLD, signal.SIG_DFL)
  try:  # die with the template (its socket EOF is how it learns to exit)
    import ctypes
    ctypes.CDLL(None).prctl(1, int(signal.SIGKILL))  # PR_SET_PDEATHSIG
  except OSError:
    pass
  if memory_limit_mb:
    import resource
    limit = memory_limit_mb << 20
    resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
  pidfd = os.pidfd_open(os.getpid())
  socket.send_fds(sock, [_READY], [pidfd])
  os.close(pidfd)
  _serve(sock, target)


def template_main(control_fd: int, target_spec: str, warm_up_spec: str | None,
                  memory_limit_mb: int | None) -> None:
  """Entry point of the template process (started with `python -c`)."""
  control = socket.socket(fileno=control_fd)
  target = _resolve(target_spec)
  if warm_up_spec:
    _resolve(warm_up_spec)()
  signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # the kernel reaps workers
  try:
    control.sendall(_READY)
  except OSError:
    return  # the parent went away during the warm-up (e.g. it failed)
  while True:
    try:
      msg, fds, _, _ = socket.recv_fds(control, 1, 1)
    except OSError:
      break
    if not msg:
      break  # the parent went away: exit; workers follow (PDEATHSIG)
    for fd in fds:
      sock = socket.socket(fileno=fd)
      if os.fork() == 0:
        try:
          _become_worker(control, sock, target, memory_limit_mb)
        finally:
          os._exit(0)
      sock.close()


# ----------------------------------------------------------------------------
# In the parent.


class _Worker:
  """The parent's handle on one forked worker."""

  def __init__(self, control: socket.socket):
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    try:
      socket.send_fds(control, [_FORK], [theirs.fileno()])
    finally:
      theirs.close()
    self.sock = mine
    self.conn: multiprocessing.connection.Connection | None = None
    self.pidfd: int | None = None
    self.task: int | None = None
    self.deadline = 0.0
    self.requested_at = time.monotonic()

  @property
  def ready(self) -> bool:
    return self.conn is not None

  def fileno(self) -> int:
    return self.sock.fileno() if self.conn is None else self.conn.fileno()

  def accept_ready(self) -> bool:
    """Reads the worker's hello (its pidfd); False when it died first."""
    msg, fds, _, _ = socket.recv_fds(self.sock, 1, 1)
    if msg != _READY or len(fds) != 1:
      for fd in fds:
        os.close(fd)
      return False
    self.pidfd = fds[0]
    self.conn = multiprocessing.connection.Connection(self.sock.detach())
    return True

  def kill(self) -> None:
    if self.pidfd is not None:
      try:
        signal.pidfd_send_signal(self.pidfd, signal.SIGKILL)
      except ProcessLookupError:
        pass
      os.close(self.pidfd)
      self.pidfd = None
    if self.conn is not None:
      self.conn.close()
    else:
      self.sock.close()


class VerifyPool:
  """Runs `config.target` on task tuples in forked workers, each item under
  a hard deadline. Thread-safe (callers are serialised; the pool already
  checks `num_workers` items in parallel). Call `close()` when done."""

  def __init__(self, config: PoolConfig):
    self.config = config
    self._lock = threading.Lock()
    self._template: subprocess.Popen | None = None
    self._control: socket.socket | None = None
    self._template_ready = False
    self._workers: list[_Worker] = []
    self._failures = 0

  # -- template -----------------------------------------------------------------

  def start(self) -> None:
    """Starts the template process (returns at once; idempotent)."""
    with self._lock:
      self._start_locked()

  def wait_ready(self) -> None:
    """Starts the template and every worker and waits until they can take
    items, so that no call's first wave spends its budget on start-up."""
    with self._lock:
      self._wait_template_locked()
      while len(self._workers) < self.config.num_workers:
        self._workers.append(self._spawn())
      deadline = time.monotonic() + self.config.startup_timeout_s
      while not all(w.ready for w in self._workers):
        if time.monotonic() > deadline:
          raise RuntimeError("verifier worker did not start")
        self._wait_and_collect([])

  def _start_locked(self) -> None:
    if self._template is not None:
      return
    mine, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    c = self.config
    code = ("import sys; from kimi_jax.rewards.verify_pool import "
            "template_main; template_main(int(sys.argv[1]), sys.argv[2], "
            f"{c.warm_up!r}, {c.memory_limit_mb!r})")
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(
        p for p in (_PACKAGE_ROOT, env.get("PYTHONPATH")) if p)
    try:
      self._template = subprocess.Popen(
          [sys.executable, "-c", code, str(theirs.fileno()), c.target],
          pass_fds=(theirs.fileno(),), env=env, stdin=subprocess.DEVNULL,
          stdout=subprocess.DEVNULL)
    finally:
      theirs.close()
    self._control = mine
    self._template_started = time.monotonic()

  def _wait_template_locked(self) -> None:
    self._start_locked()
    if self._template_ready:
      return
    assert self._control is not None and self._template is not None
    remaining = (self._template_started + self.config.startup_timeout_s
                 - time.monotonic())
    self._control.settimeout(max(remaining, 0.001))
    try:
      msg = self._control.recv(1)
    except socket.timeout:
      msg = b""
    finally:
      self._control.settimeout(None)
    if msg != _READY:
      rc = self._template.poll()
      self._stop_template_locked()
      raise RuntimeError(
          f"verifier template process did not start (exit code {rc}); run "
          f"`python -c 'import {self.config.target.split(':')[0]}'` to see "
          "why")
    self._template_ready = True

  def _stop_template_locked(self) -> None:
    for w in self._workers:
      w.kill()
    self._workers = []
    if self._control is not None:
      self._control.close()
      self._control = None
    if self._template is not None:
      if self._template.poll() is None:
        self._template.kill()
      self._template.wait()
      self._template = None
    self._template_ready = False

  # -- running ------------------------------------------------------------------

  def run(self, tasks: Sequence[tuple]) -> list[dict[str, Any]]:
    """Checks every task; results in order, never raises per item.

    An item's budget runs from when it could first be checked: the start of
    this call for the first `num_workers` items (so waiting for the template
    and the workers to start counts against them), the moment a worker
    frees up for the rest.
    """
    call_start = time.monotonic()
    with self._lock:
      self._wait_template_locked()
      return self._run_locked(tasks, call_start)

  def _spawn(self) -> _Worker:
    assert self._control is not None
    return _Worker(self._control)

  def _replace(self, worker: _Worker) -> None:
    worker.kill()
    self._workers[self._workers.index(worker)] = self._spawn()

  def _run_locked(self, tasks: Sequence[tuple], call_start: float
                  ) -> list[dict[str, Any]]:
    results: list[dict[str, Any] | None] = [None] * len(tasks)
    pending = collections.deque(range(len(tasks)))
    while len(self._workers) < self.config.num_workers:
      self._workers.append(self._spawn())
    check_s = self.config.timeout_s - self.config.margin_s
    while pending or any(w.task is not None for w in self._workers):
      now = time.monotonic()
      for w in list(self._workers):
        if w.ready and w.task is None and pending:
          idx = pending.popleft()
          try:
            w.conn.send(tasks[idx])
          except OSError:
            pending.appendleft(idx)
            self._replace(w)
            continue
          first_wave = idx < self.config.num_workers
          w.task = idx
          w.deadline = (call_start if first_wave else now) + check_s
        elif (not w.ready and
              now - w.requested_at > self.config.startup_timeout_s):
          raise RuntimeError("verifier worker did not start")
      self._wait_and_collect(results)
    return [r if r is not None else {"correct": False, "error": "lost"}
            for r in results]

  def _wait_and_collect(self, results: list[dict[str, Any] | None]) -> None:
    """Waits for one event (result, hello, death, deadline) and handles it."""
    deadlines = [w.deadline for w in self._workers if w.task is not None]
    wait_s = max(0.0, min(deadlines) - time.monotonic()) if deadlines else 1.0
    by_fd = {w.fileno(): w for w in self._workers}
    for fd in multiprocessing.connection.wait(list(by_fd), timeout=wait_s):
      w = by_fd[fd]
      if not w.ready:
        try:
          ok = w.accept_ready()
        except OSError:
          ok = False
        if not ok:
          self._note_failure()
          self._replace(w)
        else:
          self._failures = 0
        continue
      try:
        msg = w.conn.recv()
      except (EOFError, OSError):
        # The worker died (e.g. killed by the OS); its item scores incorrect.
        if w.task is not None:
          results[w.task] = {"correct": False, "error": "worker crashed"}
        self._replace(w)
        continue
      if w.task is not None:
        results[w.task] = msg
        w.task = None
    now = time.monotonic()
    for w in list(self._workers):
      if w.task is not None and now >= w.deadline:
        results[w.task] = {"correct": False, "error": "timeout"}
        self._replace(w)

  def _note_failure(self) -> None:
    self._failures += 1
    if self._failures >= 3:
      raise RuntimeError("verifier workers die at start-up")

  def close(self) -> None:
    with self._lock:
      self._stop_template_locked()

  def __del__(self):
    try:
      self.close()
    except Exception:  # noqa: BLE001 - interpreter shutdown
      pass
