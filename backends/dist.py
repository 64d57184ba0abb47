"""Process groups and the few collectives the training loop uses.

Only the loop calls these (never a loss helper). Rank and world size come from the
torchrun-style environment (RANK, WORLD_SIZE, LOCAL_RANK, LOCAL_WORLD_SIZE, MASTER_ADDR,
MASTER_PORT). A failed or timed-out collective becomes one clear error instead of a hang.
"""
from __future__ import annotations

import os
from dataclasses import dataclass
from datetime import timedelta
from typing import Any

import torch
import torch.distributed as dist

from portagrpo.errors import UserError

from .base import BaseBackend


class PeerFailure(UserError, RuntimeError):
    """Another rank died or stopped answering."""


@dataclass(frozen=True)
class DistEnv:
    rank: int = 0
    world_size: int = 1
    local_rank: int = 0
    local_world_size: int = 1

    @classmethod
    def from_environ(cls) -> "DistEnv":
        def get(name: str, default: int) -> int:
            value = os.environ.get(name)
            try:
                return int(value) if value not in (None, "") else default
            except ValueError:
                raise UserError(
                    f"environment variable {name}={value!r} must be an integer (it is set by torchrun)."
                ) from None

        world = get("WORLD_SIZE", 1)
        return cls(get("RANK", 0), world, get("LOCAL_RANK", 0), get("LOCAL_WORLD_SIZE", world))


class Collectives:
    """One process: every collective is the identity."""

    grouped = False  # a torch process group is formed (several ranks, or FSDP2 on one)

    def __init__(self, env: DistEnv | None = None) -> None:
        self.env = env or DistEnv()

    @property
    def rank(self) -> int:
        return self.env.rank

    @property
    def world_size(self) -> int:
        return self.env.world_size

    @property
    def is_main(self) -> bool:
        return self.env.rank == 0

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        """Concatenate equal-shaped tensors from every rank along dim 0, in rank order."""
        return tensor

    def sum_on_host(self, values: torch.Tensor) -> torch.Tensor:
        """Exact float64 sum over ranks of `values`, returned on the host.

        Collective libraries differ in what they reduce (HCCL refuses float64), so the float64
        values travel as their int64 bit patterns through an all-gather, and every rank adds them
        up on the host in rank order: the same bits everywhere, on every vendor."""
        return values.detach().to("cpu", torch.float64).clone()

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        """Overwrite `tensor` in place with rank `src`'s."""
        return None

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def all_gather_object(self, obj: Any) -> list[Any]:
        """Every rank's picklable `obj`, in rank order."""
        return [obj]

    def barrier(self) -> None:
        return None

    def close(self, abandon: bool = False) -> None:
        """Leave the group. `abandon`: this rank is failing, so it neither waits for its peers (they may be
        blocked in a collective it will never join) nor lets them wait for it: the group is aborted, the
        peers' next or pending collective fails at once, and the launcher stops the rest."""
        return None


class ProcessGroupCollectives(Collectives):
    grouped = True

    def __init__(self, env: DistEnv, backend: BaseBackend, timeout_s: float) -> None:
        super().__init__(env)
        self.backend, self.timeout_s = backend, timeout_s

    def _run(self, op: str, fn, *args):
        try:
            return fn(*args)
        except (RuntimeError, dist.DistError) as err:
            # Tear the broken group down now: a gloo group left to interpreter shutdown can abort
            # the process ("terminate called without an active exception") instead of exiting cleanly.
            try:
                dist.destroy_process_group()
            except (RuntimeError, dist.DistError, ValueError):
                pass
            raise PeerFailure(
                f"rank {self.rank} of {self.world_size}: the collective {op} failed ({str(err).splitlines()[0]}); "
                f"another rank has died or stopped answering within trainer.dist_timeout_s={self.timeout_s:g}. "
                f"The run is stopped; fix the failing rank and continue with --resume."
            ) from err

    def _reduce(self, tensor: torch.Tensor, op, label: str) -> torch.Tensor:
        self.backend.check_collective(tensor, label)
        out = self.backend.to_collective(tensor.clone())
        self._run(label, dist.all_reduce, out, op)
        return self.backend.from_collective(out, like=tensor)

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, dist.ReduceOp.SUM, "all_reduce(sum)")

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        return self._reduce(tensor, dist.ReduceOp.MAX, "all_reduce(max)")

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        self.backend.check_collective(tensor, "all_gather")
        staged = self.backend.to_collective(tensor.contiguous())
        parts = [torch.empty_like(staged) for _ in range(self.world_size)]
        self._run("all_gather", dist.all_gather, parts, staged)
        return self.backend.from_collective(torch.cat(parts, dim=0), like=tensor)

    def sum_on_host(self, values: torch.Tensor) -> torch.Tensor:
        bits = values.detach().to(torch.float64).reshape(-1).view(torch.int64)
        device = self.backend.device(self.env.local_rank)
        gathered = self.all_gather_cat(bits.to(device).unsqueeze(0)).cpu()  # [world, n] int64
        return gathered.view(torch.float64).sum(dim=0).reshape(values.shape)

    def broadcast_(self, tensor: torch.Tensor, src: int = 0) -> None:
        self.backend.check_collective(tensor, "broadcast")
        staged = self.backend.to_collective(tensor)
        self._run("broadcast", dist.broadcast, staged, src)
        if staged is not tensor:
            tensor.copy_(self.backend.from_collective(staged, like=tensor))

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run("broadcast_object_list", dist.broadcast_object_list, box, src)
        return box[0]

    def all_gather_object(self, obj: Any) -> list[Any]:
        box: list[Any] = [None] * self.world_size
        self._run("all_gather_object", dist.all_gather_object, box, obj)
        return box

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def close(self, abandon: bool = False) -> None:
        if not dist.is_initialized():
            return
        if abandon:
            abort_group()
            return
        try:
            dist.barrier()  # no rank tears its connections down while a peer still talks to it
        except (RuntimeError, dist.DistError):
            pass
        dist.destroy_process_group()


def abort_group() -> None:
    """Tear this process's group down without a word to the peers (a failing rank): their collectives
    with it fail instead of waiting out trainer.dist_timeout_s. torch's abort (2.6+) does not wait for
    in-flight work, which a plain destroy can (NCCL, HCCL)."""
    from torch.distributed import distributed_c10d as c10d

    abort = getattr(c10d, "_abort_process_group", None)
    try:
        abort() if abort is not None else dist.destroy_process_group()
    except (RuntimeError, dist.DistError, ValueError, AttributeError, NotImplementedError):
        try:
            dist.destroy_process_group()
        except (RuntimeError, dist.DistError, ValueError):
            pass


# Set by portagrpo's launchers (the local one, Ray's) for every rank: the group forms over a store whose
# server is a socket the launcher bound on MASTER_ADDR itself, its descriptor in STORE_FD_ENV on rank 0.
RENDEZVOUS_ENV = "PORTAGRPO_RENDEZVOUS_STORE"
STORE_FD_ENV = "PORTAGRPO_STORE_FD"


def launched_store(env: DistEnv, timeout_s: float):
    """The rendezvous store of a rank that a portagrpo launcher started, or None (torchrun's or the
    user's environment forms the group). Rank 0 serves the socket bound on MASTER_ADDR (127.0.0.1 for
    the local launcher, the node's address under Ray) instead of torch binding every interface; the
    others connect to it."""
    if not os.environ.get(RENDEZVOUS_ENV):
        return None
    host, port, timeout = os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"]), timedelta(seconds=timeout_s)
    if env.rank == 0:
        # the legacy server: libuv's ignores a socket handed over on torch < 2.8
        return dist.TCPStore(host, port, env.world_size, True, timeout=timeout,
                             master_listen_fd=int(os.environ[STORE_FD_ENV]), use_libuv=False)
    return dist.TCPStore(host, port, env.world_size, False, timeout=timeout)


def init_collectives(backend: BaseBackend, timeout_s: float, env: DistEnv | None = None,
                     group_of_one: bool = False) -> Collectives:
    """Form the process group over the backend's collective library, or return the one-process stub.
    `group_of_one`: one process that runs FSDP2 (model/parallel.py `strategy_name`) gets a real group of one rank,
    formed over an in-process store (nothing listens), with the same `cpu:gloo,<device>:<library>` form."""
    env = env or DistEnv.from_environ()
    if env.world_size == 1 and not group_of_one:
        return Collectives(env)
    if env.world_size == 1:
        backend.set_device(env.local_rank)
        if not dist.is_initialized():
            dist.init_process_group(backend=backend.group_backend, rank=0, world_size=1,
                                    timeout=timedelta(seconds=timeout_s), store=dist.HashStore())
        return ProcessGroupCollectives(env, backend, timeout_s)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UserError(f"WORLD_SIZE={env.world_size} but {', '.join(missing)} is not set; launch with torchrun "
                        f"(torchrun --nproc-per-node K -m portagrpo train ...) or trainer.nproc_per_node=K.")
    backend.set_device(env.local_rank)
    for var, value in backend.collective_env().items():
        os.environ.setdefault(var, value)  # read by the collective library when the group forms; the user's value wins
    if not dist.is_initialized():
        dist.init_process_group(backend=backend.group_backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s), store=launched_store(env, timeout_s))
    return ProcessGroupCollectives(env, backend, timeout_s)
