"""Data-parallel strategies for the policy: none (one process), replicated (DDP-style gradient
all-reduce) and FSDP2 (`fully_shard`). The loop asks its strategy to wrap the model, to sync
gradients, to clip, and for the state checkpoints hold (full state dicts, or each rank's own shards).

Every rank's loss is normalised by *global* token and sequence counts, so the gradient of the
global mini-batch is the SUM of the per-rank gradients: both strategies sum, never average.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator, Protocol

import torch
from torch.distributed.checkpoint.state_dict import (
    StateDictOptions,
    get_model_state_dict,
    get_optimizer_state_dict,
    set_model_state_dict,
    set_optimizer_state_dict,
)

from portagrpo.backends.dist import Collectives
from portagrpo.backends.fsdp_compat import fsdp2_problem, keep_gathered, sum_gradients
from portagrpo.errors import UserError
from portagrpo.model.loading import decoder_of, lm_head_of, run_in_head
from portagrpo.model.vision import vision_blocks
from portagrpo.model.weight_push import ExpertsWanted, push_pairs
from portagrpo.registry import Registry

FULL = StateDictOptions(full_state_dict=True, cpu_offload=True)
FULL_TRAINABLE = StateDictOptions(full_state_dict=True, cpu_offload=True, ignore_frozen_params=True)


def _unique_state(scorer: torch.nn.Module) -> Iterator[tuple[str, torch.Tensor]]:
    """The scorer's state, each tensor once: a tied weight (an `lm_head` sharing the embedding) comes
    only under its first name, so it is never gathered or sent twice (a consumer ties it back, as
    vLLM does from the model config)."""
    first_names = {n for n, _ in scorer.named_parameters()}
    aliases = {n for n, _ in scorer.named_parameters(remove_duplicate=False)} - first_names
    for name, value in scorer.state_dict().items():
        if name not in aliases:
            yield name, value


def _strip(prefix: str, state: dict[str, Any]) -> dict[str, Any]:
    return {k[len(prefix):] if k.startswith(prefix) else k: v for k, v in state.items()}


class ParallelStrategy(Protocol):
    """How the policy's scorers are spread over the ranks: what the loop, the engines and the checkpoints ask."""

    name: str
    shards_checkpoints: bool  # each rank writes and reads only its own shards of a checkpoint

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        """Extra `generate` arguments (`synced_gpus` under FSDP2)."""

    def wrap(self, scorer: torch.nn.Module, *, trainable: bool, compute_dtype: torch.dtype | None = None,
             offload: bool = False) -> torch.nn.Module:
        """The scorer as this strategy runs it; `offload`: its shards (and their gradients and optimizer state) in
        host memory, copied to the device unit by unit (FSDP2 only)."""

    def generation(self, scorer: torch.nn.Module) -> contextlib.AbstractContextManager:
        """Around a rollout with the training model itself (a sharded one is gathered once)."""

    def full_tensors(self, scorer: torch.nn.Module, wanted: ExpertsWanted = None,
                     per_expert: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """Every parameter unsharded, one at a time (a weight push; with `per_expert`, for a consumer that takes a hub
        checkpoint's per-expert names, packed experts one expert at a time, only those `wanted`: `push_pairs`)."""

    def release(self, scorer: torch.nn.Module) -> None:
        """After forwards without a backward (a scoring pass): free whatever they left gathered."""

    def gradient_sync(self, scorer: torch.nn.Module, enabled: bool) -> None: ...

    def sync_grads(self, params: list[torch.nn.Parameter]) -> None: ...

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor: ...

    def model_state(self, scorer: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]: ...

    def optimizer_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load_model_state(self, scorer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None: ...

    def load_optimizer_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        ...

    def sharded_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]: ...

    def load_sharded_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        ...


class SingleProcess:
    name = "none"
    shards_checkpoints = False  # rank 0 writes a checkpoint's whole tensors (a sharded strategy: each rank its own)

    def __init__(self, comm: Collectives, shard_group: int = -1, pinned_offload: bool = False,
                 stream_rows: bool = True, expert_group: int = -1) -> None:
        """`shard_group`: trainer.fsdp_size, the ranks one FSDP2 shard group spans (-1: all; the others ignore it).
        `pinned_offload`: the backend's answer to whether offloaded shards sit in page-locked memory.
        `stream_rows`: actor.stream_head_rows (FSDP2: an untied head and embedding read by rows, StreamedRows).
        `expert_group`: trainer.ep_size, the ranks one expert-parallel group spans (-1: all; only `ep` reads it)."""
        self.comm, self.shard_group, self.pinned_offload = comm, shard_group, pinned_offload
        self.stream_rows, self.expert_group = stream_rows, expert_group

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        return {}

    def wrap(self, scorer: torch.nn.Module, *, trainable: bool, compute_dtype: torch.dtype | None = None,
             offload: bool = False) -> torch.nn.Module:
        refuse_offload(offload, "one process", scorer)
        return scorer

    def generation(self, scorer: torch.nn.Module):
        """Context for sampling with the training model itself (the `hf` engine)."""
        return contextlib.nullcontext()

    def release(self, scorer: torch.nn.Module) -> None:
        """Nothing is gathered: every rank holds its parameters whole."""
        return None

    def full_tensors(self, scorer: torch.nn.Module, wanted: ExpertsWanted = None,
                     per_expert: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """(name, full tensor) of every LM weight, one at a time (keys as in the Hugging Face model): a
        consumer that drops each after use (the vLLM weight push) never holds the whole gathered model. With
        `per_expert`, packed experts go one expert at a time, only those this rank's engine keeps
        (model/weight_push.py `push_pairs`)."""
        return push_pairs(((name.removeprefix("lm."), value) for name, value in _unique_state(scorer)), wanted,
                          per_expert=per_expert)

    def gradient_sync(self, scorer: torch.nn.Module, enabled: bool) -> None:
        """Whether the next backward reduces gradients across ranks (only a sharded strategy reduces
        inside backward; the others reduce in `sync_grads`)."""
        return None

    def sync_grads(self, params: list[torch.nn.Parameter]) -> None:
        return None

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        return torch.nn.utils.clip_grad_norm_(params, max_norm)

    def model_state(self, scorer: torch.nn.Module, trainable_only: bool = False) -> dict[str, torch.Tensor]:
        """Full state dict of the LM (keys as in the Hugging Face model); a collective when sharded. With
        `trainable_only`, the trainable tensors alone (a LoRA checkpoint's adapters: the frozen base is never
        gathered, which for a 72B base would be 290 GB on rank 0's host at every save)."""
        return _strip("lm.", get_model_state_dict(scorer, options=FULL_TRAINABLE if trainable_only else FULL))

    def optimizer_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """Full optimizer state keyed by parameter name, so any strategy can resume any other's checkpoint."""
        return get_optimizer_state_dict(scorer, optimizer, options=FULL)

    def load_model_state(self, scorer: torch.nn.Module, state: dict[str, torch.Tensor]) -> None:
        named = {f"lm.{k}": v for k, v in state.items()}
        set_model_state_dict(scorer, named, options=StateDictOptions(full_state_dict=True, strict=False))

    def load_optimizer_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        set_optimizer_state_dict(scorer, optimizer, state, options=StateDictOptions(full_state_dict=True))

    def sharded_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer) -> dict[str, Any]:
        """This rank's own part of the model and optimizer state, gathered nowhere: DTensors of its shards under
        FSDP2, whole tensors otherwise. They are the live tensors, so `torch.distributed.checkpoint` writes them as
        they are and loads a checkpoint into them in place, resharded to this run's ranks (checkpoint.py)."""
        aliases = {n for n, _ in scorer.named_parameters(remove_duplicate=False)} - {n for n, _ in
                                                                                  scorer.named_parameters()}
        model = {k: v for k, v in get_model_state_dict(scorer).items() if k not in aliases}  # a tied weight once
        return {"model": _strip("lm.", model), "optimizer": get_optimizer_state_dict(scorer, optimizer)}

    def load_sharded_state(self, scorer: torch.nn.Module, optimizer: torch.optim.Optimizer, state: dict) -> None:
        """Put back what `sharded_state` returned once a checkpoint was read into it (its tied aliases left out)."""
        named = {f"lm.{k}": v for k, v in state["model"].items()}
        set_model_state_dict(scorer, named, options=StateDictOptions(strict=False))
        set_optimizer_state_dict(scorer, optimizer, state["optimizer"])


class Replicated(SingleProcess):
    """Every rank holds the whole model; gradients are summed with one all-reduce per mini-batch."""

    name = "ddp"

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        return {}

    def wrap(self, scorer: torch.nn.Module, *, trainable: bool, compute_dtype: torch.dtype | None = None,
             offload: bool = False) -> torch.nn.Module:
        refuse_offload(offload, "trainer.parallel=ddp", scorer)
        with torch.no_grad():
            for tensor in list(scorer.parameters()) + list(scorer.buffers()):
                self.comm.broadcast_(tensor.data, src=0)  # identical starting weights everywhere
        return scorer

    def sync_grads(self, params: list[torch.nn.Parameter]) -> None:
        grads = [p.grad if p.grad is not None else torch.zeros_like(p) for p in params]
        flat = self.comm.all_reduce_sum(torch.cat([g.reshape(-1) for g in grads]))
        offset = 0
        for p, g in zip(params, grads):
            n = g.numel()
            p.grad = flat[offset:offset + n].view_as(p).clone()
            offset += n


class FSDP2(SingleProcess):
    """`fully_shard` on every decoder layer (and vision block) and on the scorer; gradients reduce-scattered as
    sums."""

    name = "fsdp2"
    shards_checkpoints = True
    _mesh = None

    def mesh(self):
        """None: FSDP2's own mesh over every rank. With trainer.fsdp_size k < world: a (world / k) x k mesh, each row
        k consecutive ranks (a node) that shard, the columns replicas that all-reduce the gradient shards (HSDP).
        Made once, so the policy and the reference share it."""
        world, k = self.comm.world_size, self.shard_group
        if k in (-1, world):
            return None
        if self._mesh is None:
            from torch.distributed.device_mesh import init_device_mesh

            from portagrpo.backends.fsdp_compat import native_sum

            if not native_sum():
                raise UserError(f"trainer.fsdp_size={k} needs torch 2.8 or newer here (FSDP2 summing gradients across "
                                f"replicas, set_force_sum_reduction_for_comms); use trainer.fsdp_size=-1 on torch "
                                f"{torch.__version__}.")
            self._mesh = init_device_mesh(mesh_device(), (world // k, k), mesh_dim_names=("replicate", "shard"))
        return self._mesh

    @property
    def generate_kwargs(self) -> dict[str, Any]:
        # Ranks finish sampling at different steps; sharded forwards must stay in lockstep.
        return {"synced_gpus": True}

    def wrap(self, scorer: torch.nn.Module, *, trainable: bool, compute_dtype: torch.dtype | None = None,
             offload: bool = False) -> torch.nn.Module:
        from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, fully_shard, register_fsdp_forward_method

        # Under bf16/fp16 the all-gathers carry parameters in that dtype (half the bytes of the fp32 master
        # copy) and gradients reduce-scatter in fp32: verl's FSDP2 setting. fp32/fp64 runs move their own dtype.
        low = compute_dtype in (torch.bfloat16, torch.float16)
        mp = {"mp_policy": MixedPrecisionPolicy(param_dtype=compute_dtype, reduce_dtype=torch.float32)} if low else {}
        mesh = self.mesh()
        if mesh is not None:
            mp["mesh"] = mesh
        if offload:
            from torch.distributed.fsdp import CPUOffloadPolicy

            mp["offload_policy"] = CPUOffloadPolicy(pin_memory=self.pinned_offload)
        self.shard_experts(scorer, mp, offload)
        # a vision-language policy's vision blocks are units of their own too (frozen ones are gathered, never reduced)
        for layer in [*vision_blocks(scorer.lm), *getattr(decoder_of(scorer.lm), "layers", [])]:
            fully_shard(layer, **mp)
        # before fully_shard makes their classes subclasses
        lookup = streams_lookup(scorer.lm.get_input_embeddings())
        linear = streams_head(scorer.lm.get_output_embeddings())
        head = split_root(scorer, lambda unit: fully_shard(unit, **mp), trainable)
        if head is not None:  # the kernels read the head's weight: they run as a forward of its unit
            register_fsdp_forward_method(head, "through_head")
            scorer.through_head = head.through_head
            # ... or, for the token log-probs, one rank's rows at a time, never gathered whole; and the embedding
            rows = StreamedRows(compute_dtype if low else None)
            if self.stream_rows and linear:
                scorer.streamed_head = rows
            if self.stream_rows and lookup:
                scorer.streamed_embedding = rows
        fully_shard(scorer, **mp)
        register_fsdp_forward_method(scorer, "generate")
        problem = fsdp2_problem(torch.float32 if low else compute_dtype)
        if problem:
            raise UserError(problem)
        for module in scorer.modules():
            if isinstance(module, FSDPModule):
                sum_gradients(module)  # the losses divide by global counts: ranks' gradients add up
        return scorer

    def shard_experts(self, scorer: torch.nn.Module, options: dict[str, Any], offload: bool) -> None:
        """Before the layers are sharded: FSDP2 shards a MoE layer's experts with the rest of its layer (gathered
        whole for each forward); expert parallelism makes them units of their own."""
        return None

    def gradient_sync(self, scorer: torch.nn.Module, enabled: bool) -> None:
        """On (the update's default): the next backward reduce-scatters each unit's gradients as it finishes and
        frees them, so a rank holds its shard of the gradients (4 bytes a parameter / world size) and one unit's
        unsharded ones. Off (actor.use_no_sync_for_gradient_accumulation, for all but a mini-batch's last
        micro-batch): the unsharded fp32 gradients of the whole model stay on every rank until the reduce-scatter
        of the last micro-batch, one per optimizer step instead of one per micro-batch."""
        scorer.set_requires_gradient_sync(enabled)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        norm = torch.nn.utils.clip_grad_norm_(params, max_norm)
        return norm.full_tensor() if hasattr(norm, "full_tensor") else norm

    @contextlib.contextmanager
    def generation(self, scorer: torch.nn.Module):
        """Gather every shard once for the whole rollout and keep it gathered across the forwards of
        `generate`, instead of an all-gather per layer per generated token; resharded afterwards."""
        from torch.distributed.fsdp import FSDPModule

        units = [m for m in scorer.modules() if isinstance(m, FSDPModule)]  # the root (scorer) first
        if not all(keep_gathered(unit, True) for unit in units):  # torch < 2.8: gather per forward, as usual
            yield
            return
        for unit in units:
            unit.unshard()
        try:
            yield
        finally:
            for unit in units:
                unit.reshard()
            for unit in units[1:]:  # the layers reshard after forward again; FSDP keeps the root's gathered anyway
                keep_gathered(unit, False)

    def release(self, scorer: torch.nn.Module) -> None:
        """FSDP2 keeps the root unit gathered after a forward until a backward reshards it (torch's
        fully_shard: the root does not reshard after forward). A reference model never runs a backward, so its
        root (a tied embedding and LM head, the vision merger) stayed gathered from its first scoring pass to the
        end of the run (measured on the emulated device: tests/emulated/test_memory_plan_measured.py, vl)."""
        from torch.distributed.fsdp import FSDPModule

        if isinstance(scorer, FSDPModule):
            scorer.reshard()

    def full_tensors(self, scorer: torch.nn.Module, wanted: ExpertsWanted = None,
                     per_expert: bool = False) -> Iterator[tuple[str, torch.Tensor]]:
        """One parameter gathered at a time (a collective on every rank, in the same order everywhere); with
        `per_expert`, packed experts by the expert, from the rank that holds them to the ranks whose engine keeps them
        (model/weight_push.py `push_pairs`)."""
        return push_pairs(((name.removeprefix("lm."), value) for name, value in _unique_state(scorer)), wanted,
                          per_expert=per_expert)


class ExpertParallel(FSDP2):
    """trainer.parallel=ep: FSDP2 for the dense layers, and every MoE layer's experts split over groups of
    trainer.ep_size ranks (model/expert_parallel.py: torchtitan's all-to-all dispatcher under transformers' block).
    Ranks that hold the same experts (world / ep_size of them, `efsdp`) shard those with FSDP2 too, as a unit of
    their own: an expert's gradient reaches its holders through the all-to-all's backward and is summed over efsdp
    by FSDP2's reduce-scatter, never over ep. Generation keeps FSDP2's lockstep (every forward is an all-to-all)."""

    name = "ep"
    _sparse = None

    def sparse_mesh(self):
        """The (efsdp, ep) mesh: rank r holds the experts of ep coordinate r % ep_size, consecutive ranks forming
        one expert-parallel group (a node's ranks, where the all-to-all is cheapest). Made once, shared by the
        policy and the reference."""
        world, ep = self.comm.world_size, self.ep_size
        if self._sparse is None:
            from torch.distributed.device_mesh import init_device_mesh

            self._sparse = init_device_mesh(mesh_device(), (world // ep, ep), mesh_dim_names=("efsdp", "ep"))
        return self._sparse

    @property
    def ep_size(self) -> int:
        return self.comm.world_size if self.expert_group in (-1, 0) else self.expert_group

    def shard_experts(self, scorer: torch.nn.Module, options: dict[str, Any], offload: bool) -> None:
        from torch.distributed.fsdp import fully_shard

        from portagrpo.model.expert_parallel import ep_import_problem, ep_model_problem, to_expert_parallel

        problem = ep_import_problem() or ep_model_problem(scorer.lm, self.ep_size)
        if problem:
            raise UserError(problem)
        sparse = self.sparse_mesh()
        expert_options = {k: v for k, v in options.items() if k != "mesh"}
        for module in to_expert_parallel(scorer.lm, sparse["ep"]):
            fully_shard(module, mesh=sparse["efsdp"], **expert_options)

    def clip_grad_norm(self, params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
        from portagrpo.model.expert_parallel import clip_over_meshes

        return clip_over_meshes(params, max_norm)


def mesh_device() -> str:
    """The device type a device mesh of this process's ranks is made on: the accelerator's, else the CPU."""
    accelerator = torch.accelerator.current_accelerator() if hasattr(torch, "accelerator") else None
    return accelerator.type if accelerator is not None else "cpu"


def _output_asks_for_gradient(module, inputs, output):
    if torch.is_grad_enabled() and not output.requires_grad:
        output.requires_grad_(True)


def split_root(scorer: torch.nn.Module, shard, trainable: bool = True) -> torch.nn.Module | None:
    """The untied input embedding and LM head as units of their own (verl's FSDP2 wrap does the same), applying
    `shard` to each: in the root unit they would stay gathered from forward to the end of backward, and the root's
    post-backward reduce-scatter would hold an fp32 copy of their whole gradient (Qwen2.5's 152,064 x 8,192 head
    and embedding: about 10 GB on every rank at any world size). Returns the head unit, which the scorer calls
    through (`through_head`), or None where the two are tied (one tensor: they stay in the root, the one unit that
    is gathered at both ends of the model). A root unit is not resharded after a forward without gradients (the
    reference's): as units, the reference's head and embedding are."""
    embed, head = scorer.lm.get_input_embeddings(), scorer.lm.get_output_embeddings()
    if embed is None or head is None or lm_head_of(scorer.lm)[0] is embed.weight:
        return None
    base = getattr(head, "base_layer", None)  # a peft LoRA head
    if base is not None and base.weight is embed.weight:
        return None
    if trainable and not any(p.requires_grad for p in embed.parameters()):
        # A frozen embedding under a trained model (LoRA): its output asks for a gradient, as transformers'
        # enable_input_require_grads does, so its unit's backward runs. Otherwise the first layer's backward would
        # prefetch (all-gather) it for a backward that never comes, which FSDP2 then has to wait out at its end.
        embed.register_forward_hook(_output_asks_for_gradient)
    shard(embed)
    head.through_head = run_in_head  # a plain function: FSDP's forward hooks wrap it as the unit's forward
    shard(head)
    return head


class StreamedRows:
    """How a scorer reads the weight of an FSDP2 head or embedding unit (split_root) to score and train: one rank's
    rows at a time (kernels/streamed.py), each broadcast by the rank that holds it, its gradient summed back to that
    rank (`RankRows`). FSDP2's own unit gathers the whole [V, H] weight for the forward and again for the backward,
    and holds its whole unsharded gradient and an fp32 reduce-scatter input beside it: Qwen2.5-72B's untied head
    and embedding are 152,064 x 8,192 each, 2.5 GB in bf16 and 5 GB in fp32, on every rank at any world size.
    Streamed, a rank holds one block of V / world rows and that block's gradient; the collectives move the same bytes
    as the all-gather and reduce-scatter they replace (a broadcast and a reduce per rank; the embedding's backward
    only the reduce). The head's vocabulary log-distribution (`vocab`), a LoRA-adapted head and a head with a bias
    (`streams_head`), an embedding of another kind than torch's own (`streams_lookup`: Gemma's scaled one), a trained
    shard in host memory (`blocks`) and generation run the gathered unit."""

    def __init__(self, param_dtype: torch.dtype | None) -> None:
        self.param_dtype = param_dtype  # the mixed-precision policy's parameter dtype (None: the shard's own)

    def blocks(self, weight: torch.Tensor, device: torch.device) -> RankRows | None:
        """The weight's blocks, where `weight` is the unit's resharded parameter (a DTensor sharded on its rows), or
        None (gathered for generation, adapted, or laid out otherwise): the gathered unit computes instead. A trained
        shard offloaded to host memory (actor.offload) also takes the gathered unit: a gradient computed on `device`
        and carried by autograd into the host shard trips torch's autograd engine (`opt_ready_stream &&
        opt_parent_stream`, engine.cpp, measured on the emulated device with torch 2.13), where FSDP2 assigns its
        shards' gradients itself. A reference's offloaded shard, read without gradients, streams."""
        from torch.distributed.tensor import DTensor, Replicate, Shard

        if not isinstance(weight, DTensor) or weight.ndim != 2:
            return None
        if torch.is_grad_enabled() and weight.requires_grad and weight.to_local().device != device:
            return None
        *replicated, rows = weight.placements
        if rows != Shard(0) or len(replicated) > 1 or any(p != Replicate() for p in replicated):
            return None
        return RankRows(weight)


class RankRows:
    """`HeadBlocks` (kernels/chunked.py) over a row-sharded weight: block j is the rows rank j of the shard group
    holds, in FSDP2's layout (torch.chunk of dim 0 into world pieces, the last ones shorter or empty); under HSDP
    each replica group sums its block's gradient across the replicas too. Collectives run on the compute device
    (an offloaded shard is copied there first), as FSDP2's own gathers do."""

    def __init__(self, weight) -> None:
        import torch.distributed as dist

        mesh = weight.device_mesh
        self.group = mesh.get_group(mesh.ndim - 1)
        self.replicas = mesh.get_group(0) if mesh.ndim == 2 else None
        world, self.me = dist.get_world_size(self.group), dist.get_rank(self.group)
        vocab, step = weight.shape[0], -(-weight.shape[0] // world)
        self.rows = tuple(max(0, min(step, vocab - j * step)) for j in range(world))
        self.owners = [dist.get_global_rank(self.group, j) for j in range(world)]
        local = weight.to_local().shape[0]
        if local != self.rows[self.me]:
            raise RuntimeError(f"the LM head's shard on rank {self.me} has {local} rows, where torch.chunk's layout "
                               f"gives {self.rows[self.me]}: FSDP2's sharding changed")

    def fetch(self, local: torch.Tensor, j: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        import torch.distributed as dist

        if j == self.me:
            block = local.detach().to(device=device, dtype=dtype).contiguous()
        else:
            block = torch.empty((self.rows[j], local.shape[1]), dtype=dtype, device=device)
        dist.broadcast(block, src=self.owners[j], group=self.group)
        return block

    def reduce(self, j: int, grad: torch.Tensor, local_grad: torch.Tensor) -> None:
        import torch.distributed as dist

        dist.reduce(grad, dst=self.owners[j], group=self.group)
        if j == self.me:
            if self.replicas is not None:
                dist.all_reduce(grad, group=self.replicas)
            local_grad.copy_(grad)


def streams_lookup(embed: torch.nn.Module) -> bool:
    """Whether an input embedding is torch's own lookup (no max_norm, dense gradients not scaled by frequency),
    which kernels/streamed.py's StreamedLookup reproduces, rather than a subclass that adds to it (Gemma's scaled
    embedding)."""
    return (type(embed) is torch.nn.Embedding and embed.max_norm is None and not embed.sparse
            and not embed.scale_grad_by_freq)


def streams_head(head: torch.nn.Module | None) -> bool:
    """Whether an LM head is torch's own linear layer without a bias, which kernels/streamed.py's
    StreamedHeadLogprob computes: not a biased head (Phi-2's), not a peft LoRA-adapted one (its weight is the base's
    plus the adapters' product)."""
    return head is not None and type(head) is torch.nn.Linear and head.bias is None


STRATEGIES: Registry[type] = Registry("parallel strategy")
STRATEGIES.register("none")(SingleProcess)
STRATEGIES.register("ddp")(Replicated)
STRATEGIES.register("fsdp2")(FSDP2)
STRATEGIES.register("ep")(ExpertParallel)


def strategy_name(requested: str, resolved: str, world: int, offload: bool) -> str:
    """The strategy a run of `world` ranks takes: `resolved` is the backend's answer to trainer.parallel=`requested`
    (`BaseBackend.parallel_strategy`). On one rank that is plain `none`, unless FSDP2 is what the backend resolves to
    and the run asks for it by name or offloads (actor.offload / ref_offload): then FSDP2 over a group of one, whose
    CPUOffloadPolicy keeps the states in host memory, as verl runs FSDP on one GPU. `train`, the planner and the
    hardware check's one-device offload run all take it from here."""
    if world > 1:
        return resolved
    return "fsdp2" if resolved == "fsdp2" and (requested == "fsdp2" or offload) else "none"


def make_strategy(name: str, comm: Collectives, shard_group: int = -1, pinned_offload: bool = False,
                  stream_rows: bool = True, expert_group: int = -1):
    """`name` is `strategy_name`'s answer; `shard_group` is trainer.fsdp_size; `pinned_offload` the backend row's;
    `stream_rows` actor.stream_head_rows; `expert_group` trainer.ep_size. FSDP2 on one rank needs the group of one
    that `make_runtime` formed for it."""
    if name == "none" or (comm.world_size == 1 and not comm.grouped):
        return SingleProcess(comm)
    return STRATEGIES.get(name, field="trainer.parallel")(comm, shard_group, pinned_offload, stream_rows,
                                                          expert_group)


_SEQUENCE_GROUPS: dict[tuple[int, int, int], Any] = {}


def sequence_parallel_group(comm: Collectives, size: int):
    """This rank's Ulysses group (actor.ulysses_sequence_parallel_size consecutive ranks; model/ulysses.py), formed
    once per process, so the policy and the reference share it; None for size 1."""
    from portagrpo.model.ulysses import sequence_groups

    if size == 1:
        return None
    if size < 1 or comm.world_size % size:
        raise UserError(f"actor.ulysses_sequence_parallel_size={size} must divide the {comm.world_size} ranks; use a "
                        f"divisor of {comm.world_size}.")
    key = (comm.world_size, comm.rank, size)
    if key not in _SEQUENCE_GROUPS:
        _SEQUENCE_GROUPS[key] = sequence_groups(comm.world_size, comm.rank, size)
    return _SEQUENCE_GROUPS[key]


def refuse_offload(offload: bool, where: str, scorer: torch.nn.Module) -> None:
    """Offload asked of a strategy without FSDP2's: fine where the model already lives in host memory (the CPU
    backend), else one sentence."""
    if offload and any(p.device.type != "cpu" for p in scorer.parameters()):
        raise UserError(f"actor.offload / actor.ref_offload move FSDP2's shards to host memory, and {where} has none; "
                        f"use trainer.parallel=fsdp2 (on one rank too), or turn offload off.")
