"""The emulated accelerator (`--device emu`, the portagrpo-emu plugin): a device that is not the CPU,
so a tensor left on the host fails here as it would on a GPU or NPU. Each run is its own process,
because the PrivateUse1 device is process-global."""
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.utils.backend_registration as _registration  # noqa: E402

from portagrpo.tolerances import tolerance
from portagrpo.tools import parity_stages

# The plugin registers its device through PyTorch's Python device API, which torch 2.7 lacks.
pytestmark = pytest.mark.skipif(not hasattr(_registration, "_setup_privateuseone_for_python_backend"),
                                reason=f"torch {torch.__version__} has no Python device API "
                                       f"(_setup_privateuseone_for_python_backend), which the emulated device needs")
HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
# Several mini- and micro-batches and two epochs, so the update indexes its batch many ways.
FAST = ["trainer.total_steps=3", "trainer.test_freq=3", "trainer.save_freq=0", "trainer.progress_bar=false",
        "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=4",
        "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4", "actor.ppo_epochs=2"]


def _run(args: list[str], cwd: Path) -> subprocess.CompletedProcess:
    res = subprocess.run([sys.executable, "-m", "portagrpo", *args], env=ENV, capture_output=True, text=True,
                         timeout=900, cwd=cwd)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return res


def _metrics(run: Path) -> list[dict]:
    return [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines() if line.strip()]


@pytest.mark.parametrize("check", ["index_needs_same_device", "train_batch_select_with_host_indices",
                                   "device_rng_is_its_own"])
def test_placement(check):
    res = subprocess.run([sys.executable, str(HERE / "placement_checks.py"), check], env=ENV, capture_output=True,
                         text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]


@pytest.mark.parametrize("check", ["several_devices_per_process", "collectives_on_the_bound_device"])
def test_several_devices_per_process(check):
    """PORTAGRPO_EMU_DEVICES=3: one process drives three devices (autograd included, through the plugin's
    C++ device guard), as a rank on a node sees the node's accelerators."""
    res = subprocess.run([sys.executable, str(HERE / "placement_checks.py"), check],
                         env={**ENV, "PORTAGRPO_EMU_DEVICES": "3"}, capture_output=True, text=True, timeout=600)
    assert res.returncode == 0 and res.stdout.strip().endswith("ok"), res.stdout[-2000:] + res.stderr[-2000:]


@pytest.mark.parametrize("visible,count", [(None, 4), ("", 0), ("2,0", 2), ("1,7,2", 1), ("0,1,0", 0), ("x", 0)])
def test_visible_devices_are_read_as_torch_reads_cuda_visible_devices(visible, count):
    from portagrpo_emu.multi_device import visible_count

    assert visible_count(4, visible) == count


def test_a_bad_device_count_is_one_sentence():
    code = "from portagrpo.backends import get_backend\nget_backend('emu').device_count()\n"
    res = subprocess.run([sys.executable, "-c", code], env={**ENV, "PORTAGRPO_EMU_DEVICES": "two"},
                         capture_output=True, text=True, timeout=300)
    assert res.returncode != 0 and "PORTAGRPO_EMU_DEVICES='two' must be a whole number" in res.stderr


@pytest.mark.parametrize("lora", [False, True], ids=["full", "lora"])
def test_train_on_emu_matches_cpu(tmp_path, lora):
    """The embedded default, full model and LoRA: same samples (each device's RNG seeded alike), same losses."""
    extra = ["model.lora.rank=4", "actor.lr=1e-3"] if lora else []
    for device in ("cpu", "emu"):
        _run(["train", "--device", device, "--output-dir", str(tmp_path / device), *FAST, *extra], tmp_path)
    cpu, emu = _metrics(tmp_path / "cpu"), _metrics(tmp_path / "emu")
    assert_trained_alike(cpu, emu)
    assert emu[-1]["val/acc"] == pytest.approx(cpu[-1]["val/acc"])
    assert_memory_by_phase(emu)


def assert_memory_by_phase(rows: list[dict]) -> None:
    """Every step logs each phase's peak (train/memory.py), the device's byte count here; the load's with the first
    step. The update holds the most (weights, gradients, optimizer state), and the step's peak is its largest."""
    phases = ("rollout", "scoring", "update", "push")
    assert rows[0]["mem/load_peak_gb"] > 0 and all("mem/load_peak_gb" not in r for r in rows[1:])
    for row in rows:
        peaks = {p: row[f"mem/{p}_peak_gb"] for p in phases}
        assert all(v > 0 for v in peaks.values()), row
        assert row["mem_peak_gb"] == pytest.approx(max(peaks.values()), rel=1e-6) == peaks["update"]
        assert peaks["push"] < peaks["update"]


def assert_trained_alike(cpu: list[dict], device: list[dict]) -> None:
    """Same samples (same rewards and lengths), losses within the fp32 tolerance table, as many steps."""
    assert len(cpu) == len(device) == 3
    tol = tolerance(torch.float32, "loss")
    for a, b in zip(cpu, device):
        assert a["response_len_mean"] == b["response_len_mean"] and a["reward_mean"] == b["reward_mean"]
        for key in ("loss_policy", "entropy", "ppo_kl"):
            assert b[key] == pytest.approx(a[key], rel=tol, abs=tol), key
        assert b["grad_norm"] == pytest.approx(a["grad_norm"], rel=1e-4)


def test_a_cpu_checkpoint_resumes_on_emu(tmp_path):
    """A CPU checkpoint (its AdamW fused: BackendSpec.fused_adamw; this device's row keeps torch's default) resumes on
    this device and trains the CPU run's steps 2 and 3 alike. (This device runs torch's fused op through its CPU
    fallback, so this run does not show `keep_step_form`: tests/unit/test_optimizer_form.py does.)"""
    import shutil

    cpu = tmp_path / "cpu"
    _run(["train", "--device", "cpu", "--output-dir", str(cpu), *FAST, "trainer.save_freq=1",
          "trainer.max_ckpt_to_keep=3"], tmp_path)
    moved = tmp_path / "moved"
    shutil.copytree(cpu, moved)
    for later in ("step_00000002", "step_00000003"):
        shutil.rmtree(moved / "checkpoints" / later)
    (moved / "metrics.jsonl").write_text("")
    first = moved / "checkpoints" / "step_00000001"
    _run(["train", "--device", "emu", "--output-dir", str(moved), "--resume", str(first), *FAST, "trainer.save_freq=0"],
         tmp_path)
    straight, resumed = _metrics(cpu), _metrics(moved)
    assert [r["step"] for r in resumed] == [2, 3]
    tol = tolerance(torch.float32, "loss")
    for a, b in zip(straight[1:], resumed):
        assert a["response_len_mean"] == b["response_len_mean"] and a["reward_mean"] == b["reward_mean"]
        assert b["loss_policy"] == pytest.approx(a["loss_policy"], rel=tol, abs=tol)


def test_parity_runs_on_emu(tmp_path):
    res = _run(["parity", "--device", "emu", "--dtype", "fp32,bf16", "--kernels", "reference,chunked",
                "--json", str(tmp_path / "p.json")], tmp_path)
    reports = json.loads((tmp_path / "p.json").read_text())
    assert len(reports) == 4 and all(r["passed"] and r["device"] == "emu" for r in reports), res.stdout[-2000:]
    skip = parity_stages.VLM if parity_stages.vlm_unavailable() else set()
    for r in reports:  # the multi-turn and vision-language stages ran too (issues 35, 36)
        assert parity_stages.STAGES <= {s["stage"] for s in r["stages"]}
        assert {s["stage"] for s in r["stages"] if s.get("skipped")} == skip


def test_arange_and_a_tensor_of_device_scalars_keep_their_shapes():
    """torch.arange on the device read as size [0] (its generic kernel resizes an empty tensor through arange.out,
    which the wrapper never saw), and torch.tensor([device scalars]) failed inside torch; Qwen2.5-VL's vision
    positions and rope index use both (the parity suite's vision-language stage)."""
    code = ("import torch; from portagrpo.backends import get_backend; d = get_backend('emu').device(0); "
            "a = torch.arange(1, 7, 2, device=d); s = torch.tensor([a.sum(), a.max()], device=d); "
            "print(tuple(torch.arange(4, device=d).shape), tuple(a.shape), s.device.type, s.cpu().tolist())")
    res = subprocess.run([sys.executable, "-c", code], env=ENV, capture_output=True, text=True, timeout=300)
    assert res.stdout.strip() == "(4,) (3,) emu [9, 5]", res.stdout[-1000:] + res.stderr[-2000:]


def test_cpu_recording_replays_on_emu(tmp_path):
    run = tmp_path / "run"
    _run(["train", "--device", "cpu", "--output-dir", str(run), "trainer.record_rollouts=true", *FAST], tmp_path)
    res = _run(["replay", str(run), "--device", "emu", "--output-dir", str(tmp_path / "replay")], tmp_path)
    assert "pass" in res.stdout.lower()
