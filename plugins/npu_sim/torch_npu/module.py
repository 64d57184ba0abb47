"""`torch.npu` of the simulation: the calls portagrpo's backend makes, as torch_npu names them
(torch_npu/npu/__init__.py `__all__`, npu/utils.py, npu/memory.py, npu/random.py at Ascend/pytorch
master 9e73e708).

Visible devices follow torch_npu's `_parse_visible_devices`: ASCEND_RT_VISIBLE_DEVICES set to an
empty string shows no device. Otherwise the simulation shows one device per process (the limit of
the emulated device: see portagrpo_emu/device.py), as a per-rank binding would.
"""
from __future__ import annotations

import os

from portagrpo_emu.device import STATE, EmuModule


class NpuModule(EmuModule):
    @staticmethod
    def device_count() -> int:
        visible = os.environ.get("ASCEND_RT_VISIBLE_DEVICES")
        if visible is not None and not visible.strip():
            return 0
        return 1

    @staticmethod
    def is_available() -> bool:
        return NpuModule.device_count() > 0

    @staticmethod
    def get_device_name(device=None) -> str:
        return "Ascend910B3 (simulated: portagrpo-emu, CPU arithmetic)"

    @staticmethod
    def memory_reserved(device=None) -> int:
        from portagrpo_emu import device as emu

        return emu.STATE.allocated[emu.STATE.index(device)]


__all__ = ["NpuModule", "STATE"]
