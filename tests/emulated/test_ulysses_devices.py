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


TRAIN = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
         "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=2",
         "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "rollout.engine=fixed",
         "trainer.nproc_per_node=2", "trainer.parallel=fsdp2", "data.max_response_length=40", "actor.kl_loss_coef=0.1",
         "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=72"]


@pytest.mark.parametrize("device", ["emu", "npu"])
def test_the_trainer_with_a_sequence_parallel_group_trains_as_data_parallel_ranks_on_devices(tmp_path, device):
    """The trainer on 2 ranks of the device (FSDP2, fp32, a scoring pass, the KL reference, token budgets): SP=2
    trains as 2 data-parallel ranks, step for step to fp32 rounding."""
    env = npu_sim_env(tmp_path) if device == "npu" else dict(ENV)
    env["PORTAGRPO_NPU_SIM_DEVICES" if device == "npu" else "PORTAGRPO_EMU_DEVICES"] = "1"

    def run(sp: int) -> list[dict]:
        out = tmp_path / f"sp{sp}"
        cmd = [sys.executable, "-m", "portagrpo", "train", "--device", device, "--output-dir", str(out), *TRAIN,
               f"actor.ulysses_sequence_parallel_size={sp}"]
        counted = {"PORTAGRPO_EMU_COUNTERS": str(tmp_path / f"counters_sp{sp}.json")} if device == "emu" else {}
        res = subprocess.run(cmd, env={**env, **counted}, capture_output=True, text=True, timeout=900, cwd=tmp_path)
        assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
        return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]

    dp, sp = run(1), run(2)
    assert len(dp) == len(sp) == 2
    for a, b in zip(dp, sp):
        for key in ("loss_policy", "grad_norm", "kl", "entropy"):
            assert b[key] == pytest.approx(a[key], rel=2e-4, abs=1e-6), (device, key, a[key], b[key])
    if device == "emu":  # the group really split the rows: all-to-alls around attention, none without SP
        def all_to_alls(sp: int) -> int:
            spans = json.loads((tmp_path / f"counters_sp{sp}.json").read_text())
            return sum(span["collectives"].get("all_to_all", 0) for span in spans)

        assert all_to_alls(2) > 0 and all_to_alls(1) == 0
