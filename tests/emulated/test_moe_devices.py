"""A mixture-of-experts policy off the CPU: on the simulated Ascend (--device npu) its routers pick experts through
torch_npu's npu_moe_gating_top_k_softmax (the stand-in's semantics as documented) and its experts run eagerly; on
the emulated device likewise eagerly. Both: the MoE parity stage within the fp32 and bf16 tolerances, and an R3 run
on 2 ranks (FSDP2 on the simulated Ascend, DDP on emu) whose sampler and trainer log-probs agree to fp32 rounding,
and whose checkpoint of step 1 resumes to the same step 2."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from npu_sim_env import npu_sim_env

from portagrpo.tolerances import tolerance
from portagrpo.tools import parity, parity_moe

HERE = Path(__file__).resolve().parent
pytestmark = pytest.mark.skipif(parity_moe.moe_unavailable() is not None, reason=str(parity_moe.moe_unavailable()))


def _check(device: str, env: dict, *strategy: str) -> dict:
    res = subprocess.run([sys.executable, str(HERE / "moe_device_checks.py"), device, *strategy], env=env,
                         capture_output=True, text=True, timeout=600, cwd=HERE)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


def _assert_agrees(out: dict) -> None:
    assert {stage.split(":")[0] for stage in out["errors"]} == {"fp32", "bf16"}
    for stage, error in out["errors"].items():
        dtype, name = stage.split(":")
        assert error <= tolerance(parity.DTYPES[dtype], parity_moe.QUANTITY[name]), (stage, error)
    _assert_trains(out)


def _assert_trains(out: dict) -> None:
    assert out["rc"] == 0 and all(abs(kl) < 1e-6 for kl in out["kl"]), out["kl"]
    assert all(0.5 < a <= 1.0 for a in out["agreement"])
    assert out["steps_again"] == [1, 2] and out["resume_differs"] == [], out["resume_differs"]  # resumed exactly


def test_simulated_ascend_picks_experts_with_the_vendor_op(tmp_path):
    out = _check("npu", npu_sim_env(tmp_path))
    assert out["experts"] == "eager" and out["calls"] > 0
    _assert_agrees(out)


def test_emulated_device_runs_the_experts_eagerly(tmp_path):
    pytest.importorskip("portagrpo_emu")
    import os

    out = _check("emu", {**os.environ, "OMP_NUM_THREADS": "1"})
    assert out["experts"] == "eager" and out["calls"] == 0
    _assert_agrees(out)


@pytest.mark.parametrize("device,strategy", [("npu", "ddp"), ("emu", "fsdp2")])
def test_the_other_strategy_trains_and_resumes_on_each_device(tmp_path, device, strategy):
    """DDP on the simulated Ascend and FSDP2 (the experts sharded) on the emulated device: the R3 run at fp32
    rounding, and its step-1 checkpoint resumed to the same step 2."""
    import os

    env = npu_sim_env(tmp_path) if device == "npu" else {**os.environ, "OMP_NUM_THREADS": "1"}
    _assert_trains(_check(device, env, strategy))


def test_the_stand_in_op_keeps_the_documented_semantics():
    """The simulated torch_npu.npu_moe_gating_top_k_softmax against its documented formula, on the host (the module
    file alone; the installed op refuses non-NPU tensors)."""
    import importlib.util

    path = HERE.parents[1] / "plugins" / "npu_sim" / "torch_npu" / "moe.py"  # the module alone, not the package
    spec = importlib.util.spec_from_file_location("npu_sim_moe", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    op = module.npu_moe_gating_top_k_softmax
    x = torch.randn(5, 6, dtype=torch.bfloat16)
    finished = torch.tensor([False, True, False, False, True])
    y, idx, rows = op(x, finished, k=2)
    probs = torch.softmax(x.float(), -1)
    top = torch.topk(probs, 2, -1)
    assert y.dtype == torch.bfloat16 and idx.dtype == torch.int32 and rows.dtype == torch.int32
    assert torch.equal(y, top.values.to(torch.bfloat16))
    assert torch.equal(idx[~finished], top.indices[~finished].int()) and (idx[finished] == 6).all()
    assert rows.tolist() == [[n, 5 + n] for n in range(5)]
    with pytest.raises(RuntimeError, match="k=7"):
        op(x, k=7)
    with pytest.raises(RuntimeError, match="inference"):
        op(x.float().requires_grad_(), k=2)
