"""What an emulated device saw, counted: host synchronisations (by cause), matrix products (by
operand dtypes) and collectives (by kind, elements, bytes). An accelerator pays for each host
synchronisation with an idle device and for each fp32 matmul with a slower kernel; the CPU does
not, so a CPU test cannot see them. Counting starts at zero in every process; `dump` writes them
as JSON (to $PORTAGRPO_EMU_COUNTERS at exit, when set), split into the spans a program marks
with `mark`.
"""
from __future__ import annotations

import atexit
import json
import os
from collections import Counter
from typing import Any, Iterable

import torch

ENV = "PORTAGRPO_EMU_COUNTERS"


class Counters:
    def __init__(self) -> None:
        self.spans: list[dict[str, Any]] = []
        self._open("start")

    def _open(self, label: str) -> None:
        self.current = {"label": label, "host_syncs": Counter(), "matmuls": Counter(),
                        "collectives": Counter(), "collective_elements": Counter(), "collective_sizes": {}}
        self.spans.append(self.current)

    def mark(self, label: str) -> None:
        """Start a new span (a training step, say); later counts go to it."""
        self._open(label)

    def sync(self, cause: str) -> None:
        self.current["host_syncs"][cause] += 1

    def matmul(self, op: str, dtypes: Iterable[torch.dtype], out_features: int | None = None) -> None:
        """One matrix product; `out_features` (the last dim of the right operand) tells an LM head
        (the vocabulary size) from the rest."""
        names = ",".join(str(d).removeprefix("torch.") for d in dtypes)
        self.current["matmuls"][f"{op}({names})->{out_features}"] += 1

    def collective(self, kind: str, tensors: Iterable[torch.Tensor]) -> None:
        tensors = list(tensors)
        numel = sum(t.numel() for t in tensors)
        self.current["collectives"][kind] += 1
        self.current["collective_elements"][kind] += numel
        self.current["collective_sizes"].setdefault(kind, []).append([list(t.shape) for t in tensors])

    def total(self, key: str) -> Counter:
        out: Counter = Counter()
        for span in self.spans:
            out.update(span[key])
        return out

    def as_json(self) -> list[dict[str, Any]]:
        return [{k: (dict(v) if isinstance(v, (Counter, dict)) else v) for k, v in span.items()} for span in self.spans]

    def dump(self, path: str | os.PathLike) -> None:
        with open(path, "w", encoding="utf-8") as fh:
            json.dump(self.as_json(), fh, indent=1)


COUNTERS = Counters()


def _dump_at_exit() -> None:
    path = os.environ.get(ENV)
    if path:
        rank = os.environ.get("RANK")
        COUNTERS.dump(path if rank in (None, "0") else f"{path}.rank{rank}")


atexit.register(_dump_at_exit)
