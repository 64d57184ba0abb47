"""Issue 45 item 2: the one_step_off sampler process must see only its own device before anything in it starts the
device runtime, which reads its visible-devices variable once (torch's CUDA initialisation; the emulated device now
models it: portagrpo_emu/multi_device.py). Each check runs in a process of its own (sampler_device_checks.py)."""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.backend_registration as _registration

pytestmark = pytest.mark.skipif(not hasattr(_registration, "_setup_privateuseone_for_python_backend"),
                                reason=f"torch {torch.__version__} has no Python device API, which the emulated "
                                       f"device needs")
HERE = Path(__file__).resolve().parent


@pytest.mark.parametrize("check,visible", [("visible_devices_are_read_once", "2,0"),
                                           ("vllm_sampler_lands_on_its_own_device", None)])
def test_sampler_device(check, visible):
    env = {k: v for k, v in os.environ.items() if k not in ("PORTAGRPO_EMU_VISIBLE_DEVICES", "LOCAL_RANK")}
    env.update(OMP_NUM_THREADS="1", PORTAGRPO_EMU_DEVICES="3", **({"PORTAGRPO_EMU_VISIBLE_DEVICES": visible}
                                                                 if visible is not None else {}))
    res = subprocess.run([sys.executable, str(HERE / "sampler_device_checks.py"), check], env=env,
                         capture_output=True, text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-3000:]
