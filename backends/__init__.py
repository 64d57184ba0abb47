"""Backend registry: the one place that maps a `--device` name to a `Backend`."""
from __future__ import annotations

import os
from typing import Callable

from .base import Availability, Backend, BackendSpec, BackendUnavailable, BaseBackend
from .cpu import CPUBackend

_FACTORIES: dict[str, Callable[[], BaseBackend]] = {}


def register_backend(name: str, factory: Callable[[], BaseBackend]) -> None:
    _FACTORIES[name] = factory


def backend_names() -> list[str]:
    return list(_FACTORIES)


register_backend("cpu", CPUBackend)


class _NotYetBackend(BaseBackend):
    """A vendor whose module is not written yet: it says so in one sentence."""

    def __init__(self, name: str, device_type: str, dist: str) -> None:
        super().__init__(BackendSpec(name=name, device_type=device_type, dist_backend=dist))

    def is_available(self) -> Availability:
        return Availability(False, f"the {self.name} backend is not implemented yet in this version of portagrpo")


for _name, _dt, _dist in (("cuda", "cuda", "nccl"), ("rocm", "cuda", "nccl"), ("npu", "npu", "hccl")):
    register_backend(_name, lambda n=_name, d=_dt, c=_dist: _NotYetBackend(n, d, c))


def get_backend(name: str | None = None) -> BaseBackend:
    """Return a usable backend for `name` (cpu|cuda|rocm|npu|auto), or raise BackendUnavailable."""
    requested = name or os.environ.get("PORTAGRPO_DEVICE") or "auto"
    if requested == "auto":
        for candidate in ("npu", "cuda", "rocm", "cpu"):
            backend = _FACTORIES[candidate]()
            if backend.is_available().ok:
                return backend
        raise BackendUnavailable("no backend is usable on this machine, not even the CPU")
    if requested not in _FACTORIES:
        raise BackendUnavailable(
            f"trainer.device={requested!r} is not a known device; choose one of auto, {', '.join(_FACTORIES)}."
        )
    return _FACTORIES[requested]().require()


__all__ = [
    "Availability",
    "Backend",
    "BackendSpec",
    "BackendUnavailable",
    "BaseBackend",
    "backend_names",
    "get_backend",
    "register_backend",
]
