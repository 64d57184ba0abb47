"""Behaviour shared by the accelerator backends (CUDA, ROCm, NPU): each exposes a torch device
module (`torch.cuda`, `torch.npu`) with the same housekeeping calls, so vendor modules only
state their data row, their availability rules and their attention/kernel choices.
"""
from __future__ import annotations

import os
from typing import Any

import torch

from .base import Availability, BackendSpec, BackendUnavailable, BaseBackend
from .probe import RuntimeProbe


class AcceleratorBackend(BaseBackend):
    def __init__(self, spec: BackendSpec, probe: RuntimeProbe | None = None) -> None:
        super().__init__(spec)
        self.probe = probe or RuntimeProbe()
        self._module: Any = None

    # The device module is fetched lazily: building a backend object never imports a vendor package.
    @property
    def module(self) -> Any:
        if self._module is None:
            self._module = self.probe.device_module(self.device_type)
        return self._module

    def runtime_problem(self) -> str | None:
        """The reason this torch cannot drive the vendor's devices, before touching the device module."""
        raise NotImplementedError

    def is_available(self) -> Availability:
        problem = self.runtime_problem()
        if problem:
            return Availability(False, problem)
        try:
            mod = self.module
            usable = bool(mod.is_available()) and mod.device_count() > 0
        except (ImportError, OSError, RuntimeError) as err:
            return Availability(False, f"the {self.name} runtime failed to load ({err})")
        if not usable:
            shown = {v: os.environ[v] for v in self.spec.visible_devices_env if v in os.environ}
            hint = f" ({', '.join(f'{k}={v!r}' for k, v in shown.items())} may hide them)" if shown else ""
            return Availability(
                False,
                f"torch {self.probe.torch_version} supports {self.name} but no device is usable: "
                f"the driver is missing or no device is visible{hint}",
            )
        return Availability(True, details=self._details(mod))

    def _details(self, mod: Any) -> dict[str, Any]:
        names = []
        for i in range(mod.device_count()):
            try:
                names.append(mod.get_device_name(i))
            except (RuntimeError, AttributeError):
                names.append(f"{self.device_type}:{i}")
        try:
            bf16 = bool(mod.is_bf16_supported())
        except (RuntimeError, AttributeError):
            bf16 = False
        return {"device_names": names, "bf16": bf16}

    def device_index(self, local_rank: int) -> int:
        """The device a local rank drives: its own index when the process sees every device of the
        node, and the one device it sees under a per-rank binding (Ray, Slurm's --gpus-per-task,
        a visible-devices variable set per rank, an emulated device)."""
        count = self.device_count()
        if local_rank < count:
            return local_rank
        if count == 1:
            return 0
        env = "/".join(self.spec.visible_devices_env) or "the visible-devices setting"
        raise BackendUnavailable(f"local rank {local_rank} has no {self.name} device: this process sees {count} "
                                 f"(check trainer.nproc_per_node against the devices per node and {env}).")

    def only_device_env(self, index: int) -> dict[str, str]:
        """The environment under which a new process sees one device: the one this process calls `index`, as its
        device 0. It must be set before that process starts the device runtime, which reads its visible-devices
        variable once, at first use (torch's CUDA initialisation; torch_npu's likewise). The row's first variable is
        written, within the list this process was given; on ROCm CUDA_VISIBLE_DEVICES too, with the same value, as
        HIP reads it as well and vLLM refuses the two when they differ (vllm/platforms/rocm.py
        `_sync_hip_cuda_env_vars`, 0.33.0)."""
        names = self.spec.visible_devices_env
        if not names:
            return {}
        hip = names[0] == "HIP_VISIBLE_DEVICES"
        aliases = (names[0], "CUDA_VISIBLE_DEVICES") if hip else (names[0],)
        given = next((os.environ[n] for n in aliases if os.environ.get(n, "").strip()), "")
        seen = [d.strip() for d in given.split(",") if d.strip()]
        if seen and index >= len(seen):
            raise BackendUnavailable(f"{self.name} device {index} is not among this process's visible devices "
                                     f"({aliases[0]}={given!r}).")
        return {name: seen[index] if seen else str(index) for name in aliases}

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type, self.device_index(local_rank))

    def set_device(self, local_rank: int) -> None:
        self.module.set_device(self.device_index(local_rank))

    def device_count(self) -> int:
        return int(self.module.device_count())

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        if dtype == torch.bfloat16:
            return bool(self._details(self.module)["bf16"])
        return True

    def seed(self, seed: int) -> None:
        super().seed(seed)
        self.module.manual_seed_all(seed)

    def synchronize(self) -> None:
        self.module.synchronize()

    def reset_peak_memory(self) -> None:
        self.module.reset_peak_memory_stats()

    def peak_memory_gb(self) -> float:
        return float(self.module.max_memory_allocated()) / 2**30

    def empty_cache(self) -> None:
        self.module.empty_cache()

    def current_memory_gb(self) -> float:
        return float(self.module.memory_allocated()) / 2**30

    def free_memory_gb(self) -> float:
        free, _total = self.module.mem_get_info()
        return float(free) / 2**30

    def rng_state(self) -> dict[str, Any]:
        return {"device": self.module.get_rng_state_all()}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        if "device" in state:
            self.module.set_rng_state_all(state["device"])
