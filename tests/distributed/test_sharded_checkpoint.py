"""Sharded checkpoints under FSDP2 on 2 gloo ranks: each rank writes its own shards; a kill -9 at any moment leaves
only whole checkpoints; a resume repeats the uninterrupted run exactly, at 2 ranks or resharded at 1; `portagrpo
export` writes a Hugging Face directory from the shards, and `portagrpo eval` reads them."""
import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from portagrpo.backends.fsdp_compat import fsdp2_problem
from portagrpo.checkpoint import MANIFEST, SHARDS, list_checkpoints, verify_checkpoint
from portagrpo.metrics import MEASURED_KEYS, read_metrics

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
TRAIN = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "trainer.nproc_per_node=2",
         "trainer.parallel=fsdp2", "trainer.total_steps=4", "trainer.test_freq=0", "trainer.save_freq=1",
         "trainer.max_ckpt_to_keep=4", "trainer.progress_bar=false", "trainer.plot=false", "data.train_size=64"]

pytestmark = pytest.mark.skipif(fsdp2_problem(torch.float32) is not None, reason=f"FSDP2 refused on torch "
                                f"{torch.__version__}: {fsdp2_problem(torch.float32)}")


def train(*args: str, timeout: int = 600) -> None:
    res = subprocess.run([*TRAIN, *args], env=ENV, capture_output=True, text=True, timeout=timeout, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


@pytest.fixture(scope="module")
def whole_run(tmp_path_factory) -> Path:
    """4 uninterrupted steps, a sharded checkpoint after each."""
    run = tmp_path_factory.mktemp("sharded") / "run"
    train("--output-dir", str(run))
    return run


def test_each_rank_writes_its_own_shards_and_the_manifest_lists_them(whole_run):
    ckpt = list_checkpoints(whole_run)[-1]
    assert verify_checkpoint(ckpt) == []
    assert sorted(p.name for p in (ckpt / SHARDS).iterdir()) == [".metadata", "__0_0.distcp", "__1_0.distcp"]
    assert not (ckpt / "optimizer.pt").exists() and not list((ckpt / "model").glob("*.safetensors"))
    listed = json.loads((ckpt / MANIFEST).read_text())["files"]
    assert {f"{SHARDS}/__0_0.distcp", f"{SHARDS}/__1_0.distcp", f"{SHARDS}/.metadata", "model/config.json"} \
        <= set(listed)
    shard = ckpt / SHARDS / "__1_0.distcp"
    data = bytearray(shard.read_bytes())
    data[len(data) // 2] ^= 0xFF  # one flipped byte in rank 1's shard
    copy = whole_run.parent / "corrupt" / "checkpoints" / ckpt.name
    shutil.copytree(ckpt, copy)
    (copy / SHARDS / shard.name).write_bytes(bytes(data))
    (problem,) = verify_checkpoint(copy)
    assert "__1_0.distcp does not match its recorded SHA-256" in problem


def same_metrics(run: Path, reference: Path, steps: int = 4) -> None:
    first, again = read_metrics(reference / "metrics.jsonl"), read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in again] == list(range(1, steps + 1))
    for row, want in zip(again, first):
        assert {k: v for k, v in row.items() if k not in MEASURED_KEYS} == \
               {k: v for k, v in want.items() if k not in MEASURED_KEYS}, row["step"]


def test_kill_9_between_steps_then_the_resume_is_exact(whole_run, tmp_path):
    """The run's whole process group is killed -9 once step 2's checkpoint is in place (during step 3, or its
    save); resuming repeats the uninterrupted run's metrics exactly."""
    run = tmp_path / "run"
    proc = subprocess.Popen([*TRAIN, "--output-dir", str(run)], env=ENV, stdout=subprocess.DEVNULL,
                            stderr=subprocess.DEVNULL, cwd="/", start_new_session=True)
    try:
        deadline = time.monotonic() + 500
        step_2 = run / "checkpoints" / "step_00000002"
        while time.monotonic() < deadline and proc.poll() is None and not step_2.exists():
            time.sleep(0.01)
    finally:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    kept = list_checkpoints(run)
    assert [p.name for p in kept][:2] == ["step_00000001", "step_00000002"], kept
    assert all(verify_checkpoint(p) == [] for p in kept)  # no half checkpoint under a step_ name
    train("--output-dir", str(run), "--resume", str(run))
    same_metrics(run, whole_run)


def test_kill_9_mid_save_leaves_only_a_temporary(whole_run, tmp_path):
    """Killed -9 (every process of the run) at the worst moment of step 3's save: every rank's shards are written
    and fsynced but the manifest is not. What is left is a temporary without a step_ name; the run resumes from
    step 2, removes the temporary, and repeats the uninterrupted run exactly."""
    run = tmp_path / "run"
    env = {**ENV, "PYTHONPATH": str(HERE / "kill_inject"), "PORTAGRPO_TEST_KILL_AT_MANIFEST": "3"}
    proc = subprocess.run([*TRAIN, "--output-dir", str(run)], env=env, capture_output=True, text=True, timeout=600,
                          cwd="/", start_new_session=True)
    assert proc.returncode == -signal.SIGKILL, proc.stdout[-2000:] + proc.stderr[-2000:]
    root = run / "checkpoints"
    (left,) = [p for p in root.iterdir() if p.name.startswith(".tmp_step_00000003_")]
    assert (left / SHARDS / ".metadata").is_file() and not (left / MANIFEST).exists()
    assert [p.name for p in list_checkpoints(run)] == ["step_00000001", "step_00000002"]
    train("--output-dir", str(run), "--resume", str(run))
    assert not left.exists()
    same_metrics(run, whole_run)


def test_hybrid_sharding_saves_and_resumes_exactly(tmp_path):
    """4 ranks as 2 shard groups of 2 (trainer.fsdp_size=2): torch.distributed.checkpoint writes each replicated
    shard once across the groups, and a resume from step 2 repeats step 3 exactly."""
    from portagrpo.backends.fsdp_compat import native_sum

    if not native_sum():
        pytest.skip(f"trainer.fsdp_size needs torch 2.8+ (this is {torch.__version__})")
    args = ["trainer.nproc_per_node=4", "trainer.fsdp_size=2", "trainer.total_steps=3", "--output-dir"]  # the last wins
    whole, resumed = tmp_path / "whole", tmp_path / "resumed"
    train(*args, str(whole))
    ckpt = whole / "checkpoints" / "step_00000002"
    assert sorted(p.name for p in (ckpt / SHARDS).glob("*.distcp")) == [f"__{r}_0.distcp" for r in range(4)]
    shutil.copytree(whole, resumed)
    shutil.rmtree(resumed / "checkpoints" / "step_00000003")
    train(*args, str(resumed), "--resume", str(resumed / "checkpoints" / "step_00000002"))
    same_metrics(resumed, whole, steps=3)


def run_worker(out: Path, nproc: int, parallel: str, mode: str) -> dict:
    cmd = [sys.executable, str(HERE / "ckpt_worker.py"), str(out), parallel, mode]
    if nproc > 1:
        cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", str(nproc), *cmd[1:]]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out / "result.pt", weights_only=False)


@pytest.fixture(scope="module")
def fp64_run(tmp_path_factory) -> tuple[Path, dict]:
    if fsdp2_problem(torch.float64) is not None:
        pytest.skip(f"FSDP2 refuses float64 on torch {torch.__version__}")
    out = tmp_path_factory.mktemp("fp64")
    return out, run_worker(out, 2, "fsdp2", "train")


@pytest.mark.parametrize("nproc,parallel", [(1, "fsdp2"), (2, "ddp")])
def test_a_sharded_checkpoint_resumes_at_another_world_size_or_strategy(fp64_run, tmp_path, nproc, parallel):
    """Written by 2 FSDP2 ranks, loaded by 1 process or by 2 DDP ranks (torch.distributed.checkpoint reshards): the
    loaded state is bit for bit the state that was saved, and the next step equals the uninterrupted run's to the
    fp64 tolerance of 1 process == 2 processes (tests/distributed/test_data_parallel.py)."""
    out, two = fp64_run
    resumed_matches(out, two, tmp_path, nproc, parallel)


@pytest.mark.skipif(fsdp2_problem(torch.float64) is not None, reason="FSDP2 refuses float64 on this torch")
def test_a_whole_checkpoint_still_resumes_under_fsdp2(tmp_path):
    """The format DDP (and every FSDP2 run before sharded checkpoints) writes: `model/` safetensors and
    `optimizer.pt`, loaded by 2 FSDP2 ranks as before."""
    out = tmp_path / "ddp"
    two = run_worker(out, 2, "ddp", "train")
    assert (Path(two["checkpoint"]) / "optimizer.pt").is_file() and not (Path(two["checkpoint"]) / SHARDS).exists()
    resumed_matches(out, two, tmp_path / "fsdp2", 2, "fsdp2")


def resumed_matches(out: Path, two: dict, where: Path, nproc: int, parallel: str) -> None:
    """A copy of the worker's run resumed by `nproc` ranks under `parallel` loads the saved state bit for bit and
    repeats the next step to the fp64 tolerance of 1 process == 2 processes."""
    shutil.copytree(out / "run", where / "run")
    ckpt = where / "run" / "checkpoints" / Path(two["checkpoint"]).name
    other = run_worker(where, nproc, parallel, str(ckpt))
    assert (two["world"], other["world"]) == (2, nproc)
    assert other["before"].keys() == two["before"].keys() and any(".exp_avg_sq" in k for k in other["before"])
    for name, saved in two["before"].items():
        assert torch.equal(other["before"][name], saved), name
    for key in ("loss_policy", "loss_kl", "kl", "grad_norm", "reward_mean", "entropy", "clipfrac"):
        assert other["metrics"][key] == pytest.approx(two["metrics"][key], rel=1e-10, abs=1e-10), key
    for name, value in two["after"].items():
        error = float((other["after"][name] - value).norm() / value.norm().clamp(min=1e-30))
        assert error < 1e-10, (name, error)


def test_export_of_a_sharded_checkpoint_loads_with_transformers(whole_run, tmp_path):
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save
    from transformers import AutoModelForCausalLM

    from portagrpo.tools.export import export, write_sharded_weights

    out = export(whole_run, tmp_path / "export", log=lambda m: None)
    model = AutoModelForCausalLM.from_pretrained(out)
    dcp_to_torch_save(list_checkpoints(whole_run)[-1] / SHARDS, tmp_path / "whole.pt")  # the reference, loaded whole
    saved = torch.load(tmp_path / "whole.pt", weights_only=False)["model"]
    state = model.state_dict()
    assert set(state) - set(saved) == {"lm_head.weight"} and model.config.tie_word_embeddings  # tied, stored once
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
    split = tmp_path / "split"
    split.mkdir()
    files = write_sharded_weights(list_checkpoints(whole_run)[-1] / SHARDS, split, shard_bytes=100_000)
    assert len(files) > 1 and (split / "model.safetensors.index.json").is_file()
    shutil.copy(out / "config.json", split)
    again = AutoModelForCausalLM.from_pretrained(split)
    assert all(torch.equal(again.state_dict()[k], v) for k, v in state.items())


def test_eval_of_a_run_reads_its_sharded_checkpoint(whole_run):
    """`portagrpo eval --model RUN` builds the run's base model and reads the newest checkpoint's shards into it."""
    from torch.distributed.checkpoint.format_utils import dcp_to_torch_save

    from portagrpo.tools.evaluate import load_for_eval

    model, _, _, described = load_for_eval(whole_run)
    ckpt = list_checkpoints(whole_run)[-1]
    assert described == f"{ckpt} (sharded)"
    dcp_to_torch_save(ckpt / SHARDS, whole_run.parent / "eval-whole.pt")
    saved = torch.load(whole_run.parent / "eval-whole.pt", weights_only=False)["model"]
    state = model.state_dict()
    for name, value in saved.items():
        assert torch.equal(state[name], value), name
