"""The tool sandbox: every tool call runs in a process of its own, forked by a worker process, isolated and limited.

Workers are processes of their own (`python -c`, dying with the trainer), started with PATH, LANG and HOME as their
whole environment, and import the tools once. For each call a worker forks a child that, before the tool runs:
- starts a session of its own, with an environment of PATH, LANG, HOME and TMPDIR only (no inherited secrets);
- is isolated at the run's level (agent/isolation.py): `namespaces` (its own PID, mount, network, IPC, UTS and,
  for a non-root trainer, user namespaces; a read-only system, a private /tmp, uid 65534) or `process` (its own
  process and a fresh temporary directory, sharing the trainer's files);
- gets a CPU-time limit (RLIMIT_CPU), a memory limit (RLIMIT_AS, on top of what the worker already maps) and a
  process limit (RLIMIT_NPROC).
The worker reads the child's output (stdout and stderr) up to a byte cap, and kills the call at the wall-clock
limit, at the cap, and after the call: its process group, and then every process the call left behind (the
worker is their subreaper), so a `setsid()` grandchild dies with the call too. The call reports how it ended on
a status pipe of its own, so a tool's own exit code is never read as one of the sandbox's outcomes.

Whatever goes wrong (a hang, a crash, an exception, too much output, too much memory, a fork storm) becomes a
`ToolResult` with an `error` kind and a message for the model; the run goes on.
"""
from __future__ import annotations

import fcntl
import glob
import math
import os
import select
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import Connection, wait
from typing import Any

from portagrpo.agent.isolation import Isolation, SetupError, drop_network, enter_namespaces, libc, set_limits
from portagrpo.errors import UserError
from portagrpo.procs import pid_alive, sigint_ignored

PR_SET_CHILD_SUBREAPER = 36
STATUS_OK, STATUS_EXCEPTION, STATUS_MEMORY, STATUS_SETUP = b"ok", b"exception", b"memory", b"setup"
GRACE_S = 5.0  # the trainer's own deadline past the worker's, for a worker that stops answering
IMPORT_FLOOR_S = 60.0  # a tool's import may take this long (or the call timeout, if longer) before it is an error
NOTICE_AFTER_S = 10.0  # a slow import is told once after this long, so a run is never silent while it waits
TRUNCATED = "[output truncated]"
TEMP_PREFIX = "portagrpo-tool-"  # + the worker's pid: a `process`-level call's directory
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


# ---------------------------------------------------------------- in the forked child

def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _isolate(job: ToolJob, limits: Limits, level: str, workdir: str | None) -> tuple[str, int]:
    """Enter the call's isolation: (its home directory, its RLIMIT_NPROC, 0 for none)."""
    if level == "namespaces":
        return "/tmp", enter_namespaces(job.network, limits.memory_mb)
    os.chdir(workdir)
    if not job.network:
        drop_network()
    return workdir, 0  # a trainer's uid may run many threads: no count that would not break its own forks


def _child(fn, job: ToolJob, limits: Limits, level: str, workdir: str | None, out_fd: int, status_fd: int) -> None:
    """The forked call: never returns."""
    status = STATUS_EXCEPTION
    try:
        from portagrpo.agent.tools import call_tool
        from portagrpo.procs import set_parent_death_signal

        os.setsid()
        set_parent_death_signal()  # a worker killed mid-call takes the call with it
        os.dup2(out_fd, 1)
        os.dup2(out_fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        home, tasks = _isolate(job, limits, level, workdir)
        os.environ.clear()
        os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8", HOME=home, TMPDIR=home)
        cpu = max(1, math.ceil(limits.timeout_s))
        set_limits(cpu, _address_space() + limits.memory_mb * 2**20, tasks)
        text = call_tool(fn, job.arguments, job.context)
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
    """This process's children now (the worker's: a call's orphans are reparented to it, its subreaper)."""
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
    reparented to the worker when its parent dies, and killed here; so, round by round, are its own children.
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


def run_call(fn, job: ToolJob, limits: Limits, isolation: Isolation, network_isolated: bool | None) -> ToolResult:
    """One call in a forked, isolated, limited child (in a worker; tests call it directly)."""
    level = isolation.level
    workdir = tempfile.mkdtemp(prefix=f"{TEMP_PREFIX}{os.getpid()}-") if level == "process" else None
    read_fd, write_fd = os.pipe()
    status_read, status_write = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        os.close(status_read)
        _child(fn, job, limits, level, workdir, write_fd, status_write)
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
    if job.network:
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
    """`process`-level call directories whose worker is gone (killed with -9, say): removed at the next start.
    Returns how many."""
    removed = 0
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{TEMP_PREFIX}*")):
        owner = os.path.basename(path)[len(TEMP_PREFIX):].split("-", 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed


# ---------------------------------------------------------------- the worker process

WORKER_ENV_KEEP = ("PATH", "LANG", "HOME", "LD_LIBRARY_PATH")  # what a worker is started with, and nothing else


def _worker_main(conn, targets: dict[str, str], limits: Limits, setting: str, parent_pid: int) -> None:
    from portagrpo.procs import exit_with_parent, set_parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    exit_with_parent(parent_pid, "tool worker")
    from portagrpo.agent.isolation import probe
    from portagrpo.agent.tools import resolve

    functions = {}
    for name, target in targets.items():
        conn.send(("importing", name))
        try:
            functions[name] = resolve(target)
        except Exception as err:  # noqa: BLE001 - reported to the trainer as the reason
            conn.send(("init_error", f"{name}: {type(err).__name__}: {err}"))
            return
    libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    isolation = Isolation("process") if setting == "process" else probe(limits.memory_mb)
    network = network_isolation_works() if isolation.level == "process" else True
    conn.send(("ready", isolation))
    while True:
        try:
            index, job = conn.recv()
        except EOFError:
            return
        conn.send(("result", (index, run_call(functions[job.name], job, limits, isolation, network))))


def worker_entry(fd: int) -> None:
    """A worker process's start (`python -c`): its arguments come over the socket `fd` from the trainer."""
    conn = Connection(fd)
    targets, limits, setting, parent_pid = conn.recv()
    _worker_main(conn, targets, limits, setting, parent_pid)


class _Worker:
    """A worker process, started with a clean environment (PATH, LANG, HOME): a call is a fork of it, so it must
    never have held the trainer's secrets, not even in /proc/<pid>/environ."""

    def __init__(self, targets: dict[str, str], limits: Limits, setting: str) -> None:
        ours, theirs = socket.socketpair()
        code = (f"import sys; sys.path[:0] = {[p for p in sys.path if p]!r}; "
                f"from portagrpo.agent.sandbox import worker_entry; worker_entry({theirs.fileno()})")
        env = {k: os.environ[k] for k in WORKER_ENV_KEEP if k in os.environ}
        with sigint_ignored():
            self.proc = subprocess.Popen([sys.executable, "-P", "-c", code], env=env, pass_fds=[theirs.fileno()],
                                         stdin=subprocess.DEVNULL, close_fds=True)
        theirs.close()
        self.conn = Connection(ours.detach())
        self.conn.send((targets, limits, setting, os.getpid()))
        self.ready = False
        self.importing: str | None = None  # the tool this worker is importing, while it starts
        self.task: int | None = None
        self.deadline = math.inf

    @property
    def exitcode(self) -> int | None:
        return self.proc.poll()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
        try:
            self.proc.wait(timeout=5)
        except subprocess.TimeoutExpired:
            pass
        self.conn.close()


class ToolSandbox:
    """`workers` processes that run tool calls, each call in an isolated, limited process of its own.

    `setting` is `rollout.multi_turn.sandbox`: `namespaces` (refused where the host forbids them), `process`, or
    `auto` (namespaces where allowed; else `process`, refusing the `untrusted` tools, which run model-written
    code). `rank` names this training rank in the sentences that stop a run."""

    def __init__(self, targets: dict[str, str], limits: Limits, workers: int = 2, setting: str = "auto",
                 untrusted: tuple[str, ...] = (), rank: int = 0) -> None:
        self.targets, self.limits, self.num_workers = dict(targets), limits, workers
        self.setting, self.untrusted, self.rank = setting, tuple(untrusted), rank
        self._workers: list[_Worker] = []
        self._deaths_at_start = 0
        self.isolation: Isolation | None = None  # known once a worker is ready

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
                raise UserError(f"rank {self.rank}: {what} within {timeout_s:g}s (rollout.multi_turn."
                                f"tool_config_path); make its module import quickly (no work or waiting at import "
                                f"time).")
            for conn in wait([w.conn for w in self._workers if not w.ready], timeout=1.0):
                self._receive(next(w for w in self._workers if w.conn is conn), [])
            self._fill()
        self._check_isolation()
        return self.isolation  # type: ignore[return-value]

    def _check_isolation(self) -> None:
        iso = self.isolation
        if iso is None or iso.level == "namespaces":
            return
        if self.setting == "namespaces":
            self.close()
            raise UserError(f"{SETTING}=namespaces, but this host refuses them ({iso.reason}); allow unprivileged "
                            f"user namespaces (or run as root in a container that permits unshare), or set "
                            f"{SETTING}=process to run the tools without them.")
        if self.setting == "auto" and self.untrusted:
            self.close()
            raise UserError(f"rank {self.rank}: the tool(s) {', '.join(self.untrusted)} run model-written code, and "
                            f"this host refuses the namespaces that would isolate it ({iso.reason}); run where "
                            f"namespaces are allowed, or accept a process-level sandbox with {SETTING}=process.")

    def run(self, jobs: list[ToolJob]) -> list[ToolResult]:
        """A result per job, in order; the calls run in parallel over the workers."""
        results: list[ToolResult | None] = [None] * len(jobs)
        queue = list(range(len(jobs)))
        while any(r is None for r in results):
            self._fill()
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    i = queue.pop(0)
                    w.conn.send((i, jobs[i]))
                    w.task, w.deadline = i, time.monotonic() + self.limits.timeout_s + GRACE_S
            busy = [w for w in self._workers if not w.ready or w.task is not None]
            now = time.monotonic()
            timeout = max(0.0, min([w.deadline - now for w in busy if w.task is not None] + [1.0]))
            for conn in wait([w.conn for w in busy], timeout=timeout):
                self._receive(next(w for w in self._workers if w.conn is conn), results)
            now = time.monotonic()
            for w in [w for w in self._workers if w.task is not None and w.deadline <= now]:
                self._replace(w, results, ToolResult(f"Error: the tool ran past its {self.limits.timeout_s:g}s "
                                                     f"limit and was stopped.", "timeout"))
        return results  # type: ignore[return-value]

    def _receive(self, w: _Worker, results: list) -> None:
        try:
            kind, payload = w.conn.recv()
        except (EOFError, OSError):
            try:
                w.proc.wait(timeout=5)
            except subprocess.TimeoutExpired:
                pass
            if not w.ready:
                self._deaths_at_start += 1
                if self._deaths_at_start > 3:
                    self.close()
                    raise UserError(f"rank {self.rank}: tool workers die while starting (exit code "
                                    f"{w.exitcode}); check that rollout.multi_turn.tool_config_path's tools "
                                    f"import.") from None
            self._replace(w, results, ToolResult("Error: the tool's worker process died.", "crash"))
            return
        if kind == "importing":
            w.importing = payload
            return
        if kind == "init_error":
            self.close()
            raise UserError(f"rank {self.rank}: rollout.multi_turn.tool_config_path: a tool cannot be loaded in a "
                            f"tool worker: {payload}")
        if kind == "ready":
            w.ready, w.importing = True, None
            self.isolation = self.isolation or payload
            return
        index, result = payload
        results[index], w.task, w.deadline = result, None, math.inf

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self.targets, self.limits, self.setting))

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


def describe(result: ToolResult) -> dict[str, Any]:
    """A result's metadata (what the rollout records besides the text)."""
    return {"error": result.error, "network_isolated": result.network_isolated}
