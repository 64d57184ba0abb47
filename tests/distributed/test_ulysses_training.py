"""Ulysses in the trainer on 2 CPU ranks (gloo, FSDP2, fp64): a sequence-parallel group of 2 trains as 2 data-parallel
ranks do, with a scoring pass (2 PPO epochs: each rank brings its share, the group scores the union), the KL
reference, and token-budget micro-batches (the budget is per rank, so per group 2x), step for step to fp64 rounding
(DDP on a torch whose FSDP2 averages fp64 gradients)."""
import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_data_parallel import ENV  # noqa: E402

RUN = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=2",
       "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "rollout.engine=fixed",
       "trainer.nproc_per_node=2", "model.dtype=fp64", "data.max_response_length=40",
       "actor.kl_loss_coef=0.1", "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=72"]


def train(out: Path, sp: int, parallel: str) -> list[dict]:
    cmd = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(out), *RUN,
           f"trainer.parallel={parallel}", f"actor.ulysses_sequence_parallel_size={sp}"]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=out.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def test_a_sequence_parallel_group_trains_as_data_parallel_ranks(tmp_path):
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    parallel = "ddp" if fsdp2_problem(torch.float64) else "fsdp2"  # the oldest stack's FSDP2 averages fp64 gradients
    dp, sp = train(tmp_path / "dp", 1, parallel), train(tmp_path / "sp", 2, parallel)
    assert len(dp) == len(sp) == 2
    for a, b in zip(dp, sp):
        for key in ("loss_policy", "grad_norm", "kl", "entropy", "ppo_kl"):
            assert b[key] == pytest.approx(a[key], rel=1e-10, abs=1e-12), key
