"""Settings that used to be ignored or to end in a traceback (issue 49): a generator the policy cannot serve or that
does not exist, trainer.fsdp_size where the run does not shard with FSDP2, and report folders a killed launcher left
behind."""
import os
import subprocess
import sys
import tempfile

import pytest

from portagrpo.cli import main

TINY = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=4", "data.train_size=8", "data.val_size=4", "trainer.test_freq=0",
        "data.max_response_length=8", "trainer.plot=false", "trainer.tensorboard=false", "trainer.total_steps=1"]


def _one_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err and len(lines) == 1 and lines[0].startswith("portagrpo: error: "), err
    return lines[0]


def test_an_unknown_generator_is_refused_by_the_dry_run(capsys):
    assert main(["train", "--dry-run", "rollout.generator=nosuch"]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "rollout.generator='nosuch' is not a known generator" in line and "text" in line


@pytest.mark.parametrize("dry", [True, False])
def test_a_vision_generator_on_a_text_policy_is_one_sentence(tmp_path, capsys, dry):
    argv = ["train", *(["--dry-run"] if dry else ["--output-dir", str(tmp_path / "run")]), *TINY,
            "rollout.generator=vision"]
    assert main(argv) == 2
    line = _one_error(capsys.readouterr().err)
    assert "rollout.generator=vision makes a vision-language policy's rows, and this policy is text-only" in line


def test_fsdp_size_on_one_rank_is_refused_not_ignored(tmp_path, capsys):
    assert main(["train", "--output-dir", str(tmp_path / "run"), *TINY, "trainer.fsdp_size=4"]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "trainer.fsdp_size=4 asks for shard groups of 4 ranks, and this run has 1" in line


def test_fsdp_size_with_a_strategy_that_does_not_shard_is_refused(capsys):
    """On the CPU, trainer.parallel=auto is DDP: a shard group would be ignored."""
    assert main(["train", "--dry-run", "trainer.device=cpu", "trainer.nproc_per_node=2", "trainer.fsdp_size=2",
                 *TINY]) == 2
    line = _one_error(capsys.readouterr().err)
    assert "trainer.fsdp_size=2 sets FSDP2's shard groups, and trainer.parallel=auto runs ddp here" in line
    assert main(["train", "--dry-run", "trainer.device=cpu", "trainer.nproc_per_node=2", "trainer.fsdp_size=2",
                 "trainer.parallel=fsdp2", *TINY]) == 0


def test_a_killed_launchers_report_folder_is_removed_at_the_next_start(tmp_path, monkeypatch):
    from portagrpo.launcher import RANKS_PREFIX, launch_local

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    dead = subprocess.Popen(["true"])
    dead.wait()
    stale = tmp_path / f"{RANKS_PREFIX}{dead.pid}-abc"
    live = tmp_path / f"{RANKS_PREFIX}{os.getpid()}-def"
    stale.mkdir()
    live.mkdir()
    assert launch_local(1, [sys.executable, "-c", "pass"]) == 0
    assert not stale.exists() and live.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == [live.name]  # its own folder is gone as well
