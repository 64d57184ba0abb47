"""FSDP2 frees an unsharded parameter by resizing its storage to zero and re-allocates it by
resizing it back (torch/distributed/fsdp/_fully_shard/_fsdp_param.py: `free_storage`,
`alloc_storage`). An emulated device tensor is a wrapper whose own storage is a placeholder
(resizing it raises "invalid python storage"); its bytes live in the CPU payload. This module
makes those two helpers resize the payload for emulated tensors and leaves every other tensor to
torch's own code.

It replaces private torch functions, so it is pinned: it installs only on the torch versions it
was read against (TESTED), after checking the helpers still look as read, and otherwise says
which torch changed what. tests/emulated/test_multirank.py fails loudly when that happens.
"""
from __future__ import annotations

import inspect
from typing import Callable

import torch

TESTED = ("2.13",)
_MODULES = ("torch.distributed.fsdp._fully_shard._fsdp_param", "torch.distributed.fsdp._fully_shard._fsdp_param_group")
_INSTALLED = False


class UnsupportedTorch(RuntimeError):
    pass


def _torch_minor() -> str:
    return ".".join(torch.__version__.split("+")[0].split(".")[:2])


def check() -> list[str]:
    """What in this torch differs from what the patch was written against (empty when it matches)."""
    import importlib

    problems = []
    if _torch_minor() not in TESTED:
        problems.append(f"torch {torch.__version__} is not one of the tested versions {', '.join(TESTED)}")
    param = importlib.import_module(_MODULES[0])
    for name in ("free_storage", "alloc_storage"):
        fn = getattr(param, name, None)
        if not callable(fn):
            problems.append(f"{_MODULES[0]}.{name} no longer exists")
            continue
        src = inspect.getsource(getattr(fn, "__wrapped__", fn))
        if "untyped_storage()" not in src or ".resize_(" not in src:
            problems.append(f"{_MODULES[0]}.{name} no longer resizes the untyped storage")
    group = importlib.import_module(_MODULES[1])
    if getattr(getattr(group, "alloc_storage", None), "__module__", None) not in (_MODULES[0], __name__):
        problems.append(f"{_MODULES[1]} no longer imports alloc_storage from {_MODULES[0]}")
    return problems


def install(is_emulated: Callable[[torch.Tensor], bool]) -> None:
    """Route FSDP2's storage helpers to the payload for emulated tensors (once per process)."""
    global _INSTALLED
    if _INSTALLED:
        return
    problems = check()
    if problems:
        raise UnsupportedTorch("FSDP2 on an emulated device patches torch's private storage helpers, and "
                               + "; ".join(problems) + ": re-read them and update plugins/emu/portagrpo_emu/"
                               "fsdp_storage.py (or run FSDP2 on torch " + " / ".join(TESTED) + ").")
    import importlib

    from . import device

    param = importlib.import_module(_MODULES[0])
    original_free, original_alloc = param.free_storage, param.alloc_storage

    def free_storage(tensor: torch.Tensor) -> None:
        if not is_emulated(tensor):
            return original_free(tensor)
        if device.payload_storage_size(tensor):
            device.resize_payload_storage(tensor, 0)

    def alloc_storage(tensor: torch.Tensor) -> None:
        if not is_emulated(tensor):
            return original_alloc(tensor)
        size = tensor.numel() * tensor.itemsize
        if device.payload_storage_size(tensor) != size:
            device.resize_payload_storage(tensor, size)

    free_storage.__wrapped__ = original_free  # type: ignore[attr-defined]
    alloc_storage.__wrapped__ = original_alloc  # type: ignore[attr-defined]
    for name in _MODULES:
        module = importlib.import_module(name)
        for fn in (free_storage, alloc_storage):
            if hasattr(module, fn.__name__):
                setattr(module, fn.__name__, fn)
    _INSTALLED = True
