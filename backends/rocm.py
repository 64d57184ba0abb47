"""AMD ROCm backend: torch's `cuda` device type on a HIP build, RCCL behind the `nccl` name.

Same code as CUDA (`CUDALikeBackend`); only the data row and the accepted torch build differ.
Triton kernels take ROCm tuning constants from `kernels` (chosen by `is_hip()`), not a fork.
"""
from __future__ import annotations

from .base import BackendSpec
from .cuda import NCCL_WATCHDOG_ENV, CUDALikeBackend
from .probe import RuntimeProbe

SPEC = BackendSpec(
    name="rocm",
    device_type="cuda",
    dist_backend="nccl",  # RCCL implements the NCCL API on ROCm
    visible_devices_env=("HIP_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES"),
    ray_resource="GPU",
    default_attention="sdpa",
    attention_choices=("sdpa", "eager", "flash_attention_2"),
    kernel_choices=("reference", "chunked", "triton"),
    default_kernel="chunked",
    collective_env=NCCL_WATCHDOG_ENV,
    decode_cache="static",
    install_hint="install torch from the ROCm wheel index (see pytorch.org), then `pip install portagrpo[rocm]`",
    pinned_offload=True,
    runtime_reserve_gb=1.0,  # an allowance for the HIP context and RCCL's buffers, not measured
    fused_adamw=True,  # torch's fused AdamW kernel is built for HIP too
)


class ROCmBackend(CUDALikeBackend):
    wants_hip = True

    def __init__(self, probe: RuntimeProbe | None = None) -> None:
        super().__init__(SPEC, probe)
