"""The one tolerance table: relative error `||out - ref|| / ||ref||` allowed per dtype and quantity.

Every kernel test, parity test and parity command reads its bound from here. No bound is >= 1.

Why the values:
- fp64 runs the same math as the fp64 reference in a different summation order: ~1e-12.
- fp32 kernels sum over a vocabulary of 1e3-1e5 terms in a different order (chunked, online
  logsumexp): errors grow like sqrt(V) * 6e-8, so 1e-5 leaves headroom without hiding bugs.
- bf16 inputs carry 8 bits of mantissa (relative rounding 2^-9 ~ 2e-3 per element); log-probs
  computed from bf16 hidden states and weights, even with fp32 accumulation, differ from the
  fp64 reference by a few 1e-3, hence 1e-2. Gradients pass through the same rounded inputs
  and a second rounding on output, hence 2e-2.
- KL values are differences of two nearby log-distributions (policy vs reference): the
  subtraction cancels leading digits, so their relative error is several times that of the
  log-probs they come from; the `full` estimator also sums V such differences.
"""
from __future__ import annotations

import torch

TOLERANCES: dict[torch.dtype, dict[str, float]] = {
    torch.float64: {"logprob": 1e-12, "entropy": 1e-12, "grad": 1e-11, "advantage": 1e-12, "loss": 1e-12,
                    "kl": 1e-11, "grad_norm": 1e-10, "params": 1e-10},
    torch.float32: {"logprob": 1e-5, "entropy": 1e-5, "grad": 1e-5, "advantage": 1e-6, "loss": 1e-5,
                    "kl": 5e-5, "grad_norm": 1e-4, "params": 1e-5},
    torch.bfloat16: {"logprob": 1e-2, "entropy": 1e-2, "grad": 2e-2, "advantage": 1e-6, "loss": 2e-2,
                     "kl": 3e-2, "grad_norm": 5e-2, "params": 1e-2},
}


# A stored loss curve of the CLI (tests/integration/test_golden_curves.py): the same code on the same stack repeats
# it bit for bit; the bound allows for another CPU's kernels (a different summation order in matmul, ~1e-7 per
# op, grown over a few optimizer steps), not for a change of the math, which moves these numbers by far more.
CURVE_TOLERANCE = {"loss_policy": 1e-4, "reward_mean": 1e-6, "grad_norm": 1e-4}


def tolerance(dtype: torch.dtype, quantity: str) -> float:
    return TOLERANCES[dtype][quantity]


def relative_error(out: torch.Tensor, ref: torch.Tensor) -> float:
    """||out - ref|| / ||ref|| in float64 (0 when both are zero); NaN anywhere gives inf."""
    out, ref = out.detach().double(), ref.detach().double()
    if torch.isnan(out).any() or torch.isnan(ref).any():
        return float("inf")
    denom = ref.norm()
    diff = (out - ref).norm()
    return float(diff / denom) if denom > 0 else float(diff)


def assert_close(out: torch.Tensor, ref: torch.Tensor, dtype: torch.dtype, quantity: str, what: str = "") -> None:
    """Assert the relative error is within the table; on failure show the worst elements."""
    bound = tolerance(dtype, quantity)
    err = relative_error(out, ref)
    if err <= bound:
        return
    diff = (out.detach().double() - ref.detach().double()).abs().reshape(-1)
    worst = torch.topk(torch.nan_to_num(diff, nan=float("inf")), k=min(5, diff.numel())).indices
    rows = ", ".join(f"[{int(i)}] {float(out.reshape(-1)[i]):.6g} vs {float(ref.reshape(-1)[i]):.6g}" for i in worst)
    raise AssertionError(f"{what or quantity}: relative error {err:.3e} > {bound:.1e} ({dtype}); worst: {rows}")


# The config's dtype names, the one table every module uses.
DTYPES = {"fp64": torch.float64, "fp32": torch.float32, "bf16": torch.bfloat16}
