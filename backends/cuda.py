"""NVIDIA CUDA backend: NCCL collectives, flash-attention when installed, Triton kernels."""
from __future__ import annotations

import torch

from .accelerator import AcceleratorBackend
from .base import BackendSpec, BackendUnavailable
from .probe import RuntimeProbe

# ProcessGroupNCCL's ErrorHandlingMode 2 (CleanUpOnly): the watchdog aborts the communicators of a
# timed-out or failed collective and leaves the process alive; the next collective then raises
# "NCCL communicator was aborted" in Python. torch's default (3, SkipCleanUp) ends the process from the
# watchdog thread instead. RCCL reads the same variable through the same ProcessGroupNCCL.
NCCL_WATCHDOG_ENV = (("TORCH_NCCL_ASYNC_ERROR_HANDLING", "2"),)

SPEC = BackendSpec(
    name="cuda",
    device_type="cuda",
    dist_backend="nccl",
    visible_devices_env=("CUDA_VISIBLE_DEVICES",),
    ray_resource="GPU",
    default_attention="sdpa",
    attention_choices=("sdpa", "eager", "flash_attention_2"),
    kernel_choices=("reference", "chunked", "triton"),
    default_kernel="chunked",
    collective_env=NCCL_WATCHDOG_ENV,
    decode_cache="static",
    vllm_fp8=True,
    install_hint="install a CUDA build of torch for your driver (see pytorch.org), then `pip install portagrpo[cuda]`",
    pinned_offload=True,
    runtime_reserve_gb=1.0,  # an allowance for the CUDA context and NCCL's buffers, not measured
    # an H100 80GB reports 79.2 GiB to torch (issue 51's reading; not measured here: no GPU has run this project)
    usable_memory_fraction=79.2 / 80,
    fused_adamw=True,
)


def flash_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens, scale: float | None,
                        dropout: float, *, fused_op=None) -> torch.Tensor:
    """Causal attention within each sequence of a packed row through flash-attention's variable-length kernel:
    q [Hq, N, D], k/v [Hkv, N, D] (the kernel takes the head ratio), `seqlens` host ints -> [Hq, N, D]. The kernel
    takes fp16/bf16 only: under autocast the rotary embedding has promoted q and k to fp32, so all three run in the
    autocast dtype (as transformers' own flash path casts them)."""
    if fused_op is None:
        from flash_attn import flash_attn_varlen_func as fused_op
    device_type = q.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else v.dtype
    cu, total = [0], 0
    for n in seqlens:
        total += n
        cu.append(total)
    cu_t = torch.tensor(cu, dtype=torch.int32).to(q.device, non_blocking=True)
    longest = max(seqlens)
    out = fused_op(*(t.transpose(0, 1).to(dtype) for t in (q, k, v)), cu_t, cu_t, longest, longest,
                   dropout_p=dropout, softmax_scale=scale, causal=True)  # [N, Hq, D]
    return out.transpose(0, 1)


class CUDALikeBackend(AcceleratorBackend):
    """CUDA and ROCm share torch's `cuda` device type, so they share this code; ROCm only
    changes its data row and which torch build it accepts."""

    wants_hip = False

    def runtime_problem(self) -> str | None:
        p = self.probe
        if p.hip_version and not self.wants_hip:
            return (f"the installed torch {p.torch_version} is a ROCm build (torch.version.hip={p.hip_version}); "
                    f"use --device rocm, or install a CUDA build of torch")
        if self.wants_hip and not p.hip_version:
            built = f"a CUDA {p.cuda_version} build" if p.cuda_version else "a CPU-only build"
            return (f"the installed torch {p.torch_version} is {built}, not a ROCm build; install torch from the ROCm "
                    f"wheel index (see pytorch.org){', or use --device cuda' if p.cuda_version else ''}")
        if not self.wants_hip and not p.cuda_version:
            return (f"the installed torch {p.torch_version} is a CPU-only build; {SPEC.install_hint}")
        return None

    def attention_implementation(self, requested: str, dtype: torch.dtype) -> str:
        has_fa = self.probe.has_module("flash_attn")
        half = dtype in (torch.bfloat16, torch.float16)
        if requested == "auto":
            return "flash_attention_2" if has_fa and half else "sdpa"
        if requested == "flash_attention_2":
            if not has_fa:
                raise BackendUnavailable(
                    "model.attn_implementation=flash_attention_2 needs the flash_attn package, which is not installed; "
                    "`pip install flash-attn --no-build-isolation` or use sdpa.")
            if not half:
                raise BackendUnavailable(
                    "model.attn_implementation=flash_attention_2 needs model.dtype=bf16 (flash-attention has no fp32 "
                    "kernels); set model.dtype=bf16 or use sdpa.")
        return super().attention_implementation(requested, dtype)

    def varlen_attention(self, attention: str):
        """Packed rows through flash-attention's variable-length kernel when the decoder runs flash_attention_2."""
        return flash_varlen_causal if attention == "flash_attention_2" else None

    def kernel_implementation(self, requested: str) -> str:
        if requested == "triton" and not self.probe.has_module("triton"):
            raise BackendUnavailable(
                f"kernels.logprob=triton needs the triton package; `pip install portagrpo[{self.name}]`."
            )
        if requested == "auto":
            return "triton" if self.probe.has_module("triton") and "triton" in self.spec.kernel_choices else "chunked"
        return super().kernel_implementation(requested)

    def deterministic_env(self) -> dict[str, str]:
        return {"CUBLAS_WORKSPACE_CONFIG": ":4096:8"}

    def set_deterministic(self, enabled: bool) -> None:
        super().set_deterministic(enabled)
        torch.backends.cudnn.deterministic = enabled
        torch.backends.cudnn.benchmark = not enabled


class CUDABackend(CUDALikeBackend):
    def __init__(self, probe: RuntimeProbe | None = None) -> None:
        super().__init__(SPEC, probe)
