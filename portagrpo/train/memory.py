"""Peak memory per phase of a run: each phase's own high-water mark, read from the backend's peak counter.

A phase resets the backend's peak counter when it starts and reads it when it ends (and resets it again), so its
peak is its own: rollout, scoring (old and reference log-probs), update, weight push, and, once, load and each
checkpoint. Between phases the counter runs on, and the step's peak (`mem_peak_gb`) is the largest of every reading
since the step started. The backend decides what a reading is: allocated bytes on an accelerator (and the emulated
device's byte count per rank), the resident set's high-water mark on the CPU.
"""
from __future__ import annotations

import contextlib
from typing import Iterator

import torch

# a region label (Backend.region) -> the phase it is logged as: `mem/<phase>_peak_gb`
PHASES = {"load": "load", "rollout": "rollout", "logprobs": "scoring", "update": "update", "push weights": "push",
          "checkpoint": "checkpoint"}


class PhaseMemory:
    """This rank's peaks by phase since they were last taken (`take`)."""

    def __init__(self, backend) -> None:
        self.backend = backend
        self.peaks: dict[str, float] = {}
        self.step_peak = 0.0
        self._open: list[str] = []  # the phases entered and not yet left, innermost last

    def _read(self) -> float:
        peak = self.backend.peak_memory_gb()
        self.backend.reset_peak_memory()
        self.step_peak = max(self.step_peak, peak)
        return peak

    @contextlib.contextmanager
    def phase(self, label: str) -> Iterator[None]:
        """The backend's region `label`, with its own peak. A phase inside another (a rollout inside a checkpoint's
        validation, say) counts toward both."""
        outer = self._read()  # the stretch before this phase, itself a part of any enclosing phase
        for name in list(self._open):
            self.peaks[name] = max(self.peaks.get(name, 0.0), outer)
        self._open.append(PHASES.get(label, label))
        try:
            with self.backend.region(label):
                yield
        finally:
            name = self._open.pop()
            peak = self._read()
            for open_name in [*self._open, name]:
                self.peaks[open_name] = max(self.peaks.get(open_name, 0.0), peak)

    def start_step(self) -> None:
        """A step begins: its peak counts from here (the phases' peaks since the last report are kept)."""
        self.backend.reset_peak_memory()
        self.step_peak = 0.0

    def take(self, comm, device) -> tuple[float, dict[str, float]]:
        """(the step's peak, `mem/<phase>_peak_gb` of the phases since the last take), each the largest over the
        ranks (one collective); then cleared."""
        self._read()
        names = sorted(set(PHASES.values()))  # the same shape on every rank; -1: not run since the last take
        values = torch.tensor([self.step_peak, *(self.peaks.get(n, -1.0) for n in names)], dtype=torch.float32,
                              device=device)
        values = comm.all_reduce_max(values).tolist()  # host read: one sync per step
        self.peaks = {}
        return values[0], {f"mem/{n}_peak_gb": v for n, v in zip(names, values[1:]) if v >= 0}
