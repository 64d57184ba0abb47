"""Triton kernels over logits rows: log-softmax + gather + entropy in one pass (online
log-sum-exp), and the backward without storing the softmax.

One source for CUDA and ROCm: only the tuning constants differ, chosen by `is_hip()`.
Under `TRITON_INTERPRET=1` (set before this module is imported) the kernels run on the CPU,
slowly, which is how the tests check them without a GPU. Import this module only when the
`triton` kernel is chosen: portagrpo never imports triton otherwise.
"""
from __future__ import annotations

import os

import torch
import triton
import triton.language as tl

from portagrpo.errors import UserError

from .chunked import DEFAULT_CHUNK_ELEMENTS, LinearLogprob


def is_hip() -> bool:
    try:
        return triton.runtime.driver.active.get_current_target().backend == "hip"
    except Exception:  # noqa: BLE001 - no active driver (the CPU interpreter)
        return False


def tuning() -> dict[str, int]:
    """Block and warp sizes: AMD wavefronts are 64 lanes wide, so fewer warps cover a block."""
    if os.environ.get("TRITON_INTERPRET") == "1":
        return {"BLOCK_V": 256, "num_warps": 1}
    if is_hip():
        return {"BLOCK_V": 2048, "num_warps": 4}
    return {"BLOCK_V": 4096, "num_warps": 8}


@triton.jit
def _logprob_fwd(z_ptr, z_stride, tgt_ptr, logp_ptr, lse_ptr, ent_ptr, V, inv_temp,
                 ENTROPY: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    base = z_ptr + row * z_stride
    m = -float("inf")
    s = 0.0
    sz = 0.0
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        z = tl.load(base + offs, mask=valid, other=-float("inf")).to(tl.float32) * inv_temp
        m_new = tl.maximum(m, tl.max(z, axis=0))
        scale = tl.exp(m - m_new)
        e = tl.where(valid, tl.exp(z - m_new), 0.0)
        s = s * scale + tl.sum(e, axis=0)
        if ENTROPY:
            sz = sz * scale + tl.sum(e * tl.where(valid, z, 0.0), axis=0)
        m = m_new
    lse = m + tl.log(s)
    tgt = tl.load(tgt_ptr + row)
    z_t = tl.load(base + tgt).to(tl.float32) * inv_temp
    tl.store(logp_ptr + row, z_t - lse)
    tl.store(lse_ptr + row, lse)
    if ENTROPY:
        tl.store(ent_ptr + row, lse - sz / s)


@triton.jit
def _logprob_bwd(z_ptr, z_stride, g_ptr, g_stride, tgt_ptr, lse_ptr, ent_ptr, glogp_ptr, gent_ptr, V, inv_temp,
                 HAS_ENT_GRAD: tl.constexpr, BLOCK_V: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)
    zbase = z_ptr + row * z_stride
    gbase = g_ptr + row * g_stride
    lse = tl.load(lse_ptr + row)
    g_logp = tl.load(glogp_ptr + row)
    tgt = tl.load(tgt_ptr + row)
    if HAS_ENT_GRAD:
        g_ent = tl.load(gent_ptr + row)
        mean_z = lse - tl.load(ent_ptr + row)
    for start in range(0, V, BLOCK_V):
        offs = start + tl.arange(0, BLOCK_V)
        valid = offs < V
        z = tl.load(zbase + offs, mask=valid, other=0.0).to(tl.float32) * inv_temp
        p = tl.exp(z - lse)
        grad = tl.where(offs == tgt, g_logp, 0.0) - g_logp * p
        if HAS_ENT_GRAD:
            grad -= g_ent * p * (z - mean_z)
        tl.store(gbase + offs, grad * inv_temp, mask=valid)


class TritonRowOps:
    """Row ops for `LinearLogprob` backed by the kernels above (fp32 math)."""

    def forward_rows(self, z, targets, inv_temp, entropy):
        z = z.contiguous()
        rows, vocab = z.shape
        logp = torch.empty(rows, dtype=torch.float32, device=z.device)
        lse = torch.empty_like(logp)
        ent = torch.empty_like(logp) if entropy else logp  # dummy pointer when unused
        t = tuning()
        _logprob_fwd[(rows,)](z, z.stride(0), targets.contiguous(), logp, lse, ent, vocab, inv_temp,
                              ENTROPY=entropy, BLOCK_V=t["BLOCK_V"], num_warps=t["num_warps"])
        dtype = z.dtype
        return logp.to(dtype), lse.to(dtype), (ent.to(dtype) if entropy else None)

    def backward_rows(self, z, targets, lse, entropy, g_logp, g_entropy, inv_temp):
        z = z.contiguous()
        rows, vocab = z.shape
        grad = z  # written in place: the chunk's logits are not needed afterwards
        t = tuning()
        has_ent = g_entropy is not None
        lse32 = lse.float().contiguous()
        ent32 = entropy.float().contiguous() if has_ent else lse32
        _logprob_bwd[(rows,)](z, z.stride(0), grad, grad.stride(0), targets.contiguous(), lse32, ent32,
                              g_logp.float().contiguous(), (g_entropy.float().contiguous() if has_ent else lse32),
                              vocab, inv_temp, HAS_ENT_GRAD=has_ent, BLOCK_V=t["BLOCK_V"], num_warps=t["num_warps"])
        return grad


class LogitsRowsLogprob(torch.autograd.Function):
    """Log-prob/entropy of existing logits rows [N, V] with the Triton kernels (no softmax stored)."""

    @staticmethod
    def forward(ctx, logits, targets, temperature, compute_entropy):
        ops = TritonRowOps()
        logp, lse, ent = ops.forward_rows(logits.float(), targets, 1.0 / temperature, compute_entropy)
        ctx.save_for_backward(logits, targets, lse, ent if compute_entropy else lse)
        ctx.cfg = (1.0 / temperature, compute_entropy)
        return logp, ent

    @staticmethod
    def backward(ctx, g_logp, g_ent):
        logits, targets, lse, ent = ctx.saved_tensors
        inv_temp, has_ent = ctx.cfg
        g_logp = torch.zeros_like(lse) if g_logp is None else g_logp
        use_ent = has_ent and g_ent is not None
        grad = TritonRowOps().backward_rows(logits.float().clone(), targets, lse, ent if use_ent else None, g_logp,
                                            g_ent if use_ent else None, inv_temp)
        return grad.to(logits.dtype), None, None, None


def token_logprobs_from_logits_triton(logits: torch.Tensor, targets: torch.Tensor, temperature: float = 1.0,
                                      compute_entropy: bool = False):
    """logits: [N, V] (raw), targets: [N] -> (logp [N] fp32, entropy [N] or None)."""
    return LogitsRowsLogprob.apply(logits, targets.long(), float(temperature), bool(compute_entropy))


def token_logprobs_triton(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
    chunk_elements: int = DEFAULT_CHUNK_ELEMENTS,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The chunked fused-linear path with the Triton row kernels: hidden [N, H], weight [V, H].

    The kernels compute in fp32, so float64 inputs (the parity reference) are refused.
    """
    if hidden.dtype == torch.float64 or weight.dtype == torch.float64:
        raise UserError("kernels.logprob=triton computes in fp32; use reference or chunked for float64 models.")
    return LinearLogprob.apply(hidden, weight, bias, targets.long(), float(temperature), bool(compute_entropy),
                               int(chunk_elements), TritonRowOps())
