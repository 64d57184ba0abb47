"""Fused linear + log-softmax + gather (+ entropy), never holding more than one chunk of logits.

`LinearLogprob` is the one autograd Function shared by every fused path: it walks the tokens in
chunks, builds that chunk's logits from the hidden states and the LM head in fp32 (fp64 for fp64
inputs), and hands them to a *row-ops* object for the vocabulary-wide part. The torch row ops
make the `chunked` kernel; the Triton row ops (kernels/triton_logprob.py) make the `triton` one.
Backward recomputes each chunk's logits, so only per-token log-sum-exp and entropy are stored.
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


class TorchRowOps:
    def forward_rows(self, z, targets, inv_temp, entropy):
        z = z * inv_temp
        lse = torch.logsumexp(z, dim=-1)
        logp = z.gather(-1, targets.unsqueeze(-1)).squeeze(-1) - lse
        ent = None
        if entropy:
            ent = lse - (torch.softmax(z, dim=-1) * z).sum(-1)
        return logp, lse, ent

    def backward_rows(self, z, targets, lse, entropy, g_logp, g_entropy, inv_temp):
        z = z * inv_temp
        p = torch.exp(z - lse.unsqueeze(-1))
        grad = -g_logp.unsqueeze(-1) * p
        grad.scatter_add_(-1, targets.unsqueeze(-1), g_logp.unsqueeze(-1))
        if g_entropy is not None:
            # dH/dz_j = -p_j (z_j - E_p[z]), and E_p[z] = lse - H
            mean_z = (lse - entropy).unsqueeze(-1)
            grad -= g_entropy.unsqueeze(-1) * p * (z - mean_z)
        return grad * inv_temp


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
    """hidden: [N, H], weight: [V, H], targets: [N] -> (logp [N], entropy [N] or None), in fp32 (fp64 for fp64)."""
    return LinearLogprob.apply(hidden, weight, bias, targets.long(), float(temperature), bool(compute_entropy),
                               int(chunk_elements), TorchRowOps())
