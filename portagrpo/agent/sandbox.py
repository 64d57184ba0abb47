"""The tool sandbox: every tool call runs in a process of its own, isolated and limited, that holds nothing but its
own job.

Three kinds of process, and what crosses between them:
- a *worker* (one per `rollout.multi_turn.tool_workers`) is a process of its own (`python -c`, dying with the
  trainer), started with PATH, LANG, HOME and LD_LIBRARY_PATH as its whole environment. It imports the tools once and
  is then the clean template every call is forked from: it never receives a job. Per call it is handed a header (the
  call's index and whether its tool keeps the network) and, as a descriptor, the read end of a pipe that the trainer
  has already filled with the job (the tool's name, its arguments and only the context keys the tool's signature
  names). It forks a *keeper* for the call and goes back to waiting;
- the keeper forks the *call*, reads the call's output up to a byte cap, kills the call at the wall-clock limit, at
  the cap and after it (its process group, and then every process the call left behind: the keeper is their
  subreaper, so a `setsid()` grandchild dies with the call too), and sends the result to the trainer;
- the call closes every descriptor but its job pipe, its output and its status pipe before anything else, reads its
  job, and is isolated at the run's level (agent/isolation.py): `namespaces` (its own PID, mount, network, IPC and,
  for a non-root trainer, user namespaces; a read-only system, a private /tmp, uid 65534, no new user namespaces) or
  `process` (its own process and a fresh temporary directory, sharing the trainer's files; uid 65534 where the
  trainer is root). It gets an environment of PATH, LANG, HOME and TMPDIR only, a CPU-time limit (RLIMIT_CPU), a
  memory limit (RLIMIT_AS, on top of what the worker already maps) and a process limit (RLIMIT_NPROC).

So a call's memory is the template's plus its own job, never another's, and a call holds no descriptor that leads
back to the worker or the trainer. Every message that crosses from a worker or keeper to the trainer is
length-framed JSON (agent/wire.py), never a pickle; one that does not parse is a failed call, and the worker that
sent it is replaced. The call reports how it ended on a status pipe of its own, so a tool's own exit code is never
read as one of the sandbox's outcomes.

Whatever goes wrong (a hang, a crash, an exception, too much output, too much memory, a fork storm) becomes a
`ToolResult` with an `error` kind and a message for the model; the run goes on.
"""
from __future__ import annotations

import fcntl
import inspect
import json
import math
import os
import resource
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import asdict, dataclass
from multiprocessing.connection import wait
from typing import Any

from portagrpo.agent import wire
from portagrpo.agent.isolation import (
    LEVELS,
    SANDBOX_ID,
    Isolation,
    SetupError,
    drop_network,
    drop_privileges,
    enter_namespaces,
    libc,
    set_limits,
    task_limit,
)
from portagrpo.errors import UserError
from portagrpo.procs import remove_orphaned_dirs, sigint_ignored

PR_SET_CHILD_SUBREAPER = 36
STATUS_OK, STATUS_EXCEPTION, STATUS_MEMORY, STATUS_SETUP = b"ok", b"exception", b"memory", b"setup"
READ_TIMEOUT_S = 30.0  # a message that has started must arrive whole within this
GRACE_S = 5.0  # the trainer's own deadline past the worker's, for a worker that stops answering
IMPORT_FLOOR_S = 60.0  # a tool's import may take this long (or the call timeout, if longer) before it is an error
NOTICE_AFTER_S = 10.0  # a slow import is told once after this long, so a run is never silent while it waits
TRUNCATED = "[output truncated]"
TEMP_PREFIX = "portagrpo-tool-"  # + the keeper's pid: a `process`-level call's directory
SETTING = "rollout.multi_turn.sandbox"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock; the CPU-time limit is the same number of seconds, rounded up
    memory_mb: int = 1024  # address space the call may add to the worker's (and the size of its /tmp)
    max_output_bytes: int = 16384  # stdout and stderr together; more is cut and the call counted as an error


@dataclass(frozen=True)
class ToolResult:
    text: str  # what the model is told
    error: str | None = None  # None, or: parse, unknown_tool, arguments, exception, timeout, memory, output, crash
    network_isolated: bool | None = None  # None: the call never reached a process


@dataclass(frozen=True)
class ToolJob:
    name: str
    target: str
    arguments: dict
    context: dict  # what a tool may ask for by name (ground_truth)
    network: bool = False


# ---------------------------------------------------------------- in the call's process

MAX_JOB_BYTES = 1 << 20  # a call's job (its arguments and context) must fit one pipe: the trainer writes it whole


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def keep_only(fds: tuple[int, ...]) -> None:
    """Close every descriptor of this process but `fds` (a call must hold nothing that leads back out)."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    top = min(max(soft, hard if hard != resource.RLIM_INFINITY else soft), 1 << 20)  # close_range(2) where it exists
    low = 0
    for fd in sorted(set(fds)):
        if fd > low:
            os.closerange(low, fd)
        low = fd + 1
    os.closerange(low, max(top, low))


def _above_stdio(fd: int) -> int:
    """`fd`, or a copy of it above 2 where the worker started without a standard stream (so dup2 onto 0-2 cannot
    clobber it)."""
    return fd if fd > 2 else fcntl.fcntl(fd, fcntl.F_DUPFD, 3)


def _read_job(fd: int) -> dict:
    chunks, size = [], 0
    while True:
        data = os.read(fd, 65536)
        if not data:
            break
        size += len(data)
        if size > MAX_JOB_BYTES:
            raise ValueError("the call's job is over its size limit")
        chunks.append(data)
    job = json.loads(b"".join(chunks).decode())
    if not (isinstance(job, dict) and isinstance(job.get("name"), str) and isinstance(job.get("arguments"), dict)
            and isinstance(job.get("context"), dict)):
        raise ValueError("the call's job is not a job")
    return job


def _isolate(network: bool, limits: Limits, level: str, workdir: str | None) -> tuple[str, int]:
    """Enter the call's isolation: (its home directory, its RLIMIT_NPROC, 0 for none)."""
    if level == "namespaces":
        return "/tmp", enter_namespaces(network, limits.memory_mb)
    as_root = os.geteuid() == 0  # read before anything may change what geteuid() answers
    keeper = os.getppid()
    os.chdir(workdir)
    if not network:
        drop_network()
    drop_privileges(as_root, userns_required=False)
    from portagrpo.procs import set_parent_death_signal

    set_parent_death_signal()  # after the uid switch, which clears it: the call dies with its keeper
    if os.getppid() != keeper:
        os._exit(1)  # the keeper went in between
    # a root trainer's calls run as SANDBOX_ID, whose processes can be counted; a trainer's own uid may run many
    # threads: no count that would not break its own forks
    return workdir, task_limit(True) if as_root else 0


def _child(functions: dict, job_fd: int, network: bool, limits: Limits, level: str, workdir: str | None,
           out_fd: int, status_fd: int) -> None:
    """The forked call: never returns."""
    status = STATUS_EXCEPTION
    try:
        from portagrpo.agent.tools import call_tool
        from portagrpo.procs import set_parent_death_signal

        job_fd, out_fd, status_fd = (_above_stdio(fd) for fd in (job_fd, out_fd, status_fd))
        keep_only((0, 1, 2, job_fd, out_fd, status_fd))
        os.setsid()
        set_parent_death_signal()  # a keeper killed mid-call takes the call with it
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        os.close(out_fd)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.close(null)
        job = _read_job(job_fd)
        os.close(job_fd)
        home, tasks = _isolate(network, limits, level, workdir)
        os.environ.clear()
        os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8", HOME=home, TMPDIR=home)
        tempfile.tempdir = None
        cpu = max(1, math.ceil(limits.timeout_s))
        set_limits(cpu, _address_space() + limits.memory_mb * 2**20, tasks)
        text = call_tool(functions[job["name"]], job["arguments"], job["context"])
        sys.stdout.write(text)
        sys.stdout.flush()
        status = STATUS_OK
    except MemoryError:
        status = STATUS_MEMORY
        os.write(2, b"MemoryError: the tool went over its memory limit")
    except SetupError as err:
        status = STATUS_SETUP
        os.write(2, f"the sandbox could not be set up ({err})".encode(errors="replace"))
    except BaseException as err:  # noqa: BLE001 - told to the model, the run goes on
        try:
            os.write(2, f"{type(err).__name__}: {err}".encode(errors="replace")[:4096])
        except BaseException:  # noqa: BLE001 - nothing more can be said
            pass
    try:
        os.write(status_fd, status)
    finally:
        os._exit(0)


# ---------------------------------------------------------------- in the call's keeper

def _read_capped(fd: int, deadline: float, cap: int) -> tuple[bytes, bool, bool]:
    """The child's output up to `cap` bytes: (bytes, over the cap, past the deadline)."""
    chunks, size = [], 0
    while True:
        left = deadline - time.monotonic()
        if left <= 0:
            return b"".join(chunks), False, True
        ready, _, _ = select.select([fd], [], [], left)
        if not ready:
            continue
        data = os.read(fd, 65536)
        if not data:
            return b"".join(chunks), False, False
        chunks.append(data[:max(cap - size, 0)])
        size += len(data)
        if size > cap:
            return b"".join(chunks), True, False


def _kill_group(pgid: int) -> None:
    try:
        os.killpg(pgid, signal.SIGKILL)
    except (ProcessLookupError, PermissionError):
        pass


def _children() -> list[int]:
    """This process's children now (the keeper's: a call's orphans are reparented to it, its subreaper)."""
    pids: list[int] = []
    for tid in os.listdir("/proc/self/task"):
        try:
            with open(f"/proc/self/task/{tid}/children") as f:
                pids += [int(p) for p in f.read().split()]
        except OSError:
            continue
    return pids


def _reap_all() -> None:
    """Kill and collect every process a call left behind: a process that left the call's group (setsid) is
    reparented to the keeper when its parent dies, and killed here; so, round by round, are its own children.
    Under `namespaces` the first round ends it all: killing a PID namespace's first process ends the namespace."""
    for _ in range(200):
        while True:  # collect what has ended
            try:
                pid, _ = os.waitpid(-1, os.WNOHANG)
            except ChildProcessError:
                return
            if pid == 0:
                break
        alive = _children()
        if not alive:
            return
        for pid in alive:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        time.sleep(0.005)


def _status(fd: int) -> bytes:
    fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)
    try:
        return os.read(fd, 64)
    except BlockingIOError:
        return b""


def _call_dir(level: str) -> str | None:
    """A `process`-level call's home: a fresh directory under the trainer's temp dir, the call's own where it runs
    as SANDBOX_ID."""
    if level != "process":
        return None
    workdir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-")
    if os.geteuid() == 0:
        os.chown(workdir, SANDBOX_ID, SANDBOX_ID)
    return workdir


def run_call(functions: dict, job_fd: int, network: bool, limits: Limits, isolation: Isolation,
             network_isolated: bool | None) -> ToolResult:
    """One call in a forked, isolated, limited child that reads its job from `job_fd` (in a keeper, which never
    reads it; tests call this directly)."""
    level = isolation.level
    workdir = _call_dir(level)
    read_fd, write_fd = os.pipe()
    status_read, status_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        _child(functions, job_fd, network, limits, level, workdir, write_fd, status_write)
    os.close(job_fd)
    os.close(write_fd)
    os.close(status_write)
    try:
        out, over, late = _read_capped(read_fd, time.monotonic() + limits.timeout_s, limits.max_output_bytes)
    finally:
        _kill_group(pid)  # the call and all it forked; its pgid lives while the child is unreaped
        try:
            os.kill(pid, signal.SIGKILL)  # the child itself, should it not have reached setsid
        except ProcessLookupError:
            pass
        _, wait_status = os.waitpid(pid, 0)
        os.close(read_fd)
        _reap_all()
        status = _status(status_read)
        os.close(status_read)
        if workdir is not None:
            shutil.rmtree(workdir, ignore_errors=True)
    if network:
        isolated = None
    else:
        isolated = True if level == "namespaces" else network_isolated
    text = out.decode(errors="replace")
    return ToolResult(*_outcome(text, wait_status, status, over, late, limits), network_isolated=isolated)


def _outcome(text: str, wait_status: int, status: bytes, over: bool, late: bool,
             limits: Limits) -> tuple[str, str | None]:
    if over:
        return f"{text}\n{TRUNCATED}", "output"
    if late:
        return f"Error: the tool ran past its {limits.timeout_s:g}s limit and was stopped.", "timeout"
    if os.WIFSIGNALED(wait_status):
        sig = os.WTERMSIG(wait_status)
        if sig == signal.SIGXCPU:
            return (f"Error: the tool used its {math.ceil(limits.timeout_s)}s CPU-time limit and was stopped.",
                    "timeout")
        return f"Error: the tool's process died ({signal.Signals(sig).name}).", "crash"
    if status == STATUS_OK:
        return text, None
    if status == STATUS_MEMORY:
        return f"Error: the tool went over its {limits.memory_mb} MB memory limit.", "memory"
    if status == STATUS_EXCEPTION:
        return f"Error: {text.strip()[-2000:]}", "exception"
    if status == STATUS_SETUP:
        return f"Error: {text.strip()[-500:]}", "crash"
    code = os.WEXITSTATUS(wait_status)
    return f"Error: the tool's process exited with code {code}. {text.strip()[-500:]}".strip(), "crash"


def network_isolation_works() -> bool:
    """Whether a forked child can drop its network here (asked once per `process`-level worker)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if drop_network() else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


def remove_stale_dirs() -> int:
    """`process`-level call directories whose keeper is gone (killed with -9, say): removed at the next start.
    Returns how many."""
    return remove_orphaned_dirs(TEMP_PREFIX)


# ---------------------------------------------------------------- the worker: the template every call is forked from

WORKER_ENV_KEEP = ("PATH", "LANG", "HOME", "LD_LIBRARY_PATH")  # what a worker is started with, and nothing else


def context_names(fn) -> list[str]:
    """The parameters a tool names, so that a call is sent only the context keys it asks for (`ground_truth`)."""
    try:
        return list(inspect.signature(fn).parameters)
    except (TypeError, ValueError):
        return []


def _keeper(sock: socket.socket, functions: dict, header: dict, job_fd: int, limits: Limits, isolation: Isolation,
            network_isolated: bool | None) -> None:
    """A call's keeper (forked from the worker, never returns): runs the call and sends its result."""
    code = 1
    try:
        from portagrpo.procs import set_parent_death_signal

        signal.signal(signal.SIGCHLD, signal.SIG_DFL)  # the worker ignores it; the keeper waits for its call
        set_parent_death_signal()  # a worker killed (at the trainer's deadline) takes the keeper with it
        libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
        try:
            result = run_call(functions, job_fd, bool(header["network"]), limits, isolation, network_isolated)
        except Exception as err:  # noqa: BLE001 - the sandbox's own failure (no descriptors, no temp dir): one call
            result = ToolResult(f"Error: the sandbox could not run the call ({type(err).__name__}: {err}).", "crash")
        wire.send(sock, {"kind": "result", "index": header["index"], "result": asdict(result)})
        code = 0
    finally:
        os._exit(code)


def _worker_main(sock: socket.socket, start: dict) -> None:
    from portagrpo.procs import exit_with_parent, set_parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    exit_with_parent(int(start["parent_pid"]), "tool worker")
    tempfile.tempdir = start["tempdir"]  # the trainer's ($TMPDIR): where `process`-level calls get their directory
    limits, setting = Limits(**start["limits"]), start["setting"]
    from portagrpo.agent.isolation import probe
    from portagrpo.agent.tools import resolve

    functions = {}
    for name, target in start["targets"].items():
        wire.send(sock, {"kind": "importing", "name": name})
        try:
            functions[name] = resolve(target)
        except Exception as err:  # noqa: BLE001 - reported to the trainer as the reason
            wire.send(sock, {"kind": "init_error", "text": f"{name}: {type(err).__name__}: {err}"})
            return
    isolation = Isolation("process") if setting == "process" else probe(limits.memory_mb)
    network = network_isolation_works() if isolation.level == "process" else True
    signal.signal(signal.SIGCHLD, signal.SIG_IGN)  # keepers are collected by the kernel
    wire.send(sock, {"kind": "ready", "isolation": asdict(isolation),
                     "takes": {name: context_names(fn) for name, fn in functions.items()}})
    while True:
        try:
            message, fds = wire.recv(sock)
        except (EOFError, OSError, wire.WireError):
            return
        header = wire.expect(message, "call", "index", "network")
        if len(fds) != 1:
            return
        if os.fork() == 0:
            _keeper(sock, functions, header, fds[0], limits, isolation, network)
        os.close(fds[0])


def worker_entry(fd: int) -> None:
    """A worker process's start (`python -c`): its settings come over the socket `fd` from the trainer."""
    sock = socket.socket(fileno=fd)
    start, _ = wire.recv(sock)
    _worker_main(sock, wire.expect(start, "start", "targets", "limits", "setting", "parent_pid", "tempdir"))


class _Worker:
    """A worker process, started with a clean environment (PATH, LANG, HOME): a call is forked from it, so it must
    never have held the trainer's secrets, not even in /proc/<pid>/environ, nor any job."""

    def __init__(self, targets: dict[str, str], limits: Limits, setting: str) -> None:
        ours, theirs = socket.socketpair()
        code = (f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; "
                f"from portagrpo.agent.sandbox import worker_entry; worker_entry({theirs.fileno()})")
        env = {k: os.environ[k] for k in WORKER_ENV_KEEP if k in os.environ}
        try:
            with sigint_ignored():
                self.proc = subprocess.Popen([sys.executable, "-P", "-c", code], env=env,
                                             pass_fds=[theirs.fileno()], stdin=subprocess.DEVNULL, close_fds=True)
        except BaseException:
            ours.close()
            raise
        finally:
            theirs.close()
        self.sock = ours
        try:
            wire.send(self.sock, {"kind": "start", "targets": targets, "limits": asdict(limits), "setting": setting,
                                  "parent_pid": os.getpid(), "tempdir": tempfile.gettempdir()})
        except BaseException:
            self.kill()
            raise
        self.ready = False
        self.importing: str | None = None  # the tool this worker is importing, while it starts
        self.task: int | None = None
        self.deadline = math.inf

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def fileno(self) -> int:
        return self.sock.fileno()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.sock.close()


def job_pipe(job: ToolJob, takes: list[str]) -> int:
    """The read end of a pipe that holds the call's job, written whole (the worker passes it on unread): the tool's
    name, its arguments, and only the context keys the tool names. ValueError where it would not fit."""
    context = {k: v for k, v in job.context.items() if k in takes and k not in job.arguments}
    data = json.dumps({"name": job.name, "arguments": job.arguments, "context": context}, default=str).encode()
    read_fd, write_fd = os.pipe2(os.O_CLOEXEC | os.O_NONBLOCK)
    try:
        if len(data) > 65536:
            try:
                fcntl.fcntl(write_fd, fcntl.F_SETPIPE_SZ, min(max(len(data), 65536), MAX_JOB_BYTES))
            except OSError:
                pass
        capacity = fcntl.fcntl(write_fd, fcntl.F_GETPIPE_SZ)
        if len(data) > capacity:
            raise ValueError(f"the call's arguments and context are {len(data)} bytes, over the {capacity}-byte "
                             f"limit of one call")
        if os.write(write_fd, data) != len(data):
            raise ValueError(f"the call's job of {len(data)} bytes did not fit its pipe")
    except BaseException:
        os.close(read_fd)
        raise
    finally:
        os.close(write_fd)
    os.set_blocking(read_fd, True)
    return read_fd


class ToolSandbox:
    """`workers` processes that run tool calls, each call in an isolated, limited process of its own.

    `setting` is `rollout.multi_turn.sandbox`: `namespaces` (refused where the host forbids them), `process`, or
    `auto` (namespaces where allowed; else `process`, refusing the `untrusted` tools, which run model-written
    code). `rank` names this training rank in the sentences that stop a run."""

    def __init__(self, targets: dict[str, str], limits: Limits, workers: int = 2, setting: str = "auto",
                 untrusted: tuple[str, ...] = (), rank: int = 0, field: str = SETTING,
                 source: str = "rollout.multi_turn.tool_config_path") -> None:
        """`field`: the config key `setting` came from, and `source` the one that names the tools, for the sentences
        that stop a run (the code generator's are rollout.code.sandbox and rollout.generator=code)."""
        self.targets, self.limits, self.num_workers = dict(targets), limits, workers
        self.setting, self.untrusted, self.rank = setting, tuple(untrusted), rank
        self.field, self.source = field, source
        self._workers: list[_Worker] = []
        self._deaths_at_start = 0
        self.isolation: Isolation | None = None  # known once a worker is ready
        self.takes: dict[str, list[str]] = {}  # each tool's parameter names, from the first ready worker

    def start(self, import_timeout_s: float | None = None) -> Isolation:
        """Start the workers and wait until each has imported the tools and tried its isolation: a tool that
        cannot be loaded, or does not load in time (`import_timeout_s`, by default the call timeout but at least
        IMPORT_FLOOR_S), and an isolation the setting refuses, are one sentence before the first step. Returns
        the isolation the calls run at."""
        remove_stale_dirs()
        self._fill()
        timeout_s = import_timeout_s or max(IMPORT_FLOOR_S, self.limits.timeout_s)
        started = time.monotonic()
        deadline, told = started + timeout_s, False
        while any(not w.ready for w in self._workers):
            slow = next((w.importing for w in self._workers if w.importing), None)
            if not told and slow and time.monotonic() - started > NOTICE_AFTER_S:
                print(f"portagrpo: rank {self.rank}: the tool {slow!r} is still importing after {NOTICE_AFTER_S:g}s "
                      f"(it has {timeout_s:g}s).", file=sys.stderr, flush=True)
                told = True
            if time.monotonic() >= deadline:
                late = next(w for w in self._workers if not w.ready)
                self.close()
                what = (f"the tool {late.importing!r} did not import" if late.importing
                        else "a tool worker did not start")
                raise UserError(f"rank {self.rank}: {what} within {timeout_s:g}s ({self.source}); make its module "
                                f"import quickly (no work or waiting at import time).")
            for w in wait([w for w in self._workers if not w.ready], timeout=1.0):
                self._receive(w, [])
            self._fill()
        self._check_isolation()
        return self.isolation  # type: ignore[return-value]

    def _check_isolation(self) -> None:
        iso = self.isolation
        if iso is None or iso.level == "namespaces":
            return
        if self.setting == "namespaces":
            self.close()
            raise UserError(f"{self.field}=namespaces, but this host refuses them ({iso.reason}); allow "
                            f"unprivileged user namespaces (or run as root in a container that permits unshare), or "
                            f"set {self.field}=process to run the tools without them.")
        if self.setting == "auto" and self.untrusted:
            self.close()
            raise UserError(f"rank {self.rank}: the tool(s) {', '.join(self.untrusted)} run model-written code, and "
                            f"this host refuses the namespaces that would isolate it ({iso.reason}); run where "
                            f"namespaces are allowed, or accept a process-level sandbox with {self.field}=process.")

    def run(self, jobs: list[ToolJob]) -> list[ToolResult]:
        """A result per job, in order; the calls run in parallel over the workers."""
        results: list[ToolResult | None] = [None] * len(jobs)
        queue = list(range(len(jobs)))
        while any(r is None for r in results):
            self._fill()
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    i = queue.pop(0)
                    self._dispatch(w, i, jobs[i], results)
            busy = [w for w in self._workers if not w.ready or w.task is not None]
            now = time.monotonic()
            timeout = max(0.0, min([w.deadline - now for w in busy if w.task is not None] + [1.0]))
            for w in wait(busy, timeout=timeout):
                self._receive(w, results)
            now = time.monotonic()
            for w in [w for w in self._workers if w.task is not None and w.deadline <= now]:
                self._replace(w, results, ToolResult(f"Error: the tool ran past its {self.limits.timeout_s:g}s "
                                                     f"limit and was stopped.", "timeout"))
        return results  # type: ignore[return-value]

    def _dispatch(self, w: _Worker, index: int, job: ToolJob, results: list) -> None:
        """Hand a job to an idle worker: its pipe, filled here, and a header; the worker never reads the job."""
        try:
            fd = job_pipe(job, self.takes.get(job.name, []))
        except ValueError as err:
            results[index] = ToolResult(f"Error: {err}.", "arguments")
            return
        try:
            wire.send(w.sock, {"kind": "call", "index": index, "network": job.network}, (fd,))
        except OSError:
            w.task = index  # the worker is gone: the call is told so, and the worker replaced
            self._replace(w, results, ToolResult("Error: the tool's worker process died.", "crash"))
            return
        finally:
            os.close(fd)
        w.task, w.deadline = index, time.monotonic() + self.limits.timeout_s + GRACE_S

    def _receive(self, w: _Worker, results: list) -> None:
        try:
            message, fds = wire.recv(w.sock, READ_TIMEOUT_S)
            for fd in fds:  # nothing a worker sends carries a descriptor
                os.close(fd)
            if not isinstance(message, dict):
                raise wire.WireError("a message is a JSON object")
            kind = message.get("kind")
        except (EOFError, OSError, wire.WireError) as err:
            self._lost(w, results, err)
            return
        try:
            self._handle(w, kind, message, results)
        except UserError:
            raise
        except Exception as err:  # noqa: BLE001 - whatever a message makes fail fails its call, never the run
            self._lost(w, results, wire.WireError(str(err)))

    def _lost(self, w: _Worker, results: list, err: BaseException) -> None:
        """A worker that died, or sent what is not a message: its call fails, and it is replaced."""
        if isinstance(err, wire.WireError):
            result = ToolResult("Error: the tool's worker sent a malformed message; the call failed.", "crash")
        else:
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            result = ToolResult("Error: the tool's worker process died.", "crash")
            if not w.ready:
                self._deaths_at_start += 1
                if self._deaths_at_start > 3:
                    self.close()
                    raise UserError(f"rank {self.rank}: tool workers die while starting (exit code "
                                    f"{w.exitcode}); check that rollout.multi_turn.tool_config_path's tools "
                                    f"import.") from None
        self._replace(w, results, result)

    def _handle(self, w: _Worker, kind: str, message: dict, results: list) -> None:
        if kind in ("importing", "init_error", "ready") and w.ready:
            raise ValueError(f"a {kind!r} message from a worker that is ready")
        if kind == "importing":
            w.importing = str(message["name"])
            return
        if kind == "init_error":
            self.close()
            raise UserError(f"rank {self.rank}: rollout.multi_turn.tool_config_path: a tool cannot be loaded in a "
                            f"tool worker: {message['text']}")
        if kind == "ready":
            self._ready(w, message)
            return
        if kind != "result" or message["index"] != w.task or w.task is None:
            raise ValueError(f"an unexpected {kind!r} message")
        results[w.task] = _result(message["result"])
        w.task, w.deadline = None, math.inf

    def _ready(self, w: _Worker, message: dict) -> None:
        isolation, takes = message["isolation"], message["takes"]
        level, reason = isolation["level"], str(isolation["reason"])
        if level not in LEVELS or not isinstance(takes, dict) or not all(isinstance(v, list) for v in takes.values()):
            raise ValueError("not a ready message")
        if self.isolation is not None and level != self.isolation.level:
            # a worker started later (a replacement) whose namespaces were refused: never a lower level unnoticed
            self._deaths_at_start += 1
            self._replace(w, [], ToolResult("", None))
            if self._deaths_at_start > 3:
                self.close()
                raise UserError(f"rank {self.rank}: the tool sandbox runs at {self.isolation.level}, and new tool "
                                f"workers could only reach {level} ({reason}); the host stopped allowing what the "
                                f"run started with (user namespaces, their count), so the run stops rather than run "
                                f"tools less isolated.")
            return
        w.ready, w.importing = True, None
        self.isolation = self.isolation or Isolation(level, reason)
        self.takes = self.takes or {str(k): [str(n) for n in v] for k, v in takes.items()}

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            try:
                self._workers.append(_Worker(self.targets, self.limits, self.setting))
            except OSError as err:  # no process or descriptor to be had: counted as a death at start
                self._deaths_at_start += 1
                if self._deaths_at_start > 3:
                    self.close()
                    raise UserError(f"rank {self.rank}: tool workers cannot be started ({err}); free processes or "
                                    f"descriptors, or lower rollout.multi_turn.tool_workers.") from None
                return

    def _replace(self, w: _Worker, results: list, result: ToolResult) -> None:
        if w.task is not None:
            results[w.task] = result
        w.kill()
        self._workers.remove(w)

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []

    def __del__(self) -> None:  # noqa: D105
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown
            pass


ERROR_KINDS = (None, "parse", "unknown_tool", "arguments", "exception", "timeout", "memory", "output", "crash")


def _result(data: Any) -> ToolResult:
    """A keeper's result, read as data: ValueError where it is not one."""
    if not isinstance(data, dict) or not isinstance(data.get("text"), str) or data.get("error") not in ERROR_KINDS \
            or data.get("network_isolated") not in (None, True, False):
        raise ValueError("not a tool result")
    return ToolResult(data["text"], data["error"], data["network_isolated"])


def describe(result: ToolResult) -> dict[str, Any]:
    """A result's metadata (what the rollout records besides the text)."""
    return {"error": result.error, "network_isolated": result.network_isolated}
