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
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        step = chunk_tokens(vocab, chunk_elements)
        inv_temp = 1.0 / temperature
        logp = torch.empty(n, dtype=dtype, device=hidden.device)
        lse = torch.empty(n, dtype=dtype, device=hidden.device)
        ent = torch.empty(n, dtype=dtype, device=hidden.device) if compute_entropy else None
        for s in range(0, n, step):
            z = hidden[s:s + step].to(dtype) @ w.t()
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
        w = weight.to(dtype)
        b = None if bias is None else bias.to(dtype)
        need_h, need_w, need_b = ctx.needs_input_grad[0], ctx.needs_input_grad[1], bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.empty(hidden.shape, dtype=dtype, device=hidden.device) if need_h else None
        grad_w = torch.zeros(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.zeros(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(dtype)
        g_ent = None if (g_ent is None or ent is None) else g_ent.to(dtype)
        for s in range(0, hidden.shape[0], step):
            h = hidden[s:s + step].to(dtype)
            z = h @ w.t()
            if b is not None:
                z += b
            gz = row_ops.backward_rows(z, targets[s:s + step], lse[s:s + step], None if ent is None else ent[s:s + step],
                                       g_logp[s:s + step], None if g_ent is None else g_ent[s:s + step], inv_temp)
            if need_h:
                grad_h[s:s + step] = gz @ w
            if need_w:
                grad_w.addmm_(gz.t(), h)
            if need_b:
                grad_b += gz.sum(0)
        return (None if grad_h is None else grad_h.to(hidden.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None, None)


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
        h = hidden.to(dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        block = _block_size(n, vocab, chunk_elements)
        inv_temp = 1.0 / temperature
        run_max = torch.full((n,), float("-inf"), dtype=dtype, device=h.device)
        run_sum = torch.zeros(n, dtype=dtype, device=h.device)
        run_zsum = torch.zeros(n, dtype=dtype, device=h.device) if compute_entropy else None
        z_target = torch.zeros(n, dtype=dtype, device=h.device)
        rows = torch.arange(n, device=h.device)
        for v0 in range(0, vocab, block):
            z = _block_logits(h, weight, bias, v0, block, dtype, inv_temp)
            inside = (targets >= v0) & (targets < v0 + z.shape[1])
            z_target[inside] = z[rows[inside], targets[inside] - v0]
            new_max = torch.maximum(run_max, z.max(-1).values)
            scale = torch.exp(run_max - new_max)
            if compute_entropy:
                e = torch.exp(z - new_max.unsqueeze(-1))
                run_zsum = run_zsum * scale + (e * z).sum(-1)
            else:  # z is not needed again: exponentiate in place
                e = z.sub_(new_max.unsqueeze(-1)).exp_()
            run_sum = run_sum * scale + e.sum(-1)
            run_max = new_max
        lse = run_max + torch.log(run_sum)
        ent = lse - run_zsum / run_sum if compute_entropy else None
        ctx.save_for_backward(hidden, weight, bias, targets, lse, ent)
        ctx.cfg = (inv_temp, block)
        return z_target - lse, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        hidden, weight, bias, targets, lse, ent = ctx.saved_tensors
        inv_temp, block = ctx.cfg
        dtype = lse.dtype
        h = hidden.to(dtype)
        n, vocab = hidden.shape[0], weight.shape[0]
        need_h, need_w = ctx.needs_input_grad[0], ctx.needs_input_grad[1]
        need_b = bias is not None and ctx.needs_input_grad[2]
        grad_h = torch.zeros(h.shape, dtype=dtype, device=h.device) if need_h else None
        grad_w = torch.empty(weight.shape, dtype=dtype, device=weight.device) if need_w else None
        grad_b = torch.empty(bias.shape, dtype=dtype, device=bias.device) if need_b else None
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp.to(dtype)
        use_ent = g_ent is not None and ent is not None
        mean_z = (lse - ent).unsqueeze(-1) if use_ent else None
        rows = torch.arange(n, device=h.device)
        for v0 in range(0, vocab, block):
            z = _block_logits(h, weight, bias, v0, block, dtype, inv_temp)
            v1 = v0 + z.shape[1]
            if use_ent:
                p = torch.exp(z - lse.unsqueeze(-1))
                # dH/dz_j = -p_j (z_j - E_p[z]); built in place in z, which is not needed afterwards
                ent_term = z.sub_(mean_z).mul_(p).mul_(g_ent.to(dtype).unsqueeze(-1))
                gz = p.mul_(-g_logp.unsqueeze(-1)).sub_(ent_term)
            else:
                gz = z.sub_(lse.unsqueeze(-1)).exp_().mul_(-g_logp.unsqueeze(-1))
            inside = (targets >= v0) & (targets < v1)
            gz[rows[inside], targets[inside] - v0] += g_logp[inside]
            gz.mul_(inv_temp)
            if need_h:
                grad_h.addmm_(gz, weight[v0:v1].to(dtype))
            if need_w:
                torch.mm(gz.t(), h, out=grad_w[v0:v1])
            if need_b:
                grad_b[v0:v1] = gz.sum(0)
        return (None if grad_h is None else grad_h.to(hidden.dtype), None if grad_w is None else grad_w.to(weight.dtype),
                None if grad_b is None else grad_b.to(bias.dtype), None, None, None, None)


def _block_logits(h, weight, bias, v0, block, dtype, inv_temp):
    """Logits of vocabulary rows [v0, v0 + block) for every token: [N, block] in `dtype`, temperature applied."""
    z = h @ weight[v0:v0 + block].to(dtype).t()
    if bias is not None:
        z += bias[v0:v0 + block].to(dtype)
    return z.mul_(inv_temp)
