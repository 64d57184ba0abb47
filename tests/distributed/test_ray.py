"""Ray-placed workers: the same numbers as one process (and so as torchrun), and clear failures."""
import json
import os
import re
import subprocess
import sys
import time
from pathlib import Path

import pytest

ray = pytest.importorskip("ray")

from dp_worker import OVERRIDES  # noqa: E402
from test_data_parallel import run_worker  # noqa: E402

from portagrpo.config import load_config  # noqa: E402
from portagrpo.errors import UserError  # noqa: E402
from portagrpo.ray_launcher import _rank_env, train_with_ray  # noqa: E402

COMMON = [*OVERRIDES, "model.dtype=fp64"]


def test_two_ray_workers_match_torchrun_and_one_process(tmp_path):
    """Same config and rollouts: 2 Ray workers == 2 locally launched ranks (and == 1 process), fp64."""
    torchrun = run_worker(tmp_path / "torchrun", 2, "auto", "fp64")
    single = run_worker(tmp_path / "one", 1, "auto", "fp64")
    cfg = load_config(None, [*COMMON, "trainer.total_steps=2", "trainer.save_freq=2", "trainer.devices_per_node=2"])
    got = train_with_ray(cfg, tmp_path / "ray", log=lambda m: None)
    assert [m["world_size"] for m in got] == [2, 2] == [m["world_size"] for m in torchrun["metrics"]]
    for reference in (torchrun, single):
        for m1, m2 in zip(reference["metrics"], got):
            for key in ("loss_policy", "loss_kl", "kl", "grad_norm", "reward_mean", "entropy", "clipfrac"):
                assert m2[key] == pytest.approx(m1[key], rel=1e-10, abs=1e-12), key
    from safetensors.torch import load_file

    saved = load_file(tmp_path / "ray" / "checkpoints" / "step_00000002" / "model" / "model.safetensors")
    for reference in (torchrun, single):
        for name, p in reference["state"].items():
            if name in saved:
                rel = float((saved[name].double() - p.double()).norm() / p.double().norm())
                assert rel < 1e-10, name
    assert (tmp_path / "ray" / "metrics.jsonl").read_text().count("\n") == 2  # the driver logs


def test_dead_worker_is_reported_with_rank_and_node(tmp_path):
    cfg = load_config(None, [*COMMON, "trainer.total_steps=4", "trainer.save_freq=0", "trainer.devices_per_node=2",
                             "trainer.dist_timeout_s=30"])

    def kill_rank_one(run, metrics):
        if metrics["step"] == 1:
            ray.kill(run.workers[1])

    with pytest.raises(UserError, match=r"Ray worker rank \d on node .* failed during step.*--resume"):
        train_with_ray(cfg, tmp_path / "ray", log=lambda m: None, on_step=kill_rank_one)
    assert not ray.is_initialized()


def test_rank_environment():
    nodes = [{"ip": "10.0.0.1", "accelerators": []}, {"ip": "10.0.0.1", "accelerators": []},
             {"ip": "10.0.0.2", "accelerators": []}]
    env = _rank_env(nodes, 2, ("10.0.0.1", 29500), ())
    assert env == {"RANK": "2", "WORLD_SIZE": "3", "LOCAL_RANK": "0", "LOCAL_WORLD_SIZE": "1",
                   "MASTER_ADDR": "10.0.0.1", "MASTER_PORT": "29500"}
    assert _rank_env(nodes, 1, ("10.0.0.1", 1), ())["LOCAL_RANK"] == "1"
    gpu = [{"ip": "a", "accelerators": ["3"]}, {"ip": "a", "accelerators": ["5"]}]
    env = _rank_env(gpu, 1, ("a", 1), ("ASCEND_RT_VISIBLE_DEVICES",))
    assert env["ASCEND_RT_VISIBLE_DEVICES"] == "5" and env["LOCAL_RANK"] == "0"


def test_rocm_rank_sees_its_device():
    """ROCR_VISIBLE_DEVICES filters before HIP_VISIBLE_DEVICES; both set to 3 leave HIP no device 3."""
    from portagrpo.backends.rocm import SPEC

    env = _rank_env([{"ip": "a", "accelerators": ["3"]}], 0, ("a", 1), SPEC.visible_devices_env)
    visible = list(range(8))  # what the node's ROCr runtime exposes
    if "ROCR_VISIBLE_DEVICES" in env:
        visible = [visible[int(k)] for k in env["ROCR_VISIBLE_DEVICES"].split(",")]
    hip = [visible[int(k)] for k in env["HIP_VISIBLE_DEVICES"].split(",") if int(k) < len(visible)]
    assert hip == [3] and env["LOCAL_RANK"] == "0"


def test_local_ranks_count_ray_nodes_not_addresses():
    """Two Ray nodes on one machine share an address; each is its own node, so each rank is local rank 0."""
    nodes = [{"ip": "127.0.0.1", "node_id": "a", "accelerators": []},
             {"ip": "127.0.0.1", "node_id": "b", "accelerators": []}]
    assert [_rank_env(nodes, i, ("127.0.0.1", 1), ())["LOCAL_RANK"] for i in (0, 1)] == ["0", "0"]
    assert [_rank_env(nodes, i, ("127.0.0.1", 1), ())["LOCAL_WORLD_SIZE"] for i in (0, 1)] == ["1", "1"]



# Every Ray process of the two-node tests (nodes, driver, workers) takes 127.0.0.1 as its address.
LOOPBACK = {"RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER": "0", "RAY_AUTH_MODE": "disabled", "RAY_USAGE_STATS_ENABLED": "0",
            "OMP_NUM_THREADS": "1"}


@pytest.fixture
def two_nodes():
    """(address, cluster process): two Ray nodes on 127.0.0.1, one CPU each."""
    env = {**os.environ, **LOOPBACK}
    proc = subprocess.Popen([sys.executable, str(Path(__file__).parent / "ray_cluster.py")], env=env, text=True,
                            stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=subprocess.DEVNULL)
    try:
        line = proc.stdout.readline()
        assert line.startswith("address "), f"the cluster did not start: {line!r}"
        yield line.split()[1], proc
    finally:
        try:
            proc.stdin.write("stop\n")
            proc.stdin.flush()
        except BrokenPipeError:
            pass
        try:
            proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            proc.kill()


def _train_on(address: str, out: Path, steps: int) -> subprocess.Popen:
    cmd = [sys.executable, "-m", "portagrpo", "train", "--ray-address", address, "--output-dir", str(out), *COMMON,
           f"trainer.total_steps={steps}", "trainer.nnodes=2", "trainer.devices_per_node=1", "reward.num_workers=0",
           "trainer.dist_timeout_s=120"]
    return subprocess.Popen(cmd, env={**os.environ, **LOOPBACK}, text=True, stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, cwd=out.parent)


def test_two_ray_nodes_on_loopback_match_one_process(tmp_path, two_nodes):
    """`train --ray-address` on a two-node cluster: one worker per node (counted by Ray node id, as
    both nodes share 127.0.0.1), the same numbers as one process."""
    address, _ = two_nodes
    single = run_worker(tmp_path / "one", 1, "auto", "fp64")
    proc = _train_on(address, tmp_path / "ray", steps=2)
    out, err = proc.communicate(timeout=900)
    assert proc.returncode == 0, out[-2000:] + err[-3000:]
    assert "ray: 2 workers on 2 node(s)" in out + err
    got = [json.loads(line) for line in (tmp_path / "ray" / "metrics.jsonl").read_text().splitlines()]
    assert [m["world_size"] for m in got] == [2, 2]
    for m1, m2 in zip(single["metrics"], got):
        for key in ("loss_policy", "loss_kl", "kl", "grad_norm", "reward_mean", "entropy", "clipfrac"):
            assert m2[key] == pytest.approx(m1[key], rel=1e-10, abs=1e-12), key


def test_a_node_that_dies_ends_the_run_with_one_sentence(tmp_path, two_nodes):
    address, cluster = two_nodes
    out = tmp_path / "ray"
    proc = _train_on(address, out, steps=500)
    metrics = out / "metrics.jsonl"
    deadline = time.monotonic() + 600
    while not (metrics.exists() and metrics.read_text().strip()) and proc.poll() is None:
        assert time.monotonic() < deadline, "no step finished"
        time.sleep(0.5)
    assert proc.poll() is None, proc.communicate()[1][-3000:]
    cluster.stdin.write("kill-worker-node\n")
    cluster.stdin.flush()
    stdout, stderr = proc.communicate(timeout=600)
    assert proc.returncode != 0
    message = [line for line in stderr.splitlines() if line.startswith("portagrpo: error:")]
    assert len(message) == 1, stderr[-3000:]
    assert re.search(r"Ray worker rank \d on node .* failed during step.*--resume", message[0]), message[0]
    assert "Traceback" not in stderr


def test_a_local_run_starts_its_own_cluster_beside_a_running_one(tmp_path, two_nodes):
    """Without --ray-address the run starts a Ray cluster of its own (address="local"), even where another cluster
    runs on the machine: Ray would otherwise connect to the latest one and refuse the run's num_cpus (which a
    parallel test run hit)."""
    cfg = load_config(None, [*OVERRIDES, "trainer.total_steps=1", "trainer.save_freq=0", "trainer.devices_per_node=2"])
    got = train_with_ray(cfg, tmp_path / "ray", log=lambda m: None)
    assert [m["world_size"] for m in got] == [2]


def test_ray_workers_each_drive_their_own_sampler_process(tmp_path):
    """rollout.mode=one_step_off under Ray: each worker starts its sampler process beside itself and the
    run overlaps as it does under the local launcher (staleness 0, then 1)."""
    cfg = load_config(None, [*OVERRIDES, "rollout.engine=hf", "rollout.mode=one_step_off", "trainer.total_steps=3",
                             "trainer.save_freq=0", "trainer.devices_per_node=2"])
    got = train_with_ray(cfg, tmp_path / "ray", log=lambda m: None)
    assert [m["world_size"] for m in got] == [2, 2, 2]
    assert [m["rollout_staleness"] for m in got] == [0, 1, 1]
    assert all("rollout_corr/kl" in m for m in got)


def test_an_error_on_one_worker_stops_every_worker_with_its_cause(tmp_path):
    """Rank 1's reward raises at step 2 while rank 0 waits in a collective for it: the run ends at once, not
    after trainer.dist_timeout_s (400 s here, which the old driver waited out on rank 0), with one sentence
    naming rank 1 and the cause; step 1's checkpoint is whole."""
    from portagrpo.checkpoint import list_checkpoints, verify_checkpoint

    marker = tmp_path / "ray" / "checkpoints" / "step_00000001" / "manifest.json"
    reward = tmp_path / "reward.py"
    reward.write_text("import os\ndef score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      f"    if os.environ.get('RANK') == '1' and os.path.exists({str(marker)!r}):\n"
                      "        raise ValueError('injected failure in the reward phase')\n"
                      "    return 0.5\n")
    cfg = load_config(None, [*COMMON, "trainer.total_steps=4", "trainer.save_freq=1", "trainer.devices_per_node=2",
                             "trainer.dist_timeout_s=400", "reward.num_workers=0", f"reward.function={reward}:score"])
    start = time.monotonic()
    with pytest.raises(UserError, match=r"Ray worker rank 1 on node .* failed during step: the reward function "
                                        r"failed .*injected failure in the reward phase.*--resume") as err:
        train_with_ray(cfg, tmp_path / "ray", log=lambda m: None)
    assert time.monotonic() - start < 300, "ended by the collective timeout, not by the failure"
    assert "\n" not in str(err.value)
    saved = list_checkpoints(tmp_path / "ray")
    assert saved and all(verify_checkpoint(c) == [] for c in saved)
    assert not ray.is_initialized()


def test_a_lost_peer_is_not_named_when_the_rank_that_failed_on_its_own_answers(monkeypatch):
    """The driver's choice, without a cluster: rank 0's collective lost rank 1 and answered first; rank 1's own
    error (the reward's) is what the driver names, so the sentence does not depend on which answer came first."""
    from ray.exceptions import RayTaskError

    from portagrpo.backends.dist import PeerFailure
    from portagrpo.ray_launcher import RayRun

    errors = {"r0": RayTaskError("step", "tb", PeerFailure("rank 0 of 2: the collective all_gather failed")),
              "r1": RayTaskError("step", "tb", UserError("the reward function failed on sample 3: boom"))}

    class Worker:
        def __init__(self, ref):
            self.step = type("M", (), {"remote": staticmethod(lambda *a: ref)})

    def get(ref):
        raise errors[ref]

    monkeypatch.setattr(ray, "wait", lambda refs, num_returns=1, timeout=None: (refs[:num_returns], refs[num_returns:]))
    monkeypatch.setattr(ray, "get", get)
    monkeypatch.setattr(ray, "kill", lambda *a, **k: None)
    run = RayRun.__new__(RayRun)
    run.workers, run.nodes, run.run_dir = [Worker("r0"), Worker("r1")], [{"host": "h", "ip": "127.0.0.1"}] * 2, "run"
    with pytest.raises(UserError, match=r"^Ray worker rank 1 on node h \(127.0.0.1\) failed during step: the reward "
                                        r"function failed on sample 3: boom; resume"):
        run._call("step", False)
