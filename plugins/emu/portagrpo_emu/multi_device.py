"""N emulated devices in one process, as a node's process sees its accelerators.

`PORTAGRPO_EMU_DEVICES=N` (default 1) sets how many `emu` devices the machine has, and
`PORTAGRPO_EMU_VISIBLE_DEVICES` selects among them as CUDA_VISIBLE_DEVICES does, and as torch reads that one:
once, when the device runtime starts (here: when the device is installed, at its first use); a change afterwards
changes nothing in that process (the simulated Ascend has its own pair: plugins/npu_sim/torch_npu/module.py).
With more than one device the process needs a device guard that reports them to the autograd engine; PyTorch's
Python guard reports one, so a small C++ guard (device_guard.cpp, only c10 headers) is compiled once per torch
build with the system's C++ compiler and loaded before the device is installed. One device needs nothing
compiled.
"""
from __future__ import annotations

import ctypes
import hashlib
import os
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

DEVICES_ENV = "PORTAGRPO_EMU_DEVICES"
VISIBLE_ENV = "PORTAGRPO_EMU_VISIBLE_DEVICES"
CACHE_ENV = "PORTAGRPO_EMU_CACHE"
SOURCE = Path(__file__).with_name("device_guard.cpp")

_GUARD: ctypes.CDLL | None = None


def physical_count(env: str, default: int = 1) -> int:
    """The machine's emulated device count from `env` (a whole number >= 0; unset = `default`)."""
    raw = os.environ.get(env, "").strip()
    if not raw:
        return default
    try:
        count = int(raw)
    except ValueError:
        count = -1
    if count < 0:
        raise RuntimeError(f"{env}={raw!r} must be a whole number of emulated devices (0 or more).")
    return count


def visible_ids(physical: int, visible: str | None) -> list[int]:
    """The machine's devices a process sees under a visible-devices list, in the process's order (its device k is
    the machine's device ids[k]), read as torch reads CUDA_VISIBLE_DEVICES (torch/cuda/__init__.py
    `_parse_visible_devices` and its tests): unset shows all, an empty string none, otherwise the listed indices up
    to the first entry that is not one of the machine's devices; an index listed twice shows none."""
    if visible is None:
        return list(range(physical))
    seen: list[int] = []
    for item in visible.split(","):
        item = item.strip()
        if not item.isdigit() or int(item) >= physical:
            break
        if int(item) in seen:
            return []
        seen.append(int(item))
    return seen


def visible_count(physical: int, visible: str | None) -> int:
    return len(visible_ids(physical, visible))


def emu_device_ids() -> list[int]:
    """The machine's devices this process sees now (the device reads this once, when it is installed)."""
    return visible_ids(physical_count(DEVICES_ENV), os.environ.get(VISIBLE_ENV))


def emu_device_count() -> int:
    return len(emu_device_ids())


def _cache_dir() -> Path:
    base = os.environ.get(CACHE_ENV) or os.path.join(
        os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache"), "portagrpo-emu")
    return Path(base)


def _build(torch_lib: str, include: str, abi: int, target: Path) -> None:
    compiler = os.environ.get("CXX") or shutil.which("c++") or shutil.which("g++") or shutil.which("clang++")
    if compiler is None:
        raise RuntimeError(f"more than one emulated device per process needs a C++ compiler to build the emulated "
                           f"device guard ({SOURCE.name}); install g++ or clang++ (or set CXX), or set "
                           f"{DEVICES_ENV}=1.")
    target.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(suffix=".so", dir=target.parent)
    os.close(fd)
    flags = ["-O1", "-shared", "-fPIC", "-std=c++17", f"-D_GLIBCXX_USE_CXX11_ABI={abi}", f"-I{include}"]
    if sys.platform == "darwin":
        flags.append("-undefined dynamic_lookup")
    cmd = [compiler, *flags, str(SOURCE), f"-L{torch_lib}", "-lc10", f"-Wl,-rpath,{torch_lib}", "-o", tmp]
    res = subprocess.run(cmd, capture_output=True, text=True)
    if res.returncode != 0:
        os.unlink(tmp)
        first = (res.stderr.strip().splitlines() or ["no output"])[0][:300]
        raise RuntimeError(f"building the emulated device guard failed ({compiler}: {first}); set {DEVICES_ENV}=1 "
                           f"to run one emulated device per process.")
    os.replace(tmp, target)  # atomic: processes building at once all end with one whole library


def load_guard(count: int) -> None:
    """Register the C++ device guard for PrivateUse1 with `count` devices (before the device is installed)."""
    global _GUARD
    import torch

    if _GUARD is None:
        torch_dir = Path(torch.__file__).resolve().parent
        torch_lib, include = str(torch_dir / "lib"), str(torch_dir / "include")
        abi = int(bool(torch._C._GLIBCXX_USE_CXX11_ABI))
        key = hashlib.sha256(SOURCE.read_bytes() + f"{torch.__version__}|{torch_dir}|{abi}".encode()).hexdigest()[:16]
        target = _cache_dir() / f"device_guard-{key}.so"
        if not target.exists():
            _build(torch_lib, include, abi, target)
        _GUARD = ctypes.CDLL(str(target), mode=ctypes.RTLD_GLOBAL)  # its static initializer registers the guard
    _GUARD.portagrpo_emu_set_device_count(int(count))


def set_current(index: int) -> None:
    """Keep the C++ guard's current device (what torch's own code reads) with the Python one."""
    if _GUARD is not None:
        _GUARD.portagrpo_emu_set_current_device(int(index))
