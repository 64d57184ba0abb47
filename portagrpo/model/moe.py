"""Mixture-of-experts models: their MoE blocks and routers, their shape for a plan, and how their experts run.

Where a MoE policy's routes go (recorded, replayed, compared) is model/router_replay.py; how a checkpoint's
per-expert tensors pack into the experts transformers 5 holds is model/expert_packing.py; vLLM's routes are read
next to the engine (rollout/vllm_routes.py).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from portagrpo.errors import UserError

ROUTE_DTYPE = torch.int16  # expert ids up to 32767 (Qwen3: 128, DeepSeek-V3: 256); -1: not known
REPLAY_MODES = (None, "R2", "R3")


@dataclass(frozen=True)
class MoeLayer:
    """One MoE block: its router module, its layout, its top-k and expert count."""

    index: int  # among the model's MoE layers (the L axis of a route grid)
    gate: torch.nn.Module
    layout: str  # "router" (transformers >= 5: the gate returns (logits, weights, indices)), "linear" (4.x)
    top_k: int
    num_experts: int
    norm_topk_prob: bool
    # how the router weighs its chosen experts: "softmax" over every expert (Qwen), or "sigmoid" of each expert's
    # logit (DeepSeek-V3's family, whose router keeps an e_score_correction_bias for choosing), then times `scale`
    # (DeepSeek-V3's routed_scaling_factor)
    scoring: str = "softmax"
    scale: float = 1.0


def base_lm(model) -> torch.nn.Module:
    """The transformers model under our wrappers (the scorer's `.lm`, peft)."""
    lm = getattr(model, "lm", model)
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def _decoder_layers(model) -> list[torch.nn.Module]:
    from portagrpo.model.loading import decoder_of

    return list(getattr(decoder_of(base_lm(model)), "layers", []))


def moe_layers(model) -> list[MoeLayer]:
    """The model's MoE blocks in layer order (a decoder layer whose `mlp` has a `gate` and `experts`); [] for a dense
    model."""
    out = []
    for layer in _decoder_layers(model):
        block = getattr(layer, "mlp", None)
        gate, experts = getattr(block, "gate", None), getattr(block, "experts", None)
        if gate is None or experts is None:
            continue
        if hasattr(gate, "top_k") and hasattr(gate, "num_experts"):  # transformers >= 5: a router module
            scoring = "sigmoid" if hasattr(gate, "e_score_correction_bias") else "softmax"
            scale = float(getattr(gate, "routed_scaling_factor", 1.0))
            out.append(MoeLayer(len(out), gate, "router", gate.top_k, gate.num_experts, bool(gate.norm_topk_prob),
                                scoring, scale))
        elif isinstance(gate, torch.nn.Linear) and hasattr(block, "top_k"):  # transformers 4.x
            out.append(MoeLayer(len(out), gate, "linear", block.top_k, block.num_experts,
                                bool(getattr(block, "norm_topk_prob", False))))
    return out


def is_moe(model) -> bool:
    return bool(moe_layers(model))


@dataclass(frozen=True)
class MoeShape:
    """What a plan needs to count a MoE model: experts, the parameters a token uses and the route buffers."""

    moe_layers: int
    num_experts: int
    top_k: int
    total_params: int
    active_params: int  # parameters one token's forward touches: all but the experts it is not routed to
    route_bytes_per_token: int  # a route grid's int16 entries per token (L x k x 2 bytes)


def moe_shape(model) -> MoeShape | None:
    """Total and active parameter counts and the routing buffer per token; None for a dense model."""
    layers = moe_layers(model)
    if not layers:
        return None
    total = sum(p.numel() for p in model.parameters())
    expert_params = 0
    for layer in _decoder_layers(model):
        experts = getattr(getattr(layer, "mlp", None), "experts", None)
        if experts is not None:
            expert_params += sum(p.numel() for p in experts.parameters())
    e, k = layers[0].num_experts, layers[0].top_k
    active = total - expert_params + expert_params * k // e
    return MoeShape(len(layers), e, k, total, active, len(layers) * k * 2)


def refuse_replay_problem(model, mode: str | None) -> str | None:
    """Why `actor.router_replay=mode` cannot run on this model, in one sentence; None when it can."""
    if mode is None:
        return None
    if mode not in REPLAY_MODES:
        return f"actor.router_replay={mode!r} is not a router replay mode; use null, R2 or R3."
    layers = moe_layers(model)
    if not layers:
        return (f"actor.router_replay={mode} replays a mixture-of-experts router, and this policy has none; set "
                f"actor.router_replay=null.")
    bad = [m for m in layers if m.layout == "linear" and not m.norm_topk_prob]
    if bad:
        return (f"actor.router_replay={mode} on transformers {_tf_version()} replays only routers that renormalise "
                f"their top-k (norm_topk_prob=true), and this model's do not; upgrade to transformers 5, or set "
                f"actor.router_replay=null.")
    return None


def _tf_version() -> str:
    import transformers

    return transformers.__version__


def check_routes(routes: torch.Tensor, model, field_name: str = "routes") -> None:
    """A route grid fits this model: L MoE layers, top-k, expert ids in range (a record from another model is
    refused in one sentence)."""
    layers = moe_layers(model)
    if routes.shape[2] != len(layers) or routes.shape[3] != layers[0].top_k:
        raise UserError(f"{field_name} hold {routes.shape[2]} layers x top-{routes.shape[3]} routes, and this model "
                        f"has {len(layers)} MoE layers x top-{layers[0].top_k}; replay them on the model that "
                        f"made them.")


def fit_experts_to_dtype(model, choice: str = "grouped_mm") -> None:
    """How transformers 5 runs the packed experts: the backend's `choice` (BackendSpec.moe_experts), except that an
    fp64 model (the parity reference, model.dtype=fp64) runs them eagerly (`torch._grouped_mm` takes fp32, bf16 and
    fp16 only). transformers 4.x has one module per expert and no choice to make."""
    lm = base_lm(model)
    config = getattr(lm, "config", None)
    if config is None or not moe_layers(lm) or not hasattr(config, "_experts_implementation"):
        return
    fp64 = any(p.dtype == torch.float64 for p in lm.parameters())
    config._experts_implementation = "eager" if fp64 else choice


def _moe_blocks(model) -> list[tuple[int, torch.nn.Module]]:
    """(decoder-layer index, MoE block) of every layer whose `mlp` has a `gate` and `experts`, in order."""
    out = []
    for i, layer in enumerate(_decoder_layers(model)):
        block = getattr(layer, "mlp", None)
        if getattr(block, "gate", None) is not None and getattr(block, "experts", None) is not None:
            out.append((i, block))
    return out


def moe_decoder_indices(model) -> list[int]:
    """The decoder-layer index of each MoE layer, in order (an engine that reports every layer, vLLM, is read at
    these)."""
    return [i for i, _ in _moe_blocks(model)]


def expert_modules(model) -> list[torch.nn.Module]:
    """Every MoE layer's experts module (`mlp.experts`), in layer order (what trainer.parallel=ep splits)."""
    return [block.experts for _, block in _moe_blocks(model)]




def configure_experts(model, mode: str | None, experts: str = "grouped_mm") -> None:
    """A MoE policy as the run and its backend want it: refused in one sentence where `actor.router_replay=mode` cannot
    replay its routers, and its experts run as the backend answers (`experts`: BackendSpec.moe_experts). A dense
    model with mode null: nothing to do."""
    problem = refuse_replay_problem(model, mode)
    if problem:
        raise UserError(problem)
    fit_experts_to_dtype(model, experts)
