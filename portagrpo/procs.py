"""Child processes that die with their parent, and signals that end a run with one line."""
from __future__ import annotations

import contextlib
import os
import signal
import sys
import threading
import time

LAUNCHER_ENV = "PORTAGRPO_LAUNCHER_PID"  # set by the local multi-rank launcher for its ranks


def portagrpo_command(*args: str) -> list[str]:
    """`python -m portagrpo ARGS` for a child process, importing the portagrpo this process runs: `-P`
    (Python 3.11+) keeps the current directory off sys.path, so a source tree there (the images' WORKDIR,
    a clone) cannot shadow the installed package."""
    safe_path = ["-P"] if sys.version_info >= (3, 11) else []
    return [sys.executable, *safe_path, "-m", "portagrpo", *args]


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


@contextlib.contextmanager
def sigint_ignored():
    """Start child processes inside this: a SIGINT disposition of "ignore" is inherited through exec, so
    Python in the child never turns the terminal's Ctrl-C (sent to the whole process group) into a
    traceback of its own; the parent stops its children itself."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    previous = signal.signal(signal.SIGINT, signal.SIG_IGN)
    try:
        yield
    finally:
        signal.signal(signal.SIGINT, previous)


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
        return not _pid_alive(parent_pid) or (started_under == parent_pid and os.getppid() != parent_pid)

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
        raise Stopped()

    return signal.signal(signal.SIGTERM, handler)
