"""Two ranks on emulated devices: DDP and FSDP2 over the device's own collective library
(portagrpo_emu.collectives, host-staged gloo), on `emu` and on the simulated Ascend (`npu`, HCCL),
against one CPU process on identical rollouts (tests/distributed/dp_worker.py)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.tolerances import tolerance

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
from npu_sim_env import npu_sim_env  # noqa: E402
from test_data_parallel import relative_error, run_worker  # noqa: E402
from test_emulated_device import ENV, HERE, pytestmark  # noqa: E402,F401 - the same skip rule

KEYS = ("loss_policy", "loss_kl", "kl", "grad_norm", "reward_mean", "adv_mean", "entropy", "clipfrac")


@pytest.fixture(scope="module")
def one_cpu(tmp_path_factory):
    return run_worker(tmp_path_factory.mktemp("one") / "cpu", 1, "auto", "fp32")


# npu x ddp is left to test_npu_sim.py's two-rank `portagrpo train --device npu` (CI time). With two
# devices per process each rank binds its own (rank 1 trains on index 1, its collectives refuse any other).
@pytest.mark.parametrize("device,parallel,per_process", [("emu", "ddp", 1), ("emu", "fsdp2", 1), ("npu", "fsdp2", 1),
                                                         ("emu", "ddp", 2), ("npu", "fsdp2", 2)])
def test_two_device_ranks_match_one_cpu_process(tmp_path, one_cpu, device, parallel, per_process):
    env = npu_sim_env(tmp_path) if device == "npu" else dict(ENV)
    env["PORTAGRPO_NPU_SIM_DEVICES" if device == "npu" else "PORTAGRPO_EMU_DEVICES"] = str(per_process)
    two = run_worker(tmp_path / "two", 2, parallel, "fp32", env=env, device=device)
    assert two["world"] == 2
    tol = tolerance(torch.float32, "loss")
    for m1, m2 in zip(one_cpu["metrics"], two["metrics"]):
        for key in KEYS:
            assert m2[key] == pytest.approx(m1[key], rel=tol, abs=tol), (device, parallel, key, m1[key], m2[key])
    assert one_cpu["state"].keys() == two["state"].keys()
    for name, p1 in one_cpu["state"].items():
        assert relative_error(two["state"][name], p1) < 2e-5, (device, parallel, name)


def test_fsdp2_storage_patch_still_fits_this_torch():
    """The one piece of private torch the emulated device replaces (FSDP2's free/alloc_storage) is
    pinned: on a tested torch it must still look as read; elsewhere FSDP2 on emu is refused in one
    sentence instead of running on a patch nobody checked."""
    code = ("from portagrpo_emu import fsdp_storage, device\n"
            "device.install()\n"
            "print('PROBLEMS', fsdp_storage.check())\n"
            "from portagrpo.backends import get_backend\n"
            "b = get_backend('emu')\n"
            "try:\n    print('CHOICE', b.parallel_strategy('fsdp2'))\n"
            "except Exception as err:\n    print('REFUSED', err)\n")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    from portagrpo_emu import fsdp_storage

    minor = ".".join(torch.__version__.split("+")[0].split(".")[:2])
    if minor in fsdp_storage.TESTED:
        assert "PROBLEMS []" in res.stdout and "CHOICE fsdp2" in res.stdout, res.stdout
    else:
        assert "REFUSED trainer.parallel=fsdp2 on --device emu" in res.stdout and torch.__version__ in res.stdout


@pytest.mark.parametrize("library", ["emuccl", "hccl"])
def test_collective_library_semantics(tmp_path, library):
    env = npu_sim_env(tmp_path) if library == "hccl" else ENV
    res = subprocess.run([sys.executable, str(HERE / "collective_checks.py"), library], env=env, capture_output=True,
                         text=True, timeout=300)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]
