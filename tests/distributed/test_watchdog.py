"""A dead peer ends the run with one sentence on NCCL/RCCL/HCCL too, not only on gloo.

On gloo a failed collective raises in Python at once. NCCL and HCCL run collectives asynchronously
and leave failures to a watchdog thread, whose default is to take the process down from C++
(SIGABRT and a trace). The accelerator backends set the watchdog to abort the communicators and keep
the process, so the next collective raises ("... communicator was aborted ...") and becomes the
one-sentence `PeerFailure`; a rank that is still taken down by a signal is named by the launcher.
"""
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import torch.distributed as dist

from portagrpo.backends.cuda import CUDABackend
from portagrpo.backends.dist import DistEnv, PeerFailure, ProcessGroupCollectives, init_collectives
from portagrpo.backends.npu import NPUBackend
from portagrpo.backends.rocm import ROCmBackend

ROOT = Path(__file__).resolve().parents[2]
WATCHDOG_VARS = {"cuda": "TORCH_NCCL_ASYNC_ERROR_HANDLING", "rocm": "TORCH_NCCL_ASYNC_ERROR_HANDLING",
                 "npu": "HCCL_ASYNC_ERROR_HANDLING"}


def _formed_group_env(monkeypatch, backend) -> dict:
    """The environment the collective library sees when `init_collectives` forms the group."""
    seen = {}
    monkeypatch.setenv("MASTER_ADDR", "127.0.0.1")
    monkeypatch.setenv("MASTER_PORT", "1")
    monkeypatch.setattr(dist, "is_initialized", lambda: False)
    monkeypatch.setattr(dist, "init_process_group", lambda **kw: seen.update(os.environ, backend=kw["backend"]))
    monkeypatch.setattr(backend, "set_device", lambda local_rank: None)
    init_collectives(backend, 30.0, DistEnv(rank=0, world_size=2))
    return seen


@pytest.mark.parametrize("make", [CUDABackend, ROCmBackend, NPUBackend], ids=["cuda", "rocm", "npu"])
def test_the_watchdog_keeps_the_process_so_python_sees_the_failure(monkeypatch, make):
    backend = make()
    var = WATCHDOG_VARS[backend.name]
    monkeypatch.delenv(var, raising=False)
    seen = _formed_group_env(monkeypatch, backend)
    assert seen[var] == "2"  # CleanUpOnly in both ProcessGroupNCCL's and ProcessGroupHCCL's ErrorHandlingMode
    # the library for the device, gloo for host tensors (FSDP2's offloaded shards: issue 50)
    assert seen["backend"] == f"cpu:gloo,{backend.device_type}:{backend.dist_backend}"


def test_a_users_watchdog_setting_wins(monkeypatch):
    monkeypatch.setenv("TORCH_NCCL_ASYNC_ERROR_HANDLING", "3")
    assert _formed_group_env(monkeypatch, CUDABackend())["TORCH_NCCL_ASYNC_ERROR_HANDLING"] == "3"


@pytest.mark.parametrize("message", [
    "NCCL communicator was aborted on rank 0. Original reason for failure was: [Rank 0] Watchdog caught collective "
    "operation timeout: WorkNCCL(SeqNum=7, OpType=ALLREDUCE, NumelIn=1, NumelOut=1, Timeout(ms)=30000) ran for "
    "30004 milliseconds before timing out.\n(C++ frames follow)",
    "HCCL communicator was aborted on rank 0. Original reason: [ERROR] HCCL error in: ProcessGroupHCCL.cpp\n"
    "EI0006: Getting socket times out."])
def test_an_aborted_communicator_ends_with_one_sentence(monkeypatch, message):
    """What the next collective raises after the watchdog (mode 2) aborted the communicators."""
    def aborted(*args, **kwargs):
        raise dist.DistBackendError(message)

    monkeypatch.setattr(dist, "all_reduce", aborted)
    monkeypatch.setattr(dist, "destroy_process_group", lambda: None)
    comm = ProcessGroupCollectives(DistEnv(rank=0, world_size=2), CUDABackend(), timeout_s=30.0)
    comm.backend.check_collective = lambda tensor, op: None  # a CPU tensor stands in for the device's
    with pytest.raises(PeerFailure) as err:
        comm.all_reduce_sum(torch.ones(1))
    text = str(err.value)
    assert "\n" not in text and "C++" not in text
    assert text.startswith("rank 0 of 2: the collective all_reduce(sum) failed (")
    assert "communicator was aborted on rank 0" in text
    assert "another rank has died or stopped answering within trainer.dist_timeout_s=30" in text


KILL_RANK_1 = """import os, signal
def score(ds, s, gt, extra=None):
    if os.environ.get("RANK") == "1":
        os.kill(os.getppid(), signal.SIGABRT)  # the reward worker's parent is the rank (spawned, not forked)
    return 0.0
"""


def test_a_rank_taken_down_by_sigabrt_is_named_by_the_launcher(tmp_path):
    """As NCCL's watchdog in torch's default mode (or the heartbeat monitor) ends a rank."""
    (tmp_path / "kill.py").write_text(KILL_RANK_1)
    env = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONPATH": str(ROOT)}
    res = subprocess.run(
        [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(tmp_path / "run"),
         "trainer.nproc_per_node=2", "trainer.total_steps=2", "trainer.progress_bar=false", "trainer.test_freq=0",
         "data.train_size=16", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
         "actor.micro_batch_size=2", "data.max_response_length=8", f"reward.function={tmp_path / 'kill.py'}:score",
         "trainer.dist_timeout_s=60"],
        env=env, capture_output=True, text=True, timeout=900, cwd="/")
    assert res.returncode == 1, res.stdout[-2000:] + res.stderr[-2000:]
    last = res.stderr.strip().splitlines()[-1]
    assert last.startswith("portagrpo: error: rank 1 was aborted (SIGABRT), as a collective library's watchdog"), last
    assert "(of 2 ranks)" in last and "--resume" in last
    assert "Traceback" not in res.stderr.split("portagrpo: error:")[-1]


def test_failure_sentences_for_each_way_a_rank_ends():
    from portagrpo.launcher import describe_rank_failures

    text = describe_rank_failures({0: 1, 1: -9, 2: -15, 3: 143}, 4)
    assert text.startswith("rank 1 was killed (SIGKILL), often by the out-of-memory killer; rank 0 exited with "
                           "status 1; the launcher then stopped ranks 2, 3 (of 4 ranks)")
    assert "(of 4 ranks)" in text
    assert describe_rank_failures({}, 2).startswith("a rank of 2 failed")


def test_a_signalled_rank_is_the_cause_over_a_peer_that_only_lost_it():
    """The SIGABRT test above is a race: the surviving rank may or may not leave its report (its collective lost
    the peer) before the launcher stops it. With the report there, the rank that died by the signal is still named."""
    from portagrpo.launcher import describe_rank_failures
    from portagrpo.procs import RankFailure

    peer = RankFailure(0, 2, "the collective all_gather failed (connection closed by peer)", True, 1.0)
    text = describe_rank_failures({0: 1, 1: -6}, 2, [peer])
    assert text.startswith("rank 1 was aborted (SIGABRT)") and "rank 0 exited with status 1" in text
    own = RankFailure(0, 2, "the reward function failed", False, 1.0)  # a rank's own failure still comes first
    assert describe_rank_failures({0: 1, 1: -6}, 2, [own]).startswith("rank 0 of 2 failed: the reward function")
    # a peer report with no signalled rank beside it (the other was stopped by the launcher) is still told
    assert describe_rank_failures({0: 1, 1: -15}, 2, [peer]).startswith("rank 0 of 2 failed: the collective")
