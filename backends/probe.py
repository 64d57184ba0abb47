"""What the backends read from the installed torch and vendor packages.

Backends take a `RuntimeProbe` so selection logic can be tested with injected facts
instead of pretending a device exists.
"""
from __future__ import annotations

import importlib
import importlib.util
from dataclasses import dataclass, field
from typing import Any, Callable

import torch


def _has_module(name: str) -> bool:
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def _device_module(device_type: str) -> Any:
    """torch.cuda, or torch.npu (which exists only once torch_npu is imported)."""
    if device_type == "npu":
        importlib.import_module("torch_npu")
    return getattr(torch, device_type)


@dataclass
class RuntimeProbe:
    torch_version: str = field(default_factory=lambda: torch.__version__)
    hip_version: str | None = field(default_factory=lambda: getattr(torch.version, "hip", None))
    cuda_version: str | None = field(default_factory=lambda: getattr(torch.version, "cuda", None))
    has_module: Callable[[str], bool] = _has_module
    device_module: Callable[[str], Any] = _device_module
    module_version: Callable[[str], str | None] = field(default=lambda name: _dist_version(name))


def _dist_version(name: str) -> str | None:
    try:
        from importlib.metadata import version

        return version(name)
    except Exception:  # noqa: BLE001 - not installed or no metadata
        return None


VENDOR_PACKAGES = ("torch", "transformers", "torch_npu", "triton", "flash_attn", "vllm", "vllm_ascend", "ray", "peft")


def torch_build() -> dict[str, str | None]:
    return {"version": torch.__version__, "cuda": getattr(torch.version, "cuda", None),
            "hip": getattr(torch.version, "hip", None)}


def package_versions() -> dict[str, str | None]:
    """Installed versions from package metadata; nothing is imported."""
    return {name: _dist_version(name) or _dist_version(name.replace("_", "-")) for name in VENDOR_PACKAGES}
