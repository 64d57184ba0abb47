"""`torch_npu.npu_moe_gating_top_k_softmax` of the simulation, in plain torch, with the documented semantics (Ascend's
torch_npu API reference, ptaoplist "npu_moe_gating_top_k_softmax", and aclnnMoeGatingTopKSoftmax's formula; the
op-plugin test computes its reference softmax in float32):

- x: 2-D [N, E] or 3-D [B, S, E], float16, bfloat16 or float32; `k` a host int, 0 < k <= E and k <= 1024;
- finished (optional): bool, shaped x.shape[:-1]; a finished row's expert ids are all E (one past the last expert);
- softmax over the last axis in float32, then top-k: y (the top-k probabilities, cast to x's dtype), expert_idx
  (int32) and row_idx (int32, arange(N * k) laid out [k, N] and transposed: row_idx[n, j] = j * N + n);
- inference only (the documented constraint): no backward; inputs that ask for a gradient are refused.
"""
from __future__ import annotations

import torch

DTYPES = (torch.float16, torch.bfloat16, torch.float32)


def npu_moe_gating_top_k_softmax(x: torch.Tensor, finished: torch.Tensor | None = None, k: int = 1):
    if x.dim() not in (2, 3):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: x must be 2-D or 3-D, got {x.dim()}-D")
    if x.dtype not in DTYPES:
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: x must be float16, bfloat16 or float32, got {x.dtype}")
    experts = x.shape[-1]
    if not (0 < k <= experts and k <= 1024):
        raise RuntimeError(f"npu_moe_gating_top_k_softmax: k={k} must be in 1..min({experts}, 1024)")
    if x.requires_grad and torch.is_grad_enabled():
        raise RuntimeError("npu_moe_gating_top_k_softmax is an inference operator (no backward)")
    if finished is not None and (finished.dtype != torch.bool or tuple(finished.shape) != tuple(x.shape[:-1])):
        raise RuntimeError("npu_moe_gating_top_k_softmax: finished must be bool, shaped x.shape[:-1]")
    probs = torch.softmax(x.float(), dim=-1)
    y, idx = torch.topk(probs, k, dim=-1)
    idx = idx.to(torch.int32)
    if finished is not None:
        idx = torch.where(finished[..., None], torch.full_like(idx, experts), idx)
    rows = x.reshape(-1, experts).shape[0]
    row_idx = torch.arange(rows * k, dtype=torch.int32, device=x.device).reshape(k, rows).t().reshape(idx.shape)
    return y.to(x.dtype), idx, row_idx
