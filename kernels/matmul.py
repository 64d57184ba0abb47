"""LM-head matmuls of the fused kernels: low-precision operands, fp32 accumulation and results.

Under bf16 (or fp16) the kernels keep the matmul operands in that dtype and get fp32 results, as
tensor cores do natively (`torch.mm(..., out_dtype=torch.float32)`), instead of upcasting both
operands and running an fp32 matmul (with TF32 off, many times slower on a GPU). Where a device has
no such mixed matmul (the CPU) the operands are rounded to the same dtype and multiplied in fp32,
which is the same arithmetic: bf16 -> fp32 is exact, so only the order of the fp32 sums differs.
The gradient of the logits, which the kernels form in fp32, is rounded to the operand dtype before
its two matmuls, as autograd through an unfused bf16 LM head would; `portagrpo.tolerances` bounds
the effect (bf16 log-probs 1e-2, gradients 2e-2 relative).
"""
from __future__ import annotations

import torch

LOW_PRECISION = (torch.bfloat16, torch.float16)
_MIXED_MM: dict[str, bool] = {}


def operand_dtype(result: torch.dtype, *tensors: torch.Tensor | None) -> torch.dtype:
    """The dtype the matmul operands take: the inputs' low-precision dtype when the result is fp32
    and the inputs share one, else the result dtype (fp32 inputs stay fp32, fp64 stays fp64)."""
    lows = {t.dtype for t in tensors if t is not None and t.dtype in LOW_PRECISION}
    others = [t for t in tensors if t is not None and t.dtype not in LOW_PRECISION]
    if result == torch.float32 and len(lows) == 1 and not others:
        return lows.pop()
    return result


def has_mixed_mm(device: torch.device) -> bool:
    """Whether this device type multiplies bf16 operands into fp32 results (feature-detected once)."""
    key = device.type
    if key not in _MIXED_MM:
        try:
            x = torch.ones(2, 2, dtype=torch.bfloat16, device=device)
            _MIXED_MM[key] = torch.mm(x, x, out_dtype=torch.float32).dtype == torch.float32
        except (RuntimeError, NotImplementedError, TypeError):
            _MIXED_MM[key] = False
    return _MIXED_MM[key]


def mm(a: torch.Tensor, b: torch.Tensor, operand: torch.dtype, result: torch.dtype) -> torch.Tensor:
    """a @ b with both operands rounded to `operand`, accumulated and returned in `result`."""
    a, b = a.to(operand), b.to(operand)
    if operand == result:
        return a @ b
    if has_mixed_mm(a.device):
        return torch.mm(a, b, out_dtype=result)
    return a.to(result) @ b.to(result)
