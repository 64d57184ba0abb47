"""The backend contract: everything device-specific the trainer may ask, and nothing else.

A backend is a small object plus a data row (`BackendSpec`). The trainer core never names
a device; it asks its `Backend` (the Protocol below; `BaseBackend` implements it).
"""
from __future__ import annotations

import contextlib
import os
import random
from dataclasses import dataclass, field
from typing import Any, Callable, ContextManager, Protocol, runtime_checkable

import numpy as np
import torch

from portagrpo.errors import UserError


class BackendUnavailable(UserError, RuntimeError):
    """The requested backend cannot run on this machine; the message says why and how to fix it."""


@dataclass(frozen=True)
class BackendSpec:
    """The data row of a backend: the facts that differ between vendors."""

    name: str
    device_type: str  # torch device type: "cpu", "cuda" (also ROCm), "npu"
    dist_backend: str  # torch.distributed backend: gloo, nccl (RCCL on ROCm), hccl
    visible_devices_env: tuple[str, ...] = ()
    ray_resource: str = "CPU"
    default_attention: str = "sdpa"
    attention_choices: tuple[str, ...] = ("sdpa", "eager")
    # (decoder attention, the one a vision tower's variable-length windows run through) for an attention that is
    # this vendor's own; transformers' own implementations (VARLEN_ATTENTION) serve both.
    vision_attention: tuple[tuple[str, str], ...] = ()
    kernel_choices: tuple[str, ...] = ("reference",)
    default_kernel: str = "reference"
    install_hint: str = ""
    # How data parallelism shards the policy: FSDP2 where the vendor runs it well, else replicated (DDP-style).
    default_parallel: str = "fsdp2"
    # "ep": expert parallelism, its all-to-all on the row's dist_backend (gloo, NCCL, RCCL, HCCL; model/parallel.py)
    parallel_choices: tuple[str, ...] = ("ddp", "fsdp2", "ep")
    rollout_engines: tuple[str, ...] = ("hf", "fixed", "vllm")
    # dtypes the collective library reduces; None = any. HCCL on Atlas A2/A3 refuses float64.
    collective_dtypes: tuple[torch.dtype, ...] | None = None
    # Environment for the collective library's watchdog, set (unless the user set it) before the process
    # group forms: on a dead or silent peer the watchdog aborts the communicators but keeps the process,
    # so the next collective raises in Python and ends the run with one sentence (`PeerFailure`) instead
    # of the vendor's default of tearing the process down from its own thread (SIGABRT, a C++ trace).
    collective_env: tuple[tuple[str, str], ...] = ()
    # KV cache of the `hf` rollout engine: "static" lets transformers compile the decode step (one graph
    # per shape, no Python per token); "dynamic" decodes eagerly. Not yet measured on hardware.
    decode_cache: str = "dynamic"
    # How transformers runs a mixture-of-experts layer's packed experts (its experts_implementation): "grouped_mm"
    # (torch._grouped_mm, one call for every expert) where the device runs it, else "eager" (a loop over the experts
    # a batch routes to). An fp64 model always runs eagerly (grouped_mm takes no fp64).
    moe_experts: str = "grouped_mm"
    # The vLLM platform plugin this vendor's vLLM runs through ("vllm-ascend" on Ascend), whose settings
    # the vLLM engine applies before building the engine (see rollout/vllm.py: PLUGIN_SETTINGS).
    vllm_plugin: str | None = None
    # vLLM's block-FP8 rollout (rollout.precision=fp8): e4m3 weights with per-block scales, the format
    # verl's FP8 rollout uses on NVIDIA; ROCm (e4m3fnuz) and Ascend are not built.
    vllm_fp8: bool = False
    # Page-locked host memory for what FSDP2 offloads (actor.offload, actor.ref_offload): faster, asynchronous copies
    # to the device where the vendor's runtime has it (CUDA, ROCm's HIP, Ascend's ACL).
    pinned_offload: bool = False
    # vLLM's sleep mode (LLM(enable_sleep_mode=True), sleep/wake_up): vLLM offers it where
    # `Platform.is_sleep_mode_available()` says so (vllm/platforms/interface.py: CUDA, ROCm, XPU; vllm-ascend's
    # NPU platform too) and refuses it elsewhere (vllm/config/model.py: "Sleep mode is not supported on current
    # platform."). Without it the engine keeps its memory between rollouts.
    vllm_sleep_mode: bool = True
    # The attention head sizes vLLM's attention backend runs on this device; None: any the model has. A model
    # with another head size is refused in one sentence before vLLM is built.
    vllm_head_sizes: tuple[int, ...] | None = None
    # Environment vLLM reads when its engine is built, set unless the user set it (e.g. the CPU's KV cache size).
    vllm_env: tuple[tuple[str, str], ...] = ()
    # vLLM's expert parallelism (rollout.expert_parallel_size: `enable_expert_parallel`, each rank of the engine's
    # tensor- and data-parallel groups holding whole experts, tokens exchanged between them) on this vendor's vLLM.
    vllm_expert_parallel: bool = True
    # Whether `sdpa` keeps each head's length x length attention probabilities for backward (a math path, as torch's
    # fallback on a device without a fused kernel); `eager` always does. The memory plan (portagrpo plan) counts them.
    attention_saves_scores: bool = False
    # Device memory the runtime and the collective library keep for themselves (the context, communicator buffers), in
    # GiB: an allowance the memory plan reserves on every device, not a measurement (none has run on hardware yet).
    runtime_reserve_gb: float = 0.0
    # The share of a device's nominal memory (the GB of its name: "80 GB", "64 GB") that torch reports it can
    # allocate (torch.<device>.get_device_properties(i).total_memory): the plan's capacity is the nominal figure
    # (trainer.device_memory_gb, --device-memory-gb) times this. 1.0 where no figure is known.
    usable_memory_fraction: float = 1.0
    # AdamW's fused step (torch.optim.AdamW(fused=True): one kernel over all parameters) where torch builds it for the
    # device: CPU (torch 2.4+), CUDA and ROCm. Elsewhere torch's default (a loop over the parameters, or its foreach
    # form). The fused step rounds differently in the last bit (not a different algorithm).
    fused_adamw: bool = False


@dataclass
class Availability:
    ok: bool
    reason: str = ""
    details: dict[str, Any] = field(default_factory=dict)


@runtime_checkable
class Backend(Protocol):
    """The contract the trainer core calls: every device question, and nothing else. `BaseBackend`
    implements it from a `BackendSpec` row; a vendor subclasses `BaseBackend` (or implements this
    Protocol itself) and registers through the `portagrpo.backends` entry point."""

    spec: BackendSpec

    @property
    def name(self) -> str: ...

    @property
    def device_type(self) -> str: ...

    @property
    def dist_backend(self) -> str: ...

    @property
    def group_backend(self) -> str: ...

    def fused_adamw_for(self, params: list[torch.Tensor]) -> bool: ...

    def is_available(self) -> Availability: ...

    def require(self) -> "Backend":
        """This backend, or the one-sentence reason it cannot run here (starts the device runtime)."""

    def only_device_env(self, index: int) -> dict[str, str]:
        """The environment under which a new process sees only this process's device `index` (as its device 0)."""

    def device(self, local_rank: int = 0) -> torch.device: ...

    def device_count(self) -> int: ...

    def set_device(self, local_rank: int) -> None: ...

    def supports_dtype(self, dtype: torch.dtype) -> bool: ...

    def supports_dynamic_quantization(self) -> bool: ...

    def sampler_process_device(self, local_rank: int, local_world: int, sampler_devices: int) -> str: ...

    def autocast(self, dtype: torch.dtype) -> ContextManager: ...

    def seed(self, seed: int) -> None: ...

    def rng_state(self) -> dict[str, Any]: ...

    def set_rng_state(self, state: dict[str, Any]) -> None: ...

    def set_deterministic(self, enabled: bool) -> None: ...

    def synchronize(self) -> None: ...

    def region(self, label: str) -> ContextManager: ...

    def reset_peak_memory(self) -> None: ...

    def peak_memory_gb(self) -> float: ...

    def current_memory_gb(self) -> float: ...

    def free_memory_gb(self) -> float: ...

    def empty_cache(self) -> None: ...

    def attention_implementation(self, requested: str, dtype: torch.dtype) -> str: ...

    def varlen_attention(self, attention: str) -> Callable | None: ...

    def moe_topk(self) -> Callable | None: ...

    def vision_attention_implementation(self, requested: str, dtype: torch.dtype) -> str: ...

    def kernel_implementation(self, requested: str) -> str: ...

    def parallel_strategy(self, requested: str) -> str: ...

    def rollout_engine(self, requested: str) -> str: ...

    def check_collective(self, tensor: torch.Tensor, op: str) -> None: ...

    def to_collective(self, tensor: torch.Tensor) -> torch.Tensor: ...

    def from_collective(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor: ...

    def collective_env(self) -> dict[str, str]: ...


def _rss_peak_gb() -> float:
    """Peak resident set size of this process (Linux reports KiB, macOS bytes)."""
    try:
        import resource
        import sys

        peak = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        scale = 1 if sys.platform == "darwin" else 1024
        return peak * scale / 2**30
    except (ImportError, OSError):  # pragma: no cover - non-POSIX
        return 0.0


def fsdp2_sum_reduction_available() -> str | None:
    """None when FSDP2 can sum gradients on this torch (natively from 2.8, through portagrpo's fallback on
    2.6/2.7), else the sentence why not."""
    from .fsdp_compat import fsdp2_problem

    return fsdp2_problem()


# transformers' attention implementations that run a vision tower's cu_seqlens windows themselves (Qwen2.5-VL's
# vision attention): sdpa and eager one call per window, flash-attention one variable-length call for all.
VARLEN_ATTENTION = ("sdpa", "eager", "flash_attention_2", "flash_attention_3")


class BaseBackend:
    """Behaviour shared by every backend; vendor modules override what differs."""

    spec: BackendSpec

    def __init__(self, spec: BackendSpec) -> None:
        self.spec = spec

    @property
    def name(self) -> str:
        return self.spec.name

    @property
    def device_type(self) -> str:
        return self.spec.device_type

    @property
    def dist_backend(self) -> str:
        return self.spec.dist_backend

    def fused_adamw_for(self, params: list[torch.Tensor]) -> bool:
        """Whether AdamW steps `params` with torch's fused kernel: the row's answer for its device, and yes for
        parameters that live on the host (actor.offload keeps FSDP2's shards there; torch's foreach list has no `cpu`,
        utils/_foreach_utils.py, while the fused CPU kernel exists and DTensor takes `_fused_adamw_`)."""
        def where(p: torch.Tensor) -> str:
            return (p.to_local() if hasattr(p, "to_local") else p).device.type

        return self.spec.fused_adamw or (bool(params) and all(where(p) == "cpu" for p in params))

    @property
    def group_backend(self) -> str:
        """What the default process group is formed with: the library alone on the CPU; for an accelerator,
        `cpu:gloo,<device>:<library>` (verl's form). torch gives a group only the devices its backends name
        (distributed_c10d.py `Backend.backend_capability`: NCCL serves `cuda`; torch_npu registers `hccl` for
        `npu`), and FSDP2's offloaded shards and gradients are DTensors on the host: their `full_tensor()` and the
        gradient-norm reduction run on host tensors, which need a CPU backend in the group."""
        if self.spec.dist_backend == "gloo":
            return "gloo"
        return f"cpu:gloo,{self.spec.device_type}:{self.spec.dist_backend}"

    def is_available(self) -> Availability:
        raise NotImplementedError

    def only_device_env(self, index: int) -> dict[str, str]:
        """No visible-devices variable: a new process sees what this one sees (the CPU)."""
        return {}

    def require(self) -> "BaseBackend":
        """Fail with the one-sentence reason when this backend cannot run here."""
        avail = self.is_available()
        if not avail.ok:
            reason = avail.reason if avail.reason.endswith(".") else avail.reason + "."
            raise BackendUnavailable(f"--device {self.name} cannot be used: {reason}")
        return self

    def device(self, local_rank: int = 0) -> torch.device:
        return torch.device(self.device_type, local_rank)

    def device_count(self) -> int:
        return 1

    def set_device(self, local_rank: int) -> None:
        """Bind this process to its device before the process group forms (no-op on the CPU)."""
        return None

    def supports_dtype(self, dtype: torch.dtype) -> bool:
        return dtype in (torch.float32, torch.float64, torch.bfloat16, torch.float16)

    def supports_dynamic_quantization(self) -> bool:
        """PyTorch's dynamic int8 linear layers (fbgemm/qnnpack kernels) run on CPU tensors only."""
        return self.device_type == "cpu"

    def sampler_process_device(self, local_rank: int, local_world: int, sampler_devices: int) -> str:
        """Where rank `local_rank`'s sampler process (rollout.mode=one_step_off) runs. On the CPU it takes
        the cores the trainer leaves it. On an accelerator it needs a device of its own
        (`rollout.devices` = the ranks per node): the node's devices after the training ranks' ones, so
        local rank r samples on device ranks-per-node + r."""
        from portagrpo.errors import UserError

        if self.device_type == "cpu":
            return "cpu"
        count = self.device_count()
        if count == 1 and local_world == 1 and sampler_devices:
            raise UserError(f"rollout.mode=one_step_off needs a second {self.name} device for the sampler process, and "
                            f"this process sees one (Ray, or a per-rank visible-devices binding, gives each worker "
                            f"its own); launch with trainer.nproc_per_node or torchrun on the node, or use "
                            f"rollout.mode=sync.")
        if sampler_devices != local_world:
            raise UserError(f"rollout.mode=one_step_off on --device {self.name} gives each rank's sampler process a "
                            f"device of its own: set rollout.devices={local_world} (one per rank on the node; it is "
                            f"{sampler_devices}).")
        if count < 2 * local_world:
            raise UserError(f"rollout.mode=one_step_off with rollout.devices={sampler_devices} needs "
                            f"{2 * local_world} {self.name} devices per node ({local_world} training, "
                            f"{sampler_devices} sampling); this process sees {count}. Use fewer ranks per node, "
                            f"or rollout.mode=sync.")
        return f"{self.device_type}:{local_world + local_rank}"

    def autocast(self, dtype: torch.dtype) -> ContextManager:
        if dtype in (torch.float32, torch.float64):
            return contextlib.nullcontext()
        return torch.autocast(device_type=self.device_type, dtype=dtype)

    def seed(self, seed: int) -> None:
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)

    def synchronize(self) -> None:
        return None

    def region(self, label: str) -> ContextManager:
        """A named stretch of a step (rollout, logprobs, update, ...) for a profiler or counter that
        wants to tell the phases apart; nothing by default."""
        return contextlib.nullcontext()

    def reset_peak_memory(self) -> None:
        """Linux: the resident set's high-water mark (VmHWM) starts again from the current resident set."""
        try:
            with open("/proc/self/clear_refs", "w") as fh:
                fh.write("5")
        except OSError:  # not Linux, or a kernel without it: the peak then counts from the process's start
            pass

    def peak_memory_gb(self) -> float:
        """The resident set's high-water mark since the last reset (VmHWM), else since the process started."""
        try:
            with open("/proc/self/status") as fh:
                for line in fh:
                    if line.startswith("VmHWM:"):
                        return int(line.split()[1]) / 2**20
        except (OSError, ValueError):
            pass
        return _rss_peak_gb()

    def empty_cache(self) -> None:
        return None

    def current_memory_gb(self) -> float:
        """Memory in use now (resident set on the CPU), the baseline for a peak measurement."""
        try:
            with open("/proc/self/statm") as fh:
                pages = int(fh.read().split()[1])
            return pages * os.sysconf("SC_PAGE_SIZE") / 2**30
        except (OSError, ValueError):
            return 0.0

    def free_memory_gb(self) -> float:
        """Memory a new allocation can use (available system memory on the CPU)."""
        try:
            with open("/proc/meminfo") as fh:
                for line in fh:
                    if line.startswith("MemAvailable:"):
                        return int(line.split()[1]) / 2**20
        except (OSError, ValueError):
            pass
        return float("inf")

    def set_deterministic(self, enabled: bool) -> None:
        torch.use_deterministic_algorithms(enabled, warn_only=False)
        for var, value in self.deterministic_env().items():
            if enabled:
                os.environ.setdefault(var, value)

    def deterministic_env(self) -> dict[str, str]:
        return {}

    def collective_env(self) -> dict[str, str]:
        """Variables the collective library reads when the process group forms (see `BackendSpec`)."""
        return dict(self.spec.collective_env)

    def rng_state(self) -> dict[str, Any]:
        return {}

    def set_rng_state(self, state: dict[str, Any]) -> None:
        return None

    def moe_topk(self) -> Callable | None:
        """The vendor op that picks a softmax router's top-k experts, as `f(logits [N, E], k) -> [N, k]` expert ids
        (the weights are then taken from the live softmax, differentiably: model/moe.py); None: transformers' own
        softmax and top-k."""
        return None

    def varlen_attention(self, attention: str) -> Callable | None:
        """The variable-length causal attention for packed rows under the decoder attention `attention` (the
        backend's answer), as `f(q [Hq, N, D], k [Hkv, N, D], v, seqlens, scale, dropout) -> [Hq, N, D]`; None: the
        trainer's block-diagonal SDPA (portagrpo/model/ulysses.py), one call per sequence."""
        return None

    def attention_implementation(self, requested: str, dtype: torch.dtype) -> str:
        choice = self.spec.default_attention if requested == "auto" else requested
        if choice not in self.spec.attention_choices:
            raise BackendUnavailable(
                f"model.attn_implementation={requested!r} is not available on --device {self.name}; "
                f"choose one of {', '.join(('auto',) + self.spec.attention_choices)}."
            )
        return choice

    def vision_attention_implementation(self, requested: str, dtype: torch.dtype) -> str:
        """The attention of a vision tower's blocks at the tower's compute dtype, asked as the decoder's is (from
        `model.attn_implementation`): the decoder's choice where transformers' own implementation serves variable-
        length windows too, else the vendor attention's windowed form from the data row, else refused."""
        choice = self.attention_implementation(requested, dtype)
        windowed = dict(self.spec.vision_attention).get(choice)
        if windowed is not None:
            return windowed
        if choice not in VARLEN_ATTENTION:
            raise BackendUnavailable(
                f"model.attn_implementation={requested!r} gives {choice} on --device {self.name}, which has no form "
                f"for a vision tower's variable-length windows; use sdpa or eager for a vision-language policy.")
        return choice

    def kernel_implementation(self, requested: str) -> str:
        choice = self.spec.default_kernel if requested == "auto" else requested
        if choice not in self.spec.kernel_choices:
            raise BackendUnavailable(
                f"kernels.logprob={requested!r} is not available on --device {self.name}; "
                f"choose one of {', '.join(('auto',) + self.spec.kernel_choices)}."
            )
        return choice

    def check_collective(self, tensor: torch.Tensor, op: str) -> None:
        """Refuse, with the vendor's reason, a tensor the collective library would refuse: one on
        another device than this backend's, or of a dtype it does not reduce."""
        if tensor.device.type != self.device_type:
            raise RuntimeError(f"{op}: the {self.dist_backend} collective of --device {self.name} takes "
                               f"{self.device_type} tensors, got one on {tensor.device} (a placement bug).")
        allowed = self.spec.collective_dtypes
        if allowed is not None and tensor.dtype not in allowed:
            raise RuntimeError(f"{op}: the {self.dist_backend} collective of --device {self.name} does not support "
                               f"{tensor.dtype} (Unsupported data type); reduce in float32/int64 or on the host.")

    def to_collective(self, tensor: torch.Tensor) -> torch.Tensor:
        """The tensor the collective library is handed (the same one, except for host-staged backends)."""
        return tensor

    def from_collective(self, result: torch.Tensor, like: torch.Tensor) -> torch.Tensor:
        return result

    def parallel_strategy(self, requested: str) -> str:
        choice = self.spec.default_parallel if requested == "auto" else requested
        problem = fsdp2_sum_reduction_available() if choice in ("fsdp2", "ep") else None
        if problem:
            if requested == "auto":
                choice = "ddp"  # FSDP2 without plain-SUM comms would average gradients; replicate instead
            else:
                raise BackendUnavailable(problem)
        if choice not in self.spec.parallel_choices:
            raise BackendUnavailable(
                f"trainer.parallel={requested!r} does not run on --device {self.name}; use one of "
                f"{', '.join(('auto',) + self.spec.parallel_choices)}.")
        return choice

    def rollout_engine(self, requested: str) -> str:
        if requested not in self.spec.rollout_engines:
            raise BackendUnavailable(
                f"rollout.engine={requested!r} does not run on --device {self.name}; use one of "
                f"{', '.join(self.spec.rollout_engines)}.")
        return requested

    def describe(self) -> dict[str, Any]:
        """One row of `portagrpo doctor`: availability, devices, collectives, attention and kernels."""
        avail = self.is_available()
        row: dict[str, Any] = {
            "backend": self.name,
            "available": avail.ok,
            "reason": avail.reason,
            "device_type": self.device_type,
            "dist_backend": self.dist_backend,
            "visible_devices_env": list(self.spec.visible_devices_env),
            "ray_resource": self.spec.ray_resource,
            "device_count": self.device_count() if avail.ok else 0,
            "device_names": [],
            "bf16": None,
            "attention": {"fp32": None, "bf16": None},
            "kernel": None,
        }
        row.update(avail.details)
        if avail.ok:
            for label, dtype in (("fp32", torch.float32), ("bf16", torch.bfloat16)):
                try:
                    row["attention"][label] = self.attention_implementation("auto", dtype)
                except UserError as err:
                    row["attention"][label] = f"none ({err})"
            row["kernel"] = self.kernel_implementation("auto")
        return row
