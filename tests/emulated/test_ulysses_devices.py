"""Ulysses sequence parallelism on 2 ranks of the emulated device and of the simulated Ascend (HCCL): the group's
gradients add up to one rank's in fp64 (the all-to-alls carry float64 as int64 bits), with one kv head repeated over
the group, and with activation offload on the simulated Ascend (tests/distributed/ulysses_worker.py)."""
import json
import subprocess
import sys

import pytest
import torch
from npu_sim_env import npu_sim_env
from test_emulated_device import ENV, HERE, pytestmark  # noqa: F401 - the same skip rule

from portagrpo.tolerances import tolerance

WORKER = HERE.parent / "distributed" / "ulysses_worker.py"


@pytest.mark.parametrize("device,extra", [("emu", ()), ("npu", ("offload",))], ids=["emu", "npu-offload"])
def test_sequence_parallel_gradients_equal_one_rank_on_devices(tmp_path, device, extra):
    env = npu_sim_env(tmp_path) if device == "npu" else dict(ENV)
    env["PORTAGRPO_NPU_SIM_DEVICES" if device == "npu" else "PORTAGRPO_EMU_DEVICES"] = "1"
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(WORKER), str(tmp_path), device, "fp64",
           "2", "1", *extra]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    for rank in (0, 1):
        errors = json.loads((tmp_path / f"errors_rank{rank}.json").read_text())
        if extra:
            assert errors.pop("moved_bytes") > 0  # layer inputs went to host memory
        assert errors.pop("logp") <= tolerance(torch.float64, "logprob")
        assert errors.pop("scoring") <= tolerance(torch.float64, "logprob")  # each rank its own rows, scored together
        worst = max(errors, key=errors.get)
        assert errors[worst] <= tolerance(torch.float64, "grad"), (device, worst, errors[worst])
