"""Checks that must run before `import torch`: a torch_npu wheel installed without the CANN
toolkit makes torch's device-backend autoload fail (`libhccl.so: cannot open shared object
file`), which breaks `import torch` itself. Nothing here imports torch or torch_npu.
"""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

AUTOLOAD_VAR = "TORCH_DEVICE_BACKEND_AUTOLOAD"
CANN_DEFAULT = "/usr/local/Ascend/ascend-toolkit/latest"
SET_ENV_HINT = "source /usr/local/Ascend/ascend-toolkit/set_env.sh"

# Set when portagrpo disabled the autoload to keep `import torch` working; doctor reports it.
autoload_disabled_reason: str | None = None


def torch_npu_installed() -> bool:
    try:
        return importlib.util.find_spec("torch_npu") is not None
    except (ImportError, ValueError):
        return False


def cann_library_dirs() -> list[Path]:
    dirs = [Path(p) for p in os.environ.get("LD_LIBRARY_PATH", "").split(":") if p]
    for var in ("ASCEND_TOOLKIT_HOME", "ASCEND_HOME_PATH"):
        if os.environ.get(var):
            dirs.append(Path(os.environ[var]) / "lib64")
    dirs.append(Path(CANN_DEFAULT) / "lib64")
    return dirs


def cann_found() -> bool:
    return any((d / "libhccl.so").exists() for d in cann_library_dirs())


def guard_torch_import() -> str | None:
    """If torch_npu is installed but CANN is not loaded, disable the autoload (unless the user
    chose a value) so that `import torch` keeps working; return the reason, else None."""
    global autoload_disabled_reason
    if not torch_npu_installed() or cann_found() or AUTOLOAD_VAR in os.environ:
        return None
    os.environ[AUTOLOAD_VAR] = "0"
    autoload_disabled_reason = (
        f"torch_npu is installed but the CANN toolkit is not loaded (libhccl.so was not found), which breaks "
        f"`import torch`; portagrpo set {AUTOLOAD_VAR}=0 so other devices still work. For the NPU, run "
        f"`{SET_ENV_HINT}`; otherwise `pip uninstall torch_npu`."
    )
    return autoload_disabled_reason
