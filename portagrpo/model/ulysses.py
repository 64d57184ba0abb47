"""Packed rows without padding, and Ulysses sequence parallelism over them (actor.ulysses_sequence_parallel_size).

A micro-batch's sequences are packed into one row of N tokens, positions restarting per sequence. Attention then runs
within each sequence: through the backend's variable-length kernel where it has one (`npu_fusion_attention`'s TND
layout on Ascend), else one causal SDPA call per sequence (block-diagonal, no [N, N] mask anywhere), so packing has no
length cap.

With sequence parallelism a group of `sp` ranks holds the same micro-batch, and each rank runs the decoder over its
N / sp consecutive tokens of the packed row (padded to a multiple of sp). Everything but attention is per token.
Around attention an all-to-all swaps the sequence shards for head shards: each rank gets the whole row for H / sp of
the heads, attends, and an all-to-all swaps back. Key/value heads fewer than sp are repeated first (sp / Hkv copies
of each), so every rank has the key/value heads its query heads read. The LM head and the log-prob kernel run on the
rank's own tokens; their per-token results are gathered in the group, and the loss is computed alike on every rank of
it. Backward of the gather hands each rank the gradient of its own tokens, the all-to-alls carry gradients back to the
ranks whose tokens they came from, and the sum of the group's parameter gradients is the gradient of the micro-batch:
the sum over all ranks that every strategy already does (model/parallel.py).

The collectives are the backend's process-group ones (gloo, NCCL, HCCL, the emulated device's); float64 payloads move
as their int64 bits (no collective library is asked to carry float64).
"""
from __future__ import annotations

from bisect import bisect_left
from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.distributed as dist

from portagrpo.errors import UserError

PACKED_PREFIX = "portagrpo_packed_"  # the attention implementation name this module registers, before the base's


@dataclass(frozen=True)
class SequenceGroup:
    """This rank's sequence-parallel group: `size` consecutive ranks, this one `rank` within it."""

    group: Any  # torch.distributed ProcessGroup
    size: int
    rank: int


@dataclass(frozen=True)
class Packing:
    """What the decoder's attention needs of a packed row (passed to it as the keyword `packing`)."""

    seqlens: tuple[int, ...]  # lengths of the row's sequences, in order, summing to the whole (unsharded) row
    sp: SequenceGroup | None = None
    varlen: Callable | None = None  # the backend's variable-length attention, None: block-diagonal SDPA


def sequence_groups(world: int, rank: int, sp: int, new_group: Callable = None) -> SequenceGroup | None:
    """The group of `sp` consecutive ranks this rank belongs to (every rank creates every group, in one order, as
    torch.distributed asks). None for sp == 1."""
    if sp == 1:
        return None
    if world % sp:
        raise UserError(f"actor.ulysses_sequence_parallel_size={sp} must divide the {world} ranks; use a divisor.")
    new_group = new_group or dist.new_group
    mine = None
    for first in range(0, world, sp):
        g = new_group(list(range(first, first + sp)))
        if first <= rank < first + sp:
            mine = g
    return SequenceGroup(mine, sp, rank % sp)


def sequence_parallel_problem(sp: int, heads: int, kv_heads: int, moe: bool) -> str | None:
    """Why a model cannot be split over `sp` sequence-parallel ranks (its experts, its heads), or None: the run and
    `portagrpo plan` say the same sentence."""
    if moe:
        return (f"actor.ulysses_sequence_parallel_size={sp} splits each row over ranks, and a mixture-of-experts "
                f"policy's routes (recorded, replayed and compared per token of the whole row) are not split with it "
                f"yet; use actor.ulysses_sequence_parallel_size=1.")
    return check_heads(heads, kv_heads, sp)


def check_heads(heads: int, kv_heads: int, sp: int) -> str | None:
    """Why a model with these heads cannot be split over `sp` ranks, or None."""
    if heads % sp:
        return (f"actor.ulysses_sequence_parallel_size={sp} must divide the model's {heads} attention heads (each rank "
                f"attends with heads / sp of them); use a divisor of {heads}.")
    if kv_heads % sp and sp % kv_heads:
        return (f"actor.ulysses_sequence_parallel_size={sp} and the model's {kv_heads} key/value heads: one must "
                f"divide the other (fewer kv heads than sp are repeated); use a size that does.")
    return None


# ---- collectives with autograd
def _bits(x: torch.Tensor) -> torch.Tensor:
    return x.view(torch.int64) if x.dtype == torch.float64 else x


def _a2a(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """all_to_all over dim 0 (of size group.size): slice j goes to rank j, and slice j of the result came from it."""
    x = x.contiguous()
    out = torch.empty_like(x)
    dist.all_to_all_single(_bits(out), _bits(x), group=group.group)
    return out


def _seq_to_heads(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[H, L, D] (all heads, this rank's L tokens) -> [H / sp, sp * L, D] (its heads, every token)."""
    h, length, d = x.shape
    out = _a2a(x.reshape(group.size, h // group.size, length, d), group)  # [sp, H/sp, L, D]: slice j from rank j
    return out.transpose(0, 1).reshape(h // group.size, group.size * length, d)


def _heads_to_seq(x: torch.Tensor, group: SequenceGroup) -> torch.Tensor:
    """[H / sp, sp * L, D] -> [H, L, D], the inverse of `_seq_to_heads`."""
    hs, n, d = x.shape
    length = n // group.size
    parts = x.reshape(hs, group.size, length, d).transpose(0, 1)  # [sp, H/sp, L, D]: slice j goes to rank j
    return _a2a(parts, group).reshape(group.size * hs, length, d)


class Swap(torch.autograd.Function):
    """`_seq_to_heads` (to_heads) or `_heads_to_seq` with autograd: the backward is the other one."""

    @staticmethod
    def forward(ctx, x, group, to_heads: bool):
        ctx.group, ctx.to_heads = group, to_heads
        return _seq_to_heads(x, group) if to_heads else _heads_to_seq(x, group)

    @staticmethod
    def backward(ctx, grad):
        return (_heads_to_seq(grad, ctx.group) if ctx.to_heads else _seq_to_heads(grad, ctx.group)), None, None


class GatherTokens(torch.autograd.Function):
    """Every rank's [n_r, ...] rows, concatenated in rank order ([sum n_r, ...]) on every rank of the group. Backward:
    the gradient of this rank's own rows (every rank computes the same loss from the gathered rows)."""

    @staticmethod
    def forward(ctx, x, group, counts):
        ctx.span = (sum(counts[:group.rank]), sum(counts[:group.rank + 1]))
        widest = max(max(counts), 1)
        padded = x.new_zeros((widest,) + tuple(x.shape[1:]))
        padded[:x.shape[0]] = x
        parts = [torch.empty_like(padded) for _ in range(group.size)]
        dist.all_gather([_bits(p) for p in parts], _bits(padded), group=group.group)
        return torch.cat([p[:c] for p, c in zip(parts, counts)])

    @staticmethod
    def backward(ctx, grad):
        return grad[ctx.span[0]:ctx.span[1]], None, None


# ---- attention over a packed row
def _repeat_heads(x: torch.Tensor, times: int) -> torch.Tensor:
    return x if times == 1 else x.repeat_interleave(times, dim=0)


def block_diagonal_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens: tuple[int, ...],
                             scale: float | None, dropout: float) -> torch.Tensor:
    """Causal attention within each sequence of a packed row: q [Hq, N, D], k/v [Hkv, N, D] -> [Hq, N, D]. One SDPA
    call per sequence (its own causal square), so memory grows with the longest sequence, not with N^2."""
    groups = q.shape[0] // k.shape[0]
    k, v = _repeat_heads(k, groups), _repeat_heads(v, groups)
    outs, start = [], 0
    for n in seqlens:
        s = slice(start, start + n)
        outs.append(torch.nn.functional.scaled_dot_product_attention(
            q[None, :, s], k[None, :, s], v[None, :, s], dropout_p=dropout, is_causal=True, scale=scale)[0])
        start += n
    return torch.cat(outs, dim=1)


def packed_attention(base: Callable, module: torch.nn.Module, query: torch.Tensor, key: torch.Tensor,
                     value: torch.Tensor, attention_mask, scaling: float | None = None, dropout: float = 0.0,
                     packing: Packing | None = None, **kwargs):
    """transformers attention-interface function: `base` (the model's own implementation) for ordinary rows; for a
    packed row (the keyword `packing`) causal attention within each sequence, around all-to-alls under sequence
    parallelism. query [1, Hq, L, D], key/value [1, Hkv, L, D] -> ([1, L, Hq, D], None)."""
    if packing is None:
        return base(module, query, key, value, attention_mask, scaling=scaling, dropout=dropout, **kwargs)
    q, k, v = query[0], key[0], value[0]
    sp = packing.sp
    if sp is not None:
        if k.shape[0] < sp.size:  # replicate kv heads so that each rank receives the ones its query heads read
            k, v = _repeat_heads(k, sp.size // k.shape[0]), _repeat_heads(v, sp.size // v.shape[0])
        q, k, v = (Swap.apply(t, sp, True) for t in (q, k, v))
    p = dropout if module.training else 0.0
    if packing.varlen is not None:
        out = packing.varlen(q, k, v, packing.seqlens, scaling, p)
    else:
        out = block_diagonal_attention(q, k, v, packing.seqlens, scaling, p)
    if sp is not None:
        out = Swap.apply(out, sp, False)
    return out.transpose(0, 1)[None], None


def use_packed_attention(config, flash: bool = False) -> bool:
    """Give a decoder config the packed form of its attention implementation (sdpa, or a backend's registered one),
    registered with transformers under PACKED_PREFIX + its name with the base's mask function (the name keeps "flash"
    in it for a flash base, which transformers reads). False where the base is not a registered function (eager is
    each model's own), and for flash-attention unless `flash` (sequence parallelism): without it flash-attention reads
    packed rows from their positions itself, with no cap, and is left as transformers runs it."""
    try:
        from transformers import AttentionInterface
        from transformers.masking_utils import ALL_MASK_ATTENTION_FUNCTIONS, AttentionMaskInterface
        from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS
    except ImportError:
        return False
    name = getattr(config, "_attn_implementation", None)
    if name is None or name.startswith(PACKED_PREFIX):
        return name is not None
    registered = name in ALL_ATTENTION_FUNCTIONS and name in ALL_MASK_ATTENTION_FUNCTIONS
    if not registered or ("flash" in name and not flash):
        return False
    base = ALL_ATTENTION_FUNCTIONS[name]

    def forward(*args, **kw):
        return packed_attention(base, *args, **kw)

    AttentionInterface.register(PACKED_PREFIX + name, forward)
    AttentionMaskInterface.register(PACKED_PREFIX + name, ALL_MASK_ATTENTION_FUNCTIONS[name])
    config._attn_implementation = PACKED_PREFIX + name
    return True


# ---- the host plan of a packed row
@dataclass(frozen=True)
class PackedRow:
    """Where things are in a packed row of row lengths `lengths` (prompt + response), and this rank's part of it."""

    seqlens: tuple[int, ...]  # the sequences, plus one of padding up to a multiple of sp
    start: int  # this rank's first token of the row
    stop: int
    predicting: list[int]  # positions in the row of the hidden states predicting each response token, in order
    mine: tuple[int, int]  # the span of `predicting` on this rank
    counts: list[int]  # how many response tokens each rank of the group holds


def plan_row(lengths: list[tuple[int, int]], sp: SequenceGroup | None) -> PackedRow:
    """From the host lengths (prompt, response) of each row: the packed row and this rank's shard of it."""
    seqlens, predicting, offset = [], [], 0
    for p, r in lengths:
        seqlens.append(p + r)
        predicting.extend(range(offset + p - 1, offset + p - 1 + r))
        offset += p + r
    size, rank = (1, 0) if sp is None else (sp.size, sp.rank)
    padded = -(-offset // size) * size
    if padded > offset:
        seqlens.append(padded - offset)
    shard = padded // size
    bounds = [bisect_left(predicting, shard * j) for j in range(size + 1)]
    counts = [bounds[j + 1] - bounds[j] for j in range(size)]
    return PackedRow(tuple(seqlens), shard * rank, shard * (rank + 1), predicting, (bounds[rank], bounds[rank + 1]),
                     counts)


def one_per_group(gathered: torch.Tensor, groups: int, sp: int) -> torch.Tensor:
    """[world * n, ...] gathered in rank order, where the sp ranks of each group hold the same n rows -> [groups * n,
    ...], the first rank's copy of each group (how a scoring pass split by groups is gathered back)."""
    return gathered.view(groups, sp, -1, *gathered.shape[1:])[:, 0].flatten(0, 1)


def check_same_rows(lengths: list[tuple[int, int]], sp: SequenceGroup) -> None:
    """Every rank of the group must hold the same micro-batch; rows that differ (a caller that split the batch by rank,
    not by group) are one sentence here instead of a collective mismatch inside attention. One small host gather."""
    seen = [None] * sp.size
    dist.all_gather_object(seen, tuple(lengths), group=sp.group)
    if any(s != seen[0] for s in seen):
        raise UserError("actor.ulysses_sequence_parallel_size: the ranks of a sequence-parallel group were handed "
                        "different rows to score (split by rank, not by group); this pass does not run under sequence "
                        "parallelism yet: use actor.ulysses_sequence_parallel_size=1 for it.")
