"""Packed rows without padding (model.use_remove_padding, portagrpo/model/ulysses.py): text rows past the old
4,096-token cap of a dense block-causal mask, and vision-language rows with their 3-D rotary positions and images,
give the padded grid's log-probs, entropies and gradients. tests/emulated/test_packed_devices.py runs the text check
on the emulated device and the simulated Ascend."""
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.kernels import logprob_impl
from portagrpo.tolerances import relative_error, tolerance

# prompt and response lengths: 4,458 real tokens in all (a dense [N, N] mask would hold 19.9M entries, over the cap)
LONG = [(40, 1500), (12, 1406), (300, 1200)]


def long_rows(device, vocab: int, lengths=LONG):
    g = torch.Generator().manual_seed(3)
    p_max, t_max = max(p for p, _ in lengths), max(r for _, r in lengths)
    ids = torch.randint(1, vocab, (len(lengths), p_max + t_max), generator=g)
    mask = torch.zeros_like(ids)
    for i, (p, r) in enumerate(lengths):
        mask[i, p_max - p:p_max + r] = 1
    return [x.to(device) for x in (ids, mask, ids[:, p_max:], mask[:, p_max:].bool())], lengths


def score(scorer, rows, lengths, images=None):
    """log-probs, entropies and the gradient of a policy-gradient-like loss, as fp64 on the host."""
    ids, mask, resp, rmask = rows
    extra = {} if images is None else {"images": images}
    logp, ent, _, _ = scorer(ids, mask, resp, rmask, 0.9, True, False, counts=(int(mask.sum()), int(rmask.sum())),
                             lengths=lengths, **extra)
    scorer.lm.zero_grad(set_to_none=True)
    ((logp * rmask).sum() / rmask.sum() + 0.1 * (ent * rmask).sum() / rmask.sum()).backward()
    grads = torch.cat([p.grad.double().cpu().flatten() for p in scorer.lm.parameters() if p.grad is not None])
    return logp.detach().double().cpu(), ent.detach().double().cpu(), grads


def packed_vs_padded(device: str, dtype: torch.dtype, attention: str = "sdpa", spy=None,
                     lengths=LONG) -> dict[str, float]:
    """Relative errors of the packed forward in `dtype` against the padded grid in float64 (float32 where the device
    has no float64 attention), for a tiny Llama with GQA on rows of these (prompt, response) lengths."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.model.scorer import ResponseScorer

    config = LlamaConfig(vocab_size=40, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, attn_implementation=attention)
    torch.manual_seed(0)
    base = LlamaForCausalLM(config)
    rows, lengths = long_rows(device, config.vocab_size, lengths)
    ref_dtype = torch.float64 if device == "cpu" else torch.float32
    ref = score(ResponseScorer(base.to(ref_dtype).to(device), logprob_impl("reference"), remove_padding=False), rows,
                lengths)
    lm = LlamaForCausalLM(config)
    lm.load_state_dict(base.state_dict())
    varlen = None if spy is None else spy
    got = score(ResponseScorer(lm.to(dtype).to(device), logprob_impl("reference"), varlen=varlen), rows, lengths)
    return {name: relative_error(g, r) for name, g, r in zip(("logprob", "entropy", "grad"), got, ref)}


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16], ids=["fp32", "bf16"])
def test_long_text_rows_pack_past_the_dense_mask_cap(dtype, monkeypatch):
    from portagrpo.model import ulysses

    seen = []
    real = ulysses.block_diagonal_attention
    monkeypatch.setattr(ulysses, "block_diagonal_attention", lambda q, k, v, lens, *a: seen.append(lens) or
                        real(q, k, v, lens, *a))
    errors = packed_vs_padded("cpu", dtype)
    assert seen and seen[0] == tuple(p + r for p, r in LONG)  # one packed row of the three sequences
    for quantity, error in errors.items():
        assert error <= tolerance(dtype, quantity), (quantity, error)


def test_vision_language_rows_pack_with_their_images_and_positions(monkeypatch):
    """The tiny Qwen2.5-VL on rows of two images of different sizes and a text-only row
    (tests/distributed/ulysses_worker.py's `vl_batch`)."""
    pytest.importorskip("PIL")
    from portagrpo.model import ulysses, vision
    from portagrpo.model.scorer import ResponseScorer

    if vision.vision_support_problem():
        pytest.skip(vision.vision_support_problem())
    sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "distributed"))
    from ulysses_worker import vl_batch

    seen = []
    real = ulysses.block_diagonal_attention
    monkeypatch.setattr(ulysses, "block_diagonal_attention", lambda q, k, v, lens, *a: seen.append(lens) or
                        real(q, k, v, lens, *a))
    results = []
    for remove_padding in (False, True):
        model, (ids, mask, resp, rmask, _), lengths, images = vl_batch("cpu")
        results.append(score(ResponseScorer(model, logprob_impl("reference"), remove_padding=remove_padding),
                             [ids, mask, resp, rmask], lengths, images))
    assert seen and seen[0] == tuple(p + r for p, r in lengths)  # the packed forward ran, one row of three
    for quantity, padded, packed in zip(("logprob", "entropy", "grad"), *results):
        assert relative_error(packed, padded) <= tolerance(torch.float32, quantity), quantity


def test_the_flash_attention_varlen_adapter_hands_the_kernel_its_layout():
    """backends/cuda.py's packed-row attention for flash_attention_2 (under sequence parallelism), against a stand-in
    of flash_attn_varlen_func with its documented contract ([total, heads, dim] tensors, int32 cumulative lengths
    from 0, the head ratio taken by the kernel, causal within each sequence): the block-diagonal SDPA's result."""
    from portagrpo.backends.cuda import flash_varlen_causal
    from portagrpo.model.ulysses import block_diagonal_attention

    calls = []

    def stand_in(q, k, v, cu_q, cu_k, max_q, max_k, dropout_p, softmax_scale, causal):
        assert q.dim() == 3 and q.shape[1] == 4 and k.shape[1] == 2 and cu_q.dtype == torch.int32 and causal
        calls.append((cu_q.tolist(), max_q))
        out = torch.empty_like(q)
        cu = cu_q.tolist()
        for a, b in zip(cu, cu[1:]):
            kk, vv = (t[a:b].transpose(0, 1).repeat_interleave(2, dim=0) for t in (k, v))
            out[a:b] = torch.nn.functional.scaled_dot_product_attention(
                q[a:b].transpose(0, 1), kk, vv, is_causal=True, scale=softmax_scale).transpose(0, 1)
        return out

    g = torch.Generator().manual_seed(0)
    q, k, v = torch.randn(4, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g), torch.randn(2, 12, 8, generator=g)
    got = flash_varlen_causal(q, k, v, (5, 4, 3), 0.3, 0.0, fused_op=stand_in)
    assert calls == [([0, 5, 9, 12], 5)]
    want = block_diagonal_attention(q, k, v, (5, 4, 3), 0.3, 0.0)
    assert relative_error(got, want) <= tolerance(torch.float32, "logprob")


def test_flash_attention_is_wrapped_only_for_sequence_parallelism():
    """Without Ulysses, flash-attention packs rows from their positions itself and is left alone."""
    from transformers import LlamaConfig

    from portagrpo.model.ulysses import PACKED_PREFIX, use_packed_attention

    config = LlamaConfig()
    config._attn_implementation = "flash_attention_2"
    assert not use_packed_attention(config) and config._attn_implementation == "flash_attention_2"
    assert use_packed_attention(config, flash=True)
    assert config._attn_implementation == PACKED_PREFIX + "flash_attention_2"  # "flash" stays in the name
