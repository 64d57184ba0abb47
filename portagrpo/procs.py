"""Child processes that die with their parent, and signals that end a run with one line."""
from __future__ import annotations

import contextlib
import json
import os
import signal
import sys
import threading
import time
from dataclasses import asdict, dataclass

LAUNCHER_ENV = "PORTAGRPO_LAUNCHER_PID"  # set by the local multi-rank launcher for its ranks


def portagrpo_command(*args: str) -> list[str]:
    """`python -m portagrpo ARGS` for a child process, importing the portagrpo this process runs: `-P`
    (Python 3.11+) keeps the current directory off sys.path, so a source tree there (the images' WORKDIR,
    a clone) cannot shadow the installed package."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "portagrpo", *args]


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


_STARTING = {"depth": 0, "stopped": False}  # inside `sigint_ignored`: a SIGTERM's Stopped waits for its end


@contextlib.contextmanager
def sigint_ignored():
    """Start child processes inside this: a SIGINT disposition of "ignore" is inherited through exec, so
    Python in the child never turns the terminal's Ctrl-C (sent to the whole process group) into a
    traceback of its own; the parent stops its children itself. A SIGTERM meanwhile (`stop_on_sigterm`) is
    raised at the end, not in the middle of a start: a spawn cut while it writes the child's preparation data
    leaves a child that prints its own traceback ("Ran out of input", a flaky CI failure of issue 49)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    _STARTING["depth"] += 1
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)
        _STARTING["depth"] -= 1
        if _STARTING["depth"] == 0 and _STARTING["stopped"]:
            _STARTING["stopped"] = False
            raise Stopped()


def set_parent_death_signal(sig: int = signal.SIGKILL) -> None:
    """Linux: the kernel sends `sig` to this process when the thread that started it exits. Only for
    children started from a parent's main thread (the reward pool); no-op elsewhere."""
    if not sys.platform.startswith("linux"):
        return
    try:
        import ctypes

        libc = ctypes.CDLL(None, use_errno=True)
        libc.prctl(1, int(sig), 0, 0, 0)  # PR_SET_PDEATHSIG
    except (OSError, AttributeError):
        pass


def exit_with_parent(parent_pid: int, what: str, interval_s: float = 0.5) -> None:
    """Watch `parent_pid` from a daemon thread and end this process when it is gone (kill -9 of a
    launcher leaves no one to stop its children otherwise). Polling also works where a hung call
    holds the main thread, as long as it releases the GIL."""
    started_under = os.getppid()

    def gone() -> bool:
        return not pid_alive(parent_pid) or (started_under == parent_pid and os.getppid() != parent_pid)

    def watch() -> None:
        while not gone():
            time.sleep(interval_s)
        print(f"portagrpo: {what}: its parent process {parent_pid} is gone; stopping.", file=sys.stderr, flush=True)
        os._exit(1)

    threading.Thread(target=watch, name="portagrpo-lifeline", daemon=True).start()


class Stopped(BaseException):
    """SIGTERM arrived; raised in the main thread so `finally` blocks run and the CLI prints one line."""


def stop_on_sigterm():
    """Turn SIGTERM into `Stopped` in the main thread; returns the previous handler (None off the main thread)."""
    if threading.current_thread() is not threading.main_thread():
        return None

    def handler(signum, frame):  # noqa: ARG001 - signal handler signature
        if _STARTING["depth"]:
            _STARTING["stopped"] = True  # raised when the child's start is complete (sigint_ignored)
            return
        raise Stopped()

    return signal.signal(signal.SIGTERM, handler)


# Set by the local launcher for its ranks: a folder where a failing rank leaves one line on why it failed, so
# the launcher ends the run with one sentence naming the rank and the cause instead of one message per rank.
RANK_REPORTS_ENV = "PORTAGRPO_RANK_REPORTS"


@dataclass(frozen=True)
class RankFailure:
    """Why one rank of a multi-rank run failed. `peer`: it failed only because another rank was gone."""

    rank: int
    world_size: int
    message: str
    peer: bool
    time: float


def rank_prefix() -> str:
    """'rank R of W: ' for a rank of a multi-rank run, else ''."""
    world = os.environ.get("WORLD_SIZE", "1")
    return f"rank {os.environ.get('RANK', '?')} of {world}: " if world not in ("", "1") else ""


def report_rank_failure(message: str, peer: bool) -> bool:
    """Leave this rank's failure for whoever launched it: the local launcher's report folder, and torchrun's
    error file (TORCHELASTIC_ERROR_FILE, shown as the root cause in its summary). True if the local launcher
    will print it (so the rank need not)."""
    rank, world = int(os.environ.get("RANK", "0") or 0), int(os.environ.get("WORLD_SIZE", "1") or 1)
    failure = RankFailure(rank, world, message.strip(), peer, time.time())
    told = False
    folder = os.environ.get(RANK_REPORTS_ENV)
    if folder:
        told = _write_json(os.path.join(folder, f"rank{rank}.json"), asdict(failure))
    error_file = os.environ.get("TORCHELASTIC_ERROR_FILE")
    if error_file:  # torchrun names the failure with the smallest whole-second timestamp as the root cause, the
        # lowest rank on a tie, and stamps a rank it stopped (no error file) with the second it noticed: a failure of
        # its own is stamped a second early, so it wins against a peer stopped in the same second (the flaky CI
        # failure of issue 49), and one only because a peer was gone a second late, so it never wins a tie
        sentence = f"{rank_prefix()}{failure.message}"
        _write_json(error_file, {"message": {"message": sentence, "extraInfo": {
            "py_callstack": sentence, "timestamp": str(int(failure.time) + (1 if peer else -1))}}})
    return told


def read_rank_failures(folder: str) -> list[RankFailure]:
    """The reports left in `folder`, first failure first."""
    out = []
    for name in sorted(os.listdir(folder)) if os.path.isdir(folder) else []:
        try:
            with open(os.path.join(folder, name), encoding="utf-8") as fh:
                out.append(RankFailure(**json.load(fh)))
        except (OSError, ValueError, TypeError):
            continue  # a rank killed while writing: the launcher falls back to its exit status
    return sorted(out, key=lambda f: (f.peer, f.time, f.rank))


def _write_json(path: str, data: dict) -> bool:
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "w", encoding="utf-8") as fh:
            json.dump(data, fh)
        os.replace(tmp, path)
        return True
    except OSError:
        return False


def remove_orphaned_dirs(prefix: str) -> int:
    """Folders `<temp dir>/<prefix><pid>-*` whose owning process `pid` is gone (a `kill -9` leaves them behind):
    removed, at the next start of whatever makes them. Returns how many."""
    import glob
    import shutil
    import tempfile

    removed = 0
    for path in glob.glob(os.path.join(tempfile.gettempdir(), f"{prefix}*")):
        owner = os.path.basename(path)[len(prefix):].split("-", 1)[0]
        if owner.isdigit() and not pid_alive(int(owner)):
            shutil.rmtree(path, ignore_errors=True)
            removed += 1
    return removed
