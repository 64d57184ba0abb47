"""Packed rows without padding (model.use_remove_padding, portagrpo/model/ulysses.py): text rows past the old 4,096-token
cap of a dense block-causal mask, and vision-language rows with their 3-D rotary positions and images, give the
padded grid's log-probs, entropies and gradients. tests/emulated/test_packed_devices.py runs the text check on the
emulated device and the simulated Ascend."""
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
    logp, ent, _ = scorer(ids, mask, resp, rmask, 0.9, True, False, counts=(int(mask.sum()), int(rmask.sum())),
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
