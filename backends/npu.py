"""Huawei Ascend NPU backend: torch_npu device module, HCCL collectives, and the fused
attention of torch_npu (`npu_fusion_attention`) registered with transformers when chosen.

torch_npu is imported only when this backend is asked whether it can run, never when
portagrpo is imported.
"""
from __future__ import annotations

from typing import Any, Callable

import torch

from .accelerator import AcceleratorBackend
from .base import BackendSpec, BackendUnavailable
from .npu_env import SET_ENV_HINT, autoload_disabled_reason, cann_found, torch_npu_installed
from .npu_varlen import FUSED_DTYPES, NPU_VISION_ATTENTION, register_npu_vision_attention
from .probe import RuntimeProbe

NPU_ATTENTION = "npu_fusion"

SPEC = BackendSpec(
    name="npu",
    device_type="npu",
    dist_backend="hccl",
    visible_devices_env=("ASCEND_RT_VISIBLE_DEVICES",),
    ray_resource="NPU",
    default_attention=NPU_ATTENTION,
    attention_choices=(NPU_ATTENTION, "sdpa", "eager"),
    # a vision tower's windows (cu_seqlens) go to npu_fusion_attention's TND layout, one call for them all
    vision_attention=((NPU_ATTENTION, NPU_VISION_ATTENTION),),
    kernel_choices=("reference", "chunked"),
    default_kernel="chunked",
    # HCCL on Atlas A2/A3 answers "Unsupported data type" for float64.
    collective_dtypes=(torch.float32, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
                       torch.int8, torch.uint8, torch.bool),
    # torch_npu's ProcessGroupHCCL has the same ErrorHandlingMode: 2 (CleanUpOnly) aborts the HCCL
    # communicators on an error and keeps the process, so the next collective raises in Python
    # (its default, 1, rethrows in the watchdog thread and takes the process down).
    collective_env=(("HCCL_ASYNC_ERROR_HANDLING", "2"),),
    vllm_plugin="vllm-ascend",
    install_hint=("install the CANN toolkit and the torch_npu release matching your torch "
                  "(`pip install torch-npu==<torch version>`), then `" + SET_ENV_HINT + "`"),
    pinned_offload=True,
    # torch._grouped_mm is not an Ascend op: the experts run as transformers' per-expert loop
    moe_experts="eager",
    runtime_reserve_gb=1.5,  # an allowance for the CANN context and HCCL's buffers (HCCL_BUFFSIZE), not measured
    # a 64 GB Atlas 800T A2 (910B) reports 61-62 GiB to torch_npu (issue 51's reading, the lower taken; not measured
    # here: no NPU has run this project)
    usable_memory_fraction=61.0 / 64,
)


def npu_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    fused_op: Callable[..., Any] | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface adapter around `torch_npu.npu_fusion_attention`.

    query: [B, N, Sq, D], key/value: [B, Nkv, Skv, D]; attention_mask: bool [B, 1, Sq, Skv]
    with True = attend (the sdpa mask), or None: plain causal, or full attention where the caller says
    `is_causal=False` (a vision block's window; as sdpa's adapter reads it, from the module by default).
    Returns ([B, Sq, N, D], None).

    The fused op takes the head ratio itself (Nq / Nkv whole), so K/V go in unrepeated. Plain
    causal attention is its sparse_mode 3 (causal from the bottom-right corner, right for a query
    shorter than its keys too) with the 2048x2048 compressed mask, built once per device; only a
    mask with padding goes in dense, inverted (the op masks where True).
    """
    if fused_op is None:
        import torch_npu

        fused_op = torch_npu.npu_fusion_attention
    # The fused op needs one dtype for q, k and v. Under autocast the projections come out in the autocast
    # dtype but RoPE multiplies q and k by fp32 cos/sin, which promotes them back to fp32.
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else value.dtype
    query, key, value = query.to(dtype), key.to(dtype), value.to(dtype)
    heads = query.shape[1]
    causal = kwargs.get("is_causal")
    if attention_mask is None and not (getattr(module, "is_causal", True) if causal is None else causal):
        masked, sparse_mode = None, DENSE_MASK  # no mask: every query attends to every key
    elif attention_mask is None:
        masked, sparse_mode = causal_compressed_mask(query.device), CAUSAL_BOTTOM_RIGHT
    elif attention_mask.dtype == torch.bool:
        masked, sparse_mode = ~attention_mask, DENSE_MASK
    else:  # additive float mask: very negative = masked
        masked, sparse_mode = attention_mask < -1.0, DENSE_MASK
    scale = scaling if scaling is not None else query.shape[-1] ** -0.5
    out = fused_op(query, key, value, heads, "BNSD", atten_mask=masked, scale=scale, sparse_mode=sparse_mode,
                   keep_prob=1.0 - (dropout if module.training else 0.0))[0]
    return out.transpose(1, 2).contiguous(), None


def npu_varlen_causal(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, seqlens, scale: float | None,
                      dropout: float, *, fused_op: Callable[..., Any] | None = None) -> torch.Tensor:
    """Causal attention within each sequence of a packed row in npu_fusion_attention's TND layout: q [Hq, N, D],
    k/v [Hkv, N, D] (the op takes the head ratio), `seqlens` host ints -> [Hq, N, D]. Calls of at most 1024
    sequences and 1M tokens (npu_varlen.varlen_calls); causal from each sequence's corner (sparse_mode 3 with the
    compressed mask)."""
    from .npu_varlen import varlen_calls

    if fused_op is None:
        import torch_npu

        fused_op = torch_npu.npu_fusion_attention
    device_type = q.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else v.dtype
    q, k, v = (t.transpose(0, 1).to(dtype) for t in (q, k, v))  # TND: tokens first
    cu = [0]
    for n in seqlens:
        cu.append(cu[-1] + n)
    scale = scale if scale is not None else q.shape[-1] ** -0.5
    outs = []
    for first, end in varlen_calls(cu, cu):
        a, b = cu[first], cu[end]
        outs.append(fused_op(q[a:b], k[a:b], v[a:b], q.shape[1], "TND", atten_mask=causal_compressed_mask(q.device),
                             scale=scale, keep_prob=1.0 - dropout, sparse_mode=CAUSAL_BOTTOM_RIGHT,
                             actual_seq_qlen=[c - a for c in cu[first + 1:end + 1]],
                             actual_seq_kvlen=[c - a for c in cu[first + 1:end + 1]])[0])
    return (outs[0] if len(outs) == 1 else torch.cat(outs)).transpose(0, 1)


# npu_fusion_attention's sparse modes (torch_npu docs): 0 = the mask as given, 3 = causal from the
# bottom-right corner, taking the compressed mask below instead of a [Sq, Skv] one.
DENSE_MASK, CAUSAL_BOTTOM_RIGHT = 0, 3
COMPRESSED_MASK_SIZE = 2048
_COMPRESSED: dict[torch.device, torch.Tensor] = {}


def npu_moe_topk(logits: torch.Tensor, k: int) -> torch.Tensor:
    """[N, E] router logits -> [N, k] expert ids (int64), by `torch_npu.npu_moe_gating_top_k_softmax(x, finished, k)`
    -> (top-k softmax values, expert_idx int32, row_idx): its x is fp16, bf16 or fp32, so fp64 logits (the parity
    reference) go in as fp32."""
    import torch_npu

    x = logits if logits.dtype in (torch.float16, torch.bfloat16, torch.float32) else logits.float()
    _, expert_idx, _ = torch_npu.npu_moe_gating_top_k_softmax(x.detach(), None, k=k)
    return expert_idx.long()


def causal_compressed_mask(device: torch.device) -> torch.Tensor:
    """The 2048x2048 upper-triangular mask (True = masked) sparse modes 2-4 take, one per device."""
    if device not in _COMPRESSED:
        _COMPRESSED[device] = torch.ones(COMPRESSED_MASK_SIZE, COMPRESSED_MASK_SIZE, dtype=torch.bool,
                                         device=device).triu(1)
    return _COMPRESSED[device]


def register_npu_attention(fused_op: Callable[..., Any] | None = None) -> str:
    """Register the adapter with transformers under `npu_fusion` (done when the backend picks it)."""
    from transformers import AttentionInterface
    from transformers.masking_utils import AttentionMaskInterface, sdpa_mask

    def forward(*args: Any, **kwargs: Any):
        return npu_attention_forward(*args, fused_op=fused_op, **kwargs)

    AttentionInterface.register(NPU_ATTENTION, forward)
    AttentionMaskInterface.register(NPU_ATTENTION, sdpa_mask)
    return NPU_ATTENTION


def transformers_has_attention_masks() -> bool:
    import importlib.util

    try:
        return importlib.util.find_spec("transformers.masking_utils") is not None
    except (ImportError, ValueError):
        return False


class NPUBackend(AcceleratorBackend):
    def __init__(
        self,
        probe: RuntimeProbe | None = None,
        *,
        torch_npu_present: Callable[[], bool] = torch_npu_installed,
        cann_present: Callable[[], bool] = cann_found,
    ) -> None:
        super().__init__(SPEC, probe)
        self._torch_npu_present, self._cann_present = torch_npu_present, cann_present

    def runtime_problem(self) -> str | None:
        if not self._torch_npu_present():
            return f"torch_npu is not installed; {SPEC.install_hint}"
        if not self._cann_present():
            extra = " (portagrpo set TORCH_DEVICE_BACKEND_AUTOLOAD=0 so `import torch` keeps working)" \
                if autoload_disabled_reason else ""
            return (f"torch_npu is installed but the CANN toolkit is not loaded (libhccl.so was not found){extra}; "
                    f"run `{SET_ENV_HINT}`")
        return None

    def attention_implementation(self, requested: str, dtype: torch.dtype) -> str:
        choice = super().attention_implementation(requested, dtype)
        if choice == NPU_ATTENTION and not transformers_has_attention_masks():
            if requested == "auto":
                return "sdpa"
            raise BackendUnavailable("model.attn_implementation=npu_fusion needs transformers >= 4.53 "
                                     "(transformers.masking_utils); upgrade transformers or use sdpa.")
        if choice == NPU_ATTENTION:
            register_npu_attention()
        return choice

    def varlen_attention(self, attention: str):
        """Packed rows through npu_fusion_attention's TND layout when the decoder runs npu_fusion."""
        return npu_varlen_causal if attention == NPU_ATTENTION else None

    def moe_topk(self):
        """A softmax router's experts through torch_npu's `npu_moe_gating_top_k_softmax` (softmax over the experts,
        then top-k; documented for inference only, so it picks the experts and the weights come from the live
        softmax). DeepSeek-V3's grouped sigmoid router (`npu_moe_gating_top_k`) is not one transformers' Qwen MoE
        has."""
        return npu_moe_topk

    def vision_attention_implementation(self, requested: str, dtype: torch.dtype) -> str:
        choice = super().vision_attention_implementation(requested, dtype)
        if choice == NPU_VISION_ATTENTION and dtype not in FUSED_DTYPES:
            if requested == "auto":
                return "sdpa"
            raise BackendUnavailable(f"model.attn_implementation={requested} runs the vision tower through "
                                     f"npu_fusion_attention, which has no {str(dtype).removeprefix('torch.')} kernels; "
                                     f"use model.dtype=bf16 or fp32, or model.attn_implementation=sdpa.")
        if choice == NPU_VISION_ATTENTION:
            register_npu_vision_attention()
        return choice

    def kernel_implementation(self, requested: str) -> str:
        if requested == "triton":
            if not self.probe.has_module("triton"):
                raise BackendUnavailable("kernels.logprob=triton on NPU needs triton-ascend, which is not installed; "
                                         "use chunked.")
            return "triton"  # triton-ascend provides the `triton` package; parity decides whether to trust it
        return super().kernel_implementation(requested)

    def deterministic_env(self) -> dict[str, str]:
        return {"HCCL_DETERMINISTIC": "true"}
