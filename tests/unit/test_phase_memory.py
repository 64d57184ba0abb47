"""Peak memory per phase (train/memory.py): each phase's own high-water mark from a byte-counting backend, nested
phases counting toward both, the step's peak the largest reading, and a report that clears what it took."""
import contextlib

import pytest

from portagrpo.backends.dist import Collectives
from portagrpo.train.memory import PhaseMemory


class Counting:
    """A backend whose memory is a byte counter with a resettable peak, as an accelerator's allocator keeps it."""

    def __init__(self) -> None:
        self.now, self.peak, self.regions = 0, 0, []

    def use(self, gib: float) -> None:
        self.now += int(gib * 2**30)
        self.peak = max(self.peak, self.now)

    def reset_peak_memory(self) -> None:
        self.peak = self.now

    def peak_memory_gb(self) -> float:
        return self.peak / 2**30

    @contextlib.contextmanager
    def region(self, label):
        self.regions.append(label)
        yield


def test_each_phase_has_its_own_peak_and_the_step_the_largest():
    b = Counting()
    mem = PhaseMemory(b)
    mem.start_step()
    with mem.phase("rollout"):
        b.use(3)
        b.use(-2)  # a KV cache freed at the end of generation: 1 GiB left
    b.use(4)  # between phases: 5 GiB, part of the step, of no phase
    b.use(-4)
    with mem.phase("logprobs"):
        b.use(1)  # 2 GiB
        b.use(-1)
    with mem.phase("update"):
        b.use(2)  # 3 GiB
        b.use(-2)
    peak, phases = mem.take(Collectives(), "cpu")
    assert b.regions == ["rollout", "logprobs", "update"]  # the backend's own regions still open
    assert phases == {"mem/rollout_peak_gb": 3.0, "mem/scoring_peak_gb": 2.0, "mem/update_peak_gb": 3.0}
    assert peak == 5.0
    assert mem.take(Collectives(), "cpu")[1] == {}  # taken: cleared


def test_a_phase_inside_another_counts_toward_both():
    b = Counting()
    mem = PhaseMemory(b)
    with mem.phase("checkpoint"):
        b.use(1)
        with mem.phase("rollout"):
            b.use(2)
            b.use(-2)
        b.use(0.5)
    _, phases = mem.take(Collectives(), "cpu")
    assert phases == {"mem/checkpoint_peak_gb": pytest.approx(3.0), "mem/rollout_peak_gb": pytest.approx(3.0)}


def test_load_and_checkpoint_wait_for_the_next_report():
    b = Counting()
    mem = PhaseMemory(b)
    with mem.phase("load"):
        b.use(6)
        b.use(-5)
    mem.start_step()  # the step's peak counts from here, the load's peak is kept for its report
    with mem.phase("push weights"):
        b.use(1)
        b.use(-1)
    peak, phases = mem.take(Collectives(), "cpu")
    assert phases == {"mem/load_peak_gb": 6.0, "mem/push_peak_gb": 2.0} and peak == 2.0
