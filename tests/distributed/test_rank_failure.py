"""A failure on one rank ends every rank within bounded time, with one sentence naming the rank and the cause,
under portagrpo's launcher and under torchrun; the checkpoints already written stay whole.

Before the fix, a rank that failed waited at a barrier on its way out while its peer waited in a collective:
both hung until trainer.dist_timeout_s, here an hour, so the subprocess limit below (far above the run's
real duration of tens of seconds) would be hit."""
import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

HERE = Path(__file__).resolve().parent
RUN = ["trainer.progress_bar=false", "trainer.plot=false", "trainer.tensorboard=false", "data.train_size=32",
       "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=2",
       "data.max_response_length=8", "trainer.test_freq=0", "trainer.total_steps=3", "trainer.save_freq=1",
       "trainer.dist_timeout_s=3600"]
HANG_LIMIT_S = 400  # only catches the hang: a failing run ends in well under a minute
REWARD = """import os
def score(data_source, solution_str, ground_truth, extra_info=None):
    if os.environ.get("RANK") == "1" and os.path.exists(os.environ.get("FAIL_REWARD_AFTER", "/nonexistent")):
        raise ValueError("injected failure in the reward phase")
    return float(solution_str[:1] == ground_truth[:1])
"""
CAUSES = {"data": "injected failure in the data phase", "engine": "injected failure in the engine phase",
          "update": "injected failure in the update phase", "reward": "injected failure in the reward phase"}


def _env(phase: str, tmp_path: Path) -> dict[str, str]:
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1",
           "PYTHONPATH": os.pathsep.join([str(HERE / "fail_inject"), os.environ.get("PYTHONPATH", "")])}
    env.pop("PORTAGRPO_TEST_FAIL", None)
    if phase == "reward":  # once step 1's checkpoint is whole
        env["FAIL_REWARD_AFTER"] = str(tmp_path / "run" / "checkpoints" / "step_00000001" / "manifest.json")
    elif phase:
        env["PORTAGRPO_TEST_FAIL"] = f"{phase}@2"  # rank 1's second call: step 1 and its checkpoint are done
    return env


def _train_args(tmp_path: Path, reward: Path, *extra: str) -> list[str]:
    return ["train", "--device", "cpu", "--output-dir", str(tmp_path / "run"), f"reward.function={reward}:score",
            *RUN, *extra]


@pytest.fixture()
def reward(tmp_path) -> Path:
    path = tmp_path / "reward.py"
    path.write_text(REWARD)
    return path


def _check_whole_checkpoint(tmp_path: Path) -> None:
    from portagrpo.checkpoint import list_checkpoints, verify_checkpoint

    saved = list_checkpoints(tmp_path / "run")
    assert saved, "step 1's checkpoint was written before the failure"
    for ckpt in saved:
        assert verify_checkpoint(ckpt) == [], ckpt


@pytest.mark.parametrize("phase,workers", [("reward", "1"), ("reward", "0"), ("data", "1"), ("engine", "1"),
                                           ("update", "1")])
def test_local_launcher_stops_every_rank_with_one_sentence(tmp_path, reward, phase, workers):
    res = subprocess.run([sys.executable, "-m", "portagrpo", *_train_args(tmp_path, reward, "trainer.nproc_per_node=2",
                                                                          f"reward.num_workers={workers}")],
                         env=_env(phase, tmp_path), capture_output=True, text=True, timeout=HANG_LIMIT_S, cwd="/")
    assert res.returncode != 0
    errors = [line for line in res.stderr.splitlines() if line.startswith("portagrpo: error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert errors[0].startswith("portagrpo: error: rank 1 of 2 failed: ") and CAUSES[phase] in errors[0], errors
    assert "The other rank (0) was stopped with it" in errors[0] and "--resume" in errors[0]
    _check_whole_checkpoint(tmp_path)
    if phase == "update":  # whole, and the run continues from it
        res = subprocess.run([sys.executable, "-m", "portagrpo", *_train_args(tmp_path, reward,
                                                                              "trainer.nproc_per_node=2"),
                              "--resume", "auto"], env=_env("", tmp_path), capture_output=True, text=True,
                             timeout=HANG_LIMIT_S, cwd="/")
        assert res.returncode == 0, res.stderr[-3000:]


def _torchrun_in_own_network() -> list[str] | None:
    """torchrun's rendezvous store listens on every interface: it runs in a network namespace of its own,
    where the only interface is loopback (root on Linux: `unshare -n`)."""
    if shutil.which("unshare") is None or shutil.which("ip") is None:
        return None
    probe = subprocess.run(["unshare", "-n", "ip", "link", "set", "lo", "up"], capture_output=True)
    return ["unshare", "-n", "sh", "-c", 'ip link set lo up && exec "$@"', "sh"] if probe.returncode == 0 else None


@pytest.mark.parametrize("phase", ["reward", "data", "engine", "update"])
def test_torchrun_stops_every_rank_and_names_the_failing_one(tmp_path, reward, phase):
    wrap = _torchrun_in_own_network()
    if wrap is None:
        pytest.skip("needs `unshare -n` (root on Linux) to keep torchrun's store off the machine's network")
    cmd = [*wrap, sys.executable, "-m", "torch.distributed.run", "--nproc-per-node", "2", "--master-addr",
           "127.0.0.1", "--master-port", "29511", "-m", "portagrpo", *_train_args(tmp_path, reward)]
    res = subprocess.run(cmd, env=_env(phase, tmp_path), capture_output=True, text=True, timeout=HANG_LIMIT_S, cwd="/")
    assert res.returncode != 0
    named = [line for line in res.stderr.splitlines() if line.startswith("portagrpo: error: rank 1 of 2: ")]
    assert named and CAUSES[phase] in res.stderr, res.stderr[-3000:]
    # torchrun's own summary names the cause as the root cause (TORCHELASTIC_ERROR_FILE)
    assert "rank 1 of 2: " in res.stderr.split("Root Cause")[-1], res.stderr[-3000:]
    _check_whole_checkpoint(tmp_path)
