"""Datasheet peak dense matmul throughput per device model, for MFU (model FLOPs utilisation: the model FLOPs a
step needs over the time it took, divided by what the device's datasheet says its tensor cores do).

Dense figures, without the 2:4 sparsity that the datasheets' headline numbers include (half of those). A device not
in the table has no MFU (the report says so, and gives the run's share of the matmul rate it measured itself, which
needs no table). Rows are matched by substring of torch's device name, most specific first.
"""
from __future__ import annotations

import torch

# (substring of the device name, {dtype: dense TFLOP/s}, source)
PEAK_TFLOPS: tuple[tuple[str, dict[torch.dtype, float], str], ...] = (
    ("H200", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
     "NVIDIA H200 Tensor Core GPU datasheet (SXM; BF16 1,979 TFLOPS with sparsity)"),
    ("H100 PCIe", {torch.bfloat16: 756.5, torch.float16: 756.5, torch.float32: 51.2},
     "NVIDIA H100 Tensor Core GPU datasheet (PCIe; BF16 1,513 TFLOPS with sparsity)"),
    ("H100 NVL", {torch.bfloat16: 835.5, torch.float16: 835.5, torch.float32: 60.0},
     "NVIDIA H100 Tensor Core GPU datasheet (NVL; BF16 1,671 TFLOPS with sparsity)"),
    ("H100", {torch.bfloat16: 989.4, torch.float16: 989.4, torch.float32: 66.9},
     "NVIDIA H100 Tensor Core GPU datasheet (SXM; BF16 1,979 TFLOPS with sparsity)"),
    ("A100", {torch.bfloat16: 312.0, torch.float16: 312.0, torch.float32: 19.5},
     "NVIDIA A100 Tensor Core GPU datasheet (BF16 624 TFLOPS with sparsity)"),
    ("MI325X", {torch.bfloat16: 1307.4, torch.float16: 1307.4, torch.float32: 163.4},
     "AMD Instinct MI325X datasheet (BF16 dense)"),
    ("MI300X", {torch.bfloat16: 1307.4, torch.float16: 1307.4, torch.float32: 163.4},
     "AMD Instinct MI300X datasheet (BF16 dense)"),
    ("MI250X", {torch.bfloat16: 383.0, torch.float16: 383.0, torch.float32: 95.7},
     "AMD Instinct MI250X datasheet (matrix cores)"),
)


def peak_flops(device_name: str, dtype: torch.dtype) -> tuple[float | None, str]:
    """(peak FLOP/s of one device of this name at this dtype, its source), or (None, why there is none)."""
    for part, table, source in PEAK_TFLOPS:
        if part in device_name:
            if dtype in table:
                return table[dtype] * 1e12, source
            return None, f"{source} gives no {dtype} figure"
    return None, f"no datasheet peak for {device_name!r} in backends/peaks.py"
