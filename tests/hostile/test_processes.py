"""Processes: children die with a killed parent, signals end with one line, reward timeouts run in parallel."""
import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from portagrpo.rewards.functions import RewardFunctionError, RewardResolver, score_responses
from portagrpo.rewards.pool import RewardPool

ROOT = Path(__file__).resolve().parents[2]
linux_only = pytest.mark.skipif(not Path("/proc/self/stat").exists(), reason="reads the process table from /proc")
TINY = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=4", "data.train_size=16", "data.val_size=4", "trainer.test_freq=0",
        "data.max_response_length=8", "trainer.plot=false", "trainer.tensorboard=false"]


def children(pid: int) -> list[int]:
    out = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid and fields[0] != "Z":
            out.append(int(stat.parent.name))
    return out


def alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


def wait_for(condition, what: str, limit_s: float = 600.0):
    """Poll until `condition()` is truthy; the limit (far above start-up on a busy machine) only catches a hang."""
    end = time.monotonic() + limit_s
    while time.monotonic() < end:
        value = condition()
        if value:
            return value
        time.sleep(0.2)
    raise AssertionError(f"gave up waiting for {what}")


def start_training(tmp_path, *overrides):
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, "-m", "portagrpo", "train", "--output-dir", str(tmp_path / "run"), *TINY,
                             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


HANG = "import time\ndef score(ds, s, gt, extra=None):\n    time.sleep(3600)\n    return 1.0\n"


@linux_only
def test_kill_9_of_the_trainer_ends_its_hung_reward_workers(tmp_path):
    (tmp_path / "hang.py").write_text(HANG)
    proc = start_training(tmp_path, f"reward.function={tmp_path / 'hang.py'}:score", "reward.num_workers=2",
                          "reward.timeout_s=3000", "trainer.total_steps=1")
    try:
        # reward workers start at the first scoring call, so once they exist the step is scoring
        workers = wait_for(lambda: len(children(proc.pid)) >= 2 and children(proc.pid), "two reward workers")
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(alive(w) for w in workers), "the orphaned reward workers to exit")
    finally:
        proc.kill()


@linux_only
def test_kill_9_of_the_multi_rank_launcher_ends_its_ranks(tmp_path):
    proc = start_training(tmp_path, "trainer.nproc_per_node=2", "actor.micro_batch_size=2", "trainer.total_steps=10000",
                          "trainer.save_freq=0")
    try:
        ranks = wait_for(lambda: len(children(proc.pid)) >= 2 and children(proc.pid), "two ranks")
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").is_file(), "the ranks to start training")
        proc.kill()
        proc.wait()
        wait_for(lambda: not any(alive(r) for r in ranks), "the orphaned ranks to exit")
    finally:
        proc.kill()


@linux_only
def test_sigterm_ends_training_with_one_line(tmp_path):
    proc = start_training(tmp_path, "trainer.total_steps=10000", "trainer.save_freq=0")
    try:
        wait_for(lambda: (tmp_path / "run" / "metrics.jsonl").is_file(), "training to start")
        proc.send_signal(signal.SIGTERM)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    assert proc.returncode == 143
    assert "Traceback" not in err
    assert "portagrpo: stopped by SIGTERM" in err.strip().splitlines()[-1]


def test_hung_rewards_fail_after_one_timeout_wave_not_one_per_sample(tmp_path):
    (tmp_path / "hang.py").write_text(HANG)
    spec = f"{tmp_path / 'hang.py'}:score"
    pool = RewardPool(spec, num_workers=4, timeout_s=1.0)
    def failed_and_unscored(max_error_frac: float) -> tuple[int, int]:
        with pytest.raises(RewardFunctionError, match=r"timeout_s=1s") as err:
            score_responses(RewardResolver(spec), ["x"] * 32, ["1"] * 32, ["x"] * 32, list(range(32)),
                            max_error_frac=max_error_frac, pool=pool)
        found = re.search(r"failed on (\d+) of 32 samples, (\d+) left unscored", str(err.value))
        return int(found[1]), int(found[2])

    try:
        # Before: every sample waited for its own timeout in turn (32 x 1 s / 4 workers). Now the
        # first timeout beyond the tolerance stops scoring: at most one wave of 4 timed out.
        failed, unscored = failed_and_unscored(0.0)
        assert 1 <= failed <= 4 and failed + unscored == 32
        # tolerating 25% (8 samples): scoring stops within the wave that passes 8, long before 32
        failed, unscored = failed_and_unscored(0.25)
        assert 9 <= failed <= 12 and failed + unscored == 32
    finally:
        pool.close()


def test_reward_timeout_does_not_count_worker_start_up(tmp_path):
    slow_import = "import time\ntime.sleep(3)\ndef score(ds, s, gt, extra=None):\n    return 1.0\n"
    (tmp_path / "slow_start.py").write_text(slow_import)
    spec = f"{tmp_path / 'slow_start.py'}:score"
    pool = RewardPool(spec, num_workers=2, timeout_s=1.0)
    try:
        out = score_responses(RewardResolver(spec), ["a", "b", "c"], ["1"] * 3, ["x"] * 3, [0, 1, 2],
                              pool=pool)
        assert out.scores == [1.0, 1.0, 1.0] and not out.failures
    finally:
        pool.close()


def _ctrl_c(tmp_path, *overrides, started):
    """Start training in its own process group with Ctrl-C's default meaning, then do what a terminal
    does on Ctrl-C: SIGINT to every process of the group (trainer, ranks, reward workers)."""
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "portagrpo", "train", "--output-dir", str(tmp_path / "run"), *TINY,
                             *overrides], env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True,
                            start_new_session=True, preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))
    try:
        wait_for(lambda: started(proc), "training to start")
        os.killpg(proc.pid, signal.SIGINT)
        _, err = proc.communicate(timeout=600)
    finally:
        proc.kill()
    return proc.returncode, err


@linux_only
def test_ctrl_c_with_reward_workers_is_one_line(tmp_path):
    code, err = _ctrl_c(tmp_path, "reward.num_workers=2", "trainer.total_steps=100000", "trainer.save_freq=0",
                        started=lambda p: len(children(p.pid)) >= 2 and (tmp_path / "run" / "metrics.jsonl").is_file())
    assert code == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert [line for line in err.splitlines() if "stopped by" in line] == [err.strip().splitlines()[-1]]


@linux_only
def test_ctrl_c_of_a_two_rank_launcher_is_one_line(tmp_path):
    code, err = _ctrl_c(tmp_path, "trainer.nproc_per_node=2", "actor.micro_batch_size=2", "reward.num_workers=1",
                        "trainer.total_steps=100000", "trainer.save_freq=0",
                        started=lambda p: (tmp_path / "run" / "metrics.jsonl").is_file())
    assert code == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    stops = [line for line in err.splitlines() if "stopped by" in line]
    assert len(stops) == 1 and "portagrpo: stopped by" in stops[0], err


@linux_only
def test_ctrl_c_of_an_overlapped_run_is_one_line(tmp_path):
    """rollout.mode=one_step_off: the sampler process ignores the terminal's Ctrl-C and ends with the
    trainer, which prints the one line."""
    code, err = _ctrl_c(tmp_path, "rollout.mode=one_step_off", "trainer.total_steps=100000", "trainer.save_freq=0",
                        started=lambda p: len(children(p.pid)) >= 1 and (tmp_path / "run" / "metrics.jsonl").is_file())
    assert code == 130
    assert "Traceback" not in err and "KeyboardInterrupt" not in err
    assert [line for line in err.splitlines() if "stopped by" in line] == [err.strip().splitlines()[-1]]
