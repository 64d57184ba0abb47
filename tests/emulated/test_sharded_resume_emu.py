"""Sharded FSDP2 checkpoints on a device whose collective library takes only device tensors for its collectives, as
NCCL and HCCL do (the emulated device's `emuccl`): torch.distributed.checkpoint plans a save with gather/scatter of
objects, each rank writes its own shards, and a resumed run's next step equals the uninterrupted run's exactly."""
import json
import subprocess
import sys

from test_emulated_device import ENV, pytestmark  # noqa: F401 - the same skip rule

RUN = ["trainer.nproc_per_node=2", "trainer.test_freq=0", "trainer.save_freq=1", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=2",
       "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "trainer.parallel=fsdp2", "trainer.seed=3"]


def _train(out, steps: int, *extra: str) -> None:
    cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "emu", "--output-dir", str(out), *extra, *RUN,
           f"trainer.total_steps={steps}"]
    res = subprocess.run(cmd, env={**ENV, "PORTAGRPO_EMU_DEVICES": "1"}, capture_output=True, text=True, timeout=1200,
                         cwd=out.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def test_a_resumed_emulated_fsdp2_run_continues_exactly(tmp_path):
    whole, parts = tmp_path / "whole", tmp_path / "parts"
    _train(whole, 2)
    _train(parts, 1)
    assert (parts / "checkpoints" / "step_00000001" / "shards").is_dir()  # each rank's own shards, no gathered model
    _train(parts, 2, "--resume", "auto")
    a = json.loads((whole / "metrics.jsonl").read_text().splitlines()[-1])
    b = json.loads((parts / "metrics.jsonl").read_text().splitlines()[-1])
    assert a["step"] == b["step"] == 2
    for key in ("loss_policy", "grad_norm", "entropy", "reward_mean"):
        assert a[key] == b[key], key
