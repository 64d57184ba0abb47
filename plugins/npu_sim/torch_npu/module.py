"""`torch.npu` of the simulation: the calls portagrpo's backend makes, as torch_npu names them
(torch_npu/npu/__init__.py `__all__`, npu/utils.py, npu/memory.py, npu/random.py at Ascend/pytorch
master 9e73e708).

Devices: `PORTAGRPO_NPU_SIM_DEVICES=N` (default 1) is how many NPUs the simulated node has, and
ASCEND_RT_VISIBLE_DEVICES selects among them: set to an empty string it shows no device, as torch_npu's
`_parse_visible_devices` reads it; a list is read as torch reads CUDA_VISIBLE_DEVICES
(portagrpo_emu.multi_device.visible_count). A process sees them all
as `npu:0` .. `npu:N-1` (the emulated device of portagrpo_emu, multi_device.py), as a process on an
Ascend node sees the node's NPUs unless a per-rank binding narrows them.
"""
from __future__ import annotations

import os

from portagrpo_emu.device import STATE, EmuModule
from portagrpo_emu.multi_device import physical_count, visible_count

DEVICES_ENV = "PORTAGRPO_NPU_SIM_DEVICES"
VISIBLE_ENV = "ASCEND_RT_VISIBLE_DEVICES"


def sim_device_count() -> int:
    return visible_count(physical_count(DEVICES_ENV), os.environ.get(VISIBLE_ENV))


class NpuModule(EmuModule):
    # device_count is EmuModule's: the devices installed when torch_npu was imported. ASCEND_RT_VISIBLE_DEVICES is
    # read once, at that first use, as ACL reads it when torch_npu initialises; a later change is not seen.

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


__all__ = ["NpuModule", "STATE", "sim_device_count"]
