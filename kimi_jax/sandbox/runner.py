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
from dataclasses import dataclass

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
  out_r, out_w = os.pipe()
  err_r, err_w = os.pipe()
  status_r, status_w = os.pipe()
  bufs = {out_r: bytearray(), err_r: bytearray(), status_r: bytearray()}
  start = time.monotonic()
  try:
    proc = subprocess.Popen(
        argv, stdin=status_w, stdout=out_w, stderr=err_w, env=env,
        close_fds=True, pass_fds=pass_fds, start_new_session=True)
  except BaseException:
    for fd in bufs:
      os.close(fd)
    raise
  finally:
    os.close(out_w)
    os.close(err_w)
    os.close(status_w)
  pid_fd = os.pidfd_open(proc.pid)
  caps = {out_r: max_output_bytes, err_r: max_output_bytes,
          status_r: max_output_bytes}
  status_tail = b""
  compiled = compile_wall_s is None
  deadline = start + (wall_s if compiled else compile_wall_s)
  killed = None
  truncated = False
  sel = selectors.DefaultSelector()
  try:
    for fd in bufs:
      os.set_blocking(fd, False)
      sel.register(fd, selectors.EVENT_READ)
    sel.register(pid_fd, selectors.EVENT_READ)
    exited = False
    cpu_limit_hit = False
    peak = 0
    next_poll = start + (watch.poll_s if watch else 0.0)
    while killed is None and (exited is False or len(sel.get_map()) > 0):
      now = time.monotonic()
      remaining = deadline - now
      if remaining <= 0:
        killed = "timeout" if compiled else "compile_timeout"
        break
      if watch is not None and not exited and now >= next_poll:
        memory, cpu = sample(proc.pid)
        peak = max(peak, memory)
        cap = watch.memory_bytes if compiled else watch.compile_memory_bytes
        if compiled and cpu >= watch.cpu_soft_s - watch.cpu_slack_s:
          cpu_limit_hit = True
        if memory > cap:
          killed = "memory_limit"
          break
        next_poll = now + watch.poll_s
      wait_s = remaining if watch is None or exited else min(
          remaining, max(next_poll - now, 0.0))
      for key, _ in sel.select(wait_s):
        fd = key.fd
        if fd == pid_fd:
          exited = True
          sel.unregister(fd)
          continue
        try:
          chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
          continue
        if not chunk:
          sel.unregister(fd)
          continue
        buf = bufs[fd]
        room = caps[fd] - len(buf)
        if len(chunk) > room:
          buf += chunk[:max(room, 0)]
          if fd != status_r:  # program output over budget: stop it now
            truncated = True
            killed = "output_limit"
            break
          continue  # compiler chatter beyond the cap is dropped
        buf += chunk
        if fd == status_r and not compiled:
          status_tail = (status_tail + chunk)[-len(COMPILED_MARK):]
          if status_tail == COMPILED_MARK:
            compiled = True
            deadline = time.monotonic() + wall_s
    if killed is not None:
      _kill_sandbox(proc.pid)
    returncode, cpu_s = _reap(proc, pid_fd, timeout_s=10.0)
    wall = time.monotonic() - start
    # Drain what is left in the pipes (the namespace is gone, so they end).
    for fd, buf in bufs.items():
      while len(buf) <= caps[fd]:
        try:
          chunk = os.read(fd, _CHUNK)
        except BlockingIOError:
          break
        if not chunk:
          break
        room = caps[fd] - len(buf)
        buf += chunk[:room]
        if len(chunk) > room:
          if fd != status_r:
            truncated = True
          break
  finally:
    sel.close()
    os.close(pid_fd)
    for fd in bufs:
      os.close(fd)
  return RawOutcome(returncode=returncode, stdout=bytes(bufs[out_r]),
                    stderr=bytes(bufs[err_r]), status=bytes(bufs[status_r]),
                    killed=killed, truncated=truncated, wall_s=wall, cpu_s=cpu_s,
                    cpu_limit_hit=cpu_limit_hit, peak_memory_bytes=peak)
