"""The hardware check runs as one command and writes one report; CI runs it on cpu here and on emu from the installed
wheel in a fresh --no-deps venv (test_installed_wheel.py), at the tiny size, so the script itself is tested (on a
GPU/NPU machine it runs at full size)."""
import json
import os
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
EXPECTED = ["doctor", "parity", "device tests", "record on cpu", "replay on device", "bench kernels", "bench step"]


def _check(device: str, out: Path) -> dict:
    """The script run from OUT's parent with OUT relative: the steps find the model, the runs and the
    device-marked tests (beside the package, in this editable install) wherever the caller stands."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(["bash", str(ROOT / "ci" / "hardware-check.sh"), device, out.name, "--size", "tiny"],
                         capture_output=True, text=True, env=env, cwd=out.parent, timeout=1800)
    assert (out / "report.json").is_file(), res.stdout[-3000:] + res.stderr[-3000:]
    report = json.loads((out / "report.json").read_text())
    assert res.returncode == (0 if report["passed"] else 1)
    return report


def test_hardware_check_on_the_cpu(tmp_path):
    report = _check("cpu", tmp_path / "cpu")
    steps = {s["step"]: s for s in report["steps"]}
    assert all(name in steps for name in EXPECTED)
    failed = [s for s in report["steps"] if s["status"] == "failed"]
    assert not failed, failed
    runs = [s for s in report["steps"] if "-step run" in s["step"] and s["status"] == "passed"]
    from portagrpo.model.expert_parallel import ep_import_problem

    ep = {"ep x2"} if ep_import_problem() is None else set()  # the tiny Qwen3-MoE's experts over 2 ranks
    assert {s["step"].split(", ")[1] for s in runs} == {"one process", "ddp x2", "fsdp2 x2", "embedded default",
                                                        "FSDP2 with actor.offload on one rank", *ep}
    assert steps["runs with rollout.engine=vllm"]["status"] == "skipped"  # no vLLM here: said, not passed
    planned = steps["peak memory against portagrpo plan"]
    assert planned["status"] == "passed" and {"update", "load"} <= set(planned["phases"])
    assert all(v["measured_gib"] > 0 and v["planned_gib"] > 0 for v in planned["phases"].values())
    numbers = steps["bench step"]["numbers"]
    assert numbers["model_flops_per_s_per_device"] > 0 and 0 < numbers["matmul_utilization"]
    assert numbers["mfu"] is None and "no datasheet peak" in numbers["mfu_peak_source"]  # a CPU has no row
    parity = json.loads((tmp_path / "cpu" / "parity.json").read_text())
    assert {(r["dtype"], r["kernel"]) for r in parity} == {
        (d, k) for d in ("fp32", "bf16") for k in ("reference", "chunked")
    }
    assert "| parity | passed |" in (tmp_path / "cpu" / "report.md").read_text()
    assert steps["device tests"]["status"] == "passed" and (tmp_path / "cpu" / "pytest-device.xml").is_file()
    assert steps["bench step"]["status"] == "passed" and (tmp_path / "cpu" / "model" / "config.json").is_file()
