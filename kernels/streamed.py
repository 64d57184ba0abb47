"""An LM head or input embedding held in blocks of vocabulary rows, one per FSDP2 rank, read one block at a time
(model/parallel.py `RankRows`), so that no rank holds either whole for training or scoring.

- `StreamedHeadLogprob` is the `chunked` kernel's math (kernels/chunked.py) walking the blocks: its forward fetches
  each block once, its backward once more, and sends each block's gradient home.
- `StreamedLookup` is an embedding lookup: each block's rows fill the tokens that fall in it; the backward only sends
  each block's gradient home (an embedding's gradient needs no weight).

`SlicedHead` cuts one whole weight into blocks: the one-process form, and the parity reference of both.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .chunked import DEFAULT_CHUNK_ELEMENTS, _block_logits, _block_size, _in_block, _LogitGrad, _OnlineLse
from .matmul import mm, operand_dtype
from .reference import compute_dtype


class HeadBlocks(Protocol):
    """A [V, H] weight read one block of vocabulary rows at a time, in vocabulary order."""

    rows: tuple[int, ...]  # each block's vocabulary rows

    def fetch(self, local: torch.Tensor, j: int, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        """Block j's rows [rows[j], H] in `dtype` on `device` (`local`: the part of the weight this process holds)."""

    def reduce(self, j: int, grad: torch.Tensor, local_grad: torch.Tensor) -> None:
        """Sum block j's gradient [rows[j], H] over the processes, into `local_grad` where this one holds block j."""


class SlicedHead:
    """One whole weight as `parts` blocks of vocabulary rows: the one-process `HeadBlocks` (and the streamed
    kernel's parity reference)."""

    def __init__(self, vocab: int, parts: int) -> None:
        step = -(-vocab // parts)
        self.rows = tuple(max(0, min(step, vocab - j * step)) for j in range(parts))

    def _span(self, j: int) -> slice:
        start = sum(self.rows[:j])
        return slice(start, start + self.rows[j])

    def fetch(self, local, j, dtype, device):
        return local[self._span(j)].to(device=device, dtype=dtype)

    def reduce(self, j, grad, local_grad):
        local_grad[self._span(j)] = grad


class StreamedHeadLogprob(torch.autograd.Function):
    """The `chunked` kernel's math over an LM head held in blocks (`HeadBlocks`): the forward fetches each block once
    and the backward twice over, once to recompute its logits and once to send its gradient home, so no process
    holds more than one block of the weight and of its gradient (FSDP2 gathers the whole head for its unit, and
    holds its whole gradient for the reduce-scatter). `local`'s gradient comes back in fp32 (fp64), in its own
    dtype and on its own device, as FSDP2's reduce-scatter gives its shard's."""

    @staticmethod
    def forward(ctx, hidden, local, targets, blocks, op_dtype, temperature, compute_entropy, chunk_elements, source):
        like = hidden.new_empty(0, dtype=op_dtype)  # the blocks' dtype
        dtype = compute_dtype(hidden, like)
        op = operand_dtype(dtype, hidden, like)
        h = hidden.to(op)
        inv_temp = 1.0 / temperature
        walk = _OnlineLse(hidden.shape[0], dtype, h.device, compute_entropy)
        for _, v0, w in _walk_blocks(blocks, local, op_dtype, h.device):
            block = _block_size(h.shape[0], w.shape[0], chunk_elements)
            for b0 in range(0, w.shape[0], block):
                walk.add(_block_logits(h, w, None, b0, block, op, dtype, inv_temp), targets, v0 + b0)
            del w
        z_target, lse, ent = walk.result()
        ctx.save_for_backward(hidden, targets, lse, ent)
        ctx.cfg = (blocks, op_dtype, op, inv_temp, chunk_elements, source, local.shape)
        return z_target - lse, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, targets, lse, ent = ctx.saved_tensors
        blocks, op_dtype, op, inv_temp, chunk_elements, source, shape = ctx.cfg
        dtype = lse.dtype
        h = hidden.to(op)
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
        local_grad = torch.zeros(shape, dtype=dtype, device=h.device) if need_w else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(dtype)
        grad_of = _LogitGrad(targets, lse, ent, g_logp, g_ent, inv_temp)
        for j, v0, w in _walk_blocks(blocks, source.tensor, op_dtype, h.device):
            grad_w = torch.empty(w.shape, dtype=dtype, device=h.device) if need_w else None
            block = _block_size(h.shape[0], w.shape[0], chunk_elements)
            for b0 in range(0, w.shape[0], block):
                gz = grad_of(_block_logits(h, w, None, b0, block, op, dtype, inv_temp), v0 + b0)
                b1 = b0 + gz.shape[1]
                if need_h:
                    grad_h += mm(gz, w[b0:b1], op, dtype)
                if need_w:
                    grad_w[b0:b1] = mm(gz.t(), h, op, dtype)
            del w
            if need_w:
                blocks.reduce(j, grad_w, local_grad)
        grad_local = None if local_grad is None else local_grad.to(source.tensor.dtype)
        grad_h = None if grad_h is None else grad_h.to(hidden.dtype)
        return grad_h, grad_local, None, None, None, None, None, None, None


def _walk_blocks(blocks: HeadBlocks, local: torch.Tensor, op_dtype: torch.dtype, device: torch.device):
    """(j, the block's first vocabulary row, the block's weight) for every block that has rows, in order."""
    v0 = 0
    for j, rows in enumerate(blocks.rows):
        if rows:
            yield j, v0, blocks.fetch(local, j, op_dtype, device)
        v0 += rows


def token_logprobs_streamed(
    hidden: torch.Tensor,
    local: torch.Tensor,
    targets: torch.Tensor,
    blocks: HeadBlocks,
    *,
    weight_dtype: torch.dtype | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [N, H]; `local`: this process's part of an LM head [V, H] with no bias, read through `blocks`, each
    block in `weight_dtype` (default: `local`'s; an FSDP2 run's parameter dtype) -> (logp [N], entropy [N] or
    None), in fp32 (fp64 for fp64), as `token_logprobs_chunked` on the whole weight in that dtype."""
    # An offloaded shard (host memory) enters on the compute device through torch's own copy, whose backward takes
    # the gradient home; the backward reads the shard where it lives again rather than hold the copy.
    logp, ent = StreamedHeadLogprob.apply(hidden, local.to(hidden.device), targets.long(), blocks,
                                          weight_dtype or local.dtype, float(temperature), bool(compute_entropy),
                                          int(chunk_elements), _Held(local))
    return logp, (ent if compute_entropy else None)


class StreamedLookup(torch.autograd.Function):
    """`torch.nn.functional.embedding(ids, weight, padding_idx)` over a weight held in blocks: one block of rows at a
    time in `dtype`, the output in `dtype`; the gradient of `local` in fp32 (fp64), nothing for `padding_idx`."""

    @staticmethod
    def forward(ctx, ids, local, blocks, dtype, padding_idx):
        out = None
        for _, v0, w in _walk_blocks(blocks, local, dtype, ids.device):
            inside, at = _in_block(ids, v0, w.shape[0])
            rows = w.index_select(0, at.squeeze(1).flatten()).view(*ids.shape, w.shape[1])
            out = rows if out is None else torch.where(inside.unsqueeze(-1), rows, out)
            del w, rows
        ctx.save_for_backward(ids)
        ctx.cfg = (blocks, padding_idx, local.shape, local.dtype, local.device)
        return out

    @staticmethod
    def backward(ctx, grad_out):
        (ids,) = ctx.saved_tensors
        blocks, padding_idx, shape, dtype, device = ctx.cfg
        if not ctx.needs_input_grad[1]:
            return None, None, None, None, None
        acc = compute_dtype(grad_out)
        flat = ids.flatten()
        grad = grad_out.reshape(flat.shape[0], -1).to(acc)
        if padding_idx is not None:
            grad = grad * (flat != padding_idx).unsqueeze(1).to(acc)
        local_grad = torch.zeros(shape, dtype=acc, device=grad.device)
        v0 = 0
        for j, rows in enumerate(blocks.rows):
            if rows:
                inside, at = _in_block(flat, v0, rows)
                block = torch.zeros((rows, shape[1]), dtype=acc, device=grad.device)
                block.index_add_(0, at.squeeze(1), grad * inside.unsqueeze(1).to(acc))
                blocks.reduce(j, block, local_grad)
                del block
            v0 += rows
        return None, local_grad.to(device=device, dtype=dtype), None, None, None


def embedding_streamed(ids: torch.Tensor, local: torch.Tensor, blocks: HeadBlocks, *,
                       weight_dtype: torch.dtype | None = None, padding_idx: int | None = None) -> torch.Tensor:
    """ids [...] -> embeddings [..., H] in `weight_dtype` (default: `local`'s) of a weight held in `blocks`."""
    return StreamedLookup.apply(ids, local.to(ids.device), blocks, weight_dtype or local.dtype, padding_idx)


class _Held:
    """A tensor handed to an autograd function as a setting, not an input (no gradient, not saved)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor
