"""`--device npu` on the simulated Ascend (plugins/npu_sim): portagrpo's own backends/npu.py, its
attention adapter and HCCL rules, run by the CLI as a user would run them. A simulation, not
hardware: what it cannot prove is listed in docs/backends.md."""
import json
import subprocess
import sys

import pytest
from npu_sim_env import npu_sim_env
from test_emulated_device import ENV, FAST, HERE, _metrics, assert_trained_alike, pytestmark  # noqa: F401

from portagrpo.tools import parity_stages


def _run(args, cwd, env):
    res = subprocess.run([sys.executable, "-m", "portagrpo", *args], env=env, capture_output=True, text=True,
                         timeout=900, cwd=cwd)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


@pytest.fixture(scope="module")
def cpu_two_ranks(tmp_path_factory):
    run = tmp_path_factory.mktemp("cpu2") / "run"
    _run(["train", "--device", "cpu", "--output-dir", str(run), "trainer.nproc_per_node=2", *FAST], run.parent, ENV)
    return _metrics(run)


@pytest.mark.parametrize("parallel", ["ddp", "fsdp2"])
def test_train_two_npu_ranks_matches_cpu(tmp_path, cpu_two_ranks, parallel):
    """Same per-rank seeds, so the same samples; losses within the fp32 tolerance of the CPU run."""
    env = npu_sim_env(tmp_path)
    res = _run(["train", "--device", "npu", "--output-dir", str(tmp_path / "run"), "trainer.nproc_per_node=2",
                f"trainer.parallel={parallel}", *FAST], tmp_path, env)
    assert f"device npu, 2 process(es), {parallel} parallel" in res.stdout
    assert_trained_alike(cpu_two_ranks, _metrics(tmp_path / "run"))


def test_parity_runs_on_the_simulated_npu(tmp_path):
    env = npu_sim_env(tmp_path)
    res = _run(["parity", "--device", "npu", "--dtype", "fp32,bf16", "--kernels", "reference,chunked",
                "--json", str(tmp_path / "p.json")], tmp_path, env)
    reports = json.loads((tmp_path / "p.json").read_text())
    assert len(reports) == 4 and all(r["passed"] and r["device"] == "npu" for r in reports), res.stdout[-2000:]
    skip = parity_stages.VLM if parity_stages.vlm_unavailable() else set()
    for r in reports:  # the multi-turn and vision-language stages ran too (issues 35, 36)
        assert parity_stages.STAGES <= {s["stage"] for s in r["stages"]}
        assert {s["stage"] for s in r["stages"] if s.get("skipped")} == skip


def test_cpu_recording_replays_on_the_simulated_npu(tmp_path):
    env = npu_sim_env(tmp_path)
    run = tmp_path / "run"
    _run(["train", "--device", "cpu", "--output-dir", str(run), "trainer.record_rollouts=true", *FAST], tmp_path, ENV)
    res = _run(["replay", str(run), "--device", "npu", "--output-dir", str(tmp_path / "replay")], tmp_path, env)
    assert "pass" in res.stdout.lower()


@pytest.mark.parametrize("check", ["fusion_attention_semantics", "adapter_in_a_gqa_model_under_autocast"])
def test_simulation(tmp_path, check):
    res = subprocess.run([sys.executable, str(HERE / "sim_checks.py"), check], env=npu_sim_env(tmp_path),
                         capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]


def test_one_step_off_samples_on_a_second_npu(tmp_path):
    """Issue 31 item 3: the sampler process of rollout.mode=one_step_off on npu:1 of a 2-NPU node, running
    the backend's npu_fusion attention, which must be registered in that process too."""
    env = {**npu_sim_env(tmp_path), "PORTAGRPO_NPU_SIM_DEVICES": "2"}
    res = subprocess.run([sys.executable, str(HERE / "sim_checks.py"), "one_step_off_on_a_second_device"], env=env,
                         capture_output=True, text=True, timeout=900)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-3000:]


def test_two_ranks_one_step_off_on_a_four_npu_node(tmp_path):
    """`portagrpo train` with two ranks per node and rollout.devices=2 on a simulated node of 4 NPUs: ranks
    on npu:0 and npu:1, their sampler processes on npu:2 and npu:3 (Backend.sampler_process_device)."""
    env = {**npu_sim_env(tmp_path), "PORTAGRPO_NPU_SIM_DEVICES": "4"}
    run = tmp_path / "run"
    res = _run(["train", "--device", "npu", "--output-dir", str(run), "trainer.nproc_per_node=2",
                "rollout.mode=one_step_off", "rollout.devices=2", "trainer.total_steps=2", "trainer.test_freq=0",
                "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.plot=false",
                "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
                "data.max_response_length=8", "reward.num_workers=0"], tmp_path, env)
    assert "device npu, 2 process(es)" in res.stdout
    assert [m["rollout_staleness"] for m in _metrics(run)] == [0, 1]


def test_the_stand_in_never_shadows_a_real_torch_npu(tmp_path):
    """A torch_npu found elsewhere on the path wins: the stand-in refuses to load in front of it."""
    real = tmp_path / "site" / "torch_npu"
    real.mkdir(parents=True)
    (real / "__init__.py").write_text("REAL = True\n")
    env = npu_sim_env(tmp_path)
    env["PYTHONPATH"] = env["PYTHONPATH"] + ":" + str(tmp_path / "site")
    res = subprocess.run([sys.executable, "-c", "import torch_npu"], env=env, capture_output=True, text=True,
                         timeout=300)
    assert res.returncode != 0 and "a real torch_npu is installed" in res.stderr


def test_visible_devices_are_read_once_at_first_use(tmp_path):
    """As ACL reads ASCEND_RT_VISIBLE_DEVICES when torch_npu initialises, the simulated Ascend reads it once: a change
    after that first use is not seen (a child process that must see one device sets it before it starts)."""
    env = {**npu_sim_env(tmp_path), "PORTAGRPO_NPU_SIM_DEVICES": "4", "ASCEND_RT_VISIBLE_DEVICES": "1,3"}
    code = ("import os, torch, torch_npu\n"
            "first = torch.npu.device_count()\n"
            "os.environ['ASCEND_RT_VISIBLE_DEVICES'] = ''\n"
            "print(first, torch.npu.device_count(), torch.npu.is_available())\n")
    res = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, timeout=300)
    assert res.returncode == 0, res.stderr[-2000:]
    assert res.stdout.split() == ["2", "2", "True"]
