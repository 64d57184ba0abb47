"""The `emu` backend: a third-party backend package as a vendor would write one.

It subclasses portagrpo's shared accelerator behaviour, states its data row, and installs its
torch device only when asked whether it can run (never at import). Its collectives follow the
strictest vendor rules (HCCL's: device tensors only, no float64) over gloo on host copies.
"""
from __future__ import annotations

from typing import Any

import torch

from portagrpo.backends.accelerator import AcceleratorBackend
from portagrpo.backends.base import BackendSpec
from portagrpo.backends.probe import RuntimeProbe

SPEC = BackendSpec(
    name="emu",
    device_type="emu",
    dist_backend="gloo",  # over host copies, see to_collective
    visible_devices_env=("PORTAGRPO_EMU_VISIBLE_DEVICES",),
    ray_resource="CPU",
    default_attention="sdpa",
    attention_choices=("sdpa", "eager"),
    kernel_choices=("reference", "chunked"),
    default_kernel="chunked",
    install_hint="`pip install -e plugins/emu` (test-only)",
    default_parallel="ddp",
    parallel_choices=("ddp",),
    rollout_engines=("hf", "fixed"),
    collective_dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
                       torch.int8, torch.bool),
)


def _device_module(device_type: str) -> Any:
    from . import device

    device.install()
    return getattr(torch, device.NAME)


class EmuBackend(AcceleratorBackend):
    def __init__(self, probe: RuntimeProbe | None = None) -> None:
        super().__init__(SPEC, probe or RuntimeProbe(device_module=_device_module))

    def runtime_problem(self) -> str | None:
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", SPEC.device_type):
            return f"this process already has the PrivateUse1 device {name!r} (a real vendor runtime)"
        return None

    def to_collective(self, tensor: torch.Tensor) -> torch.Tensor:
        return tensor.cpu()  # gloo moves host memory; a real vendor library reads device memory

    def from_collective(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return result.to(like.device)
