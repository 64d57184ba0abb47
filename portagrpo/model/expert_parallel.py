"""Expert parallelism (trainer.parallel=ep): each rank of an expert-parallel group holds num_experts / ep of every
MoE layer's experts, and tokens travel to the rank that holds their expert and back (all-to-all), instead of FSDP2
gathering the whole layer's experts on every rank for every forward.

The engine is torchtitan's (0.3.0) `AllToAllTokenDispatcher`: its token exchange, split-size exchange and
permutations, in plain torch collectives on a device mesh. The MoE block stays transformers' own: its router
(`mlp.gate`, where router replay hooks in), its shared experts, and its packed expert tensors under their own names
(`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), which become DTensors sharded on dim 0
(the experts) over the `ep` mesh. Only the experts module's class changes: its forward sends the tokens by the ids
the router (or the replayed routes) chose, runs the rank's own experts with transformers' experts function (the
backend's `moe_experts` choice, eager for fp64), and combines the outputs weighted by the router's scores. Why not
torchtitan's MoE layer: docs/design.md, "Expert parallelism: which engine".
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from portagrpo.model.moe import expert_modules, moe_layers

EP_INSTALL = ("pip install 'portagrpo[ep]' (torchtitan 0.3.0, spmd_types, tyro and triton, the versions "
              "ci/constraints-cpu.txt pins)")


def ep_import_problem() -> str | None:
    """Why torchtitan's dispatcher cannot run here, in one sentence (None when it can). It imports
    torch.nn.attention.varlen (torch 2.10 on; not 2.9), and its token exchanges call
    torch.compiler._is_non_strict_tracing (token_dispatcher.py:259, 326, 354, evaluated on every dispatch and combine),
    which torch 2.12 has and 2.11 does not: there the first forward would raise AttributeError."""
    try:
        from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher  # noqa: F401
    except Exception as exc:  # ImportError, or torchtitan importing what this torch lacks
        return (f"trainer.parallel=ep runs torchtitan's all-to-all token dispatcher, which does not import here "
                f"({type(exc).__name__}: {str(exc).splitlines()[0] if str(exc) else ''}); {EP_INSTALL} on torch "
                f"2.12 or newer, or use trainer.parallel=fsdp2.")
    if not hasattr(torch.compiler, "_is_non_strict_tracing"):
        return (f"trainer.parallel=ep runs torchtitan 0.3.0's all-to-all token dispatcher, which calls "
                f"torch.compiler._is_non_strict_tracing at every token exchange, and torch {torch.__version__} has "
                f"none (torch 2.12 added it); use torch 2.12 or newer, or trainer.parallel=fsdp2.")
    return None


def ep_model_problem(model, ep: int) -> str | None:
    """Why this model's experts cannot be split over `ep` ranks, in one sentence (None when they can)."""
    layers = moe_layers(model)
    if not layers:
        return ("trainer.parallel=ep splits a mixture-of-experts model's experts over the ranks, and this model has "
                "none; use trainer.parallel=fsdp2.")
    if any(m.layout != "router" for m in layers):
        return ("trainer.parallel=ep runs transformers 5's packed experts (one [E, 2I, H] tensor a layer), and this "
                "transformers keeps one module per expert; upgrade to transformers 5, or use trainer.parallel=fsdp2.")
    for module in expert_modules(model):
        if not (isinstance(getattr(module, "gate_up_proj", None), torch.Tensor)
                and isinstance(getattr(module, "down_proj", None), torch.Tensor)):
            return (f"trainer.parallel=ep splits packed experts (gate_up_proj, down_proj), and this model's "
                    f"{type(module).__name__} holds others; use trainer.parallel=fsdp2.")
        if any("lora" in name for name, _ in module.named_parameters()):
            return ("trainer.parallel=ep does not split LoRA adapters on the experts; leave the experts out of "
                    "lora.target_modules, or use trainer.parallel=fsdp2.")
    experts = layers[0].num_experts
    if ep < 1 or experts % ep:
        return (f"trainer.ep_size={ep} must divide the model's {experts} experts (each rank of an expert-parallel "
                f"group holds experts / ep_size of every layer); give a divisor of {experts}.")
    return None


class LocalExperts:
    """What transformers' experts function reads of `self` for one rank's experts: the local shards of the packed
    tensors and their count; every other attribute (the activation, the gate function, the layout flags) is the
    experts module's own."""

    def __init__(self, experts: torch.nn.Module, gate_up: torch.Tensor, down: torch.Tensor) -> None:
        self.experts, self.gate_up_proj, self.down_proj = experts, gate_up, down
        self.num_experts = gate_up.shape[0]
        self._is_expert_parallel = False  # transformers' own EP sentinels: none here, every id is local

    def __getattr__(self, name: str) -> Any:
        return getattr(self.experts, name)


class ExpertParallelExperts(torch.nn.Module):
    """Mixed in before a transformers experts class (the module's class is swapped, its parameters and names kept):
    `gate_up_proj` and `down_proj` are DTensors sharded on the experts over the `ep` mesh."""

    def attach(self, dispatcher, run_local: Callable) -> None:
        self.dispatcher, self.run_local = dispatcher, run_local

    def forward(self, hidden_states: torch.Tensor, top_k_index: torch.Tensor, top_k_weights: torch.Tensor):
        counts = torch.bincount(top_k_index.reshape(-1), minlength=self.num_experts)
        routed, local_counts, meta = self.dispatcher.dispatch(hidden_states, top_k_weights, top_k_index, counts)
        gate_up, down = self.gate_up_proj.to_local(), self.down_proj.to_local()
        ids = torch.repeat_interleave(torch.arange(gate_up.shape[0], device=routed.device), local_counts,
                                      output_size=routed.shape[0])
        ones = torch.ones((routed.shape[0], 1), dtype=routed.dtype, device=routed.device)
        out = self.run_local(LocalExperts(self, gate_up, down), routed, ids[:, None], ones)
        if routed.shape[0] == 0 and torch.is_grad_enabled():
            # No token reached this rank's experts (a router that prefers the other rank's group): transformers' eager
            # loop then returns zeros cut off from its inputs, and this rank's backward would skip both all-to-alls
            # that the other ranks' backwards wait in (measured: a hang). A zero that depends on them keeps them.
            out = out + (routed.sum() + gate_up.sum() + down.sum()) * 0
        return self.dispatcher.combine(out, meta, hidden_states)


def _dispatcher_class():
    from torchtitan.models.common.token_dispatcher import AllToAllTokenDispatcher
    from torchtitan.ops.scatter_add import deterministic_scatter_add

    class WideCombine(AllToAllTokenDispatcher):
        """torchtitan's dispatcher, with the combine's score product in the wider of fp32 and the output's dtype:
        torchtitan multiplies in fp32, which costs an fp64 run (the parity reference) 2e-7 relative (measured);
        fp32 and bf16 multiply as torchtitan does."""

        def combine(self, routed_output_RD, metadata, x_TD):
            routed = self._unpermute(routed_output_RD, metadata.input_shape, metadata.permuted_indices)
            routed = self._combine_token_exchange(routed, None, metadata.input_splits, metadata.output_splits)
            wide = torch.promote_types(routed.dtype, torch.float32)
            scores = metadata.topk_scores_experts_sorted_N.reshape(-1, 1)
            routed = (routed.to(wide) * scores.to(wide)).to(routed.dtype)
            index = metadata.token_indices_experts_sorted_N.reshape(-1, 1).expand(-1, x_TD.shape[-1])
            return deterministic_scatter_add(torch.zeros_like(x_TD), index, routed)

    return WideCombine


def _local_function(hf_class: type) -> Callable:
    """transformers' experts function for the implementation the model's config names at the time of the call
    (grouped_mm, batched_mm, or the class's own eager loop: `fit_experts_to_dtype` sets it)."""
    from transformers.integrations.moe import ALL_EXPERTS_FUNCTIONS

    eager = getattr(hf_class.forward, "__wrapped__", hf_class.forward)

    def run(view, hidden, ids, weights):
        implementation = getattr(getattr(view, "config", None), "_experts_implementation", None) or "eager"
        return ALL_EXPERTS_FUNCTIONS.get_interface(implementation, eager)(view, hidden, ids, weights)

    return run


def to_expert_parallel(model, ep_mesh) -> list[torch.nn.Module]:
    """Make every MoE layer's experts module of `model` expert-parallel over `ep_mesh` (a 1-D mesh): each rank keeps
    its block of consecutive experts (torch.chunk's layout) as the local shard of a DTensor, no collective (a meta
    model stays on meta, for the sharded load). Returns the modules."""
    from torch.distributed.tensor import DTensor, Shard
    from torchtitan.distributed.utils import set_spmd_backend

    # torchtitan's functional all_to_all_single path: uneven splits (gloo, NCCL, HCCL), no spmd_types mesh context
    set_spmd_backend("partial_dtensor")
    dispatcher_class = _dispatcher_class()
    ep, rank = ep_mesh.size(), ep_mesh.get_local_rank()
    modules = expert_modules(model)
    for module, layer in zip(modules, moe_layers(model)):
        hf_class = type(module)
        run_local = _local_function(hf_class)
        module.__class__ = type(f"ExpertParallel{hf_class.__name__}", (ExpertParallelExperts, hf_class), {})
        dispatcher = dispatcher_class(dispatcher_class.Config(num_experts=module.num_experts, top_k=layer.top_k))
        dispatcher.wire_meshes(ep_mesh=ep_mesh)
        module.attach(dispatcher, run_local)
        for name in ("gate_up_proj", "down_proj"):
            whole = getattr(module, name)
            block = whole.shape[0] // ep
            local = whole.detach().narrow(0, rank * block, block).clone()  # the whole one is freed
            shard = DTensor.from_local(local, ep_mesh, [Shard(0)], run_check=False, shape=whole.shape,
                                       stride=whole.stride())
            module.register_parameter(name, torch.nn.Parameter(shard, requires_grad=whole.requires_grad))
    return modules


def clip_over_meshes(params: list[torch.nn.Parameter], max_norm: float) -> torch.Tensor:
    """`torch.nn.utils.clip_grad_norm_` where gradients live on different meshes (the dense layers' and the experts'
    (efsdp, ep)): torch's norm stacks per-tensor norms, which DTensor refuses across meshes. The 2-norm of each
    mesh's gradients, whole (a collective on that mesh), then the total; every gradient scaled by the same factor.
    Returns the total norm as a plain tensor."""
    from torch.distributed.tensor import DTensor

    groups: dict[Any, list[torch.nn.Parameter]] = {}
    for p in params:
        if p.grad is not None:
            key = p.grad.device_mesh if isinstance(p.grad, DTensor) else None
            groups.setdefault(key, []).append(p)
    norms = []
    for group in groups.values():
        norm = torch.nn.utils.get_total_norm([p.grad for p in group], 2.0)
        norms.append(norm.full_tensor() if isinstance(norm, DTensor) else norm)
    if not norms:
        return torch.tensor(0.0)
    total = torch.linalg.vector_norm(torch.stack([n.to(norms[0].device, torch.float64) for n in norms]))
    scale = torch.clamp(max_norm / (total + 1e-6), max=1.0)
    for group in groups.values():
        for p in group:
            grad = p.grad.to_local() if isinstance(p.grad, DTensor) else p.grad
            grad.mul_(scale.to(grad.device, grad.dtype))
    return total.to(norms[0].dtype)
