"""1 process == K processes (gloo, CPU) on identical rollouts; dead or hung ranks end the run."""
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

HERE = Path(__file__).resolve().parent
ENV = {**os.environ, "OMP_NUM_THREADS": "1", "PYTHONUNBUFFERED": "1"}


def run_worker(out: Path, nproc: int, parallel: str, dtype: str, env: dict | None = None, device: str = "cpu",
               extra: tuple[str, ...] = ()) -> dict:
    out.mkdir(parents=True, exist_ok=True)
    if nproc == 1:
        cmd = [sys.executable, str(HERE / "dp_worker.py"), str(out), parallel, dtype, device, *extra]
    else:
        # portagrpo's local launcher: its rendezvous listens on 127.0.0.1 only (torchrun's on every interface)
        cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", str(nproc), str(HERE / "dp_worker.py"), str(out),
               parallel, dtype, device, *extra]
    res = subprocess.run(cmd, env={**ENV, **(env or {})}, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    return torch.load(out / "result.pt", weights_only=False)


def relative_error(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.double() - b.double()).norm() / b.double().norm().clamp(min=1e-30))


@pytest.fixture(scope="module")
def single(tmp_path_factory):
    base = tmp_path_factory.mktemp("dp")
    return {dtype: run_worker(base / f"one-{dtype}", 1, "auto", dtype) for dtype in ("fp64", "fp32")}


# fp64: the two runs differ only by summation order (~1e-16 per op); fp32 as observed for
# FSDP2 over gloo (measured ~6e-6 relative), bounded at 2e-5.
@pytest.mark.parametrize(
    "parallel,dtype,tol", [("ddp", "fp64", 1e-10), ("fsdp2", "fp64", 1e-10), ("fsdp2", "fp32", 2e-5)]
)
def test_two_processes_match_one(tmp_path, single, parallel, dtype, tol):
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    if parallel == "fsdp2" and fsdp2_problem(torch.float64 if dtype == "fp64" else torch.float32):
        pytest.skip(f"refused with one sentence on torch {torch.__version__}: "
                    f"{fsdp2_problem(torch.float64 if dtype == 'fp64' else torch.float32)}")
    two = run_worker(tmp_path / "two", 2, parallel, dtype)
    one = single[dtype]
    assert two["world"] == 2 and one["world"] == 1
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        for key in ("loss_policy", "loss_kl", "kl", "grad_norm", "reward_mean", "adv_mean", "entropy", "clipfrac"):
            assert m2[key] == pytest.approx(m1[key], rel=tol, abs=tol), (parallel, key, m1[key], m2[key])
    assert one["state"].keys() == two["state"].keys()
    for name, p1 in one["state"].items():
        assert relative_error(two["state"][name], p1) < tol, name
    assert one["metrics"][1]["loss_policy"] != one["metrics"][0]["loss_policy"]  # a real second step


def test_untied_head_and_embedding_as_units_of_their_own_train_as_one_process(tmp_path):
    """FSDP2 makes an untied LM head and input embedding units of their own (model/parallel.py split_root) and reads
    both one rank's rows at a time (StreamedRows). Two ranks train as one process does in fp64: to 1e-10 where FSDP2
    takes fp64; torch 2.7's refuses it, and there the fp32 ranks are held to the fp64 process at fp32's bounds. (Not
    to an fp32 process: AdamW's first step is about the sign of each gradient element, and an element whose terms
    cancel takes either sign at fp32 rounding. Measured: an fp32 process ends 2.6e-4 from fp64, two streamed fp32
    ranks 2.4e-6.)"""
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    untied = ("model.tiny.tie_word_embeddings=false",)
    fp64 = fsdp2_problem(torch.float64) is None
    one = run_worker(tmp_path / "one", 1, "auto", "fp64", extra=untied)
    two = run_worker(tmp_path / "two", 2, "fsdp2", "fp64" if fp64 else "fp32", extra=untied)
    bound = 1e-10 if fp64 else 2e-5
    assert "lm_head.weight" in one["state"] and "model.embed_tokens.weight" in one["state"], sorted(one["state"])[:5]
    for m1, m2 in zip(one["metrics"], two["metrics"]):
        for key in ("loss_policy", "loss_kl", "grad_norm", "entropy"):
            assert m2[key] == pytest.approx(m1[key], rel=bound, abs=bound), (key, m1[key], m2[key])
    for name, p1 in one["state"].items():
        assert relative_error(two["state"][name].double(), p1) < bound, name
    assert relative_error(one["state"]["lm_head.weight"], one["state"]["model.embed_tokens.weight"]) > 0.1  # untied


def test_no_float64_collective_under_hccl_rules(tmp_path):
    """HCCL on Atlas A2/A3 refuses float64 all-reduces. With its rules on gloo, two ranks run a step's update
    metrics, token counts, peak memory, validation totals and the parameter fingerprint without one, and the
    float64 sums still match one process (they travel as exact bit patterns and add up on the host)."""
    hccl = {"PORTAGRPO_TEST_HCCL_RULES": "1"}
    two = run_worker(tmp_path / "two", 2, "ddp", "fp32", hccl)
    one = run_worker(tmp_path / "one", 1, "ddp", "fp32", hccl)
    for key in ("loss_policy", "grad_norm", "kl"):
        assert two["metrics"][1][key] == pytest.approx(one["metrics"][1][key], rel=2e-5, abs=1e-7), key
    val = two["metrics"][2]  # validation reduced its totals (samples differ by rank, so no equality here)
    assert set(val) == {"val/reward_mean", "val/acc", "val/pass@2"} and all(0 <= v <= 1 for v in val.values())
    fp1, fp2 = one["metrics"][3]["fingerprint"], two["metrics"][3]["fingerprint"]
    assert fp1.keys() == fp2.keys()
    for k in fp1:  # (sum, sum of squares): a sum near 0 needs an absolute bound
        assert fp2[k][0] == pytest.approx(fp1[k][0], abs=1e-4) and fp2[k][1] == pytest.approx(fp1[k][1], rel=2e-5), k


def _spawn_pair(mode: str, timeout: float):
    """Two ranks rendezvousing as portagrpo.launcher's do (rank 0 serves a socket bound on 127.0.0.1)."""
    from portagrpo.backends.dist import RENDEZVOUS_ENV, STORE_FD_ENV
    from portagrpo.procs import LAUNCHER_ENV

    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(16)
        procs = []
        for rank in (0, 1):
            env = {**ENV, "RANK": str(rank), "WORLD_SIZE": "2", "LOCAL_RANK": str(rank), "MASTER_ADDR": "127.0.0.1",
                   "MASTER_PORT": str(listener.getsockname()[1]), LAUNCHER_ENV: str(os.getpid()),
                   RENDEZVOUS_ENV: "1", STORE_FD_ENV: str(listener.fileno())}
            procs.append(subprocess.Popen([sys.executable, str(HERE / "peer_worker.py"), mode, str(timeout)], env=env,
                                          stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, cwd="/",
                                          pass_fds=(listener.fileno(),) if rank == 0 else ()))
    return procs


@pytest.mark.parametrize("mode", ["die", "hang"])
def test_lost_rank_stops_the_others_with_a_clear_error(mode):
    timeout = 8.0
    start = time.monotonic()
    rank0, rank1 = _spawn_pair(mode, timeout)
    out, err = rank0.communicate(timeout=120)
    elapsed = time.monotonic() - start
    rank1.kill()
    rank1.wait()
    assert rank0.returncode == 2, out + err
    assert "rank 0 of 2: the collective all_reduce(sum) failed" in out
    assert "another rank has died or stopped answering" in out
    assert elapsed < 90


def test_world_size_divisions_are_checked():
    from portagrpo.config import load_config, validate_world

    cfg = load_config(None, ["data.train_batch_size=3", "rollout.n=4", "actor.ppo_mini_batch_size=12",
                             "actor.micro_batch_size=4"])
    problems = validate_world(cfg, 2)
    assert any("data.train_batch_size=3 prompts cannot be split over 2 ranks" in p for p in problems)
    cfg = load_config(None, ["actor.ppo_mini_batch_size=64", "actor.micro_batch_size=32"])
    assert validate_world(cfg, 4) == [] and cfg.micro_batch(4) == 16  # a micro-batch is never a rank's whole share
    (msg,) = validate_world(load_config(None, ["actor.ppo_mini_batch_size=6", "data.train_batch_size=12",
                                               "rollout.n=2"]), 4)
    assert "actor.ppo_mini_batch_size=6 cannot be split over 4 ranks" in msg


def test_cli_trains_with_two_local_ranks(tmp_path):
    """`portagrpo train trainer.nproc_per_node=2 --device cpu` starts two ranks (portagrpo.launcher) and trains."""
    from portagrpo.metrics import read_metrics

    res = subprocess.run(
        [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "--output-dir", str(tmp_path),
         "trainer.nproc_per_node=2", "trainer.total_steps=3", "trainer.test_freq=3", "trainer.save_freq=3",
         "trainer.progress_bar=false", "data.train_size=64"],
        env=ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    assert "2 process(es), ddp parallel" in res.stdout
    rows = read_metrics(tmp_path / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3] and all(r["world_size"] == 2 for r in rows)
    assert "val/reward_mean" in rows[-1] and (tmp_path / "checkpoints" / "step_00000003" / "manifest.json").is_file()


@pytest.mark.skipif(not os.path.isdir("/proc/self/fd"), reason="reads listening sockets from Linux /proc")
def test_local_ranks_listen_on_loopback_only():
    """The launcher and its ranks listen only on 127.0.0.1 (torchrun's agent store listened on every
    interface whatever --master-addr said)."""
    import json

    res = subprocess.run([sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(HERE / "listen_check.py")],
                         env=ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    addresses = json.loads(res.stdout.strip().splitlines()[-1])
    loopback = {"0100007F", "0000000000000000FFFF00000100007F", "00000000000000000000000001000000"}
    assert addresses and set(addresses) <= loopback, addresses  # the store and gloo, all on 127.0.0.1 / ::1


def test_two_ranks_each_with_a_sampler_process_resume_exactly(tmp_path):
    """rollout.mode=one_step_off on two ranks: each rank's sampler process samples its share one step
    ahead; the checkpoint holds both ranks' in-flight batches, and a resumed run repeats step 3 exactly."""
    from portagrpo.metrics import MEASURED_KEYS, read_metrics

    common = [sys.executable, "-m", "portagrpo", "train", "--device", "cpu", "trainer.nproc_per_node=2",
              "trainer.total_steps=3", "trainer.test_freq=0", "trainer.save_freq=2", "trainer.progress_bar=false",
              "trainer.plot=false", "data.train_size=64", "rollout.mode=one_step_off"]
    run = tmp_path / "run"
    res = subprocess.run([*common, "--output-dir", str(run)], env=ENV, capture_output=True, text=True, timeout=600,
                         cwd="/")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    first = read_metrics(run / "metrics.jsonl")
    assert [r["rollout_staleness"] for r in first] == [0, 1, 1] and all(r["world_size"] == 2 for r in first)
    saved = torch.load(run / "checkpoints" / "step_00000002" / "inflight.pt", weights_only=False)
    assert saved["world_size"] == 2 and [r["step"] for r in saved["ranks"]] == [3, 3]
    shares = [r["generated"]["rollout"]["responses"] for r in saved["ranks"]]  # each rank's round, kept whole
    assert not torch.equal(shares[0], shares[1])  # each rank its share
    res = subprocess.run([*common, "--resume", str(run / "checkpoints" / "step_00000002")], env=ENV,
                         capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-2000:]
    again = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in again] == [1, 2, 3]
    for key, value in first[2].items():
        if key not in MEASURED_KEYS:
            assert again[2][key] == value, key
