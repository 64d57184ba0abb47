"""Backend registry: the one place that maps a `--device` name to a `Backend`."""
from __future__ import annotations

import os
from typing import Callable

from portagrpo.registry import Registry

from .base import Availability, Backend, BackendSpec, BackendUnavailable, BaseBackend
from .cpu import CPUBackend
from .cuda import CUDABackend
from .npu import NPUBackend
from .rocm import ROCmBackend

# --device name -> factory; built-ins, then entry-point plugins (the one Registry every table uses)
BACKENDS: Registry[Callable[[], Backend]] = Registry("device")


def register_backend(name: str, factory: Callable[[], Backend]) -> None:
    BACKENDS.set(name, factory)


ENTRY_POINT_GROUP = "portagrpo.backends"
_PLUGINS_LOADED = False


def load_plugins() -> None:
    """Register the backends that installed packages declare in the `portagrpo.backends`
    entry-point group (name = the `--device` value, object = a factory returning a backend).
    Only the entry points are read here; a plugin's module is imported when its backend is built."""
    global _PLUGINS_LOADED
    if _PLUGINS_LOADED:
        return
    _PLUGINS_LOADED = True
    from importlib.metadata import entry_points

    for ep in entry_points(group=ENTRY_POINT_GROUP):
        if ep.name not in BACKENDS:
            register_backend(ep.name, _lazy_factory(ep))


def _lazy_factory(ep) -> Callable[[], BaseBackend]:
    def build() -> Backend:
        try:
            factory = ep.load()
        except Exception as err:  # noqa: BLE001 - a broken plugin must not hide the others
            raise BackendUnavailable(f"the backend plugin {ep.name!r} ({ep.value}) failed to import: {err}") from err
        return factory()

    return build


def backend_names() -> list[str]:
    load_plugins()
    return BACKENDS.names()


register_backend("cpu", CPUBackend)


register_backend("cuda", CUDABackend)
register_backend("rocm", ROCmBackend)
register_backend("npu", NPUBackend)

AUTO_ORDER = ("npu", "cuda", "rocm", "cpu")


def all_backends() -> list[Backend]:
    load_plugins()
    return [BACKENDS.get(name)() for name in BACKENDS]


def unstarted_backend(name: str) -> Backend:
    """Backend `name` not started: its data row and its answers that need no device (which strategy, attention,
    kernel), whether or not it is usable on this machine (the memory plan of a recipe is made away from its
    cluster)."""
    load_plugins()
    return BACKENDS.get(name, field="trainer.device")()


def backend_spec(name: str) -> BackendSpec:
    """The data row of backend `name`, whether or not it is usable on this machine."""
    return unstarted_backend(name).spec


def get_backend(name: str | None = None, factories: dict[str, Callable[[], BaseBackend]] | None = None) -> Backend:
    """Return a usable backend for `name` (cpu|cuda|rocm|npu|auto), or raise BackendUnavailable.

    `auto` (also when `name` is None and PORTAGRPO_DEVICE is unset) picks npu > cuda/rocm > cpu
    by what is really usable. `factories` lets tests inject backends built on fake probes.
    """
    if factories is None:
        load_plugins()
    table = factories or BACKENDS.mapping
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
    "BACKENDS",
    "Backend",
    "Availability",
    "BackendSpec",
    "BackendUnavailable",
    "BaseBackend",
    "all_backends",
    "backend_names",
    "get_backend",
    "load_plugins",
    "register_backend",
]
