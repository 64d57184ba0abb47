"""Reward scoring in worker processes, with a deadline per sample that runs in parallel.

Each worker scores one sample at a time. A sample's clock starts when a ready worker receives it
(never during a worker's start-up), a worker past its deadline is killed and replaced, and scoring
stops as soon as more samples failed than the caller tolerates: with W workers and every sample
hanging, a batch fails after about one `timeout_s`, not after samples/W timeouts in a row.
Workers die with the trainer (parent-death signal plus a watcher thread).
"""
from __future__ import annotations

import multiprocessing
import os
import signal
import time
from multiprocessing.connection import wait

from portagrpo.procs import sigint_ignored
from portagrpo.rewards.functions import NOT_SCORED, RewardResult


def _worker_main(conn, spec: str, parent_pid: int) -> None:
    from portagrpo.procs import exit_with_parent, set_parent_death_signal

    # Ctrl-C reaches the whole process group; the trainer stops its workers itself, and a worker's
    # own KeyboardInterrupt traceback would only bury the trainer's one line.
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    set_parent_death_signal()
    exit_with_parent(parent_pid, "reward worker")
    from portagrpo.rewards.functions import RewardResolver, score_one

    try:
        resolver = RewardResolver(spec)
    except Exception as err:  # noqa: BLE001 - reported to the trainer as the reason
        conn.send(("init_error", f"{type(err).__name__}: {err}"))
        return
    conn.send(("ready", None))
    while True:
        try:
            index, item = conn.recv()
        except EOFError:
            return
        conn.send(("result", (index, score_one(resolver, *item))))


class _Worker:
    def __init__(self, ctx, spec: str) -> None:
        self.conn, child = ctx.Pipe()
        self.proc = ctx.Process(target=_worker_main, args=(child, spec, os.getpid()), daemon=True)
        with sigint_ignored():  # inherited through exec: Python in the child then never turns Ctrl-C into a traceback
            self.proc.start()
        child.close()
        self.ready = False
        self.task: int | None = None
        self.deadline = float("inf")

    def give(self, index: int, item: tuple, timeout_s: float) -> None:
        self.conn.send((index, item))
        self.task, self.deadline = index, time.monotonic() + timeout_s

    def kill(self) -> None:
        if self.proc.is_alive():
            self.proc.kill()
        self.proc.join(timeout=5)
        self.conn.close()


class RewardPool:
    def __init__(self, spec: str, num_workers: int, timeout_s: float) -> None:
        self.spec, self.num_workers, self.timeout_s = spec, num_workers, timeout_s
        self._ctx = multiprocessing.get_context("spawn")  # no fork: the trainer holds torch threads
        self._workers: list[_Worker] = []
        self._deaths_at_start = 0

    def _fill(self) -> None:
        while len(self._workers) < self.num_workers:
            self._workers.append(_Worker(self._ctx, self.spec))

    def score(self, items: list[tuple], max_failures: int | None = None) -> list[RewardResult]:
        """A result per item; stops early once more than `max_failures` failed (the rest: NOT_SCORED)."""
        from portagrpo.rewards.functions import RewardSpecError

        results: list[RewardResult | None] = [None] * len(items)
        queue = list(range(len(items)))
        failures = 0
        self._fill()
        while any(r is None for r in results):
            if max_failures is not None and failures > max_failures:
                break
            for w in self._workers:
                if w.ready and w.task is None and queue:
                    i = queue.pop(0)
                    w.give(i, items[i], self.timeout_s)
            now = time.monotonic()
            waiting = [w for w in self._workers if not w.ready or w.task is not None]
            deadline = min((w.deadline for w in waiting), default=now + 1.0)
            for conn in wait([w.conn for w in waiting], timeout=max(0.0, min(deadline - now, 1.0))):
                w = next(w for w in self._workers if w.conn is conn)
                try:
                    kind, payload = conn.recv()
                except (EOFError, OSError):
                    w.proc.join(timeout=5)  # the exit code is known only once the process is reaped
                    if not w.ready:
                        self._deaths_at_start += 1
                        if self._deaths_at_start > 3:
                            self.close()
                            raise RewardSpecError(f"reward workers for reward.function={self.spec!r} die while "
                                                  f"starting (exit code {w.proc.exitcode}); run the function in "
                                                  f"process with reward.num_workers=0 to see why.") from None
                    failures += self._replace(w, results, f"the reward worker died (exit code {w.proc.exitcode})")
                    continue
                if kind == "init_error":
                    self.close()
                    raise RewardSpecError(
                        f"reward.function={self.spec!r} cannot be loaded in a reward worker: {payload}"
                    )
                if kind == "ready":
                    w.ready = True
                else:
                    index, result = payload
                    results[index], w.task, w.deadline = result, None, float("inf")
                    failures += result.error is not None
            now = time.monotonic()
            for w in [w for w in self._workers if w.task is not None and w.deadline <= now]:
                failures += self._replace(w, results, f"TimeoutError: the reward took longer than reward.timeout_s="
                                                      f"{self.timeout_s:g}s")
            self._fill()
        for w in [w for w in self._workers if w.task is not None]:  # abandoned: those workers are busy
            w.kill()
            self._workers.remove(w)
        return [r if r is not None else NOT_SCORED for r in results]

    def _replace(self, w: _Worker, results: list, message: str) -> int:
        failed = 0
        if w.task is not None:
            results[w.task] = RewardResult(0.0, False, message)
            failed = 1
        w.kill()
        self._workers.remove(w)
        return failed

    def close(self) -> None:
        for w in self._workers:
            w.kill()
        self._workers = []
