"""The policy's weights as a push sends them to a rollout engine (model/parallel.py `full_tensors`, and vLLM's reload
after a level-2 sleep): each tensor whole when it is reached, except transformers 5's packed experts for an engine that
takes a hub checkpoint's per-expert names (vLLM), which travel by the expert, from a rank that holds them to the ranks
whose engine keeps them, never gathered whole."""
from __future__ import annotations

from typing import Callable, Iterable, Iterator

import torch


def gathered(value: torch.Tensor) -> torch.Tensor:
    """A sharded tensor's whole tensor (a collective), else `value`. An offloaded shard (actor.offload: its local
    tensor on the host) is moved to its mesh's device first, as torch's own full-state gather does
    (torch/distributed/_state_dict_utils.py), so the gather runs over the device's library, not the group's gloo:
    one whole tensor on the device at a time, which the push holds anyway."""
    if not hasattr(value, "full_tensor"):
        return value
    mesh_device = value.device_mesh.device_type
    if value.device.type != mesh_device:
        value = value.to(mesh_device)
    return value.full_tensor()


# Which experts of a MoE layer the rollout engine of a rank keeps, as (rank, number of experts) -> expert ids; None:
# every rank's engine keeps every expert (rollout/vllm_parallel.py `ExpertLayout.wanted` under vLLM's EP).
ExpertsWanted = Callable[[int, int], range] | None


# The most bytes of packed experts one broadcast of the push carries (consecutive experts of one holder, fewer
# collectives than one an expert, and a bounded buffer: DeepSeek-V3's fp32 gate_up of one expert is 117 MB).
EXPERT_CHUNK_BYTES = 256 * 2**20


def push_pairs(named: Iterable[tuple[str, torch.Tensor]], wanted: ExpertsWanted = None, *,
               per_expert: bool = True) -> Iterator[tuple[str, torch.Tensor]]:
    """The (name, tensor) pairs of a weight push, each tensor whole when it is reached (`gathered`). With
    `per_expert` (a consumer that takes a hub checkpoint's per-expert names: vLLM), transformers 5's packed experts
    ([E, 2I, H] / [E, H, I]) go one expert at a time under those names (model/expert_packing.py `one_expert`), and
    only to the ranks whose engine keeps that expert (`wanted`; None: every rank). A sharded packed tensor (FSDP2 and
    trainer.parallel=ep shard the experts' dim, whole experts per rank) is then never gathered whole: consecutive
    experts of one holder are broadcast by it, at most EXPERT_CHUNK_BYTES at a time, or, where every rank that wants
    an expert holds it (the trainer's expert layout matches the engine's), sent without a collective. So the push
    holds a chunk of experts, not a layer's packed tensor (DeepSeek-V3's is 256 x 44 M parameters). Every rank runs
    the same broadcasts in the same order. Without `per_expert` (the hf engine's sampler copy, a sampler process:
    they load transformers' own names) packed tensors are gathered whole like any other."""
    from portagrpo.model.expert_packing import packed_kind

    layouts: dict = {}  # a push's packed tensors share a few layouts: each is worked out once (world x E entries)
    for name, value in named:
        kind = packed_kind(name, value) if per_expert else None
        if kind is None or not (hasattr(value, "full_tensor") or wanted is not None):
            yield name, gathered(value).detach()
            continue
        holders = None
        if hasattr(value, "full_tensor"):
            key = (id(value.device_mesh), tuple(map(str, value.placements)), tuple(value.shape))
            if key not in layouts:
                layouts[key] = expert_holders(value)
            holders = layouts[key]
        if hasattr(value, "full_tensor") and holders is None:  # an expert split across ranks: whole tensor
            whole = gathered(value).detach()
            holders, local, first = None, whole, 0
        elif holders is None:
            local, first = value.detach(), 0
        else:
            local, first = value.to_local().detach(), _first_row(value)
        mesh_type = value.device_mesh.device_type if hasattr(value, "device_mesh") else local.device.type
        yield from _experts_of(name, kind, value.shape, local, first, holders, wanted, layouts, mesh_type)


def expert_holders(value) -> list[list[int]] | None:
    """For a DTensor of packed experts: the global ranks holding each expert whole (its shard has the expert's row
    and every other dim whole), or None where some expert is split across ranks."""
    import itertools

    from portagrpo.model.sharded_load import local_rows

    mesh = value.device_mesh
    holders: list[list[int]] = [[] for _ in range(value.shape[0])]
    for coordinate in itertools.product(*(range(n) for n in mesh.shape)):
        rows = local_rows(value, coordinate)
        if any((r.start, r.stop) != (0, n) for r, n in zip(rows[1:], value.shape[1:])):
            return None
        for e in range(rows[0].start, rows[0].stop):
            holders[e].append(int(mesh.mesh[coordinate]))
    return holders if all(holders) else None


def _first_row(value) -> int:
    from portagrpo.model.sharded_load import local_rows

    return local_rows(value)[0].start


def _experts_of(name: str, kind: str, shape, local: torch.Tensor, first: int, holders: list[list[int]] | None,
                wanted: ExpertsWanted, layouts: dict, mesh_type: str = "cpu") -> Iterator[tuple[str, torch.Tensor]]:
    """One packed tensor's experts, each to the ranks that want it (see `push_pairs`)."""
    import torch.distributed as dist

    from portagrpo.model.expert_packing import one_expert

    experts = shape[0]
    if holders is None:  # every rank has every expert: each keeps what its engine wants
        me = dist.get_rank() if dist.is_initialized() else 0
        for e in (range(experts) if wanted is None else wanted(me, experts)):
            yield from one_expert(name, kind, e, local[e])
        return
    me, world = dist.get_rank(), dist.get_world_size()
    if ("needers", experts) not in layouts:
        per_rank = [range(experts) if wanted is None else wanted(r, experts) for r in range(world)]
        layouts[("needers", experts)] = [[r for r in range(world) if e in per_rank[r]] for e in range(experts)]
    needers = layouts[("needers", experts)]
    device = local.device
    if device.type != mesh_type:  # an offloaded shard: each expert travels to the device first, as `gathered`
        device = torch.device(mesh_type)
    per_chunk = max(1, EXPERT_CHUNK_BYTES // max(1, local[0:1].numel() * local.element_size()))
    e = 0
    while e < experts:
        if not needers[e] or set(needers[e]) <= set(holders[e]):  # kept where it is held: no collective
            if me in needers[e]:
                yield from one_expert(name, kind, e, local[e - first].to(device))
            e += 1
            continue
        src, end = holders[e][0], e + 1  # consecutive experts of the same holder that travel: one broadcast
        while (end < experts and end - e < per_chunk and holders[end][0] == src and needers[end]
               and not set(needers[end]) <= set(holders[end])):
            end += 1
        if me == src:
            block = local[e - first:end - first].to(device).contiguous()
        else:
            block = torch.empty((end - e, *shape[1:]), dtype=local.dtype, device=device)
        dist.broadcast(block, src=src)
        for k in range(e, end):
            if me in needers[k]:
                yield from one_expert(name, kind, k, block[k - e])
        e = end
