"""`torch_npu.npu_fusion_attention` of the simulation, in plain torch, with the documented
semantics (Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md at 0d8f401d, and the
kernel wrapper FlashAttentionKernelNpuOpApi.cpp at 517f2e7d):

- layouts BSH, SBH, BSND, BNSD (case-insensitive; TND is not modelled and is refused);
  `head_num` is the number of query heads; key and value may have fewer heads (GQA/MQA) when
  Nq / Nkv is a whole number: the kernel takes the ratio itself, nobody repeats K/V;
- q, k, v share one dtype (float16, bfloat16, float32); `scale` multiplies q.k and defaults to
  1.0 (not 1/sqrt(d));
- `atten_mask` is bool or uint8 with True/1 = masked out (does not take part), shaped
  [B,N,Sq,Skv], [B,1,Sq,Skv], [1,1,Sq,Skv] or [Sq,Skv]; without a mask attention is full and
  sparse_mode / pre_tockens / next_tockens have no effect;
- sparse_mode 0 (the mask as given, together with the pre/next band), 1 (the full mask, band
  ignored), 2 (causal from the top-left corner), 3 (causal from the bottom-right corner), 4 (a
  band from the bottom-right corner). Modes 2-4 take the compressed mask, a 2048x2048
  `triu(ones, diagonal=1)`, and build the real one from it; modes 5-8 (prefix, varlen) are not
  modelled and are refused;
- `keep_prob` is the probability of keeping an attention weight (dropout 1 - keep_prob), drawn
  from the device generator;
- what the doc's constraints section and the wrapper's checks rule out is refused: query/key/value
  of other than 3 or 4 dimensions (the wrapper), key and value of different shapes, different batch
  sizes, head dims other than Dq = Dk >= Dv within 1..768, a query head count outside 1..256, empty
  sequences. The doc sets no contiguity rule for this operator (its page for
  npu_fused_infer_attention_score does), and the wrapper makes no contiguity check before the aclnn
  call, so strided inputs are accepted here too;
- it returns (attention_out, softmax_max, softmax_sum, softmax_in, seed, offset, numels):
  softmax_max/softmax_sum are float32 [B, N, Sq, 8] (the row statistic repeated 8 times),
  softmax_in is an empty reserved tensor.

Arithmetic runs in float32 and the output is cast to the input dtype; a vendor kernel's bf16 bit
patterns are not reproduced.
"""
from __future__ import annotations

import torch

COMPRESSED = 2048
MAX_TOKENS = 2147483647
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")
MAX_HEAD_DIM = 768  # the head-dim range of the doc's constraints section
MAX_QUERY_HEADS = 256  # the query-head range of the same section


def _to_bnsd(t: torch.Tensor, layout: str, heads: int | None) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    if layout == "BSH":
        b, s, h = t.shape
        return t.view(b, s, heads, h // heads).transpose(1, 2)
    s, b, h = t.shape  # SBH
    return t.view(s, b, heads, h // heads).permute(1, 2, 0, 3)


def _from_bnsd(t: torch.Tensor, layout: str) -> torch.Tensor:
    if layout == "BNSD":
        return t
    if layout == "BSND":
        return t.transpose(1, 2)
    b, n, s, d = t.shape
    if layout == "BSH":
        return t.transpose(1, 2).reshape(b, s, n * d)
    return t.permute(2, 0, 1, 3).reshape(s, b, n * d)


def _kv_heads(t: torch.Tensor, layout: str, head_dim: int) -> int:
    if layout in ("BNSD",):
        return t.shape[1]
    if layout == "BSND":
        return t.shape[2]
    return t.shape[-1] // head_dim


def _check_compressed(mask: torch.Tensor | None, mode: int) -> None:
    if mask is None or tuple(mask.shape) != (COMPRESSED, COMPRESSED):
        raise RuntimeError(f"sparse_mode={mode} needs the compressed atten_mask of shape [2048, 2048] "
                           f"(torch.triu(torch.ones(2048, 2048, dtype=torch.bool), diagonal=1)), got "
                           f"{None if mask is None else list(mask.shape)}")
    payload = getattr(mask, "_inner", mask)  # read on the host without counting it as a device sync
    expected = torch.ones(COMPRESSED, COMPRESSED, dtype=torch.bool).triu(1)
    if not torch.equal(payload.bool(), expected):
        raise RuntimeError(f"sparse_mode={mode}: the compressed atten_mask must be triu(ones(2048, 2048), diagonal=1)")


def _band(q_len: int, kv_len: int, pre: int, nxt: int, origin_bottom_right: bool, device) -> torch.Tensor:
    """True where key j is out of the band [i - pre, i + next] around query i."""
    shift = kv_len - q_len if origin_bottom_right else 0
    i = torch.arange(q_len, device=device).unsqueeze(1) + shift
    j = torch.arange(kv_len, device=device).unsqueeze(0)
    return (j > i + nxt) | (j < i - pre)


def npu_fusion_attention(query, key, value, head_num, input_layout, pse=None, padding_mask=None, atten_mask=None,
                         scale=1.0, keep_prob=1.0, pre_tockens=MAX_TOKENS, next_tockens=MAX_TOKENS, inner_precise=0,
                         prefix=None, actual_seq_qlen=None, actual_seq_kvlen=None, sparse_mode=0,
                         gen_mask_parallel=True, sync=False, **unmodelled):
    if unmodelled:
        raise NotImplementedError(f"the simulated npu_fusion_attention does not model {sorted(unmodelled)}")
    layout = str(input_layout).upper()
    if layout == "TND":
        raise NotImplementedError("the simulated npu_fusion_attention does not model the TND (varlen) layout")
    if layout not in _LAYOUTS:
        raise RuntimeError("The input_layout should be BSH/SBH/BNSD/BSND/TND(case-insensitive), "
                           f"but got {input_layout}")
    if head_num <= 0:
        raise RuntimeError(f"head_num must > 0, but got {head_num}")
    if pse is not None or padding_mask is not None or prefix is not None:
        raise NotImplementedError("the simulated npu_fusion_attention does not model pse, padding_mask or prefix")
    if not 0 < keep_prob <= 1:
        raise RuntimeError(f"The keep_prob value must be in range of (0, 1], but got {keep_prob}")
    if not (query.dtype == key.dtype == value.dtype):
        raise RuntimeError(f"npu_fusion_attention: query, key and value must share one dtype, got "
                           f"{query.dtype}, {key.dtype}, {value.dtype}")
    if query.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        raise RuntimeError(f"npu_fusion_attention: dtype {query.dtype} is not supported (float16, bfloat16, float32)")
    if sparse_mode not in (0, 1, 2, 3, 4):
        if sparse_mode in (5, 6, 7, 8):
            raise NotImplementedError(f"the simulated npu_fusion_attention does not model sparse_mode={sparse_mode}")
        raise RuntimeError(f"The sparse_mode value must be in range of [0,6], but got {sparse_mode}")

    for label, t in (("query", query), ("key", key), ("value", value)):
        if t.dim() not in (3, 4):
            raise RuntimeError(f"The shapes of the input {label} should be 3 or 4 dimensional, but got "
                               f"{t.dim()}-dimensional")
    if key.shape != value.shape:
        raise RuntimeError(f"npu_fusion_attention: key and value must have one shape, got {list(key.shape)} and "
                           f"{list(value.shape)}")
    q = _to_bnsd(query, layout, head_num)
    head_dim = q.shape[-1]
    kv_heads = _kv_heads(key, layout, head_dim)
    k, v = _to_bnsd(key, layout, kv_heads), _to_bnsd(value, layout, kv_heads)
    if q.shape[1] != head_num:
        raise RuntimeError(f"npu_fusion_attention: head_num={head_num} but the query has {q.shape[1]} heads")
    if not 1 <= head_num <= MAX_QUERY_HEADS:
        raise RuntimeError(f"npu_fusion_attention: Nq must be in [1, {MAX_QUERY_HEADS}], got {head_num}")
    if kv_heads == 0 or head_num % kv_heads:
        raise RuntimeError(f"npu_fusion_attention: Nq/Nkv must be a non-zero integer, got {head_num}/{kv_heads}")
    if k.shape[-1] != head_dim or v.shape[-1] > head_dim or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise RuntimeError(f"npu_fusion_attention: head dims must satisfy Dq = Dk >= Dv within [1, {MAX_HEAD_DIM}], "
                           f"got Dq={head_dim}, Dk={k.shape[-1]}, Dv={v.shape[-1]}")
    if q.shape[0] != k.shape[0] or min(q.shape[2], k.shape[2]) < 1:
        raise RuntimeError(f"npu_fusion_attention: query and key/value need one batch size and sequence lengths "
                           f">= 1, got query {list(q.shape)} and key {list(k.shape)} (BNSD)")
    groups = head_num // kv_heads
    q_len, kv_len = q.shape[2], k.shape[2]

    masked = None
    if atten_mask is not None:
        if atten_mask.dtype not in (torch.bool, torch.uint8):
            raise RuntimeError(f"npu_fusion_attention: atten_mask must be bool or uint8, got {atten_mask.dtype}")
        if sparse_mode in (2, 3, 4):
            _check_compressed(atten_mask, sparse_mode)
            if sparse_mode == 2:
                masked = _band(q_len, kv_len, MAX_TOKENS, 0, False, q.device)
            elif sparse_mode == 3:
                masked = _band(q_len, kv_len, MAX_TOKENS, 0, True, q.device)
            else:
                masked = _band(q_len, kv_len, pre_tockens, next_tockens, True, q.device)
        else:
            if atten_mask.dim() not in (2, 4) or tuple(atten_mask.shape[-2:]) != (q_len, kv_len):
                raise RuntimeError(f"npu_fusion_attention: atten_mask of shape {list(atten_mask.shape)} is not "
                                   f"[B,N,Sq,Skv], [B,1,Sq,Skv], [1,1,Sq,Skv] or [Sq,Skv] for Sq={q_len}, Skv={kv_len}")
            masked = atten_mask.bool()
            if sparse_mode == 0 and (pre_tockens < MAX_TOKENS or next_tockens < MAX_TOKENS):
                masked = masked | _band(q_len, kv_len, pre_tockens, next_tockens, False, q.device)

    # the kernel pairs query head h with key/value head h // (Nq/Nkv)
    k32 = k.float().repeat_interleave(groups, dim=1)
    v32 = v.float().repeat_interleave(groups, dim=1)
    scores = torch.matmul(q.float(), k32.transpose(-1, -2)) * scale
    if masked is not None:
        scores = scores.masked_fill(masked, float("-inf"))
    row_max = scores.amax(dim=-1, keepdim=True)
    safe_max = torch.where(torch.isfinite(row_max), row_max, torch.zeros_like(row_max))
    weights = torch.exp(scores - safe_max)
    row_sum = weights.sum(dim=-1, keepdim=True)
    probs = weights / row_sum.clamp(min=torch.finfo(torch.float32).tiny)
    if keep_prob < 1:
        keep = torch.rand(probs.shape, device=probs.device) < keep_prob
        probs = probs * keep / keep_prob
    out = torch.matmul(probs, v32).to(query.dtype)
    softmax_max = safe_max.expand(*safe_max.shape[:-1], 8).contiguous()
    softmax_sum = row_sum.expand(*row_sum.shape[:-1], 8).contiguous()
    reserved = torch.empty(0, device=query.device, dtype=query.dtype)
    return _from_bnsd(out, layout), softmax_max, softmax_sum, reserved, 0, 0, 0
