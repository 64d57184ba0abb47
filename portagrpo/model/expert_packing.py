"""A mixture-of-experts checkpoint's expert tensors in either layout: transformers 5 holds each layer's experts packed
(`experts.gate_up_proj` [E, 2I, H], `experts.down_proj` [E, H, I]); a hub checkpoint, what transformers 5's
`save_pretrained` writes and what every vLLM MoE loader takes, names them one expert at a time."""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

PACKED_EXPERTS = (".experts.gate_up_proj", ".experts.down_proj")


def packed_kind(name: str, tensor: torch.Tensor) -> str | None:
    """Which of transformers 5's packed expert tensors `name` is ("gate_up_proj" [E, 2I, H] or "down_proj" [E, H, I]),
    or None for any other tensor."""
    for suffix in PACKED_EXPERTS:
        if name.endswith(suffix) and tensor.dim() == 3:
            return suffix.rsplit(".", 1)[1]
    return None


def one_expert(name: str, kind: str, e: int, block: torch.Tensor) -> list[tuple[str, torch.Tensor]]:
    """Expert `e`'s block of the packed tensor `name` (its row, [2I, H] or [H, I]) under a hub checkpoint's names:
    `experts.<e>.gate_proj.weight` and `experts.<e>.up_proj.weight` (the halves of gate_up_proj), or
    `experts.<e>.down_proj.weight`. Views, no copies."""
    prefix = name[:-len(kind)]
    if kind == "gate_up_proj":
        half = block.shape[0] // 2
        return [(f"{prefix}{e}.gate_proj.weight", block[:half]), (f"{prefix}{e}.up_proj.weight", block[half:])]
    return [(f"{prefix}{e}.down_proj.weight", block)]


def per_expert_names(named: Iterable[tuple[str, torch.Tensor]]) -> Iterator[tuple[str, torch.Tensor]]:
    """(name, tensor) pairs with transformers 5's packed experts split into the per-expert tensors of a Hugging Face
    checkpoint, the names every vLLM MoE loader takes (a hub checkpoint's): `<layer>.mlp.experts.gate_up_proj`
    [E, 2I, H] gives `experts.<e>.gate_proj.weight` (rows :I) and `experts.<e>.up_proj.weight` (rows I:),
    `experts.down_proj` [E, H, I] gives `experts.<e>.down_proj.weight`. Views, no copies; other pairs pass through."""
    for name, tensor in named:
        kind = packed_kind(name, tensor)
        if kind is None:
            yield name, tensor
            continue
        for e in range(tensor.shape[0]):
            yield from one_expert(name, kind, e, tensor[e])


def packed_experts(state: dict[str, torch.Tensor], model) -> dict[str, torch.Tensor]:
    """A state dict in a hub checkpoint's per-expert layout (what transformers 5's `save_pretrained` writes, and
    `per_expert_names` sends) with each layer's experts packed again as `model` holds them (`experts.gate_up_proj`
    [E, 2I, H], `experts.down_proj` [E, H, I]); unchanged for a model without packed experts or a packed state."""
    wanted = {n: tuple(p.shape) for n, p in model.state_dict().items() if n.endswith(PACKED_EXPERTS) and p.dim() == 3}
    if not wanted or all(n in state for n in wanted):
        return state
    out = dict(state)
    for name, shape in wanted.items():
        prefix = name[:name.rindex(".") + 1]  # "<layer>.mlp.experts."
        parts = ("gate_proj", "up_proj") if name.endswith("gate_up_proj") else ("down_proj",)
        keys = [[f"{prefix}{e}.{part}.weight" for part in parts] for e in range(shape[0])]
        if not all(k in out for row in keys for k in row):
            continue  # left missing: the caller's check names it
        out[name] = torch.stack([torch.cat([out.pop(k) for k in row]) for row in keys])
    return out
