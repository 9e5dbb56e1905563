"""One job per workdir: a second job started on a busy workdir stops at once.

Two jobs writing the same checkpoints and metrics would interleave them and
could leave neither resumable (a rerun started while the first is still
going, or two sweep arms given one directory). `held(workdir)` takes an
exclusive `flock` on `WORKDIR/.kimi_jax.lock` for as long as the job runs
and names the holder (pid and host) when it is taken. The kernel drops the
lock when its holder exits, killed or not, so a crash never leaves a stale
lock behind and a rerun resumes as before.

Only process 0 of a multi-process job takes it (all processes share one
workdir). Object-store workdirs (gs://...) are not locked: there is no
flock there. A mounted filesystem that refuses locks gets a warning and
the job runs unguarded. A stage that runs inside another on the same
workdir (in one process) finds the lock its own and goes on.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import os
import socket
from typing import Any, Callable, Iterator, TypeVar

import jax

from kimi_jax.infra.console import log

LOCK_NAME = ".kimi_jax.lock"
_HELD: set[str] = set()  # this process's locked workdirs (real paths)
F = TypeVar("F", bound=Callable[..., Any])


class WorkdirBusyError(RuntimeError):
  """Another live job holds the workdir."""


@contextlib.contextmanager
def held(workdir: str, wait: bool = False) -> Iterator[None]:
  """Holds `workdir`'s lock for the body (see the module doc). wait: when
  another job holds it, wait for that job to end instead of raising (a
  stage that several sweep processes share: the first runs it, the others
  then find it finished)."""
  if "://" in workdir or jax.process_index() != 0:
    yield
    return
  os.makedirs(workdir, exist_ok=True)
  key = os.path.realpath(workdir)
  if key in _HELD:
    yield
    return
  path = os.path.join(workdir, LOCK_NAME)
  fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
  try:
    locked = _acquire(fd, workdir, wait)
    if locked:
      os.ftruncate(fd, 0)
      os.pwrite(fd, f"pid {os.getpid()} on {socket.gethostname()}\n"
                .encode(), 0)
    _HELD.add(key)
    try:
      yield
    finally:
      _HELD.discard(key)
      if locked:
        fcntl.flock(fd, fcntl.LOCK_UN)
  finally:
    os.close(fd)


def _acquire(fd: int, workdir: str, wait: bool) -> bool:
  """Takes the lock on `fd`; False when the filesystem has no locks (the
  job then runs unguarded, with a warning, rather than not at all)."""
  try:
    fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    return True
  except BlockingIOError:
    holder = (os.pread(fd, 200, 0).decode(errors="replace").strip()
              or "holder unknown")
    if not wait:
      raise WorkdirBusyError(
          f"{workdir} is in use by another kimi_jax job ({holder}); wait "
          f"for it to finish, stop it, or pick another --workdir") from None
    log(f"waiting for the other kimi_jax job in {workdir} ({holder})")
    fcntl.flock(fd, fcntl.LOCK_EX)
    return True
  except OSError as exc:  # ENOLCK, EOPNOTSUPP: a filesystem without flock
    log(f"warning: cannot lock {workdir} ({exc}); nothing stops a second "
        f"job from using it at the same time")
    return False


def exclusive(fn: F) -> F:
  """`fn(config, workdir, ...)` run while holding `workdir`'s lock."""

  @functools.wraps(fn)
  def run(config: Any, workdir: str, *args: Any, **kwargs: Any) -> Any:
    with held(workdir):
      return fn(config, workdir, *args, **kwargs)

  return run  # type: ignore[return-value]
