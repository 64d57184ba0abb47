"""Packed rows past the old 4,096-token cap on the emulated device and on the simulated Ascend (through
npu_fusion_attention's TND layout there): fp32 log-probs, entropies and gradients equal the padded grid's
(tests/emulated/packed_checks.py)."""
import json
import subprocess
import sys

import pytest
import torch
from npu_sim_env import npu_sim_env
from test_emulated_device import ENV, HERE, pytestmark  # noqa: F401 - the same skip rule

from portagrpo.tolerances import tolerance


@pytest.mark.parametrize("device", ["emu", "npu"])
def test_packed_rows_equal_the_padded_grid(tmp_path, device):
    env = npu_sim_env(tmp_path) if device == "npu" else ENV
    res = subprocess.run([sys.executable, str(HERE / "packed_checks.py"), device], env=env, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    out = json.loads(res.stdout.strip().splitlines()[-1])
    if device == "npu" and out["attention"] == "npu_fusion":
        assert out["varlen_calls"] > 0 and not out["block_diagonal_calls"]  # the fused op's TND layout
    else:
        assert out["block_diagonal_calls"] > 0
    for quantity, error in out["errors"].items():
        assert error <= tolerance(torch.float32, quantity), (device, quantity, error)
