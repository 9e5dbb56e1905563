"""Attacks against the REAL sandbox: each must be contained, the host must be
unaffected and the next execution clean. Needs bubblewrap: run
`.ci/install_system_deps.sh` first (missing bwrap fails these tests loudly).
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import threading
import time
import uuid

import pytest

from kimi_jax.sandbox import (ExecRequest, Sandbox, SandboxLimits,
                              SandboxUnavailableError)
from kimi_jax.sandbox.isolation import DEFAULT_HOST_UID

# These tests check that no process of the sandbox's host uid outlives a run,
# so each pytest-xdist worker gives its sandbox a uid of its own: the other
# worker's sandboxed programs (and every other test's, on the default uid)
# are then not counted.
HOST_UID = DEFAULT_HOST_UID + 1 + int(
    os.environ.get("PYTEST_XDIST_WORKER", "gw0").lstrip("gw") or 0)

SECRET = "kimi-secret-" + uuid.uuid4().hex
FAST = SandboxLimits(cpu_time_s=2, wall_time_s=4, memory_mb=256,
                     max_processes=32, tmpfs_size_mb=8, max_file_size_mb=64,
                     max_output_bytes=64 << 10)


@pytest.fixture(scope="module")
def sb():
  os.environ["KIMI_SANDBOX_TEST_SECRET"] = SECRET  # must never leak inside
  try:
    box = Sandbox(limits=FAST, max_workers=2, host_uid=HOST_UID)
  except SandboxUnavailableError as e:
    pytest.fail(f"sandbox unavailable: {e}. Run .ci/install_system_deps.sh")
  yield box
  box.close()
  os.environ.pop("KIMI_SANDBOX_TEST_SECRET", None)


def py(sb: Sandbox, source: str, **kw):
  return sb.run(ExecRequest("python", source, **kw))


def assert_clean_next_run(sb: Sandbox) -> None:
  """The following execution works and starts from an empty workdir."""
  res = py(sb, "import os; print(sorted(os.listdir('.')), len(os.listdir('/proc')))")
  assert res.status == "ok", res
  assert res.stdout.startswith("['main.py']"), res.stdout


def sandbox_uid_processes() -> list[str]:
  """Live processes of the sandbox's host uid (zombies hold nothing and
  are left for their parent to reap)."""
  if os.geteuid() != 0:
    return []
  out = subprocess.run(["ps", "-u", str(HOST_UID), "-o",
                        "stat=,pid=,args="], capture_output=True, text=True)
  return [line for line in out.stdout.splitlines()
          if line.strip() and not line.lstrip().startswith("Z")]


def test_fork_bomb_is_contained(sb):
  start = time.monotonic()
  res = py(sb, "import os\nwhile True:\n  try:\n    os.fork()\n"
           "  except OSError:\n    pass\n")
  assert res.status in ("timeout", "runtime_error"), res
  assert time.monotonic() - start < FAST.wall_time_s + 5
  assert sandbox_uid_processes() == []
  assert subprocess.run(["true"]).returncode == 0  # host can still fork
  assert_clean_next_run(sb)


def test_nproc_limit_applies(sb):
  res = py(sb, "import os, time\nn = 0\ntry:\n  for _ in range(200):\n"
           "    if os.fork() == 0:\n      time.sleep(5); os._exit(0)\n"
           "    n += 1\nexcept OSError as e:\n  print('refused', n)\n")
  assert res.status == "ok", res
  n = int(res.stdout.split()[-1])
  assert res.stdout.startswith("refused") and n < FAST.max_processes, res


@pytest.mark.parametrize("source", [
    "x = bytearray(4 << 30)",
    "a = []\nwhile True:\n  a.append(bytearray(16 << 20))",
])
def test_memory_bomb(sb, source):
  res = py(sb, source)
  assert res.status == "memory_limit", res
  assert_clean_next_run(sb)


def test_cpp_memory_bomb(sb):
  src = ("#include <vector>\nint main(){std::vector<std::vector<char>> v;"
         "while(true) v.emplace_back(1<<24, 1);}")
  res = sb.run(ExecRequest("cpp", src))
  assert res.status == "memory_limit", res


def test_cpu_spin_hits_cpu_limit(sb):
  limits = FAST.__class__(**{**FAST.to_dict(), "cpu_time_s": 1,
                             "wall_time_s": 20})
  start = time.monotonic()
  res = py(sb, "while True: pass", limits=limits)
  assert res.status == "timeout", res
  assert res.exit_code == -signal.SIGXCPU  # the CPU rlimit, not the wall
  assert time.monotonic() - start < 15


def test_sleep_forever_hits_wall_clock(sb):
  limits = FAST.__class__(**{**FAST.to_dict(), "wall_time_s": 1})
  start = time.monotonic()
  res = py(sb, "import time; time.sleep(10**6)", limits=limits)
  assert res.status == "timeout" and res.exit_code is None, res
  assert time.monotonic() - start < 3
  assert_clean_next_run(sb)


def test_no_network_to_host_loopback(sb):
  listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
  listener.bind(("127.0.0.1", 0))
  listener.listen(8)
  listener.settimeout(0.2)
  port = listener.getsockname()[1]
  accepted = []
  stop = threading.Event()

  def accept_loop():
    while not stop.is_set():
      try:
        conn, _ = listener.accept()
      except socket.timeout:
        continue
      accepted.append(conn.recv(100))
      conn.close()

  thread = threading.Thread(target=accept_loop, daemon=True)
  thread.start()
  try:
    src = (f"import socket\ntry:\n  s = socket.create_connection(('127.0.0.1', "
           f"{port}), timeout=1)\n  s.sendall(b'leak')\n  print('CONNECTED')\n"
           f"except OSError as e:\n  print('blocked', e)\n"
           f"import os\nprint(os.listdir('/sys/class/net') if "
           f"os.path.exists('/sys/class/net') else 'nosys')\n")
    res = py(sb, src)
    time.sleep(0.3)
  finally:
    stop.set()
    thread.join()
    listener.close()
  assert res.status == "ok", res
  assert "CONNECTED" not in res.stdout and "blocked" in res.stdout, res
  assert accepted == []


def test_private_files_and_env_are_invisible(sb):
  here = os.path.abspath(__file__)
  src = f"""
import os
found = []
for p in [{here!r}, '/work/main', '/work', '/root', '/root/.pyenv', '/home',
          '/etc/shadow', '/etc/ssh', '/var']:
  if os.path.exists(p):
    found.append(p)
try:
  found.append('shadow:' + open('/etc/shadow').read()[:20])
except OSError:
  pass
blob = repr(dict(os.environ))
for pid in os.listdir('/proc'):
  if pid.isdigit():
    for name in ('environ', 'cmdline'):
      try:
        blob += open(f'/proc/{{pid}}/{{name}}', 'rb').read().decode('latin1')
      except OSError:
        pass
print('FOUND', found)
print('BLOB', blob)
"""
  res = py(sb, src)
  assert res.status == "ok", res
  assert "FOUND []" in res.stdout, res.stdout
  assert SECRET not in res.stdout + res.stderr
  assert "KIMI_SANDBOX_TEST_SECRET" not in res.stdout
  assert "/root" not in res.stdout.split("BLOB", 1)[1]


def test_cannot_write_outside_workdir(sb):
  marker = f"kimi_marker_{uuid.uuid4().hex}"
  src = f"""
import os
ok = []
for d in ['/', '/usr', '/etc', '/dev', '/proc', '/var', '/box']:
  try:
    with open(os.path.join(d, {marker!r}), 'w') as f:
      f.write('x')
    ok.append(d)
  except OSError:
    pass
with open('/tmp/{marker}', 'w') as f:  # /tmp is the private workdir
  f.write('x')
print('WROTE', ok)
"""
  res = py(sb, src)
  assert res.status == "ok", res
  assert "WROTE ['/box']" in res.stdout, res.stdout
  for host_dir in ("/", "/usr", "/etc", "/tmp", "/var", "/dev", os.getcwd()):
    assert not os.path.exists(os.path.join(host_dir, marker))
  assert_clean_next_run(sb)


def test_disk_fill_is_capped(sb):
  src = """
import os
total = 0
for target in ('/box/fill', '/dev/shm/fill'):
  i = 0
  try:
    while True:
      with open(f'{target}{i}', 'wb') as f:
        for _ in range(8):
          f.write(b'x' * (1 << 20)); total += 1 << 20
      i += 1
  except OSError as e:
    print(target, 'stopped', e.errno)
print('TOTAL', total)
"""
  res = py(sb, src)
  assert res.status == "ok", res
  assert res.stdout.count("stopped 28") == 2, res.stdout  # ENOSPC both times
  total = int(res.stdout.split("TOTAL")[1])
  assert total <= 2 * (FAST.tmpfs_size_mb << 20) + (2 << 20)
  assert_clean_next_run(sb)


def test_file_size_limit(sb):
  limits = FAST.__class__(**{**FAST.to_dict(), "max_file_size_mb": 1})
  res = py(sb, "f = open('big', 'wb')\nf.write(b'x' * (2 << 20))", limits=limits)
  assert res.status != "ok", res  # SIGXFSZ or EFBIG


def test_cannot_kill_parent_or_host_processes(sb):
  tag = f"kimi_sentinel_{uuid.uuid4().hex}"
  # Own process groups, so cleanup also reaps the `sleep` children; a
  # leftover sleep under the sandbox uid would fail later tests' checks.
  sentinels = [subprocess.Popen(["sh", "-c", f"sleep 60; : {tag}"],
                                start_new_session=True)]
  if os.geteuid() == 0 and shutil.which("setpriv"):  # same host uid as sandbox
    sentinels.append(subprocess.Popen(
        ["setpriv", f"--reuid={HOST_UID}", f"--regid={HOST_UID}",
         "--clear-groups", "sh", "-c", f"sleep 60; : {tag}"],
        start_new_session=True))
  try:
    src = """
import os, signal, subprocess
for pid in (os.getppid(), 1, -1):
  try:
    os.kill(pid, signal.SIGKILL)
  except OSError as e:
    print('kill', pid, e)
subprocess.run(['kill', '-9', '-1'])
subprocess.run(['pkill', '-9', '-f', 'sleep'])
print('still here')
"""
    for _ in range(2):
      res = py(sb, src)
      assert res.status in ("ok", "runtime_error"), res
    time.sleep(0.2)
    for s in sentinels:
      assert s.poll() is None, "a host sentinel process was killed"
    assert os.getppid() > 1
  finally:
    for s in sentinels:
      os.killpg(s.pid, signal.SIGKILL)
      s.wait()
  assert_clean_next_run(sb)


@pytest.mark.parametrize("stream", ["stdout", "stderr"])
def test_gigabytes_of_output_are_capped_fast(sb, stream):
  start = time.monotonic()
  res = py(sb, f"import sys\nb = 'x' * (1 << 20)\nfor _ in range(4096):\n"
           f"  sys.{stream}.write(b)\n")
  elapsed = time.monotonic() - start
  assert res.status == "output_limit" and res.truncated, res.status
  assert len(getattr(res, stream)) <= FAST.max_output_bytes
  assert elapsed < 3, elapsed


def test_background_process_does_not_outlive_run(sb):
  tag = f"kimi_bg_{uuid.uuid4().hex}"
  src = f"""
import os, subprocess
subprocess.Popen(['sh', '-c', 'sleep 100; : {tag}'], start_new_session=True,
                 stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
if os.fork() == 0:  # daemonise the classic way, holding stdout open
  os.setsid()
  if os.fork() == 0:
    os.execvp('sh', ['sh', '-c', 'sleep 100; : {tag}'])
  os._exit(0)
print('spawned')
"""
  start = time.monotonic()
  res = py(sb, src)
  assert res.status == "ok" and "spawned" in res.stdout, res
  assert time.monotonic() - start < 3  # no waiting for the orphans
  out = subprocess.run(["pgrep", "-f", tag], capture_output=True, text=True)
  assert out.stdout.strip() == "", f"orphans survived: {out.stdout}"


def test_cannot_lift_limits_via_syscalls(sb):
  src = """
import ctypes, os, resource
libc = ctypes.CDLL(None, use_errno=True)
got = []
for res in (resource.RLIMIT_NPROC, resource.RLIMIT_AS, resource.RLIMIT_CPU,
            resource.RLIMIT_NOFILE, resource.RLIMIT_FSIZE):
  try:
    resource.setrlimit(res, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))
    got.append(f'setrlimit {res}')
  except (ValueError, OSError):
    pass
CLONE_NEWUSER, CLONE_NEWNS = 0x10000000, 0x00020000
if libc.unshare(CLONE_NEWUSER) == 0:
  got.append('unshare user')
if libc.unshare(CLONE_NEWNS) == 0:
  got.append('unshare mount')
if libc.mount(b'none', b'/box', b'tmpfs', 0, None) == 0:
  got.append('mount')
if libc.setuid(0) == 0:
  got.append('setuid')
SYS_prlimit64 = 302
class RL(ctypes.Structure):
  _fields_ = [('cur', ctypes.c_uint64), ('max', ctypes.c_uint64)]
new = RL(2**64 - 1, 2**64 - 1)
if libc.syscall(SYS_prlimit64, 0, resource.RLIMIT_AS, ctypes.byref(new), None) == 0:
  got.append('prlimit64')
print('LIFTED', got, resource.getrlimit(resource.RLIMIT_AS))
"""
  res = py(sb, src)
  assert res.status == "ok", res
  assert "LIFTED []" in res.stdout, res.stdout
  assert f"({FAST.memory_mb << 20}, {FAST.memory_mb << 20})" in res.stdout
