"""Backend registry: the one place that maps a `--device` name to a `Backend`."""
from __future__ import annotations

import os
from typing import Callable

from .base import Availability, Backend, BackendSpec, BackendUnavailable, BaseBackend
from .cpu import CPUBackend
from .cuda import CUDABackend
from .npu import NPUBackend
from .rocm import ROCmBackend

_FACTORIES: dict[str, Callable[[], BaseBackend]] = {}


def register_backend(name: str, factory: Callable[[], BaseBackend]) -> None:
    _FACTORIES[name] = factory


def backend_names() -> list[str]:
    return list(_FACTORIES)


register_backend("cpu", CPUBackend)


register_backend("cuda", CUDABackend)
register_backend("rocm", ROCmBackend)
register_backend("npu", NPUBackend)

AUTO_ORDER = ("npu", "cuda", "rocm", "cpu")


def all_backends() -> list[BaseBackend]:
    return [factory() for factory in _FACTORIES.values()]


def get_backend(name: str | None = None, factories: dict[str, Callable[[], BaseBackend]] | None = None) -> BaseBackend:
    """Return a usable backend for `name` (cpu|cuda|rocm|npu|auto), or raise BackendUnavailable.

    `auto` (also when `name` is None and PORTAGRPO_DEVICE is unset) picks npu > cuda/rocm > cpu
    by what is really usable. `factories` lets tests inject backends built on fake probes.
    """
    table = factories or _FACTORIES
    requested = (name if name not in (None, "") else None) or os.environ.get("PORTAGRPO_DEVICE") or "auto"
    if requested == "auto":
        for candidate in AUTO_ORDER:
            if candidate in table:
                backend = table[candidate]()
                if backend.is_available().ok:
                    return backend
        raise BackendUnavailable("no backend is usable on this machine, not even the CPU")
    if requested not in table:
        raise BackendUnavailable(
            f"trainer.device={requested!r} is not a known device; choose one of auto, {', '.join(table)}."
        )
    return table[requested]().require()


__all__ = [
    "Availability",
    "Backend",
    "BackendSpec",
    "BackendUnavailable",
    "BaseBackend",
    "all_backends",
    "backend_names",
    "get_backend",
    "register_backend",
]
