"""The tool sandbox: every tool call runs in a process of its own, forked by a worker process, with limits.

Workers are started as reward workers are (rewards/pool.py: spawned, dying with the trainer) and import the
tools once. For each call a worker forks a child that, before the tool runs:
- starts a session of its own (so the call and anything it forks are killed together),
- works in a fresh temporary directory (removed after the call) with an environment of PATH, LANG and
  HOME=<that directory> only (no inherited secrets),
- loses the network where the platform allows it (a user and network namespace, as `unshare -rn`; where that
  is refused the result says `network_isolated=False`; a user tool may keep it with `config: {network: true}`),
- gets a CPU-time limit (RLIMIT_CPU) and a memory limit (RLIMIT_AS, on top of what the worker already maps).
The worker reads the child's output (stdout and stderr) up to a byte cap, and kills the call's whole process group
at the wall-clock limit, at the cap, and after the call. Nothing stops a tool from reading or writing files the
trainer's user may touch: the environment holds no secrets, but the filesystem is not isolated.

Whatever goes wrong (a hang, a crash, an exception, too much output, too much memory, a fork storm) becomes a
`ToolResult` with an `error` kind and a message for the model; the run goes on.
"""
from __future__ import annotations

import ctypes
import math
import multiprocessing
import os
import resource
import select
import shutil
import signal
import sys
import tempfile
import time
from dataclasses import dataclass
from multiprocessing.connection import wait
from typing import Any

from portagrpo.errors import UserError
from portagrpo.procs import sigint_ignored

CLONE_NEWUSER, CLONE_NEWNET = 0x10000000, 0x40000000
PR_SET_CHILD_SUBREAPER = 36
EXIT_EXCEPTION, EXIT_MEMORY = 1, 3
GRACE_S = 5.0  # the trainer's own deadline past the worker's, for a worker that stops answering
TRUNCATED = "[output truncated]"


@dataclass(frozen=True)
class Limits:
    timeout_s: float = 10.0  # wall clock; the CPU-time limit is the same number of seconds, rounded up
    memory_mb: int = 1024  # address space the call may add to the worker's
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

def _libc():
    return ctypes.CDLL(None, use_errno=True)


def _drop_network() -> bool:
    """A network namespace of this process's own (no interfaces but a down loopback); False where refused."""
    libc = _libc()
    for flags in (CLONE_NEWNET, CLONE_NEWUSER | CLONE_NEWNET):
        if libc.unshare(flags) == 0:
            return True
    return False


def _address_space() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmSize:"):
                return int(line.split()[1]) * 1024
    return 0


def _child(fn, job: ToolJob, limits: Limits, workdir: str, write_fd: int) -> None:
    """The forked call: never returns."""
    code = EXIT_EXCEPTION
    try:
        from portagrpo.procs import set_parent_death_signal

        os.setsid()
        set_parent_death_signal()  # a worker killed mid-call takes the call with it
        os.dup2(write_fd, 1)
        os.dup2(write_fd, 2)
        null = os.open(os.devnull, os.O_RDONLY)
        os.dup2(null, 0)
        os.chdir(workdir)
        os.environ.clear()
        os.environ.update(PATH="/usr/local/bin:/usr/bin:/bin", LANG="C.UTF-8", HOME=workdir, TMPDIR=workdir)
        if not job.network:
            _drop_network()
        cpu = max(1, math.ceil(limits.timeout_s))
        resource.setrlimit(resource.RLIMIT_CPU, (cpu, cpu + 1))
        memory = _address_space() + limits.memory_mb * 2**20
        resource.setrlimit(resource.RLIMIT_AS, (memory, memory))
        from portagrpo.agent.tools import call_tool

        text = call_tool(fn, job.arguments, job.context)
        sys.stdout.write(text)
        sys.stdout.flush()
        code = 0
    except MemoryError:
        code = EXIT_MEMORY
        os.write(2, b"MemoryError: the tool went over its memory limit")
    except BaseException as err:  # noqa: BLE001 - told to the model, the run goes on
        try:
            os.write(2, f"{type(err).__name__}: {err}".encode(errors="replace")[:4096])
        except BaseException:  # noqa: BLE001 - nothing more can be said
            pass
    os._exit(code)


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


def _reap() -> None:
    """Collect every finished descendant (the worker is their subreaper)."""
    while True:
        try:
            pid, _ = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return


def run_call(fn, job: ToolJob, limits: Limits, network_isolated: bool | None) -> ToolResult:
    """One call in a forked, limited child (in a worker; tests call it directly)."""
    workdir = tempfile.mkdtemp(prefix="portagrpo-tool-")
    read_fd, write_fd = os.pipe()
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid == 0:
        os.close(read_fd)
        _child(fn, job, limits, workdir, write_fd)
    os.close(write_fd)
    try:
        out, over, late = _read_capped(read_fd, time.monotonic() + limits.timeout_s, limits.max_output_bytes)
    finally:
        _kill_group(pid)  # the call and all it forked; its pgid lives while the child is unreaped
        try:
            os.kill(pid, signal.SIGKILL)  # the child itself, should it not have reached setsid
        except ProcessLookupError:
            pass
        _, status = os.waitpid(pid, 0)
        os.close(read_fd)
        _reap()
        shutil.rmtree(workdir, ignore_errors=True)
    isolated = None if job.network else network_isolated
    text = out.decode(errors="replace")
    return ToolResult(*_outcome(text, status, over, late, limits), network_isolated=isolated)


def _outcome(text: str, status: int, over: bool, late: bool, limits: Limits) -> tuple[str, str | None]:
    if over:
        return f"{text}\n{TRUNCATED}", "output"
    if late:
        return f"Error: the tool ran past its {limits.timeout_s:g}s limit and was stopped.", "timeout"
    if os.WIFSIGNALED(status):
        sig = os.WTERMSIG(status)
        if sig == signal.SIGXCPU:
            return (f"Error: the tool used its {math.ceil(limits.timeout_s)}s CPU-time limit and was stopped.",
                    "timeout")
        return f"Error: the tool's process died ({signal.Signals(sig).name}).", "crash"
    code = os.WEXITSTATUS(status)
    if code == 0:
        return text, None
    if code == EXIT_MEMORY:
        return f"Error: the tool went over its {limits.memory_mb} MB memory limit.", "memory"
    if code == EXIT_EXCEPTION:
        return f"Error: {text.strip()[-2000:]}", "exception"
    return f"Error: the tool's process exited with code {code}. {text.strip()[-500:]}".strip(), "crash"


def network_isolation_works() -> bool:
    """Whether a forked child can drop its network here (asked once per worker)."""
    pid = os.fork()
    if pid == 0:
        os._exit(0 if _drop_network() else 1)
    _, status = os.waitpid(pid, 0)
    return os.WIFEXITED(status) and os.WEXITSTATUS(status) == 0


# ---------------------------------------------------------------- the worker process

def _worker_main(conn, targets: dict[str, str], limits: Limits, parent_pid: int) -> None:
    from portagrpo.procs import exit_with_parent, set_parent_death_signal

    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    exit_with_parent(parent_pid, "tool worker")
    from portagrpo.agent.tools import resolve

    try:
        functions = {name: resolve(target) for name, target in targets.items()}
    except Exception as err:  # noqa: BLE001 - reported to the trainer as the reason
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    _libc().prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0)
    isolated = network_isolation_works()
    conn.send(("ready", None))
    while True:
        try:
            index, job = conn.recv()
        except EOFError:
            return
        conn.send(("result", (index, run_call(functions[job.name], job, limits, isolated))))


class _Worker:
    def __init__(self, ctx, targets: dict[str, str], limits: Limits) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, targets, limits, os.getpid()), daemon=True)
        with sigint_ignored():
            self.proc.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = math.inf

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class ToolSandbox:
    """`workers` processes that run tool calls, each call in a limited process of its own."""

    def __init__(self, targets: dict[str, str], limits: Limits, workers: int = 2) -> None:
        self.targets, self.limits, self.num_workers = dict(targets), limits, workers
        self._ctx = multiprocessing.get_context("spawn")  # no fork: the trainer holds torch threads
        self._workers: list[_Worker] = []
        self._deaths_at_start = 0

    def start(self, timeout_s: float = 120.0) -> None:
        """Start the workers and wait until each has imported the tools: a tool that cannot be loaded is one
        sentence before the first step, not a failure in it."""
        self._fill()
        deadline = time.monotonic() + timeout_s
        while any(not w.ready for w in self._workers) and time.monotonic() < deadline:
            for conn in wait([w.conn for w in self._workers if not w.ready], timeout=1.0):
                self._receive(next(w for w in self._workers if w.conn is conn), [])
            self._fill()

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
            w.proc.join(timeout=5)
            if not w.ready:
                self._deaths_at_start += 1
                if self._deaths_at_start > 3:
                    self.close()
                    raise UserError(f"tool workers die while starting (exit code {w.proc.exitcode}); check that "
                                    f"rollout.multi_turn.tool_config_path's tools import.") from None
            self._replace(w, results, ToolResult("Error: the tool's worker process died.", "crash"))
            return
        if kind == "init_error":
            self.close()
            raise UserError(f"rollout.multi_turn.tool_config_path: a tool cannot be loaded in a tool worker: "
                            f"{payload}")
        if kind == "ready":
            w.ready = True
            return
        index, result = payload
        results[index], w.task, w.deadline = result, None, math.inf

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.targets, self.limits))

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
