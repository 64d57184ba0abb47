"""Fused linear + log-softmax + gather (+ entropy), never holding more than one chunk of logits.

Two chunkings of the same math, both storing only per-token log-sum-exp (and entropy) and
recomputing logits in backward, accumulating in fp32 (fp64 for fp64 inputs):

- `VocabChunkedLogprob` (the `chunked` kernel, pure torch, every backend) walks the vocabulary
  in blocks with an online log-sum-exp. Every matmul then has all N tokens as one dimension and
  each block of the weight gradient is written once, which keeps it close to the speed of the
  unfused path.
- `LinearLogprob` walks the tokens in chunks and hands full logits rows to a *row-ops* object:
  the Triton row kernels (kernels/triton_logprob.py) make the `triton` kernel.
"""
from __future__ import annotations

from typing import Protocol

import torch

from .matmul import mm, operand_dtype
from .reference import compute_dtype

# Elements of one logits chunk (chunk_tokens * V); 2**25 fp32 values = 128 MiB.
DEFAULT_CHUNK_ELEMENTS = 2**25


class RowOps(Protocol):
    def forward_rows(self, z: torch.Tensor, targets: torch.Tensor, inv_temp: float, entropy: bool
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """z: raw logits [c, V] -> (logp [c], lse [c], entropy [c] or None) of softmax(z * inv_temp)."""

    def backward_rows(self, z: torch.Tensor, targets: torch.Tensor, lse: torch.Tensor, entropy: torch.Tensor | None,
                      g_logp: torch.Tensor, g_entropy: torch.Tensor | None, inv_temp: float) -> torch.Tensor:
        """Gradient with respect to the raw logits z [c, V] (may overwrite z)."""


def chunk_tokens(vocab: int, chunk_elements: int) -> int:
    return max(1, chunk_elements // max(vocab, 1))


class LinearLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, compute_entropy, chunk_elements, row_ops):
        dtype = compute_dtype(hidden, weight, bias)
        op = operand_dtype(dtype, hidden, weight)
        w_t = weight.to(op).t()
        b = None if bias is None else bias.to(dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        step = chunk_tokens(vocab, chunk_elements)
        inv_temp = 1.0 / temperature
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.empty(n, dtype=dtype, device=hidden.device) if compute_entropy else None
        for s in range(0, n, step):
            z = mm(hidden[s:s + step], w_t, op, dtype)
            if b is not None:
                z += b
            lp, ls, en = row_ops.forward_rows(z, targets[s:s + step], inv_temp, compute_entropy)
            logp[s:s + step], lse[s:s + step] = lp, ls
            if compute_entropy:
                ent[s:s + step] = en
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.cfg = (inv_temp, step, row_ops)
        return (logp, ent) if compute_entropy else (logp, None)

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        inv_temp, step, row_ops = ctx.cfg
        dtype = lse.dtype
        op = operand_dtype(dtype, hidden, weight)
        w = weight.to(op)
        b = None if bias is None else bias.to(dtype)
        need_h, need_w, need_b = (
            ctx.needs_input_grad[0],
            ctx.needs_input_grad[1],
            bias is not None and ctx.needs_input_grad[2],
        )
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(dtype)
        g_ent = None if (g_ent is None or ent is None) else g_ent.to(dtype)
        for s in range(0, hidden.shape[0], step):
            h = hidden[s:s + step].to(op)
            z = mm(h, w.t(), op, dtype)
            if b is not None:
                z += b
            gz = row_ops.backward_rows(
                z,
                targets[s : s + step],
                lse[s : s + step],
                None if ent is None else ent[s : s + step],
                g_logp[s : s + step],
                None if g_ent is None else g_ent[s : s + step],
                inv_temp,
            )
            if need_h:
                grad_h[s:s + step] = mm(gz, w, op, dtype)
            if need_w:
                grad_w += mm(gz.t(), h, op, dtype)
            if need_b:
                grad_b += gz.sum(0)
        grads = (grad_h, hidden), (grad_w, weight), (grad_b, bias)
        return (*(None if g is None else g.to(x.dtype) for g, x in grads), None, None, None, None, None)


def token_logprobs_chunked(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [N, H], weight: [V, H], targets: [N] -> (logp [N], entropy [N] or None), in fp32 (fp64 for fp64).

    Holds one [N, block] slice of logits at a time, block = chunk_elements // N vocabulary rows.
    """
    logp, ent = VocabChunkedLogprob.apply(hidden, weight, bias, targets.long(), float(temperature),
                                          bool(compute_entropy), int(chunk_elements))
    return logp, (ent if compute_entropy else None)


def _block_size(n_tokens: int, vocab: int, chunk_elements: int) -> int:
    return max(1, min(vocab, chunk_elements // max(n_tokens, 1)))


class VocabChunkedLogprob(torch.autograd.Function):
    @staticmethod
    def forward(ctx, hidden, weight, bias, targets, temperature, compute_entropy, chunk_elements):
        dtype = compute_dtype(hidden, weight, bias)
        op = operand_dtype(dtype, hidden, weight)
        h = hidden.to(op)
        n, vocab = hidden.shape[0], weight.shape[0]
        block = _block_size(n, vocab, chunk_elements)
        inv_temp = 1.0 / temperature
        walk = _OnlineLse(n, dtype, h.device, compute_entropy)
        for v0 in range(0, vocab, block):
            walk.add(_block_logits(h, weight, bias, v0, block, op, dtype, inv_temp), targets, v0)
        z_target, lse, ent = walk.result()
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.cfg = (inv_temp, block)
        return z_target - lse, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        inv_temp, block = ctx.cfg
        dtype = lse.dtype
        op = operand_dtype(dtype, hidden, weight)
        h = hidden.to(op)
        vocab = weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(dtype)
        grad_of = _LogitGrad(targets, lse, ent, g_logp, g_ent, inv_temp)
        for v0 in range(0, vocab, block):
            gz = grad_of(_block_logits(h, weight, bias, v0, block, op, dtype, inv_temp), v0)
            v1 = v0 + gz.shape[1]
            if need_h:
                grad_h += mm(gz, weight[v0:v1], op, dtype)
            if need_w:
                grad_w[v0:v1] = mm(gz.t(), h, op, dtype)
            if need_b:
                grad_b[v0:v1] = gz.sum(0)
        grads = (grad_h, hidden), (grad_w, weight), (grad_b, bias)
        return (*(None if g is None else g.to(x.dtype) for g, x in grads), None, None, None, None)


class _OnlineLse:
    """The forward's walk over vocabulary blocks: a running max, sum of exponentials (and of exp * logit, for the
    entropy) and the target's logit, each block [N, width] of temperature-scaled logits added once."""

    def __init__(self, n: int, dtype: torch.dtype, device: torch.device, entropy: bool) -> None:
        self.run_max = torch.full((n,), float("-inf"), dtype=dtype, device=device)
        self.run_sum = torch.zeros(n, dtype=dtype, device=device)
        self.run_zsum = torch.zeros(n, dtype=dtype, device=device) if entropy else None
        self.z_target = torch.zeros(n, dtype=dtype, device=device)

    def add(self, z: torch.Tensor, targets: torch.Tensor, v0: int) -> None:
        """z: the logits of vocabulary rows [v0, v0 + z.shape[1]) (overwritten)."""
        # The target's logit, when it falls in this block: a gather and a select, no boolean
        # indexing (whose data-dependent shape makes the host wait for the device every block).
        inside, local = _in_block(targets, v0, z.shape[1])
        self.z_target = torch.where(inside, z.gather(1, local).squeeze(1), self.z_target)
        new_max = torch.maximum(self.run_max, z.max(-1).values)
        scale = torch.exp(self.run_max - new_max)
        if self.run_zsum is not None:
            e = torch.exp(z - new_max.unsqueeze(-1))
            self.run_zsum = self.run_zsum * scale + (e * z).sum(-1)
        else:  # z is not needed again: exponentiate in place
            e = z.sub_(new_max.unsqueeze(-1)).exp_()
        self.run_sum = self.run_sum * scale + e.sum(-1)
        self.run_max = new_max

    def result(self) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
        """(the target's logit, log-sum-exp, entropy or None), each [N]."""
        lse = self.run_max + torch.log(self.run_sum)
        ent = lse - self.run_zsum / self.run_sum if self.run_zsum is not None else None
        return self.z_target, lse, ent


class _LogitGrad:
    """The backward's gradient with respect to one block of raw logits, from the saved log-sum-exp (and entropy)
    and the incoming gradients of the log-prob (and entropy)."""

    def __init__(self, targets, lse, ent, g_logp, g_ent, inv_temp: float) -> None:
        self.targets, self.lse, self.g_logp, self.inv_temp = targets, lse, g_logp, inv_temp
        self.use_ent = g_ent is not None and ent is not None
        self.g_ent = g_ent.to(lse.dtype).unsqueeze(-1) if self.use_ent else None
        self.mean_z = (lse - ent).unsqueeze(-1) if self.use_ent else None

    def __call__(self, z: torch.Tensor, v0: int) -> torch.Tensor:
        """z: the temperature-scaled logits of rows [v0, v0 + z.shape[1]) (overwritten) -> their gradient."""
        if self.use_ent:
            p = torch.exp(z - self.lse.unsqueeze(-1))
            # dH/dz_j = -p_j (z_j - E_p[z]); built in place in z, which is not needed afterwards
            ent_term = z.sub_(self.mean_z).mul_(p).mul_(self.g_ent)
            gz = p.mul_(-self.g_logp.unsqueeze(-1)).sub_(ent_term)
        else:
            gz = z.sub_(self.lse.unsqueeze(-1)).exp_().mul_(-self.g_logp.unsqueeze(-1))
        inside, local = _in_block(self.targets, v0, gz.shape[1])
        gz.scatter_add_(1, local, torch.where(inside, self.g_logp, 0.0).unsqueeze(1))  # rows outside add 0
        return gz.mul_(self.inv_temp)


def _in_block(targets: torch.Tensor, v0: int, width: int) -> tuple[torch.Tensor, torch.Tensor]:
    """(whether each target lies in vocabulary rows [v0, v0 + width), its column there clamped into
    the block, as an [N, 1] index for gather/scatter)."""
    inside = (targets >= v0) & (targets < v0 + width)
    return inside, (targets - v0).clamp(0, width - 1).unsqueeze(1)


def _block_logits(h, weight, bias, v0, block, op, dtype, inv_temp):
    """Logits of vocabulary rows [v0, v0 + block) for every token: [N, block] in `dtype` (operands in
    `op`, see kernels/matmul.py), temperature applied."""
    z = mm(h, weight[v0:v0 + block].t(), op, dtype)
    if bias is not None:
        z += bias[v0:v0 + block].to(dtype)
    return z.mul_(inv_temp)
