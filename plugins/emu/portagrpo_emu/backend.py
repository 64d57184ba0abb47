"""The `emu` backend: a third-party backend package as a vendor would write one.

It subclasses portagrpo's shared accelerator behaviour, states its data row, and installs its
torch device only when asked whether it can run (never at import). Its collective library,
`emuccl` (portagrpo_emu.collectives), takes device tensors as NCCL or HCCL does (and host tensors only
in a group formed with a CPU backend beside it, as torch's rule is) and carries them over gloo through the
host; portagrpo's own reductions keep the strictest vendor rule (HCCL's: no float64). DDP and FSDP2 run on
it across ranks, one emulated device per process.
"""
from __future__ import annotations

import contextlib
from typing import Any, Iterator

import torch

from portagrpo.backends.accelerator import AcceleratorBackend
from portagrpo.backends.base import BackendSpec, BackendUnavailable
from portagrpo.backends.probe import RuntimeProbe

SPEC = BackendSpec(
    name="emu",
    device_type="emu",
    dist_backend="emuccl",  # registered when the device is installed, for its device alone (as NCCL, HCCL)
    visible_devices_env=("PORTAGRPO_EMU_VISIBLE_DEVICES",),
    ray_resource="CPU",
    default_attention="sdpa",
    attention_choices=("sdpa", "eager"),
    kernel_choices=("reference", "chunked"),
    default_kernel="chunked",
    install_hint="`pip install -e plugins/emu` (test-only)",
    default_parallel="ddp",
    # "ep": the all-to-all of expert parallelism on emuccl, under its dtype rule (no fp64)
    parallel_choices=("ddp", "fsdp2", "ep"),
    rollout_engines=("hf", "fixed"),
    collective_dtypes=(torch.float32, torch.bfloat16, torch.float16, torch.int64, torch.int32, torch.uint8,
                       torch.int8, torch.bool),
    attention_saves_scores=True,  # torch's math SDPA on a PrivateUse1 device: the scores are kept for backward
    # transformers' grouped_mm experts count tokens per expert with an integer histc off the CPU, which the emulated
    # device's CPU fallback has no kernel for: the experts run as transformers' per-expert loop
    moe_experts="eager",
)


def _device_module(device_type: str) -> Any:
    from . import collectives, device

    device.install()
    collectives.register("emuccl", device.NAME, payload=lambda t: t._inner)
    return getattr(torch, device.NAME)


def fsdp2_problem() -> str | None:
    """Why FSDP2 cannot run on the emulated device with this torch (None when it can)."""
    from . import device

    device.install()
    return device.FSDP2_PROBLEM


class EmuBackend(AcceleratorBackend):
    def __init__(self, probe: RuntimeProbe | None = None) -> None:
        super().__init__(SPEC, probe or RuntimeProbe(device_module=_device_module))

    def runtime_problem(self) -> str | None:
        name = torch._C._get_privateuse1_backend_name()
        if name not in ("privateuseone", SPEC.device_type):
            return f"this process already has the PrivateUse1 device {name!r} (a real vendor runtime)"
        return None

    @contextlib.contextmanager
    def region(self, label: str) -> Iterator[None]:
        """Count the stretch apart: the counters open a span `label`, then one named `after label`."""
        from .counters import COUNTERS

        COUNTERS.mark(label)
        try:
            yield
        finally:
            COUNTERS.mark(f"after {label}")

    def parallel_strategy(self, requested: str) -> str:
        choice = super().parallel_strategy(requested)
        if choice == "fsdp2":
            problem = fsdp2_problem()
            if problem:
                raise BackendUnavailable(f"trainer.parallel=fsdp2 on --device emu: {problem}")
        return choice
