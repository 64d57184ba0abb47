"""Hybrid sharding (trainer.fsdp_size): 4 CPU ranks as 2 shard groups of 2 replicas train as one process does, in fp64;
a group size that does not divide the ranks is one sentence."""
import json
import os
import subprocess
import sys

import pytest

from portagrpo.backends.fsdp_compat import native_sum

ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}
RUN = ["trainer.total_steps=2", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.progress_bar=false",
       "trainer.tensorboard=false", "trainer.plot=false", "data.train_batch_size=4", "rollout.n=4",
       "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "rollout.engine=fixed",
       "model.dtype=fp64", "trainer.parallel=fsdp2"]
KEYS = ("loss_policy", "loss_kl", "kl", "grad_norm", "entropy", "clipfrac", "ppo_kl")


def _train(out, *extra) -> list[dict]:
    res = subprocess.run([sys.executable, "-m", "portagrpo", "train", "--output-dir", str(out), *RUN, *extra],
                         env=ENV, capture_output=True, text=True, timeout=1200, cwd=out.parent)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


@pytest.mark.skipif(not native_sum(), reason="HSDP needs FSDP2's sum across replicas (torch 2.8+)")
@pytest.mark.parametrize("tied", ["true", "false"])
def test_two_groups_of_two_train_as_one_process(tmp_path, tied):
    """Untied: the head and embedding are read one shard-group rank's rows at a time (model/parallel.py RankRows),
    each block's gradient summed within the shard group and then across the replicas."""
    model = [f"model.tiny.tie_word_embeddings={tied}"]
    one = _train(tmp_path / "one", *model)
    hsdp = _train(tmp_path / "hsdp", "trainer.nproc_per_node=4", "trainer.fsdp_size=2", *model)
    assert len(one) == len(hsdp) == 2
    for a, b in zip(one, hsdp):
        for key in KEYS:
            assert b[key] == pytest.approx(a[key], rel=1e-10, abs=1e-12), key


@pytest.mark.parametrize("size,words", [(3, "must divide the 4 ranks"), (0, "is not a group size")])
def test_a_group_size_that_does_not_fit_is_one_sentence(capsys, size, words):
    from portagrpo.cli import main

    code = main(["train", "--dry-run", "trainer.nproc_per_node=4", "trainer.parallel=fsdp2",
                 f"trainer.fsdp_size={size}", "data.train_batch_size=4", "actor.ppo_mini_batch_size=8"])
    err = capsys.readouterr().err
    assert code == 2 and f"trainer.fsdp_size={size}" in err and words in err and "Traceback" not in err
