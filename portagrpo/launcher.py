"""Local multi-rank launch: `trainer.nproc_per_node=K` runs K ranks of the same command on this machine.

What torchrun's `--standalone` mode did for it, with nothing listening beyond loopback: torchrun's
agent store binds every interface whatever `--master-addr` says. Here the launcher binds the
rendezvous socket on 127.0.0.1 itself and hands it to rank 0, whose TCPStore serves it
(`backends/dist.py: launched_store`); the other ranks connect to it. Each rank gets torchrun's variables
(RANK, LOCAL_RANK, WORLD_SIZE, LOCAL_WORLD_SIZE, MASTER_ADDR, MASTER_PORT). When a rank fails, the
others are stopped (SIGTERM, then SIGKILL after a grace period), and the run ends with one
sentence naming each rank and how it ended (`describe_rank_failures`). Ranks stop when the launcher
is gone, even after `kill -9` (`procs.exit_with_parent`). The Ray launcher (`ray_launcher.py`)
places ranks across nodes.
"""
from __future__ import annotations

import argparse
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time

from portagrpo.backends.dist import RENDEZVOUS_ENV, STORE_FD_ENV
from portagrpo.procs import LAUNCHER_ENV, RANK_REPORTS_ENV, RankFailure, read_rank_failures

STOP_GRACE_S = 30.0

# How a rank that ended by a signal ended: the collective libraries' watchdogs (NCCL's in torch's default
# mode, HCCL's, the heartbeat monitor) take a rank down with SIGABRT from their own thread.
_SIGNAL_CAUSES = {
    signal.SIGABRT: "aborted (SIGABRT), as a collective library's watchdog ends a rank whose collective lost a peer "
                    "or waited past trainer.dist_timeout_s",
    signal.SIGKILL: "killed (SIGKILL), often by the out-of-memory killer",
    signal.SIGSEGV: "crashed (SIGSEGV)",
}


def describe_rank_failures(codes: dict[int, int], nproc: int, reports: list[RankFailure] = ()) -> str:
    """One sentence for the ranks that ended badly ({rank: exit status, negative for a signal}). A rank that
    left a report (`procs.report_rank_failure`) is named with its cause: the first rank that failed on its
    own, before those that failed only because it was gone. Ranks the launcher itself stopped (SIGTERM)
    after another failed are named last, as stopped."""
    reported = {r.rank for r in reports}
    # a rank ended by a signal (not the launcher's SIGTERM) without a report is the cause when every report is of
    # a rank that failed only because a peer was gone (its collective lost that rank)
    signalled = [r for r, c in codes.items() if c < 0 and c != -signal.SIGTERM and r not in reported]
    if reports and (not reports[0].peer or not signalled):
        first = reports[0]
        others = sorted(r for r in codes if r != first.rank)
        rest = (f" The other rank{'s' if len(others) > 1 else ''} ({', '.join(map(str, others))}) "
                f"{'were' if len(others) > 1 else 'was'} stopped with it;" if others else "")
        return (f"rank {first.rank} of {nproc} failed: {first.message.rstrip('.')}.{rest} every checkpoint written "
                f"so far is whole: continue with --resume.")
    # SIGTERM kills a rank (-15) or, once portagrpo's handler is installed, ends it with 128 + 15
    stopped = sorted(r for r, c in codes.items() if c in (-signal.SIGTERM, 128 + signal.SIGTERM))
    # ranks ended by a signal first: the likeliest cause (a peer then fails its collective and exits)
    failed = sorted((r for r in codes if r not in stopped), key=lambda r: (codes[r] >= 0, r)) or stopped
    if not failed:
        return f"a rank of {nproc} failed; the first error is printed above."
    parts = [_how_it_ended(rank, codes[rank]) for rank in failed]
    if failed is not stopped and stopped:
        parts.append(f"the launcher then stopped rank{'s' if len(stopped) > 1 else ''} {', '.join(map(str, stopped))}")
    return (f"{'; '.join(parts)} (of {nproc} ranks); any Python error is printed above. Every checkpoint written "
            f"so far is whole: continue with --resume.")


def _how_it_ended(rank: int, code: int) -> str:
    if code >= 0:
        return f"rank {rank} exited with status {code}"
    try:
        sig = signal.Signals(-code)
    except ValueError:
        return f"rank {rank} ended by signal {-code}"
    return f"rank {rank} was " + _SIGNAL_CAUSES.get(sig, f"ended by {sig.name}")


class _Signalled(Exception):
    def __init__(self, signum: int) -> None:
        super().__init__(signum)
        self.signum = signum


RANKS_PREFIX = "portagrpo-ranks-"  # + the launcher's pid: the folder its ranks report failures into


def remove_stale_rank_dirs() -> int:
    """Report folders whose launcher is gone: removed at the next start. Returns how many."""
    from portagrpo.procs import remove_orphaned_dirs

    return remove_orphaned_dirs(RANKS_PREFIX)


def launch_local(nproc: int, command: list[str], grace_s: float = STOP_GRACE_S) -> int:
    """Run `command` as `nproc` ranks; their exit status, or one sentence on stderr and a failure status."""
    listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    listener.bind(("127.0.0.1", 0))
    listener.listen(max(128, 4 * nproc))
    remove_stale_rank_dirs()
    reports = tempfile.mkdtemp(prefix=f"{RANKS_PREFIX}{os.getpid()}-")
    try:
        return _launch(nproc, command, grace_s, listener, reports)
    finally:
        shutil.rmtree(reports, ignore_errors=True)


def _launch(nproc: int, command: list[str], grace_s: float, listener: socket.socket, reports: str) -> int:
    base = {**os.environ, LAUNCHER_ENV: str(os.getpid()), RENDEZVOUS_ENV: "1", "MASTER_ADDR": "127.0.0.1",
            "MASTER_PORT": str(listener.getsockname()[1]), "WORLD_SIZE": str(nproc), "LOCAL_WORLD_SIZE": str(nproc),
            RANK_REPORTS_ENV: reports}
    # as torchrun: ranks sharing the cores must not each start a thread per core
    base.setdefault("OMP_NUM_THREADS", "1")
    procs: list[subprocess.Popen] = []
    previous = {s: signal.signal(s, _raise_signalled) for s in (signal.SIGTERM, signal.SIGINT)}
    try:
        for rank in range(nproc):
            env = {**base, "RANK": str(rank), "LOCAL_RANK": str(rank)}
            fds = ()
            if rank == 0:
                env[STORE_FD_ENV], fds = str(listener.fileno()), (listener.fileno(),)
            procs.append(subprocess.Popen(command, env=env, pass_fds=fds))
        listener.close()
        codes = _wait_or_stop_all(procs, grace_s)
    except _Signalled as sig:
        _stop(procs, grace_s)
        name = signal.Signals(sig.signum).name
        print(f"portagrpo: stopped by signal {name}; every checkpoint written so far is whole (continue with "
              f"--resume).", file=sys.stderr)
        return 128 + sig.signum
    finally:
        listener.close()
        for s, handler in previous.items():
            signal.signal(s, handler)
    failed = {rank: code for rank, code in codes.items() if code != 0}
    if not failed:
        return 0
    print(f"portagrpo: error: {describe_rank_failures(failed, nproc, read_rank_failures(reports))}",
          file=sys.stderr)
    return 1


def _raise_signalled(signum, frame) -> None:
    raise _Signalled(signum)


def _wait_or_stop_all(procs: list[subprocess.Popen], grace_s: float) -> dict[int, int]:
    """Every rank's exit status; the first rank to fail gets the others stopped."""
    while True:
        codes = {rank: p.poll() for rank, p in enumerate(procs)}
        if all(c is not None for c in codes.values()):
            return codes
        if any(c not in (None, 0) for c in codes.values()):
            _stop(procs, grace_s)
            return {rank: p.returncode for rank, p in enumerate(procs)}
        time.sleep(0.1)


def _stop(procs: list[subprocess.Popen], grace_s: float) -> None:
    for p in procs:
        if p.poll() is None:
            p.send_signal(signal.SIGTERM)
    deadline = time.monotonic() + grace_s
    for p in procs:
        try:
            p.wait(timeout=max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            p.kill()
            p.wait()


def main(argv: list[str] | None = None) -> int:
    """`python -m portagrpo.launcher --nproc K SCRIPT [ARGS...]`: K ranks of a Python script (tests use it
    in place of torchrun, so nothing they start listens beyond loopback)."""
    parser = argparse.ArgumentParser(prog="python -m portagrpo.launcher")
    parser.add_argument("--nproc", type=int, required=True)
    parser.add_argument("script")
    parser.add_argument("args", nargs=argparse.REMAINDER)
    args = parser.parse_args(argv)
    return launch_local(args.nproc, [sys.executable, args.script, *args.args])


if __name__ == "__main__":
    sys.exit(main())
