"""Helpers shared by the trusted harness programs (lock-down, job file, rlimits).

Runs inside the code sandbox under its Python 3 (standard library only).
"""

import ctypes
import json
import os
import resource
import signal
import sys

PY_FLAGS = ["-E", "-s", "-S", "-B"]

def lock_down():
  # Non-dumpable: same-uid processes can no longer ptrace us or open
  # /proc/<pid>/{mem,fd,environ}. Fail closed when that is impossible.
  try:
    ok = ctypes.CDLL(None, use_errno=True).prctl(4, 0, 0, 0, 0) == 0
  except Exception:
    ok = False
  if not ok:
    sys.stderr.write("harness: prctl(PR_SET_DUMPABLE) failed\n")
    sys.exit(3)

def take_job():
  with open("harness_job.json") as f:
    job = json.load(f)
  os.unlink("harness_job.json")
  return job

def kill_group(pid):
  try:
    os.killpg(pid, signal.SIGKILL)
  except OSError:
    pass

def rlimits(cpu_s, memory_mb, fsize_bytes, address_space_mb=None):
  # RLIMIT_DATA holds heap, mmap'd and off-heap memory; the address-space
  # cap may be looser (node reserves far more than it touches).
  def apply():
    cpu = max(1, int(cpu_s + 0.999))
    resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
    if memory_mb:
      mem = int(memory_mb) << 20
      space = int(address_space_mb or memory_mb) << 20
      resource.setrlimit(resource.RLIMIT_AS, (space, space))
      resource.setrlimit(resource.RLIMIT_DATA, (mem, mem))
    if fsize_bytes:
      resource.setrlimit(resource.RLIMIT_FSIZE, (fsize_bytes, fsize_bytes))
  return apply

def read_capped(path, cap):
  with open(path, "rb") as f:
    return f.read(cap + 1)
