"""`portagrpo train --ray`: training workers placed by Ray across nodes.

The driver (this process) reserves a placement group of nnodes x devices_per_node bundles of
the backend's Ray resource (`GPU` for CUDA and ROCm, `NPU` for Ascend, `CPU` on the CPU
backend), starts one `TrainWorker` actor per bundle, hands each its torch.distributed rank,
rank 0's address and a free port, and then runs the loop: every step it asks all workers to
step (they roll out, score, gather and update together over the backend's collective) and
collects the metrics, which it logs; checkpoints are written by rank 0 into the run
directory, which must be on storage every node sees. A worker that dies is reported with its
rank and node, and the run resumes from its last checkpoint with `--resume`.
"""
from __future__ import annotations

import contextlib
import os
import socket
from dataclasses import replace
from pathlib import Path
from typing import Any, Callable

from portagrpo.config import Config, to_dict
from portagrpo.errors import UserError
from portagrpo.metrics import StepReport, ValMetrics

# Ray's switch for a cluster that never leaves this machine (made for laptops): with it off, Ray
# takes 127.0.0.1 as the node's address instead of resolving the machine's routable one.
LOOPBACK_ONLY = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"


class TrainWorker:
    """One rank. Created by Ray inside a placement-group bundle."""

    def __init__(self, rank: int, visible_devices_env: tuple[str, ...], resource: str) -> None:
        self.rank, self.trainer, self.listener = rank, None, None
        self.visible_devices_env, self.resource = visible_devices_env, resource

    def node(self) -> dict[str, Any]:
        import ray

        ids = ray.get_runtime_context().get_accelerator_ids().get(self.resource, [])
        return {"ip": ray.util.get_node_ip_address(), "node_id": ray.get_runtime_context().get_node_id(),
                "host": socket.gethostname(), "pid": os.getpid(), "accelerators": [str(i) for i in ids]}

    def rendezvous_port(self) -> int:
        """Rank 0: bind the group's rendezvous socket on this node's address (what the other ranks
        dial), kept open for this process's store to serve (`backends/dist.py: launched_store`)."""
        import ray

        self.listener = socket.create_server((ray.util.get_node_ip_address(), 0), backlog=1024)
        return self.listener.getsockname()[1]

    def setup(self, cfg_dict: dict, run_dir: str, resume: str | None, env: dict[str, str]) -> dict[str, Any]:
        import torch

        from portagrpo.backends.dist import RENDEZVOUS_ENV, STORE_FD_ENV
        from portagrpo.config import from_dict
        from portagrpo.train import Trainer

        os.environ.update(env)
        os.environ[RENDEZVOUS_ENV] = "1"
        if self.rank == 0:
            os.environ[STORE_FD_ENV] = str(self.listener.fileno())
        from portagrpo.model.loading import quiet_transformers

        quiet_transformers()
        cfg: Config = from_dict(cfg_dict)
        if cfg.trainer.num_threads is None and self.resource == "CPU":
            torch.set_num_threads(1)  # one core per CPU bundle
        log = print if self.rank == 0 else (lambda m: None)
        self.trainer = Trainer(cfg, run_dir=run_dir, resume=resume, log=log, own_outputs=False).setup()
        return {"step_done": self.trainer.step_done, "total_steps": self.trainer.total_steps,
                "strategy": self.trainer.models.strategy.name, "backend": self.trainer.runtime.backend.name}

    def step(self, validate: bool) -> StepReport:
        with self._leaving_on_failure():
            return self.trainer.advance(validate)

    def validate(self) -> ValMetrics | None:
        with self._leaving_on_failure():
            return self.trainer.validate()

    def save(self) -> str | None:
        with self._leaving_on_failure():
            path = self.trainer.save()
        return None if path is None else str(path)

    @contextlib.contextmanager
    def _leaving_on_failure(self):
        """A failing worker leaves the process group at once, so its peers' collectives fail instead of
        waiting out trainer.dist_timeout_s (the driver then stops them all)."""
        try:
            yield
        except BaseException:
            self.trainer.runtime.comm.close(abandon=True)
            raise

    def close(self) -> None:
        if self.trainer is not None:
            self.trainer.close()


PEER_GRACE_S = 30.0  # how long the driver waits for the cause after a worker reports only a lost peer


def _lost_a_peer(err: Exception) -> bool:
    """Whether a worker failed only because another rank was gone (its collective failed: backends/dist.py)."""
    from portagrpo.backends.dist import PeerFailure

    return isinstance(getattr(err, "cause", None), PeerFailure)


def _cause(err: Exception) -> str:
    """The worker's own error in one line: a user error's sentence, else its type and first line."""
    cause = getattr(err, "cause", None)
    if isinstance(cause, UserError):
        return " ".join(str(cause).split()).rstrip(".")
    if isinstance(cause, BaseException):
        first = str(cause).strip().splitlines()[0] if str(cause).strip() else ""
        return f"{type(cause).__name__}: {first}"
    text = str(err).strip()
    return text.splitlines()[0] if text else type(err).__name__


def _bundle(resource: str) -> dict[str, float]:
    return {"CPU": 1.0} if resource == "CPU" else {"CPU": 1.0, resource: 1.0}


def _node_key(node: dict) -> str:
    return node.get("node_id") or node["ip"]


def _rank_env(ranks: list[dict], i: int, master: tuple[str, int], env_vars: tuple[str, ...]) -> dict[str, str]:
    """torchrun-style variables for rank i; local ranks count the workers on the same node."""
    # a node is a Ray node (its id), not an IP: several nodes may share one address (one machine, or loopback)
    same_node = [j for j, r in enumerate(ranks) if _node_key(r) == _node_key(ranks[i])]
    env = {"RANK": str(i), "WORLD_SIZE": str(len(ranks)), "LOCAL_RANK": str(same_node.index(i)),
           "LOCAL_WORLD_SIZE": str(len(same_node)), "MASTER_ADDR": master[0], "MASTER_PORT": str(master[1])}
    if ranks[i]["accelerators"] and env_vars:
        # Only the backend's primary variable: Ray's ids index the list that variable filters. On ROCm,
        # ROCR_VISIBLE_DEVICES filters first and HIP_VISIBLE_DEVICES then indexes what is left, so
        # setting both to k would ask HIP for device k of a one-device list (no device at all).
        env[env_vars[0]] = ",".join(ranks[i]["accelerators"])
        env["LOCAL_RANK"] = "0"  # each worker sees exactly its own device
    return env


class RayRun:
    def __init__(self, cfg: Config, run_dir: Path, resume: str | None, address: str | None, log=print) -> None:
        self.cfg, self.run_dir, self.resume, self.address, self.log = cfg, Path(run_dir), resume, address, log
        self.workers: list[Any] = []
        self.nodes: list[dict] = []
        self.step_done = 0

    def start(self) -> "RayRun":
        if not self.address:
            # A local cluster stays on loopback: Ray otherwise replaces 127.0.0.1 with this machine's
            # routable address when its processes bind and advertise (read once, when Ray is imported).
            os.environ.setdefault(LOOPBACK_ONLY, "0")
        try:
            import ray
            from ray.util.placement_group import placement_group
            from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy
        except ImportError as err:
            raise UserError("--ray needs Ray; `pip install portagrpo[ray]`.") from err
        from portagrpo.backends import get_backend

        t = self.cfg.trainer
        spec = get_backend(t.device).spec if t.device != "auto" else get_backend("auto").spec
        n = t.nnodes * t.devices_per_node
        if self.address:
            ray.init(address=self.address, log_to_driver=True)
        else:
            # "local": a new cluster of its own, as --ray-address's help says, never one that another job on this
            # machine left running (Ray would otherwise connect to the latest one, and refuse num_cpus for it)
            ray.init(address="local", num_cpus=max(n, os.cpu_count() or 1), include_dashboard=False,
                     log_to_driver=True, _node_ip_address="127.0.0.1")
        bundles = [_bundle(spec.ray_resource) for _ in range(n)]
        pg = placement_group(bundles, strategy="PACK" if t.nnodes == 1 else "SPREAD")
        try:
            ray.get(pg.ready(), timeout=t.dist_timeout_s)
        except ray.exceptions.GetTimeoutError as err:
            raise UserError(f"Ray could not reserve {n} bundles of {bundles[0]} within trainer.dist_timeout_s="
                            f"{t.dist_timeout_s:g}; the cluster has {ray.cluster_resources()}.") from err
        actor = ray.remote(TrainWorker)
        for i in range(n):
            options = {"num_cpus": 1, "scheduling_strategy": PlacementGroupSchedulingStrategy(pg, i)}
            if spec.ray_resource == "GPU":
                options["num_gpus"] = 1
            elif spec.ray_resource != "CPU":
                options["resources"] = {spec.ray_resource: 1}
            self.workers.append(actor.options(**options).remote(i, spec.visible_devices_env, spec.ray_resource))
        self.nodes = self._call("node")
        port = self._call_one(0, "rendezvous_port")
        master = (self.nodes[0]["ip"], port)
        cfg = replace(self.cfg, trainer=replace(self.cfg.trainer, output_dir=str(self.run_dir)))
        infos = self._call("setup", per_rank=lambda i: (to_dict(cfg), str(self.run_dir), self.resume,
                                                         _rank_env(self.nodes, i, master, spec.visible_devices_env)))
        self.info = infos[0]
        self.step_done = self.info["step_done"]
        self.log(
            f"ray: {n} workers on {len({_node_key(r) for r in self.nodes})} node(s), backend {self.info['backend']}, "
            f"{self.info['strategy']} parallel"
        )
        return self

    def _call(self, method: str, *args, per_rank: Callable[[int], tuple] | None = None) -> list[Any]:
        import ray

        refs = [getattr(w, method).remote(*(per_rank(i) if per_rank else args)) for i, w in enumerate(self.workers)]
        rank_of = {ref: i for i, ref in enumerate(refs)}
        results: dict[int, Any] = {}
        pending = list(refs)
        while pending:  # as each finishes: the first worker to fail ends the call, whichever rank it is
            done, pending = ray.wait(pending, num_returns=1)
            i = rank_of[done[0]]
            try:
                results[i] = ray.get(done[0])
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                if _lost_a_peer(err):  # a rank that failed only because another was gone: name that one instead
                    i, err = self._own_failure(pending, rank_of) or (i, err)
                self._stop_workers()  # the others may wait in a collective for the failed one
                raise UserError(f"Ray worker rank {i} on node {self._node_name(i)} failed during {method}: "
                                f"{_cause(err)}; resume from the last checkpoint with --resume {self.run_dir}."
                                ) from err
        return [results[i] for i in range(len(refs))]

    def _own_failure(self, pending: list, rank_of: dict) -> tuple[int, Exception] | None:
        """The first worker among `pending` that failed on its own, waiting up to PEER_GRACE_S for them: a rank whose
        error made a peer's collective fail ends at about the same time (it abandons its group)."""
        import ray

        done, _ = ray.wait(pending, num_returns=len(pending), timeout=PEER_GRACE_S) if pending else ([], [])
        for ref in sorted(done, key=lambda r: rank_of[r]):
            try:
                ray.get(ref)
            except (ray.exceptions.RayActorError, ray.exceptions.RayTaskError) as err:
                if not _lost_a_peer(err):
                    return rank_of[ref], err
        return None

    def _node_name(self, i: int) -> str:
        node = self.nodes[i] if i < len(self.nodes) else {"ip": "?", "host": "?"}
        return f"{node['host']} ({node['ip']})"

    def _stop_workers(self) -> None:
        import ray

        for worker in self.workers:
            try:
                ray.kill(worker, no_restart=True)
            except Exception:  # noqa: BLE001 - a worker already gone is what we want
                pass
        self.workers = []

    # The driver loop's view of the run (`portagrpo.train.loop.Steps`): every worker takes part, rank 0 answers.
    def advance(self, validate: bool) -> StepReport:
        report = self._call("step", validate)[0]  # the typed report, as the worker's loop made it
        self.step_done = report.step  # the workers' loop counts steps; the driver only reads its count
        return report

    def validate(self) -> ValMetrics | None:
        return self._call("validate")[0]

    def save(self) -> str | None:
        return self._call("save")[0]  # rank 0 logs the path

    def _call_one(self, i: int, method: str, *args) -> Any:
        import ray

        return ray.get(getattr(self.workers[i], method).remote(*args))

    def stop(self) -> None:
        import ray

        try:
            if self.workers:
                ray.get([w.close.remote() for w in self.workers], timeout=60)
        except Exception:  # noqa: BLE001 - shutting down after a failure must not mask it
            pass
        ray.shutdown()


def train_with_ray(cfg: Config, run_dir: Path, resume: str | None = None, address: str | None = None, log=print,
                   on_step: Callable[[RayRun, StepReport], None] | None = None) -> list[StepReport]:
    """The driver: claims the run directory, starts the workers, then runs the shared driver loop.
    `on_step(run, metrics)` is called after every step (progress hooks, tests)."""
    from portagrpo.config import to_yaml
    from portagrpo.fileio import write_text_atomic
    from portagrpo.metrics import MetricsLogger, make_trackers
    from portagrpo.train.loop import Cadence, drive
    from portagrpo.train.run_dir import RunDir

    run_dir = Path(run_dir)
    run_files = RunDir(run_dir)
    run_files.claim(resuming=resume is not None, log=log)  # the driver is the run's one writer
    run = RayRun(cfg, run_dir, resume, address, log)
    t = cfg.trainer
    try:
        run.start()
        # only once the workers accepted the config (a refused resume leaves the run's config.yaml as it was)
        write_text_atomic(run_files.config, to_yaml(cfg), what="writing")
        trackers = make_trackers(t.logger, run_dir, project=t.project_name, experiment=t.experiment_name,
                                 config=to_dict(cfg))
        logger = MetricsLogger(run_dir, tensorboard=cfg.tensorboard, resume_step=run.step_done, warn=log,
                               trackers=trackers)
        try:
            return drive(run, Cadence(run.info["total_steps"], t.test_freq, t.save_freq, t.val_before_train), logger,
                         progress=cfg.progress_bar, log=log, desc="grpo (ray)",
                         on_step=None if on_step is None else (lambda metrics: on_step(run, metrics)))
        finally:
            if t.plot:
                logger.plot()
            logger.close()
    finally:
        run.stop()
        run_files.unlock()
