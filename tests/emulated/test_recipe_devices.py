"""The shipped Qwen3-30B-A3B recipes' own settings (FSDP2, actor.offload and ref_offload, R2 router replay, KL loss,
gradient checkpointing; on the simulated Ascend also vLLM's tensor parallelism, through the stand-in playing
vllm-ascend 0.23) on 2 ranks of the emulated device and of the simulated Ascend (issue 50): a tiny Qwen3-MoE in place
of the checkpoint, trained 2 steps with a checkpoint, resumed for a third, equal to an uninterrupted 3-step run.
tests/emulated/recipe_check.py is one rank's run and lists what two small ranks change."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
from test_emulated_device import ENV, pytestmark  # noqa: F401 - the same skip rule

HERE = Path(__file__).resolve().parent
CONFIGS = HERE.parents[1] / "configs"


def _launch(tmp_path, device: str, out: Path, *args: str) -> list[dict]:
    from npu_sim_env import npu_sim_env

    env = npu_sim_env(tmp_path) if device == "npu" else {**ENV, "PORTAGRPO_EMU_DEVICES": "1"}
    recipe = CONFIGS / f"qwen3-30b-a3b-gsm8k-{'npu' if device == 'npu' else 'cuda'}.yaml"
    res = subprocess.run([sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(HERE / "recipe_check.py"),
                          device, str(recipe), str(out), *args], env=env, capture_output=True, text=True,
                         timeout=900, cwd=tmp_path)
    lines = [line for line in res.stdout.splitlines() if line.startswith("RESULT ")]
    assert res.returncode == 0 and lines, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(lines[0][len("RESULT "):])


@pytest.mark.parametrize("device", ["emu", "npu"])
def test_the_30b_a3b_recipe_settings_train_checkpoint_and_resume_on_two_ranks(tmp_path, device):
    first = _launch(tmp_path, device, tmp_path / "run", "2")
    resumed = _launch(tmp_path, device, tmp_path / "run", "3", "--resume")
    whole = _launch(tmp_path, device, tmp_path / "whole", "3")
    assert [r["step"] for r in first + resumed] == [r["step"] for r in whole] == [1, 2, 3]
    for a, b in zip(first + resumed, whole):
        assert a["moe/route_agreement"] == 1.0  # R2: the update routes as the old-policy pass did
        for key in ("loss_policy", "loss_kl", "grad_norm"):
            assert a[key] == pytest.approx(b[key], rel=1e-6, abs=1e-9), (a["step"], key)
