"""Builds the bubblewrap command lines that isolate one execution.

The expensive decisions (where the runtimes live, which paths to bind, the
prepared /etc) are made once per `Sandbox`; a run only appends its sizes,
file descriptors and the driver script to a precomputed argument prefix.
"""

from __future__ import annotations

import math
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass

from kimi_jax.sandbox.types import (MAIN_FILE, SandboxLimits,
                                    SandboxUnavailableError)

INSTALL_HINT = ("run `.ci/install_system_deps.sh` (apt-get install bubblewrap) "
                "to install it")
WORKDIR = "/box"
# Host uid the sandbox runs as when we are root, so that even a broken mount
# could not expose root-owned files (e.g. /etc/shadow is 0640 root:shadow).
DEFAULT_HOST_UID = 64000
# The sandbox user, as seen from inside.
INNER_UID = 1000
# V8 reserves a lot of virtual memory it never touches (code range, heap
# cages, ~0.6 GiB more per worker_threads Worker), so node's address-space
# cap is loose (room for about five Workers); its memory is held by RLIMIT_DATA (which counts every
# private writable mapping: heap, off-heap Buffers, wasm memory, thread
# stacks), --max-old-space-size and the supervisor's RSS watchdog.
JS_ADDRESS_SPACE_OVERHEAD_MB = 4096
STACK_KB = 8192  # also the default thread stack size, so keep it modest
SHM_MAX_MB = 16
# Written by the driver to the status pipe: started, and compiled OK.
STARTED_MARK = b"\x01"
COMPILED_MARK = b"\x00KIMI_COMPILED\x00"
# Driver-level failure (e.g. a limit could not be set) -> sandbox_error.
DRIVER_FAIL_RC = 125
DRIVER_FAIL_PREFIX = "kimi-sandbox:"
# Linked into every C++ program: a failed operator new says so on stderr
# before throwing. libstdc++'s own "terminate called after throwing
# std::bad_alloc" can be lost when several threads run out at once (the
# second prints only "terminate called recursively" and aborts the process).
OOM_HOOK_DIR = "/.kimi"  # inside the sandbox; `root`/HOOK_SUBDIR on the host
HOOK_SUBDIR = "hook"
OOM_HOOK_OBJECT = "oom_hook.o"
_OOM_HOOK_SOURCE = r"""
#include <new>
#include <unistd.h>
namespace {
void kimi_out_of_memory() {
  static const char msg[] = "\nkimi-sandbox: operator new failed (std::bad_alloc)\n";
  if (write(2, msg, sizeof msg - 1) < 0) {}
  throw std::bad_alloc();
}
struct Install { Install() { std::set_new_handler(kimi_out_of_memory); } } install;
}
"""

_ENV = (("PATH", "/usr/local/bin:/usr/bin:/bin"), ("HOME", WORKDIR),
        ("TMPDIR", "/tmp"), ("LANG", "C.UTF-8"), ("LC_ALL", "C.UTF-8"),
        ("TZ", "UTC"), ("USER", "sandbox"))


@dataclass(frozen=True)
class Toolchain:
  """Host binaries the sandbox needs, resolved to real paths."""
  bwrap: str
  setpriv: str | None  # drops root to an unprivileged host uid
  python: str | None
  node: str | None
  gxx: str | None
  ro_binds: tuple[str, ...]  # read-only host paths visible in the sandbox

  def runtime(self, language: str) -> str | None:
    return {"python": self.python, "javascript": self.node,
            "cpp": self.gxx}[language]


def _which(name: str, explicit: str | None, candidates: tuple[str, ...]) -> str | None:
  for path in ((explicit,) if explicit else candidates + (shutil.which(name) or "",)):
    if path and os.path.isfile(path) and os.access(path, os.X_OK):
      return os.path.realpath(path)
  return None


def _prefix_for(binary: str | None) -> str | None:
  """Directory to bind so that `binary` and its libraries are visible."""
  if binary is None or binary.startswith("/usr/"):
    return None
  prefix = os.path.dirname(os.path.dirname(binary))  # <prefix>/bin/<exe>
  for private in ("/root", "/home", "/work", "/tmp"):
    if prefix == private or prefix.startswith(private + "/"):
      return ""  # refuse: would expose private trees (e.g. pyenv under /root)
  return prefix


def find_toolchain(python: str | None = None, node: str | None = None,
                   gxx: str | None = None) -> Toolchain:
  bwrap = _which("bwrap", None, ("/usr/bin/bwrap",))
  if bwrap is None:
    raise SandboxUnavailableError(f"bubblewrap (bwrap) not found; {INSTALL_HINT}")
  # Debian's interpreter, not the pyenv one under /root (which we must hide).
  py = _which("python3", python, ("/usr/bin/python3", "/usr/local/bin/python3"))
  js = _which("node", node, ("/usr/bin/node", "/usr/local/bin/node"))
  cc = _which("g++", gxx, ("/usr/bin/g++",))
  binds = ["/usr"]
  resolved = {}
  for name, exe in (("python", py), ("node", js), ("g++", cc)):
    prefix = _prefix_for(exe)
    if prefix == "":
      exe = None  # its prefix is private; the language becomes unavailable
    elif prefix and prefix not in binds:
      binds.append(prefix)
    resolved[name] = exe
  setpriv = _which("setpriv", None, ("/usr/bin/setpriv",)) if os.geteuid() == 0 else None
  return Toolchain(bwrap=bwrap, setpriv=setpriv, python=resolved["python"],
                   node=resolved["node"], gxx=resolved["g++"],
                   ro_binds=tuple(binds))


def prepare_etc(root: str) -> str:
  """Writes a minimal /etc (no secrets) to bind read-only into every run."""
  etc = os.path.join(root, "etc")
  os.makedirs(etc, exist_ok=True)
  files = {
      "passwd": (f"root:x:0:0:root:/nonexistent:/usr/sbin/nologin\n"
                 f"sandbox:x:{INNER_UID}:{INNER_UID}:sandbox:{WORKDIR}:/bin/sh\n"
                 "nobody:x:65534:65534:nobody:/nonexistent:/usr/sbin/nologin\n"),
      "group": f"root:x:0:\nsandbox:x:{INNER_UID}:\nnogroup:x:65534:\n",
      "hostname": "sandbox\n",
      "hosts": "127.0.0.1 localhost sandbox\n::1 localhost\n",
      "nsswitch.conf": "passwd: files\ngroup: files\nhosts: files\n",
  }
  for name, text in files.items():
    with open(os.path.join(etc, name), "w") as f:
      f.write(text)
  # The loader cache only makes library lookup faster; it holds no secrets.
  if os.path.exists("/etc/ld.so.cache"):
    shutil.copyfile("/etc/ld.so.cache", os.path.join(etc, "ld.so.cache"))
  for dirpath, dirnames, filenames in os.walk(root):
    os.chmod(dirpath, 0o755)
    for name in filenames:
      os.chmod(os.path.join(dirpath, name), 0o644)
  return etc


def build_oom_hook(root: str, gxx: str) -> str:
  """Compiles the C++ out-of-memory hook once per Sandbox, on the host (our
  own fixed source), into `root`/HOOK_SUBDIR; returns that directory."""
  hook_dir = os.path.join(root, HOOK_SUBDIR)
  os.makedirs(hook_dir, exist_ok=True)
  source = os.path.join(hook_dir, "oom_hook.cpp")
  with open(source, "w") as f:
    f.write(_OOM_HOOK_SOURCE)
  obj = os.path.join(hook_dir, OOM_HOOK_OBJECT)
  done = subprocess.run([gxx, "-O2", "-c", source, "-o", obj],
                        capture_output=True, text=True, timeout=120)
  if done.returncode != 0:
    raise SandboxUnavailableError(
        f"{gxx} could not compile the sandbox's C++ hook: {done.stderr}")
  for path in (hook_dir, source, obj):
    os.chmod(path, 0o755 if os.path.isdir(path) else 0o644)
  return hook_dir


def make_prepared_root(gxx: str | None = None) -> str:
  root = tempfile.mkdtemp(prefix="kimi_sandbox_root_")
  os.chmod(root, 0o755)  # the unprivileged sandbox uid must traverse it
  prepare_etc(root)
  if gxx is not None:
    build_oom_hook(root, gxx)
  return root


def bwrap_prefix(tc: Toolchain, root: str, host_uid: int) -> tuple[str, ...]:
  """Everything before the per-run arguments; computed once per Sandbox from
  the prepared `root` (its etc/ and, with C++, hook/)."""
  etc_dir = os.path.join(root, "etc")
  args: list[str] = []
  if tc.setpriv is not None:
    args += [tc.setpriv, f"--reuid={host_uid}", f"--regid={host_uid}",
             "--clear-groups", "--inh-caps=-all", "--no-new-privs", "--"]
  args += [tc.bwrap, "--unshare-all", "--unshare-user", "--disable-userns",
           "--die-with-parent", "--new-session", "--hostname", "sandbox",
           "--uid", str(INNER_UID), "--gid", str(INNER_UID)]
  for path in tc.ro_binds:
    args += ["--ro-bind", path, path]
  for name in ("bin", "lib", "lib64", "sbin"):  # merged-/usr symlinks
    if os.path.islink(f"/{name}"):
      args += ["--symlink", os.readlink(f"/{name}"), f"/{name}"]
    elif os.path.isdir(f"/{name}"):
      args += ["--ro-bind", f"/{name}", f"/{name}"]
  args += ["--ro-bind", etc_dir, "/etc", "--proc", "/proc", "--dev", "/dev"]
  hook_dir = os.path.join(root, HOOK_SUBDIR)
  if os.path.isdir(hook_dir):
    args += ["--ro-bind", hook_dir, OOM_HOOK_DIR]
  args += ["--clearenv"]
  for key, value in _ENV:
    args += ["--setenv", key, value]
  return tuple(args)


def bwrap_run_args(limits: SandboxLimits, files: list[tuple[int, str]],
                   seccomp_fd: int | None = None) -> list[str]:
  """Per-run mounts (the size-capped tmpfs workdir, /dev/shm, the files) and
  the seccomp filter (a fresh fd per run: bwrap reads it to the end)."""
  tmpfs = limits.tmpfs_size_mb << 20
  shm = min(limits.tmpfs_size_mb, SHM_MAX_MB) << 20
  args = [] if seccomp_fd is None else ["--seccomp", str(seccomp_fd)]
  args += ["--size", str(shm), "--tmpfs", "/dev/shm", "--remount-ro", "/dev",
          "--size", str(tmpfs), "--tmpfs", WORKDIR]
  for fd, name in files:
    args += ["--perms", "0644", "--file", str(fd), f"{WORKDIR}/{name}"]
  args += ["--symlink", WORKDIR, "/tmp", "--chdir", WORKDIR, "--remount-ro", "/"]
  return args


def cpu_rlimit_s(cpu_s: float) -> int:
  """The soft RLIMIT_CPU for a limit of `cpu_s` (whole seconds)."""
  return max(1, math.ceil(cpu_s))


def _ulimits(cpu_s: float, memory_mb: int, nproc: int, fsize_mb: int,
             nofile: int, address_space_mb: int | None = None) -> str:
  cpu = cpu_rlimit_s(cpu_s)
  address_space_mb = address_space_mb or memory_mb
  # dash's ulimit sets soft and hard together unless told; soft CPU first
  # (SIGXCPU), hard one second later (SIGKILL) for programs that catch it.
  parts = ["ulimit -c 0", f"ulimit -s {STACK_KB}", f"ulimit -S -t {cpu}",
           f"ulimit -H -t {cpu + 1}", f"ulimit -v {address_space_mb * 1024}",
           f"ulimit -d {memory_mb * 1024}",
           f"ulimit -p {nproc}", f"ulimit -n {nofile}",
           f"ulimit -f {fsize_mb * 2048}"]  # -f counts 512-byte blocks
  fail = (f"{{ echo '{DRIVER_FAIL_PREFIX} cannot set resource limits' >&2; "
          f"exit {DRIVER_FAIL_RC}; }}")
  return "{ " + " && ".join(parts) + "; } || " + fail


def driver_script(language: str, tc: Toolchain, limits: SandboxLimits,
                  stdin_fd: int | None, python_flags: tuple[str, ...],
                  cpp_flags: tuple[str, ...]) -> str:
  """The /bin/sh program run inside the sandbox: set rlimits, then exec.

  On entry fd 0 is the status pipe to the supervisor; the program's real
  stdin is the sealed memfd `stdin_fd` (or /dev/null), swapped in last.
  """
  main = MAIN_FILE[language]
  stdin = "/dev/null" if stdin_fd is None else f"/dev/fd/{stdin_fd}"
  run_limits = _ulimits(limits.cpu_time_s, limits.memory_mb,
                        limits.max_processes, limits.max_file_size_mb,
                        limits.max_open_files)
  started = "printf '\\001' >&0"
  if language == "python":
    flags = " ".join(python_flags)
    return (f"{started}; {run_limits}; "
            f"exec {tc.python} {flags} {main} 0<{stdin}")
  if language == "javascript":
    js_limits = _ulimits(limits.cpu_time_s, limits.memory_mb,
                         limits.max_processes, limits.max_file_size_mb,
                         limits.max_open_files,
                         limits.memory_mb + JS_ADDRESS_SPACE_OVERHEAD_MB)
    return (f"{started}; {js_limits}; "
            f"exec {tc.node} --max-old-space-size={limits.memory_mb} "
            f"--v8-pool-size=1 {main} 0<{stdin}")
  compile_limits = _ulimits(
      limits.compile_cpu_time_s, limits.compile_memory_mb,
      max(limits.max_processes, 16), max(limits.max_file_size_mb, 256),
      max(limits.max_open_files, 256))
  flags = " ".join(cpp_flags)
  marker = "".join(f"\\{b:03o}" for b in COMPILED_MARK)
  return (f"{started}; "
          f"( {compile_limits}; exec {tc.gxx} {flags} -o .kimi_prog {main} "
          f"{OOM_HOOK_DIR}/{OOM_HOOK_OBJECT} ) "
          f">&0 2>&0 </dev/null || exit 1; printf '{marker}' >&0; "
          f"{run_limits}; exec ./.kimi_prog 0<{stdin}")
