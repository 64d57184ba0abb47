"""A failing rank is torchrun's root cause whatever second its peers are stopped in (the flaky CI failure of issue 49:
torchrun stamps a rank it stopped, which leaves no error file, with the second it noticed, and on a tie names the
lowest rank)."""
from torch.distributed.elastic.multiprocessing.errors import ChildFailedError, ProcessFailure

from portagrpo.procs import report_rank_failure


def _failure(tmp_path, monkeypatch, rank: int, peer: bool, name: str) -> ProcessFailure:
    path = tmp_path / name
    monkeypatch.setenv("TORCHELASTIC_ERROR_FILE", str(path))
    monkeypatch.setenv("RANK", str(rank))
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("PORTAGRPO_RANK_REPORTS", raising=False)
    report_rank_failure(f"failure on rank {rank}", peer=peer)
    return ProcessFailure(local_rank=rank, pid=100 + rank, exitcode=1, error_file=str(path))


def test_the_failing_rank_wins_against_a_peer_stopped_in_the_same_second(tmp_path, monkeypatch):
    failing = _failure(tmp_path, monkeypatch, 1, False, "rank1.json")
    stopped = ProcessFailure(local_rank=0, pid=100, exitcode=-15, error_file=str(tmp_path / "none.json"))
    assert stopped.timestamp >= failing.timestamp + 1  # stamped now: the same second as the failure, or later
    rank, failure = ChildFailedError("portagrpo", {0: stopped, 1: failing}).get_first_failure()
    assert rank == 1 and "rank 1 of 2: failure on rank 1" in str(failure.message)


def test_a_rank_that_failed_only_because_of_its_peer_never_wins(tmp_path, monkeypatch):
    failing = _failure(tmp_path, monkeypatch, 1, False, "rank1.json")
    peer = _failure(tmp_path, monkeypatch, 0, True, "rank0.json")
    assert peer.timestamp - failing.timestamp == 2
    rank, _ = ChildFailedError("portagrpo", {0: peer, 1: failing}).get_first_failure()
    assert rank == 1


def test_a_sigterm_during_a_child_start_is_raised_once_the_start_is_whole():
    """A SIGTERM while a worker is being spawned used to cut the spawn mid-write, and the half-started child printed
    its own traceback ("Ran out of input": the flaky test_sigterm_ends_training_with_one_line). It now waits for the
    start to finish, then stops the run as before."""
    import os
    import signal

    import pytest

    from portagrpo.procs import Stopped, sigint_ignored, stop_on_sigterm

    previous = stop_on_sigterm()
    reached = []
    try:
        with pytest.raises(Stopped):
            with sigint_ignored():
                os.kill(os.getpid(), signal.SIGTERM)
                for _ in range(1000):  # the handler runs between these bytecodes: it must not raise here
                    pass
                reached.append("the start finished")
        assert reached == ["the start finished"]
        with pytest.raises(Stopped):  # outside a start it stops at once, as before
            os.kill(os.getpid(), signal.SIGTERM)
            for _ in range(100000):
                pass
    finally:
        signal.signal(signal.SIGTERM, previous)
