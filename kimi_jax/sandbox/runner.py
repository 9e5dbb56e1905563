"""Spawns one bubblewrap process and supervises it.

Reads stdout / stderr / the driver's status pipe with a capped budget, enforces
the wall-clock deadline and tears the whole PID namespace down on a kill.
"""

from __future__ import annotations

import fcntl
import os
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass, field

from kimi_jax.sandbox.isolation import COMPILED_MARK

_CHUNK = 1 << 16
_SEALS = fcntl.F_SEAL_SEAL | fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE


@dataclass(frozen=True)
class RawOutcome:
  returncode: int | None  # bwrap's exit status (128+N: killed by signal N)
  stdout: bytes
  stderr: bytes
  status: bytes  # driver status pipe (markers + compiler output)
  # None, "timeout", "compile_timeout", "output_limit" or "memory_limit"
  killed: str | None
  truncated: bool
  wall_s: float
  cpu_s: float  # user+system time of the whole sandbox tree
  # Some process of the program was seen past (nearly) its CPU rlimit.
  cpu_limit_hit: bool = False
  peak_memory_bytes: int = 0  # largest resident total the watchdog saw


@dataclass(frozen=True)
class Watch:
  """What the watchdog enforces while the program runs.

  memory_bytes: resident anonymous + shared-memory pages summed over every
    process of the sandbox (RSS double-counts nothing shared with the host);
    over it the whole sandbox is killed -> "memory_limit".
  compile_memory_bytes: the same during the C++ compile phase.
  cpu_soft_s: the soft RLIMIT_CPU; a process seen within `cpu_slack_s` of it
    marks the run as having hit its CPU limit (a SIGKILL at the hard limit,
    or a parent reporting its child's SIGXCPU, is then a timeout).
  poll_s: how often the process tree is sampled.
  """
  memory_bytes: int
  compile_memory_bytes: int
  cpu_soft_s: float
  poll_s: float = 0.01
  cpu_slack_s: float = 0.1


_CLK_TCK = os.sysconf("SC_CLK_TCK")


def _tree(root: int) -> list[int]:
  """`root` and all its descendants (threads' children included)."""
  out, todo = [], [root]
  while todo:
    pid = todo.pop()
    out.append(pid)
    try:
      tids = os.listdir(f"/proc/{pid}/task")
    except OSError:
      continue
    for tid in tids:
      try:
        with open(f"/proc/{pid}/task/{tid}/children", "rb") as f:
          todo.extend(int(c) for c in f.read().split())
      except (OSError, ValueError):
        pass
  return out


def _usage(pid: int) -> tuple[int, float]:
  """(resident anonymous + shmem bytes, cpu seconds) of one process."""
  memory = 0
  try:
    with open(f"/proc/{pid}/status", "rb") as f:
      for line in f:
        if line.startswith((b"RssAnon:", b"RssShmem:")):
          memory += int(line.split()[1]) << 10
    with open(f"/proc/{pid}/stat", "rb") as f:
      fields = f.read().rsplit(b")", 1)[1].split()
    cpu = (int(fields[11]) + int(fields[12])) / _CLK_TCK
  except (OSError, ValueError, IndexError):
    return memory, 0.0
  return memory, cpu


def sample(root: int) -> tuple[int, float]:
  """(total memory in bytes, largest per-process cpu seconds) of a tree."""
  total, worst_cpu = 0, 0.0
  for pid in _tree(root):
    memory, cpu = _usage(pid)
    total += memory
    worst_cpu = max(worst_cpu, cpu)
  return total, worst_cpu


def sealed_memfd(name: str, data: bytes) -> int:
  """A read-only in-memory file: bwrap copies it in, or it serves as stdin."""
  fd = os.memfd_create(name, os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
  try:
    view = memoryview(data)
    while view:
      view = view[os.write(fd, view):]
    os.lseek(fd, 0, os.SEEK_SET)
    fcntl.fcntl(fd, fcntl.F_ADD_SEALS, _SEALS)  # sandbox cannot alter it
  except BaseException:
    os.close(fd)
    raise
  return fd


def _kill_sandbox(pid: int) -> None:
  """SIGKILLs the sandbox's PID-1 so the kernel reaps the whole namespace
  before bwrap exits (killing bwrap alone would return before teardown)."""
  try:
    with open(f"/proc/{pid}/task/{pid}/children") as f:
      children = [int(c) for c in f.read().split()]
  except (OSError, ValueError):
    children = []
  for child in children:
    try:
      os.kill(child, signal.SIGKILL)
    except ProcessLookupError:
      pass
  if not children:  # still setting up: no namespace yet, kill bwrap itself
    try:
      os.killpg(pid, signal.SIGKILL)
    except ProcessLookupError:
      pass


def _reap(proc: subprocess.Popen, pid_fd: int, timeout_s: float) -> tuple[int | None, float]:
  """Waits (bounded) for bwrap; returns (exit code, cpu seconds of the tree)."""
  ready = selectors.DefaultSelector()
  try:
    ready.register(pid_fd, selectors.EVENT_READ)
    if not ready.select(timeout_s):
      os.killpg(proc.pid, signal.SIGKILL)  # last resort; should not happen
  finally:
    ready.close()
  _, status, usage = os.wait4(proc.pid, 0)
  code = os.waitstatus_to_exitcode(status)
  proc.returncode = code  # tell Popen it is reaped
  return code, usage.ru_utime + usage.ru_stime


def supervise(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...],
              wall_s: float, compile_wall_s: float | None,
              max_output_bytes: int, watch: Watch | None = None
              ) -> RawOutcome:
  """Runs argv with the driver's status pipe as its stdin (dash can only
  redirect single-digit fds, so the program's stdin travels in pass_fds).
  `compile_wall_s` set means a compile phase comes first and the run deadline
  starts once the driver reports a successful compile."""
  start = time.monotonic()
  proc, fds = _spawn(argv, env, pass_fds)
  pid_fd = os.pidfd_open(proc.pid)
  compiled = compile_wall_s is None
  run = _Run(pid=proc.pid, fds=fds, cap=max_output_bytes, wall_s=wall_s,
             watch=watch, compiled=compiled,
             deadline=start + (wall_s if compiled else compile_wall_s),
             next_poll=start + (watch.poll_s if watch else 0.0))
  sel = selectors.DefaultSelector()
  try:
    for fd in fds:
      os.set_blocking(fd, False)
      sel.register(fd, selectors.EVENT_READ)
    sel.register(pid_fd, selectors.EVENT_READ)
    run.follow(sel, pid_fd)
    if run.killed is not None:
      _kill_sandbox(proc.pid)
    returncode, cpu_s = _reap(proc, pid_fd, timeout_s=10.0)
    wall = time.monotonic() - start
    run.drain()
  finally:
    sel.close()
    os.close(pid_fd)
    for fd in fds:
      os.close(fd)
  return run.outcome(returncode, wall_s=wall, cpu_s=cpu_s)


def _spawn(argv: list[str], env: dict[str, str], pass_fds: tuple[int, ...]
           ) -> tuple[subprocess.Popen, tuple[int, int, int]]:
  """Starts argv in a new process group with fresh pipes for its stdout,
  stderr and the driver's status (its stdin); returns the process and the
  read ends (stdout, stderr, status)."""
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  status_r, status_w = os.pipe()
  try:
    proc = subprocess.Popen(
        argv, stdin=status_w, stdout=out_w, stderr=err_w, env=env,
        close_fds=True, pass_fds=pass_fds, start_new_session=True)
  except BaseException:
    for fd in (out_r, err_r, status_r):
      os.close(fd)
    raise
  finally:
    os.close(out_w)
    os.close(err_w)
    os.close(status_w)
  return proc, (out_r, err_r, status_r)


@dataclass
class _Run:
  """One supervised sandbox: what its pipes said so far (each kept to `cap`
  bytes), its phase and deadline, and why it was killed, if it was."""
  pid: int
  fds: tuple[int, int, int]  # read ends: stdout, stderr, status
  cap: int
  wall_s: float  # the run deadline, from the end of the compile phase
  watch: Watch | None
  compiled: bool  # past the compile phase (or there is none)
  deadline: float
  next_poll: float
  bufs: dict[int, bytearray] = field(init=False)
  status_tail: bytes = b""
  killed: str | None = None
  truncated: bool = False
  exited: bool = False
  cpu_limit_hit: bool = False
  peak: int = 0

  def __post_init__(self):
    self.bufs = {fd: bytearray() for fd in self.fds}

  @property
  def status_fd(self) -> int:
    return self.fds[2]

  def follow(self, sel: selectors.BaseSelector, pid_fd: int) -> None:
    """Reads the pipes until the sandbox has exited and closed them all, a
    deadline passes or a limit is hit (then `killed` says which)."""
    while self.killed is None and (not self.exited or len(sel.get_map()) > 0):
      now = time.monotonic()
      remaining = self.deadline - now
      if remaining <= 0:
        self.killed = "timeout" if self.compiled else "compile_timeout"
        return
      watching = self.watch is not None and not self.exited
      if watching and now >= self.next_poll:
        self._check_usage(now)
        if self.killed is not None:
          return
      wait_s = (min(remaining, max(self.next_poll - now, 0.0)) if watching
                else remaining)
      for key, _ in sel.select(wait_s):
        if key.fd == pid_fd:
          self.exited = True
          sel.unregister(pid_fd)
          continue
        self._read(sel, key.fd)
        if self.killed is not None:
          break

  def _check_usage(self, now: float) -> None:
    """Samples the process tree: notes the peak memory and a process near its
    CPU limit; kills over the phase's memory cap."""
    watch = self.watch
    memory, cpu = sample(self.pid)
    self.peak = max(self.peak, memory)
    cap = watch.memory_bytes if self.compiled else watch.compile_memory_bytes
    if self.compiled and cpu >= watch.cpu_soft_s - watch.cpu_slack_s:
      self.cpu_limit_hit = True
    if memory > cap:
      self.killed = "memory_limit"
      return
    self.next_poll = now + watch.poll_s

  def _read(self, sel: selectors.BaseSelector, fd: int) -> None:
    """Takes one chunk from a readable pipe."""
    try:
      chunk = os.read(fd, _CHUNK)
    except BlockingIOError:
      return
    if not chunk:
      sel.unregister(fd)
      return
    if self._keep(fd, chunk):
      if fd != self.status_fd:  # program output over budget: stop it now
        self.truncated = True
        self.killed = "output_limit"
      return  # compiler chatter beyond the cap is dropped
    if fd == self.status_fd and not self.compiled:
      self._look_for_compiled(chunk)

  def _keep(self, fd: int, chunk: bytes) -> bool:
    """Appends what fits under the cap; True when `chunk` did not fit."""
    buf = self.bufs[fd]
    room = self.cap - len(buf)
    buf += chunk[:max(room, 0)]
    return len(chunk) > room

  def _look_for_compiled(self, chunk: bytes) -> None:
    """The driver's compiled mark ends the compile phase: the run deadline
    starts now."""
    self.status_tail = (self.status_tail + chunk)[-len(COMPILED_MARK):]
    if self.status_tail == COMPILED_MARK:
      self.compiled = True
      self.deadline = time.monotonic() + self.wall_s

  def drain(self) -> None:
    """Reads what is left in the pipes (the namespace is gone, so they
    end)."""
    for fd, buf in self.bufs.items():
      while len(buf) <= self.cap:
        try:
          chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
          break
        if not chunk:
          break
        if self._keep(fd, chunk):
          if fd != self.status_fd:
            self.truncated = True
          break

  def outcome(self, returncode: int | None, *, wall_s: float, cpu_s: float
              ) -> RawOutcome:
    stdout, stderr, status = (bytes(self.bufs[fd]) for fd in self.fds)
    return RawOutcome(returncode=returncode, stdout=stdout, stderr=stderr,
                      status=status, killed=self.killed,
                      truncated=self.truncated, wall_s=wall_s, cpu_s=cpu_s,
                      cpu_limit_hit=self.cpu_limit_hit,
                      peak_memory_bytes=self.peak)
