"""How one tool call's process is kept apart from the trainer: Linux namespaces, or a plain limited process.

Two levels (`rollout.multi_turn.sandbox`; docs/config.md has the guarantees in a table):

- `namespaces`: the call's process enters new user (when the trainer is not root), mount, PID, IPC, UTS and
  network namespaces (the network one unless the tool's config says `network: true`), as the tools bubblewrap
  and `unshare(1)` would set them up, but in the worker's forked child, so a tool already imported by its worker
  is not imported again for each call. Inside:
  - it is PID 1 of a PID namespace of its own: it sees no other process, and when it ends (or is killed) the
    kernel kills everything it started, `setsid()` or not;
  - its filesystem is a new root: read-only binds of the system directories (/usr, /bin, /lib...), Python's
    prefixes and site-packages and portagrpo's own packages, a private /dev (null, zero, full, random,
    urandom) and /proc, a few /etc files (no passwd of the host, no shadow), and a writable /tmp (a tmpfs of at
    most the call's memory limit, gone with the call) as its home and working directory. The run directory,
    the home directory, the trainer's config and every other file are not there;
  - it runs as uid/gid 65534 with no capabilities and `no_new_privs`, so a set-uid program cannot raise it, and a
    seccomp filter refuses it new user namespaces (which would hand it a capability set of its own);
  - with no network namespace of the host, a socket reaches nothing (not even 127.0.0.1).
- `process`: a process of its own (its own session, a cleared environment, the same limits) that shares the
  trainer's filesystem and process table; the network is dropped where an unprivileged network namespace is
  allowed. A root trainer's call runs as uid 65534 without capabilities or new user namespaces (so the trainer's
  /proc/<pid>/environ and memory are out of its reach); a non-root trainer's runs as the trainer's own uid.

Everything here runs in the forked child of a tool worker (agent/sandbox.py), never in the trainer.
"""
from __future__ import annotations

import ctypes
import errno
import os
import platform
import resource
import signal
import sys
from dataclasses import dataclass

LEVELS = ("namespaces", "process")
SANDBOX_ID = 65534  # the uid and gid a call runs as (the conventional "nobody")
MAX_TASKS = 64  # processes and threads a call may add (RLIMIT_NPROC over what its uid already runs)
ROOT_TMPFS = "size=16m,nr_inodes=4096,mode=0755"

CLONE_NEWNS, CLONE_NEWUTS, CLONE_NEWIPC = 0x00020000, 0x04000000, 0x08000000
CLONE_NEWUSER, CLONE_NEWPID, CLONE_NEWNET = 0x10000000, 0x20000000, 0x40000000
MS_RDONLY, MS_NOSUID, MS_NODEV, MS_NOEXEC = 1, 2, 4, 8
MS_REMOUNT, MS_BIND, MS_REC, MS_PRIVATE = 32, 4096, 16384, 1 << 18
MS_NOATIME, MS_NODIRATIME, MS_RELATIME = 1024, 2048, 1 << 21
MNT_DETACH = 2
PR_SET_NO_NEW_PRIVS, PR_CAPBSET_DROP = 38, 24
CAP_VERSION_3 = 0x20080522
PIVOT_ROOT = {"x86_64": 155, "aarch64": 41, "ppc64le": 203, "s390x": 217, "riscv64": 41}  # syscall numbers
DEVICES = ("null", "zero", "full", "random", "urandom")
ETC_FILES = ("/etc/ld.so.cache", "/etc/localtime", "/etc/ssl/certs", "/etc/ca-certificates")
SYSTEM_DIRS = ("/usr", "/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")


class SetupError(Exception):
    """The namespaces could not be entered (the reason, for the run's start line or the call's error)."""


@dataclass(frozen=True)
class Isolation:
    level: str  # "namespaces" or "process"
    reason: str = ""  # with "process" chosen by auto: why namespaces were refused here

    def describe(self) -> str:
        """The run's one line about its tool sandbox."""
        if self.level == "namespaces":
            return ("tool sandbox: namespaces (each call in its own PID, mount, network, IPC and UTS namespaces, as "
                    f"uid {SANDBOX_ID} without capabilities, with a read-only system and Python and a private /tmp; "
                    "no network unless a tool's config says network: true).")
        why = f" Namespaces are refused here: {self.reason}." if self.reason else ""
        user = (f"as uid {SANDBOX_ID}" if os.geteuid() == 0
                else "as the trainer's own user, which can read the trainer's environment")
        return ("tool sandbox: process (each call in its own process with time, memory and output limits and a "
                f"cleared environment, {user}, sharing the trainer's files and process table).{why}")


# ---------------------------------------------------------------- small system calls

_LIBC = None


def libc():
    global _LIBC
    if _LIBC is None:
        _LIBC = ctypes.CDLL(None, use_errno=True)
        _LIBC.mount.argtypes = [ctypes.c_char_p, ctypes.c_char_p, ctypes.c_char_p, ctypes.c_ulong, ctypes.c_char_p]
        _LIBC.umount2.argtypes = [ctypes.c_char_p, ctypes.c_int]
    return _LIBC


def _check(result: int, what: str) -> None:
    if result != 0:
        err = ctypes.get_errno()
        raise SetupError(f"{what}: {os.strerror(err)} ({errno.errorcode.get(err, err)})")


def _mount(source: str | None, target: str, fstype: str | None, flags: int, data: str | None = None) -> None:
    def enc(text: str | None) -> bytes | None:
        return None if text is None else text.encode()

    _check(libc().mount(enc(source), enc(target), enc(fstype), flags, enc(data)), f"mount {target}")


def _write(path: str, text: str) -> None:
    with open(path, "w") as f:
        f.write(text)


def unshare(flags: int) -> None:
    _check(libc().unshare(flags), "unshare")


def drop_network() -> bool:
    """A network namespace of this process's own (a down loopback only); False where refused (`process`). A root
    process never takes the user-namespace way: with no uid map it would read its uid as 65534 while the kernel
    still counts it as root, so the call would skip leaving root (the sandbox review of issue 49)."""
    ways = (CLONE_NEWNET,) if os.geteuid() == 0 else (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET)
    return any(libc().unshare(flags) == 0 for flags in ways)


# ---------------------------------------------------------------- what the new root shows

def _python_paths() -> list[str]:
    """Python's prefixes, its site-packages and the folders of portagrpo's own packages (an editable install keeps
    them in the source tree): the code a tool may import lazily."""
    import portagrpo

    paths = {sys.prefix, sys.base_prefix, sys.exec_prefix, sys.base_exec_prefix}
    paths |= {p for p in sys.path if p and ("site-packages" in p or "dist-packages" in p)}
    paths |= set(portagrpo.__path__)
    for name in ("portagrpo.backends", "portagrpo.kernels"):
        module = sys.modules.get(name)
        paths |= set(getattr(module, "__path__", []) or [])
    return [p for p in paths if os.path.isdir(p)]


def visible_paths() -> list[str]:
    """Absolute paths bound read-only into the new root, none inside another."""
    paths = sorted({os.path.abspath(p) for p in [*_python_paths(), *ETC_FILES] if os.path.exists(p)})
    kept: list[str] = []
    for path in paths:
        if not any(path == k or path.startswith(k + "/") for k in [*SYSTEM_DIRS, *kept]):
            kept.append(path)
    return kept


def _mount_flags(path: str) -> int:
    """The flags a read-only bind of `path` must keep (a user namespace may not drop its source's)."""
    f = os.statvfs(path).f_flag
    keep = [(os.ST_NOSUID, MS_NOSUID), (os.ST_NODEV, MS_NODEV), (os.ST_NOEXEC, MS_NOEXEC),
            (os.ST_NOATIME, MS_NOATIME), (os.ST_NODIRATIME, MS_NODIRATIME), (getattr(os, "ST_RELATIME", 4096),
                                                                              MS_RELATIME)]
    return sum(ms for st, ms in keep if f & st)


def _bind(fd: int, is_dir: bool, target: str, read_only: bool = True) -> None:
    if is_dir:
        os.makedirs(target, exist_ok=True)
    else:
        os.makedirs(os.path.dirname(target), exist_ok=True)
        open(target, "a").close()
    _mount(f"/proc/self/fd/{fd}", target, None, MS_BIND | MS_REC)
    if read_only:
        flags = MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | _mount_flags(target)
        _mount(None, target, None, flags)


def _build_root(stage: str, memory_mb: int) -> None:
    """The new root in a tmpfs at `stage` (this process is in its own mount and PID namespaces). The call's private
    /tmp is mounted before the binds, so a bound path under /tmp (a virtual environment there) shows inside it."""
    sources: list[tuple[str, int, bool]] = []  # opened (and looked at) before the tmpfs may cover them
    for path in [*SYSTEM_DIRS, *visible_paths(), *(f"/dev/{d}" for d in DEVICES)]:
        if os.path.exists(path) and not (path in SYSTEM_DIRS and os.path.islink(path)):
            sources.append((path, os.open(path, os.O_PATH | os.O_CLOEXEC), os.path.isdir(path)))
    _mount("tmpfs", stage, "tmpfs", MS_NOSUID | MS_NODEV, ROOT_TMPFS)
    for sub in ("tmp", "dev/shm", "proc", "etc"):
        os.makedirs(f"{stage}/{sub}", exist_ok=True)
    _mount("tmpfs", f"{stage}/tmp", "tmpfs", MS_NOSUID | MS_NODEV, f"size={memory_mb}m,nr_inodes=16384,mode=1777")
    for path in SYSTEM_DIRS:
        if os.path.islink(path):
            os.symlink(os.readlink(path), stage + path)
    for path, fd, is_dir in sources:
        _bind(fd, is_dir, stage + path, read_only=not path.startswith("/dev/"))
        os.close(fd)
    _mount("tmpfs", f"{stage}/dev/shm", "tmpfs", MS_NOSUID | MS_NODEV | MS_NOEXEC, "size=64m,mode=1777")
    for name, target in (("fd", "/proc/self/fd"), ("stdin", "/proc/self/fd/0"), ("stdout", "/proc/self/fd/1"),
                         ("stderr", "/proc/self/fd/2")):
        os.symlink(target, f"{stage}/dev/{name}")
    _write(f"{stage}/etc/passwd", f"sandbox:x:{SANDBOX_ID}:{SANDBOX_ID}:tool call:/tmp:/usr/sbin/nologin\n")
    _write(f"{stage}/etc/group", f"sandbox:x:{SANDBOX_ID}:\n")
    try:  # a /proc of the call's own PID namespace; a host that masks parts of its /proc may refuse it
        _mount("proc", f"{stage}/proc", "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC)
    except SetupError:
        pass


def _pivot(stage: str) -> None:
    os.makedirs(f"{stage}/.old", exist_ok=True)
    number = PIVOT_ROOT.get(platform.machine())
    if number is not None and libc().syscall(number, stage.encode(), f"{stage}/.old".encode()) == 0:
        os.chdir("/")
        _check(libc().umount2(b"/.old", MNT_DETACH), "umount the old root")
        os.rmdir("/.old")
    else:  # switch_root's way: move the new root over / and chroot into it
        os.chdir(stage)
        _mount(stage, "/", None, 1 << 13)  # MS_MOVE
        os.chroot(".")
        os.chdir("/")
        os.rmdir("/.old")
    _mount(None, "/", None, MS_REMOUNT | MS_BIND | MS_RDONLY | MS_NOSUID | MS_NODEV)


# ---------------------------------------------------------------- privileges and limits

def drop_privileges(as_root: bool, userns_required: bool = True) -> None:
    """Leave root (a root trainer's call becomes SANDBOX_ID), set `no_new_privs`, empty every capability set, and
    refuse new user namespaces (which would give the call a full capability set of its own: a `chroot`, mounts),
    as bubblewrap's `--disable-userns` does. Where that refusal cannot be installed, SetupError if
    `userns_required` (the `namespaces` level promises it), else the call goes on without it."""
    if as_root:
        os.setgroups([])
        os.setresgid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)
        os.setresuid(SANDBOX_ID, SANDBOX_ID, SANDBOX_ID)  # leaving uid 0 clears every capability
    _check(libc().prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0), "prctl(no_new_privs)")
    for cap in range(64):  # the bounding set (refused past the last capability, and where already dropped)
        libc().prctl(PR_CAPBSET_DROP, cap, 0, 0, 0)
    header = (ctypes.c_uint32 * 2)(CAP_VERSION_3, 0)
    data = (ctypes.c_uint32 * 6)()
    _check(libc().capset(header, data), "capset")
    try:
        refuse_user_namespaces()
    except SetupError:
        if userns_required:
            raise


# The seccomp filter that refuses new user namespaces. Per architecture: its AUDIT_ARCH value and the numbers of
# unshare, clone and clone3 (include/uapi/linux/audit.h; arch/x86/entry/syscalls/syscall_64.tbl,
# include/uapi/asm-generic/unistd.h). clone3 passes its flags in memory, which a filter cannot read: it is refused
# with ENOSYS, and the C library falls back to clone (as container runtimes' default profiles do).
SECCOMP_ARCHES = {"x86_64": (0xC000003E, 272, 56, 435), "aarch64": (0xC00000B7, 97, 220, 435)}
X32_SYSCALL_BIT = 0x40000000
PR_SET_SECCOMP, SECCOMP_MODE_FILTER = 22, 2
SECCOMP_RET_ALLOW, SECCOMP_RET_ERRNO = 0x7FFF0000, 0x00050000
BPF_LD_W_ABS, BPF_JEQ, BPF_JGE, BPF_JSET, BPF_RET = 0x20, 0x15, 0x35, 0x45, 0x06


class _SockFilter(ctypes.Structure):
    _fields_ = [("code", ctypes.c_uint16), ("jt", ctypes.c_uint8), ("jf", ctypes.c_uint8), ("k", ctypes.c_uint32)]


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_uint16), ("filter", ctypes.POINTER(_SockFilter))]


def user_namespace_filter(machine: str) -> list[tuple[int, int, int, int]]:
    """The BPF program (code, jt, jf, k rows) over `struct seccomp_data` (nr at offset 0, arch at 4, the first
    argument's low word at 16 on these little-endian machines): unshare or clone with CLONE_NEWUSER is EPERM,
    clone3 ENOSYS, a foreign architecture's (or x32's) every call EPERM; all else allowed."""
    if machine not in SECCOMP_ARCHES:
        raise SetupError(f"new user namespaces cannot be refused on {machine} (a seccomp filter is written for "
                         f"{', '.join(SECCOMP_ARCHES)})")
    arch, unshare_nr, clone_nr, clone3_nr = SECCOMP_ARCHES[machine]
    eperm, enosys = SECCOMP_RET_ERRNO | errno.EPERM, SECCOMP_RET_ERRNO | errno.ENOSYS
    return [
        (BPF_LD_W_ABS, 0, 0, 4),                 # 0: arch
        (BPF_JEQ, 1, 0, arch),                   # 1: native -> 3
        (BPF_RET, 0, 0, eperm),                  # 2
        (BPF_LD_W_ABS, 0, 0, 0),                 # 3: nr
        (BPF_JGE, 8, 0, X32_SYSCALL_BIT),        # 4: x32 -> 13
        (BPF_JEQ, 4, 0, unshare_nr),             # 5: -> 10
        (BPF_JEQ, 3, 0, clone_nr),               # 6: -> 10
        (BPF_JEQ, 1, 0, clone3_nr),              # 7: -> 9
        (BPF_RET, 0, 0, SECCOMP_RET_ALLOW),      # 8
        (BPF_RET, 0, 0, enosys),                 # 9
        (BPF_LD_W_ABS, 0, 0, 16),                # 10: flags (the first argument's low word)
        (BPF_JSET, 1, 0, CLONE_NEWUSER),         # 11: CLONE_NEWUSER -> 13, else 12
        (BPF_RET, 0, 0, SECCOMP_RET_ALLOW),      # 12
        (BPF_RET, 0, 0, eperm),                  # 13
    ]


def refuse_user_namespaces() -> None:
    """Install the filter above in this process (inherited by all it starts; `no_new_privs` must be set)."""
    rows = user_namespace_filter(platform.machine())
    program = (_SockFilter * len(rows))(*(_SockFilter(*row) for row in rows))
    fprog = _SockFprog(len(rows), program)
    _check(libc().prctl(PR_SET_SECCOMP, SECCOMP_MODE_FILTER, ctypes.byref(fprog), 0, 0), "seccomp")


def _tasks_of(uid: int) -> int:
    """Processes and threads that `uid` runs now (what RLIMIT_NPROC counts)."""
    count = 0
    for pid in os.listdir("/proc"):
        if not pid.isdigit():
            continue
        try:
            with open(f"/proc/{pid}/status") as f:
                fields = dict(line.split(":", 1) for line in f if ":" in line)
            if int(fields["Uid"].split()[0]) == uid:
                count += int(fields["Threads"])
        except (OSError, KeyError, ValueError):
            continue
    return count


def task_limit(as_root: bool) -> int:
    """RLIMIT_NPROC for a call. A root trainer's calls run as SANDBOX_ID; otherwise the limit is counted in the
    call's user namespace (Linux 5.14 on), or by the trainer's uid on older kernels."""
    if as_root:
        return _tasks_of(SANDBOX_ID) + MAX_TASKS
    major, minor = (int(x) for x in platform.release().split(".")[:2])
    return MAX_TASKS if (major, minor) >= (5, 14) else _tasks_of(os.getuid()) + MAX_TASKS


def set_limits(cpu_s: int, address_space: int, tasks: int) -> None:
    resource.setrlimit(resource.RLIMIT_CPU, (cpu_s, cpu_s + 1))
    resource.setrlimit(resource.RLIMIT_AS, (address_space, address_space))
    resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
    if tasks > 0:
        resource.setrlimit(resource.RLIMIT_NPROC, (tasks, tasks))


# ---------------------------------------------------------------- entering the namespaces

def enter_namespaces(network: bool, memory_mb: int) -> int:
    """Called in a call's forked process: unshares, then forks the process that is PID 1 of the new PID namespace
    and returns in it (after the new root and the uid switch), with the task limit for its RLIMIT_NPROC. The
    process that called it never returns: it waits for that PID 1 and ends the same way it ended."""
    as_root = os.geteuid() == 0
    uid, gid = os.getuid(), os.getgid()
    tasks = task_limit(as_root)
    flags = CLONE_NEWNS | CLONE_NEWPID | CLONE_NEWIPC | CLONE_NEWUTS | (0 if network else CLONE_NEWNET)
    unshare(flags | (0 if as_root else CLONE_NEWUSER))
    if not as_root:
        _write("/proc/self/setgroups", "deny")
        _write("/proc/self/uid_map", f"{SANDBOX_ID} {uid} 1")
        _write("/proc/self/gid_map", f"{SANDBOX_ID} {gid} 1")
    _mount(None, "/", None, MS_REC | MS_PRIVATE)
    pid = os.fork()
    if pid != 0:
        _follow(pid)
    stage = "/tmp" if os.path.isdir("/tmp") else "/mnt"
    _build_root(stage, memory_mb)
    _pivot(stage)
    drop_privileges(as_root)
    from portagrpo.procs import set_parent_death_signal

    set_parent_death_signal()  # after the uid switch, which clears it: the call dies with its first process
    os.chdir("/tmp")
    return tasks


def _follow(pid: int) -> None:
    """The first process: wait for the namespace's PID 1 and end as it ended (never returns)."""
    while True:
        try:
            _, status = os.waitpid(pid, 0)
            break
        except InterruptedError:
            continue
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        signal.signal(sig, signal.SIG_DFL)
        resource.setrlimit(resource.RLIMIT_CORE, (0, 0))
        os.kill(os.getpid(), sig)
    os._exit(os.WEXITSTATUS(status) if os.WIFEXITED(status) else 1)


def probe(memory_mb: int = 64) -> Isolation:
    """Whether a call can enter the namespaces here: a forked child enters them fully and ends; `process` with
    the reason where it cannot."""
    read_fd, write_fd = os.pipe()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        code = 1
        try:
            os.setsid()
            enter_namespaces(network=False, memory_mb=memory_mb)
            code = 0 if not os.path.exists("/etc/shadow") and os.getuid() == SANDBOX_ID else 1
            if code:
                os.write(write_fd, b"the new root still showed the host's files")
        except BaseException as err:  # noqa: BLE001 - the reason, told once at the run's start
            os.write(write_fd, str(err).encode(errors="replace")[:500])
        os._exit(code)
    os.close(write_fd)
    with os.fdopen(read_fd, "rb") as f:
        reason = f.read().decode(errors="replace").strip()
    _, status = os.waitpid(pid, 0)
    if os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0:
        return Isolation("namespaces")
    return Isolation("process", reason or f"the namespace test process ended with status {status}")
