"""vLLM in the trainer's processes: tensor-parallel groups of consecutive training ranks under vLLM's external
launcher (`tp_layout`, `TensorParallel`, `group_gather`), the trainer's process state kept around an engine
build (`_process_state_kept`), and vLLM's per-process groups made again for each engine
(`fresh_model_parallel_groups`)."""
from __future__ import annotations

import contextlib
import random
from typing import Iterator

import numpy as np
import torch

from portagrpo.errors import UserError


# The vLLM (and vllm-ascend) releases of ci/matrix.yaml's stacks; a test keeps the two equal.
def tp_layout(size: int, rank: int, world: int, local_world: int, heads: int,
              kv_heads: int | None = None) -> tuple[int, int]:
    """(engine group, rank within it) of a training rank, as vLLM forms tensor-parallel groups from the
    launcher's ranks: consecutive ranks, `arange(world).reshape(-1, ..., tp)` in
    vllm/distributed/parallel_state.py. One sentence for a layout vLLM would refuse or hang on."""
    key = f"rollout.tensor_model_parallel_size={size}"
    if world % size:
        raise UserError(f"{key} does not divide the {world} training rank(s): every rank belongs to exactly one "
                        f"engine; use a divisor of {world}, or more ranks.")
    if local_world % size:
        raise UserError(f"{key} does not divide the {local_world} rank(s) per node: a tensor-parallel group must sit "
                        f"on one node (its all-reduces run every decode step); use a divisor of "
                        f"trainer.nproc_per_node.")
    if heads % size:
        raise UserError(f"{key} does not divide the model's {heads} attention heads, which vLLM splits across the "
                        f"group; use a divisor of {heads}.")
    kv = kv_heads or heads
    if size % kv and kv % size:  # vLLM splits the KV heads, or replicates them over ranks
        raise UserError(f"{key} and the model's {kv} key/value heads must divide one another (vLLM splits or "
                        f"replicates them across the group); use a divisor or a multiple of {kv}.")
    return rank // size, rank % size


def fresh_model_parallel_groups(single_process: bool) -> None:
    """Before an engine is built in a process where an earlier one was: vLLM keeps its model-parallel groups per
    process (vllm/distributed/parallel_state.py) and sizes them for the model of the first engine built there; a
    dense model's leave no expert-parallel group, and a MoE engine built after one fails to build ("expert parallel
    group is not initialized"). Where the engine runs alone in this process (one rank, no external launcher), the
    earlier engine's groups are dropped so this engine builds its own (an earlier engine at world size 1 goes on
    working with them: its collectives are no-ops at that size). The process group itself is left: it may be the
    trainer's. Under the external launcher the groups are the ranks' own and kept."""
    if not single_process:
        return
    from vllm.distributed import parallel_state

    if parallel_state.model_parallel_is_initialized():
        parallel_state.destroy_model_parallel()


@contextlib.contextmanager
def _process_state_kept() -> Iterator[None]:
    """The trainer's process state as it was before vLLM's engine was built in it: vLLM's worker seeds the
    process's generators (`set_random_seed` with the engine's seed: Python's, NumPy's, torch's), and its CPU worker
    sets torch's thread count for its core binding and then replaces `torch.set_num_threads` with a function that
    only warns (vllm/v1/worker/cpu_worker.py). Restored: the host generators' states, torch's thread count and
    `torch.set_num_threads` itself. Not restored: accelerator generators (the trainer seeds every generator before
    each rollout anyway) and the CPU cores vLLM bound its OpenMP threads to."""
    py_state, np_state, torch_state = random.getstate(), np.random.get_state(), torch.random.get_rng_state()
    set_threads, threads = torch.set_num_threads, torch.get_num_threads()
    try:
        yield
    finally:
        torch.set_num_threads = set_threads
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)
        random.setstate(py_state)
        np.random.set_state(np_state)
        torch.random.set_rng_state(torch_state)


class TensorParallel:
    """This rank's place in its vLLM tensor-parallel group. vLLM's external launcher runs one engine per
    rank and expects every rank of a group to submit the same requests (vllm/v1/executor/uniproc_executor.py:
    "all these engines work together to process the same prompts"), in the same order, and to draw the same
    random numbers (each rank samples for itself; vLLM's torchrun example seeds every rank alike "so that
    sampling can be deterministic across ranks"), so that deterministic scheduling keeps them in step. Each
    training rank has its own prompts and its own random streams: the group's requests are gathered with one
    seed per rank, every rank submits all of them after seeding its streams with the group's first seed, and
    each keeps its own slice. The gather runs within the group only (`group_gather`): a group's prompts, and a
    vision-language policy's raw images with them, never travel to the other groups."""

    def __init__(self, size: int = 1, group: int = 0, rank: int = 0, gather=None) -> None:
        """`gather`: all_gather_object over the group (`group_gather`), or over the world."""
        if size > 1 and gather is None:
            raise ValueError("tensor parallel engines need their group's all_gather_object (group_gather)")
        self.size, self.group, self.rank, self.gather = size, group, rank, gather

    @classmethod
    def of_ranks(cls, size: int, group: int, rank: int, comm) -> "TensorParallel":
        """This rank's place, its requests gathered over its group only (`group_gather`)."""
        return cls(size, group, rank, group_gather(size, comm.rank, comm.world_size) if size > 1 else None)

    def requests(self, local: list) -> tuple[list, slice, int | None]:
        """The group's prompts in rank order, the slice of the outputs that are this rank's, and the seed the
        group's ranks sample with (None for one rank: it samples from its streams as they are)."""
        if self.size == 1:
            return local, slice(0, len(local)), None
        draw = int(torch.randint(0, 2**62, (1,)))  # from this rank's stream, which the trainer seeds per step
        group = self.gather((local, draw))  # the group's ranks in rank order (a world's gather: its group's part)
        if len(group) > self.size:
            group = group[self.group * self.size:(self.group + 1) * self.size]
        start = sum(len(part) for part, _ in group[: self.rank])
        return [p for part, _ in group for p in part], slice(start, start + len(local)), group[0][1]


class ExpertLayout:
    """vLLM's expert parallelism (rollout.expert_parallel_size, `enable_expert_parallel`) over the ranks of one vLLM
    instance: `data_parallel_size` engines of `tensor_parallel_size` consecutive ranks. With data parallelism, under
    the external launcher, that instance is the whole world: vLLM sets `data_parallel_rank = RANK // tensor size` and
    refuses one outside [0, data_parallel_size) (vllm/config/parallel.py, 0.11.2 to 0.33.0); without it each
    tensor-parallel engine is an instance of its own and splits its experts over its own ranks. vLLM forms its
    expert-parallel groups as consecutive ranks (parallel_state.py `initialize_model_parallel`:
    `all_ranks.transpose(1, 2).reshape(-1, dp * tp)`), so rank r is expert-parallel rank r % size. Each rank holds
    whole experts, none split over the tensor group (fused_moe/config.py `FusedMoEParallelConfig.make`: tp_size 1
    under EP), in vLLM's linear placement (the r-th block of num_experts / size: expert_map_manager.py
    `determine_expert_map`), and its loader skips the checkpoint tensors of the others (the weight loader returns
    before copying an expert that maps to -1). vllm-ascend 0.23 gives each rank num_experts // size experts where
    vLLM spreads the remainder over the first ranks (ops/fused_moe/fused_moe_0_23_0.py), so the experts must divide:
    one layout for every vendor. The push sends each rank only its engine's experts (`wanted`: model/parallel.py
    push_pairs); where trainer.parallel=ep holds the same blocks on the same ranks, no expert crosses a rank."""

    def __init__(self, size: int, data_parallel: int) -> None:
        self.size, self.data_parallel = size, data_parallel

    def wanted(self, rank: int, experts: int) -> range:
        per, place = experts // self.size, rank % self.size
        return range(place * per, (place + 1) * per)

    def engine_args(self) -> dict:
        return {"enable_expert_parallel": True, "data_parallel_size": self.data_parallel}

    @classmethod
    def of(cls, size: int, data_parallel: int, tp: int, world: int, experts: int | None,
           backend) -> "ExpertLayout | None":
        """The layout, None when off, or one sentence for what vLLM would refuse, hang on or compute wrongly."""
        if size <= 1:
            return None
        key = f"rollout.expert_parallel_size={size}"
        if not backend.spec.vllm_expert_parallel:
            raise UserError(f"{key}: vLLM's build for --device {backend.name} cannot split the experts (its MoE kernel "
                            f"ignores the expert map expert parallelism gives it: docs/backends.md); use "
                            f"rollout.expert_parallel_size=1 and rollout.data_parallel_size=1.")
        if not experts:
            raise UserError(f"{key} splits a mixture-of-experts policy's experts, and this policy has none; use "
                            f"rollout.expert_parallel_size=1 and rollout.data_parallel_size=1.")
        if size != tp * data_parallel or (data_parallel > 1 and size != world):
            raise UserError(f"{key} must be rollout.tensor_model_parallel_size x rollout.data_parallel_size, and with "
                            f"data_parallel_size > 1 every one of the {world} ranks (vLLM's external launcher then "
                            f"makes the whole world one instance); set rollout.data_parallel_size="
                            f"{max(world // tp, 1)}, or rollout.expert_parallel_size={tp} with data_parallel_size=1.")
        if experts % size:
            raise UserError(f"{key} does not divide the policy's {experts} experts a layer (vLLM and vllm-ascend "
                            f"place a remainder differently); use a divisor of {experts}.")
        return cls(size, data_parallel)


def group_gather(size: int, rank: int, world: int):
    """`all_gather_object` over this rank's tensor-parallel group only: consecutive ranks, the groups vLLM forms
    (`tp_layout`). Every rank creates every group, in the same order, as torch.distributed requires; the groups run
    on gloo, which carries Python objects through the host whatever the device's collective library is."""
    import torch.distributed as dist

    mine = None
    for first in range(0, world, size):
        group = dist.new_group(list(range(first, first + size)), backend="gloo")
        if first <= rank < first + size:
            mine = group

    def gather(obj):
        out = [None] * size
        dist.all_gather_object(out, obj, group=mine)
        return out

    return gather
