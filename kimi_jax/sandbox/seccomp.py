"""A seccomp-BPF filter for sandboxed programs, built here (no libseccomp).

bubblewrap installs it (`--seccomp FD`, the raw `struct sock_filter` array)
just before it executes the sandbox's driver, so it covers every program and
child in the sandbox. It denies kernel interfaces a judged program never
needs and that widen the kernel attack surface or escape the limits:
io_uring, bpf, perf events, userfaultfd, the key store, ptrace and
cross-process memory access, mounts and namespaces, kernel modules and
kexec, SysV shared memory, message queues and memfds (their memory belongs
to no process, so neither an rlimit nor the RSS watchdog would see it), and
a few privileged calls.
Denied calls fail with EPERM; `clone3` fails with ENOSYS so the C library
falls back to `clone`, whose namespace flags are then checked (clone3 passes
its flags in memory, out of a filter's reach). A call from another
architecture's ABI (i386 `int 0x80`, x32) kills the process.
"""

from __future__ import annotations

import errno
import platform
import struct

# struct seccomp_data offsets.
_NR = 0
_ARCH = 4
_ARG0_LOW = 16  # args[0], low 32 bits (little-endian)

# Classic BPF opcodes.
_LD_W_ABS = 0x20
_JEQ_K = 0x15
_JGE_K = 0x35
_JSET_K = 0x45
_RET_K = 0x06

_RET_ALLOW = 0x7FFF0000
_RET_ERRNO = 0x00050000
_RET_KILL_PROCESS = 0x80000000

_AUDIT_ARCH = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
_X32_BIT = 0x40000000

# Namespace flags of clone(); CLONE_NEWTIME (0x80) shares its bit with the
# exit signal in clone()'s flags, so it is left out (unshare is denied).
CLONE_NEW_FLAGS = (0x00020000 | 0x02000000 | 0x04000000 | 0x08000000 |
                   0x10000000 | 0x20000000 | 0x40000000)

# name -> (x86_64, aarch64) syscall numbers.
DENIED_SYSCALLS = {
    "io_uring_setup": (425, 425), "io_uring_enter": (426, 426),
    "io_uring_register": (427, 427),
    "bpf": (321, 280), "perf_event_open": (298, 241),
    "userfaultfd": (323, 282),
    "keyctl": (250, 219), "add_key": (248, 217), "request_key": (249, 218),
    "ptrace": (101, 117), "process_vm_readv": (310, 270),
    "process_vm_writev": (311, 271), "pidfd_getfd": (438, 438),
    "mount": (165, 40), "umount2": (166, 39), "pivot_root": (155, 41),
    "chroot": (161, 51), "open_tree": (428, 428), "move_mount": (429, 429),
    "fsopen": (430, 430), "fsconfig": (431, 431), "fsmount": (432, 432),
    "fspick": (433, 433), "mount_setattr": (442, 442),
    "unshare": (272, 97), "setns": (308, 268),
    "init_module": (175, 105), "finit_module": (313, 273),
    "delete_module": (176, 106), "kexec_load": (246, 104),
    "kexec_file_load": (320, 294),
    "shmget": (29, 194), "msgget": (68, 186),
    "memfd_create": (319, 279), "memfd_secret": (447, 447),
    "swapon": (167, 224), "swapoff": (168, 225), "reboot": (169, 142),
    "acct": (163, 89), "quotactl": (179, 60), "syslog": (103, 116),
    "name_to_handle_at": (303, 264), "open_by_handle_at": (304, 265),
    "fanotify_init": (300, 262), "lookup_dcookie": (212, 18),
    "vhangup": (153, 58),
}
_CLONE = (56, 220)
_CLONE3 = (435, 435)


def _insn(code: int, jt: int, jf: int, k: int) -> bytes:
  return struct.pack("=HBBI", code, jt, jf, k)


def host_arch() -> str:
  arch = platform.machine()
  if arch not in _AUDIT_ARCH:
    raise RuntimeError(f"no seccomp syscall table for architecture {arch!r}")
  return arch


def build_filter(arch: str | None = None) -> bytes:
  """The filter program for `arch` (default: this host's) as raw bytes."""
  arch = arch or host_arch()
  col = 0 if arch == "x86_64" else 1
  denied = sorted({nums[col] for nums in DENIED_SYSCALLS.values()})
  # (opcode, k, jump-if-true label, jump-if-false label)
  body: list[tuple[int, int, str | None, str | None]] = [
      (_LD_W_ABS, _ARCH, None, None),
      (_JEQ_K, _AUDIT_ARCH[arch], None, "kill"),
      (_LD_W_ABS, _NR, None, None),
  ]
  if arch == "x86_64":
    body.append((_JGE_K, _X32_BIT, "kill", None))
  body += [(_JEQ_K, nr, "eperm", None) for nr in denied]
  body += [(_JEQ_K, _CLONE3[col], "enosys", None),
           (_JEQ_K, _CLONE[col], "clone", None),
           (_RET_K, _RET_ALLOW, None, None)]
  labels = {"clone": len(body)}
  body += [(_LD_W_ABS, _ARG0_LOW, None, None),
           (_JSET_K, CLONE_NEW_FLAGS, "eperm", None),
           (_RET_K, _RET_ALLOW, None, None)]
  labels.update(eperm=len(body), enosys=len(body) + 1, kill=len(body) + 2)
  body += [(_RET_K, _RET_ERRNO | errno.EPERM, None, None),
           (_RET_K, _RET_ERRNO | errno.ENOSYS, None, None),
           (_RET_K, _RET_KILL_PROCESS, None, None)]
  prog = []
  for i, (code, k, if_true, if_false) in enumerate(body):
    jt = labels[if_true] - i - 1 if if_true else 0
    jf = labels[if_false] - i - 1 if if_false else 0
    if not (0 <= jt <= 255 and 0 <= jf <= 255):
      raise AssertionError("seccomp filter jump out of range")
    prog.append(_insn(code, jt, jf, k))
  return b"".join(prog)
