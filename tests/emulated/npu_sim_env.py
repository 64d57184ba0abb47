"""The environment that turns `--device npu` into the simulated Ascend (plugins/npu_sim): the
stand-in torch_npu on PYTHONPATH and a CANN toolkit directory that backends/npu_env.py finds.
Never used where a real torch_npu is installed."""
from __future__ import annotations

import importlib.util
import os
from pathlib import Path

import pytest

SIM = Path(__file__).resolve().parents[2] / "plugins" / "npu_sim"


def npu_sim_env(tmp_path: Path) -> dict[str, str]:
    if importlib.util.find_spec("torch_npu") is not None:
        pytest.skip("a real torch_npu is installed: the simulated Ascend never shadows it")
    if importlib.util.find_spec("portagrpo_emu") is None:
        pytest.skip("the simulated Ascend runs on portagrpo-emu (pip install -e plugins/emu)")
    toolkit = tmp_path / "ascend-toolkit"
    (toolkit / "lib64").mkdir(parents=True, exist_ok=True)
    (toolkit / "lib64" / "libhccl.so").write_bytes(b"")  # what cann_found() looks for; nothing loads it
    path = os.pathsep.join(p for p in (str(SIM), os.environ.get("PYTHONPATH", "")) if p)
    return {**os.environ, "PYTHONPATH": path, "ASCEND_TOOLKIT_HOME": str(toolkit), "OMP_NUM_THREADS": "1",
            "PYTHONUNBUFFERED": "1"}
