"""`torch_npu.npu_fusion_attention` of the simulation, in plain torch, with the documented
semantics (Ascend/op-plugin docs/context/torch_npu-npu_fusion_attention.md at 0d8f401d, and the
kernel wrapper FlashAttentionKernelNpuOpApi.cpp at 517f2e7d):

- layouts BSH, SBH, BSND, BNSD (case-insensitive) and TND, the varlen case (below);
  `head_num` is the number of query heads; key and value may have fewer heads (GQA/MQA) when
  Nq / Nkv is a whole number: the kernel takes the ratio itself, nobody repeats K/V;
- TND: query [T, Nq, D], key/value [Tkv, Nkv, D], the sequences one after the other.
  `actual_seq_qlen` / `actual_seq_kvlen` are required, of one length (1..1024 entries), and are host
  lists of ints (List[int]; the wrapper takes an IntArrayRef, never a tensor): the cumulative lengths
  without a leading 0 (lengths 2, 2, 2 -> [2, 4, 6]); a repeated entry is an empty sequence, and trailing
  0 entries are sequences left out. A token attends only to the keys of its own sequence. T is within
  1..1M. sparse_mode must be in [0, 5) or (5, 8] (the wrapper's check); modelled are 0/1 without a mask
  (full attention within each sequence) and 2/3 with the compressed mask (causal within each sequence,
  from its top-left / bottom-right corner). Stricter than the kernel: the last cumulative length must be
  T (and Tkv), since the kernel would leave the tokens after it unwritten; softmax_max/softmax_sum are
  [T, Nq, 8];
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
patterns are not reproduced. `npu_fusion_attention` here also runs on CPU tensors (unit tests load this file
alone); the installed stand-in (`on_npu_only`, __init__.py) first refuses any tensor not on the NPU, as the
wrapper's format_trans does ("only npu tensor is supported").
"""
from __future__ import annotations

import functools
import inspect

import torch

COMPRESSED = 2048
MAX_TOKENS = 2147483647
_LAYOUTS = ("BSH", "SBH", "BSND", "BNSD")
MAX_HEAD_DIM = 768  # the head-dim range of the doc's constraints section
MAX_QUERY_HEADS = 256  # the query-head range of the same section
MAX_VARLEN_SEQUENCES = 1024  # "varlen场景下长度最大支持1K": entries of actual_seq_qlen in the TND case
MAX_VARLEN_TOKENS = 1 << 20  # T (B * S) within 1..1M


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
    if layout not in _LAYOUTS + ("TND",):
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
    if layout == "TND":
        return _varlen(query, key, value, head_num, atten_mask, scale, keep_prob, actual_seq_qlen, actual_seq_kvlen,
                       sparse_mode)
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

    out, softmax_max, softmax_sum = _attend(q, k, v, groups, masked, scale, keep_prob)
    reserved = torch.empty(0, device=query.device, dtype=query.dtype)
    return _from_bnsd(out, layout), softmax_max, softmax_sum, reserved, 0, 0, 0


def _attend(q, k, v, groups: int, masked, scale: float, keep_prob: float):
    """[B, N, Sq, D] attention in float32 (True in `masked` = left out): (out in q's dtype, row max, row sum)."""
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
    out = torch.matmul(probs, v32).to(q.dtype)
    return (out, safe_max.expand(*safe_max.shape[:-1], 8).contiguous(),
            row_sum.expand(*row_sum.shape[:-1], 8).contiguous())


def _host_cumulative(name: str, lengths) -> list[int]:
    if not isinstance(lengths, (list, tuple)) or not all(type(x) is int for x in lengths):
        raise TypeError(f"npu_fusion_attention(): argument '{name}' must be a list of ints (List[int], host values), "
                        f"not {type(lengths).__name__}")
    return list(lengths)


def _segments(cumulative: list[int], total: int, name: str) -> tuple[torch.Tensor, torch.Tensor, list[int]]:
    """Per token: its sequence and its position in it; and each sequence's length. Checks the cumulative list."""
    used = len(cumulative)
    while used and cumulative[used - 1] == 0:  # trailing zeros: sequences left out
        used -= 1
    ends = cumulative[:used]
    if any(b < a for a, b in zip([0] + ends, ends)):
        raise RuntimeError(f"npu_fusion_attention: {name} must be cumulative (non-decreasing), got {cumulative}")
    if (ends[-1] if ends else 0) != total:
        raise RuntimeError(f"npu_fusion_attention: the last entry of {name} ({ends[-1] if ends else 0}) must be the "
                           f"number of tokens, {total} (the simulation refuses what the kernel leaves unwritten)")
    lengths = [b - a for a, b in zip([0] + ends, ends)] + [0] * (len(cumulative) - used)
    seq = torch.repeat_interleave(torch.arange(len(lengths)), torch.tensor(lengths, dtype=torch.long))
    starts = torch.tensor([0] + ends[:-1] + [total] * (len(cumulative) - used), dtype=torch.long)
    return seq, torch.arange(total) - starts[seq], lengths


def _varlen(query, key, value, head_num, atten_mask, scale, keep_prob, actual_seq_qlen, actual_seq_kvlen,
            sparse_mode):
    """input_layout TND (the varlen case): each token attends within its own sequence."""
    if actual_seq_qlen is None or actual_seq_kvlen is None or not len(actual_seq_qlen) \
            or len(actual_seq_qlen) != len(actual_seq_kvlen):
        raise RuntimeError("the size of actual_seq_qlen and actual_seq_kvlen must be the same and cannot be empty.")
    cu_q = _host_cumulative("actual_seq_qlen", actual_seq_qlen)
    cu_k = _host_cumulative("actual_seq_kvlen", actual_seq_kvlen)
    if len(cu_q) > MAX_VARLEN_SEQUENCES:
        raise RuntimeError(f"npu_fusion_attention: actual_seq_qlen has {len(cu_q)} entries; the varlen case takes at "
                           f"most {MAX_VARLEN_SEQUENCES}")
    if not ((0 <= sparse_mode < 5) or (5 < sparse_mode <= 8)):
        raise RuntimeError(f"The sparse_mode value must be in range of [0,5) or (5,8], but got {sparse_mode}")
    if any(t.dim() != 3 for t in (query, key, value)):
        raise RuntimeError(f"npu_fusion_attention: TND takes [T, N, D] query, key and value, got "
                           f"{[list(t.shape) for t in (query, key, value)]}")
    t_q, heads, head_dim = query.shape
    t_k, kv_heads = key.shape[0], key.shape[1]
    if heads != head_num or not 1 <= head_num <= MAX_QUERY_HEADS or kv_heads == 0 or head_num % kv_heads:
        raise RuntimeError(f"npu_fusion_attention: head_num={head_num} with a query of {heads} heads and key/value of "
                           f"{kv_heads}: Nq must be in [1, {MAX_QUERY_HEADS}] and Nq/Nkv a non-zero integer")
    if key.shape[-1] != head_dim or value.shape[-1] > head_dim or not 1 <= head_dim <= MAX_HEAD_DIM:
        raise RuntimeError(f"npu_fusion_attention: head dims must satisfy Dq = Dk >= Dv within [1, {MAX_HEAD_DIM}], "
                           f"got Dq={head_dim}, Dk={key.shape[-1]}, Dv={value.shape[-1]}")
    if not (1 <= t_q <= MAX_VARLEN_TOKENS and 1 <= t_k <= MAX_VARLEN_TOKENS):
        raise RuntimeError(f"npu_fusion_attention: T must be in [1, {MAX_VARLEN_TOKENS}], got {t_q} and {t_k}")
    seq_q, pos_q, len_q = _segments(cu_q, t_q, "actual_seq_qlen")
    seq_k, pos_k, len_k = _segments(cu_k, t_k, "actual_seq_kvlen")
    masked = seq_q[:, None] != seq_k[None, :]  # [T, Tkv]: another sequence's keys
    if atten_mask is not None and sparse_mode in (2, 3):
        _check_compressed(atten_mask, sparse_mode)
        shift = (torch.tensor(len_k) - torch.tensor(len_q))[seq_q] if sparse_mode == 3 else 0
        masked = masked | (pos_k[None, :] > (pos_q + shift)[:, None])
    elif atten_mask is not None or sparse_mode not in (0, 1):
        raise NotImplementedError(f"the simulated npu_fusion_attention models TND without atten_mask (sparse_mode 0/1) "
                                  f"or with the compressed causal one (2/3), not sparse_mode={sparse_mode} with "
                                  f"{'a' if atten_mask is not None else 'no'} mask")
    q, k, v = (t.transpose(0, 1).unsqueeze(0) for t in (query, key, value))  # [1, N, T, D]
    out, softmax_max, softmax_sum = _attend(q, k, v, head_num // kv_heads, masked.to(query.device), scale, keep_prob)
    reserved = torch.empty(0, device=query.device, dtype=query.dtype)
    return (out[0].transpose(0, 1), softmax_max[0].transpose(0, 1), softmax_sum[0].transpose(0, 1), reserved, 0, 0, 0)


def on_npu_only(op, tensors: tuple[str, ...]):
    """The op as the installed stand-in exports it: a tensor input (`tensors`, the op schema's Tensor arguments) not on
    the NPU is refused first, as the wrapper's format_trans does (TORCH_CHECK(is_npu(t), "only npu tensor is
    supported")). Arguments of other types (npu_fusion_attention's int[] cumulative lengths) are not tensor inputs:
    a tensor given there fails the op's own argument check instead."""
    signature = inspect.signature(op)

    @functools.wraps(op)
    def checked(*args, **kwargs):
        given = signature.bind(*args, **kwargs).arguments
        for name in tensors:
            t = given.get(name)
            if torch.is_tensor(t) and t.device.type != "npu":
                raise RuntimeError(f"{op.__name__}: only npu tensor is supported, {name} is on {t.device}")
        return op(*args, **kwargs)

    return checked
