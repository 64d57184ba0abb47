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
