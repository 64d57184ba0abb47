"""Stand-in for Huawei's torch_npu (tests only; see ../README.md).

Importing it does what importing torch_npu does for the parts portagrpo uses (Ascend/pytorch,
torch_npu/_init/registry/backend.py and distributed.py, read at master 9e73e708): the PrivateUse1
device is renamed `npu`, `torch.npu` becomes the device module, and the `hccl` collective backend
is registered for the `npu` device only. The device itself is the emulated accelerator of
portagrpo-emu.
"""
from __future__ import annotations

import importlib.machinery
import sys
from pathlib import Path

_HERE = Path(__file__).resolve().parent.parent


def _refuse_to_shadow() -> None:
    others = [p for p in sys.path if p and Path(p).resolve() != _HERE]
    real = importlib.machinery.PathFinder.find_spec("torch_npu", others)
    if real is not None:
        raise ImportError(f"a real torch_npu is installed ({real.origin}); the test stand-in in {_HERE} never "
                          f"shadows it: take {_HERE} off PYTHONPATH.")


_refuse_to_shadow()

import torch  # noqa: E402,F401 - torch first, as torch_npu requires

from portagrpo_emu import collectives as _collectives  # noqa: E402
from portagrpo_emu import device as _device  # noqa: E402

from . import hccl as _hccl  # noqa: E402
from .attention import npu_fusion_attention as _fusion_attention  # noqa: E402
from .attention import on_npu_only  # noqa: E402
from .module import NpuModule, sim_device_count  # noqa: E402
from .moe import npu_moe_gating_top_k_softmax as _moe_gating_top_k_softmax  # noqa: E402

SIMULATED = True  # what portagrpo's docs and reports may read to say "simulation", never "hardware"
__version__ = "0.0.0+simulated"

npu_fusion_attention = on_npu_only(_fusion_attention, ("query", "key", "value", "pse", "padding_mask", "atten_mask"))
npu_moe_gating_top_k_softmax = on_npu_only(_moe_gating_top_k_softmax, ("x", "finished"))
npu = NpuModule()
_device.install("npu", module=npu, count=sim_device_count())
_collectives.register("hccl", "npu", payload=lambda t: t._inner, refuse=_hccl.refuse)
