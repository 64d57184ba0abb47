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
    rollout_engines=("hf", "fixed"),  # vLLM's wheels need a GPU build of torch
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
