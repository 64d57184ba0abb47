"""The vision tower's attention as each backend answers it (Backend.vision_attention_implementation), on a tiny
Qwen2.5-VL on cpu, the emulated device and the simulated Ascend: features, log-probs and fp32 vision gradients
against the eager reference; on the simulated Ascend, one npu_fusion_attention TND call per vision block over
the block's cu_seqlens windows, no attention across a window or image boundary, and the op's refusals. Each device
in its own process (tests/emulated/vision_checks.py). A simulation, not hardware: see docs/backends.md."""
import subprocess
import sys

import pytest
from npu_sim_env import npu_sim_env
from test_emulated_device import ENV, HERE, pytestmark  # noqa: F401 - the emulated device's skip


def _check(device, check, env):
    res = subprocess.run([sys.executable, str(HERE / "vision_checks.py"), device, check], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-3000:] + res.stderr[-3000:]
    return res.stdout


@pytest.mark.parametrize("device", ["cpu", "emu", "npu"])
def test_vision_tower_with_the_backends_attention_matches_eager(device, tmp_path):
    out = _check(device, "features_and_logprobs_match_eager", npu_sim_env(tmp_path) if device == "npu" else ENV)
    expected = "npu_flash_varlen" if device == "npu" else "sdpa"
    assert f"{device}: vision attention {expected}" in out


@pytest.mark.parametrize("check", ["windows_in_one_tnd_call", "varlen_adapter_equals_sdpa_per_window",
                                   "installed_op_refuses_what_the_wrapper_refuses"])
def test_simulated_ascend_vision_windows(check, tmp_path):
    _check("npu", check, npu_sim_env(tmp_path))
