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
                raise UserError(f"environment variable {name}={value!r} must be an integer (it is set by torchrun).") from None

        world = get("WORLD_SIZE", 1)
        return cls(get("RANK", 0), world, get("LOCAL_RANK", 0), get("LOCAL_WORLD_SIZE", world))


class Collectives:
    """One process: every collective is the identity."""

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

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        return obj

    def barrier(self) -> None:
        return None

    def close(self) -> None:
        return None


class ProcessGroupCollectives(Collectives):
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

    def all_reduce_sum(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        self._run("all_reduce(sum)", dist.all_reduce, out, dist.ReduceOp.SUM)
        return out

    def all_reduce_max(self, tensor: torch.Tensor) -> torch.Tensor:
        out = tensor.clone()
        self._run("all_reduce(max)", dist.all_reduce, out, dist.ReduceOp.MAX)
        return out

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        parts = [torch.empty_like(tensor) for _ in range(self.world_size)]
        self._run("all_gather", dist.all_gather, parts, tensor.contiguous())
        return torch.cat(parts, dim=0)

    def broadcast_object(self, obj: Any, src: int = 0) -> Any:
        box = [obj]
        self._run("broadcast_object_list", dist.broadcast_object_list, box, src)
        return box[0]

    def barrier(self) -> None:
        self._run("barrier", dist.barrier)

    def close(self) -> None:
        if dist.is_initialized():
            try:
                dist.barrier()  # no rank tears its connections down while a peer still talks to it
            except (RuntimeError, dist.DistError):
                pass
            dist.destroy_process_group()


def init_collectives(backend: BaseBackend, timeout_s: float, env: DistEnv | None = None) -> Collectives:
    """Form the process group over the backend's collective library, or return the one-process stub."""
    env = env or DistEnv.from_environ()
    if env.world_size == 1:
        return Collectives(env)
    missing = [v for v in ("MASTER_ADDR", "MASTER_PORT") if not os.environ.get(v)]
    if missing:
        raise UserError(f"WORLD_SIZE={env.world_size} but {', '.join(missing)} is not set; launch with torchrun "
                        f"(torchrun --nproc-per-node K -m portagrpo train ...) or trainer.nproc_per_node=K.")
    backend.set_device(env.local_rank)
    if not dist.is_initialized():
        dist.init_process_group(backend=backend.dist_backend, rank=env.rank, world_size=env.world_size,
                                timeout=timedelta(seconds=timeout_s))
    return ProcessGroupCollectives(env, backend, timeout_s)
