"""A vision tower's attention on Ascend: its variable-length windows (Qwen2.5-VL's `cu_seqlens`) in one
`torch_npu.npu_fusion_attention` call with the TND layout, instead of one call per window.

What the op takes, read from Ascend/op-plugin (docs/context/torch_npu-npu_fusion_attention.md and the
wrapper op_plugin/ops/opapi/FlashAttentionKernelNpuOpApi.cpp): query [T, Nq, D] and key/value [T, Nkv, D]
(Nq / Nkv whole); `actual_seq_qlen` / `actual_seq_kvlen`, host lists of ints of one length, are the
cumulative lengths without a leading 0 (lengths 2, 2, 2 -> [2, 4, 6]); without `atten_mask` each sequence
attends to all of itself and to nothing else; in the varlen case at most 1024 sequences and 1M tokens a call.

transformers hands a vision block's `cu_seqlens` to the attention function only when the implementation's
name says "flash" (`is_flash_attention_requested` in transformers/utils/generic.py, read by
Qwen2_5_VLVisionAttention.forward); any other name gets one call per window. So the name carries "flash",
and the adapter also takes the one-call-per-window form (no `cu_seq_lens_q`: each batch row is a sequence).
"""
from __future__ import annotations

import weakref
from typing import Any, Callable

import torch

from .base import BackendUnavailable

NPU_VISION_ATTENTION = "npu_flash_varlen"
MAX_SEQUENCES_PER_CALL = 1024  # the doc's constraints: actual_seq_qlen has at most 1K entries in the varlen case
MAX_TOKENS_PER_CALL = 1 << 20  # T (= B * S) within 1..1M
FUSED_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
FULL = 0  # sparse_mode 0 without atten_mask: each sequence attends to all of itself


def varlen_calls(cu_q: list[int], cu_k: list[int]) -> list[tuple[int, int]]:
    """The sequences (given by cumulative lengths from 0, `[n + 1]` each) in consecutive runs `(first, end)`
    that one call takes: at most MAX_SEQUENCES_PER_CALL sequences and MAX_TOKENS_PER_CALL query and key
    tokens. A run ends only between sequences, so no sequence is split."""
    runs, first = [], 0
    for i in range(len(cu_q) - 1):
        if max(cu_q[i + 1] - cu_q[i], cu_k[i + 1] - cu_k[i]) > MAX_TOKENS_PER_CALL:
            raise BackendUnavailable(
                f"a vision window of {cu_q[i + 1] - cu_q[i]} tokens is longer than npu_fusion_attention takes in one "
                f"sequence ({MAX_TOKENS_PER_CALL}); use smaller images or model.attn_implementation=sdpa.")
        full = i - first == MAX_SEQUENCES_PER_CALL
        over = max(cu_q[i + 1] - cu_q[first], cu_k[i + 1] - cu_k[first]) > MAX_TOKENS_PER_CALL
        if full or over:
            runs.append((first, i))
            first = i
    runs.append((first, len(cu_q) - 1))
    return runs


class HostBoundaries:
    """The window boundaries as host lists, read from the device once per boundary tensor. A vision tower computes
    its `cu_seqlens` once per forward and hands the same tensor to every block (Qwen2.5-VL: one for its windowed
    blocks, one for its full-attention ones), so a forward reads each once instead of once per block. An entry lives
    as long as its tensor (and is read again if the tensor is changed in place)."""

    def __init__(self) -> None:
        self.kept: dict[int, tuple[Any, int, list[int]]] = {}  # id -> (weak reference, version, host list)
        self.reads = 0

    def __call__(self, cu: torch.Tensor) -> list[int]:
        held = self.kept.get(id(cu))
        if held is not None and held[0]() is cu and held[1] == cu._version:
            return held[2]
        host = [int(x) for x in cu.tolist()]  # host read: once per boundary tensor (a forward's blocks share it)
        self.reads += 1
        key = id(cu)
        self.kept[key] = (weakref.ref(cu, lambda _ref: self.kept.pop(key, None)), cu._version, host)
        return host


HOST_BOUNDARIES = HostBoundaries()


def npu_varlen_attention_forward(
    module: torch.nn.Module,
    query: torch.Tensor,
    key: torch.Tensor,
    value: torch.Tensor,
    attention_mask: torch.Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    fused_op: Callable[..., Any] | None = None,
    cu_seq_lens_q: torch.Tensor | None = None,
    cu_seq_lens_k: torch.Tensor | None = None,
    is_causal: bool | None = None,
    **kwargs: Any,
) -> tuple[torch.Tensor, None]:
    """transformers attention-interface adapter: query [B, Nq, S, D], key/value [B, Nkv, Skv, D]. With
    `cu_seq_lens_q`/`cu_seq_lens_k` ([n + 1] ints from 0, transformers' varlen form) B is 1 and the S tokens
    are n sequences one after the other, each attending to all of itself and to nothing else; without them every
    row is one sequence. Returns ([B, S, Nq, D], None)."""
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    if attention_mask is not None or causal:
        raise NotImplementedError(f"{NPU_VISION_ATTENTION} serves a vision tower's windows (whole sequences given by "
                                  f"cu_seqlens, each attending to all of itself), not a causal or padded decoder "
                                  f"attention; the decoder runs npu_fusion.")
    if fused_op is None:
        import torch_npu

        fused_op = torch_npu.npu_fusion_attention
    # one dtype for q, k and v: under autocast the rotary embedding promotes q and k back to float32
    device_type = query.device.type
    dtype = torch.get_autocast_dtype(device_type) if torch.is_autocast_enabled(device_type) else value.dtype
    batch, heads, s_q, head_dim = query.shape
    s_k, kv_heads = key.shape[2], key.shape[1]
    q = query.transpose(1, 2).reshape(batch * s_q, heads, head_dim).to(dtype)  # TND: the rows' tokens in a line
    k = key.transpose(1, 2).reshape(batch * s_k, kv_heads, head_dim).to(dtype)
    v = value.transpose(1, 2).reshape(batch * s_k, kv_heads, value.shape[-1]).to(dtype)
    if cu_seq_lens_q is None:
        cu_q, cu_k = list(range(0, batch * s_q + 1, s_q)), list(range(0, batch * s_k + 1, s_k))
    else:  # the op takes host lists: the window boundaries read once per forward (HostBoundaries)
        cu_q = HOST_BOUNDARIES(cu_seq_lens_q)
        cu_k = cu_q if cu_seq_lens_k is None or cu_seq_lens_k is cu_seq_lens_q else HOST_BOUNDARIES(cu_seq_lens_k)
    scale = scaling if scaling is not None else head_dim ** -0.5
    keep_prob = 1.0 - (dropout if module.training else 0.0)
    outs = []
    for first, end in varlen_calls(cu_q, cu_k):
        q0, k0 = cu_q[first], cu_k[first]
        outs.append(fused_op(q[q0:cu_q[end]], k[k0:cu_k[end]], v[k0:cu_k[end]], heads, "TND", scale=scale,
                             keep_prob=keep_prob, actual_seq_qlen=[c - q0 for c in cu_q[first + 1:end + 1]],
                             actual_seq_kvlen=[c - k0 for c in cu_k[first + 1:end + 1]], sparse_mode=FULL)[0])
    out = outs[0] if len(outs) == 1 else torch.cat(outs)
    return out.reshape(batch, s_q, heads, -1), None


def register_npu_vision_attention(fused_op: Callable[..., Any] | None = None) -> str:
    """Register the adapter with transformers under its name (done when the backend picks it for a vision tower)."""
    from transformers import AttentionInterface

    def forward(*args: Any, **kwargs: Any):
        return npu_varlen_attention_forward(*args, fused_op=fused_op, **kwargs)

    AttentionInterface.register(NPU_VISION_ATTENTION, forward)
    return NPU_VISION_ATTENTION
