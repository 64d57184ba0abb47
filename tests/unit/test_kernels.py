"""Every token log-prob implementation against the plain-torch reference: forward and gradients,
ragged masks, vocabularies that are not multiples of the block, fp32 and bf16, temperature,
tied weights and LoRA heads. Bounds come from portagrpo.tolerances."""
import importlib.util

import pytest
import torch

from portagrpo.kernels import logprob_impl, token_logprobs_reference
from portagrpo.kernels.reference import token_logprobs_from_logits
from portagrpo.tolerances import assert_close

HAS_TRITON = importlib.util.find_spec("triton") is not None
IMPLS = ["chunked", pytest.param("triton", marks=pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed"))]


def ragged_tokens(batch, length, hidden, vocab, dtype, seed):
    """Hidden states of the response tokens selected by a ragged [B, T] mask, as the trainer does."""
    g = torch.Generator().manual_seed(seed)
    lengths = torch.randint(0, length + 1, (batch,), generator=g)
    lengths[0] = length
    mask = torch.arange(length).unsqueeze(0) < lengths.unsqueeze(1)
    grid = torch.randn(batch, length, hidden, generator=g)
    h = grid[mask].to(dtype)
    w = (torch.randn(vocab, hidden, generator=g) * 0.5).to(dtype)
    b = (torch.randn(vocab, generator=g) * 0.1).to(dtype)
    t = torch.randint(0, vocab, (h.shape[0],), generator=g)
    return h, w, b, t


def run(fn, h, w, b, t, temperature, entropy, seed, **kw):
    h = h.detach().clone().requires_grad_(True)
    w = w.detach().clone().requires_grad_(True)
    b = None if b is None else b.detach().clone().requires_grad_(True)
    logp, ent = fn(h, w, t, bias=b, temperature=temperature, compute_entropy=entropy, **kw)
    g = torch.Generator().manual_seed(seed + 1)
    loss = (logp * torch.randn(logp.shape, generator=g, dtype=torch.float64).to(logp.dtype)).sum()
    if entropy:
        loss = loss + (ent * torch.randn(ent.shape, generator=g, dtype=torch.float64).to(ent.dtype)).sum()
    loss.backward()
    return logp, ent, h.grad, w.grad, (None if b is None else b.grad)


@pytest.mark.parametrize("impl", IMPLS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,temperature,entropy,bias", [
    (517, 1.0, False, False), (1000, 0.7, True, True), (300, 1.3, True, False),
])
def test_matches_reference(impl, dtype, vocab, temperature, entropy, bias):
    h, w, b, t = ragged_tokens(4, 9, 24, vocab, dtype, seed=vocab)
    b = b if bias else None
    # several chunks, the last one partial: 7 tokens of logits per chunk
    out = run(logprob_impl(impl), h, w, b, t, temperature, entropy, seed=1, chunk_elements=7 * vocab)
    # the reference in float64 on the same (possibly bf16-rounded) inputs
    ref = run(token_logprobs_reference, h.double(), w.double(), None if b is None else b.double(), t,
              temperature, entropy, seed=1)
    assert out[0].dtype == torch.float32  # fp32 accumulation whatever the input dtype
    names = ["logp", "entropy", "grad_hidden", "grad_weight", "grad_bias"]
    quantities = ["logprob", "entropy", "grad", "grad", "grad"]
    for name, q, o, r in zip(names, quantities, out, ref):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == (dtype if name.startswith("grad") else torch.float32), name
        assert_close(o, r, dtype, q, f"{impl} {name}")


@pytest.mark.parametrize("impl", ["reference", "chunked"])
def test_fp64_inputs_stay_fp64(impl):
    h, w, b, t = ragged_tokens(3, 5, 8, 101, torch.float64, seed=3)
    out = run(logprob_impl(impl), h, w, b, t, 0.9, True, seed=2)
    ref = run(token_logprobs_reference, h, w, b, t, 0.9, True, seed=2)
    assert out[0].dtype == torch.float64
    for o, r, q in zip(out, ref, ["logprob", "entropy", "grad", "grad", "grad"]):
        assert_close(o, r, torch.float64, q)


def test_chunked_holds_one_chunk_of_logits():
    """Peak memory of the chunked forward+backward grows with the chunk, not with N x V."""
    h, w, b, t = ragged_tokens(8, 64, 16, 4000, torch.float32, seed=5)
    fn = logprob_impl("chunked")
    seen = []

    class Spy(torch.autograd.graph.saved_tensors_hooks):
        def __init__(self):
            super().__init__(lambda x: seen.append(x.numel()) or x, lambda x: x)

    with Spy():
        logp, _ = fn(h.requires_grad_(), w.requires_grad_(), t, chunk_elements=16 * 4000)
    logp.sum().backward()
    # nothing of size N x V is saved for backward
    assert max(seen) < h.shape[0] * w.shape[0] / 4


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_triton_logits_rows_kernel(dtype):
    from portagrpo.kernels.triton_logprob import token_logprobs_from_logits_triton

    g = torch.Generator().manual_seed(4)
    z = (torch.randn(11, 777, generator=g) * 3).to(dtype)
    t = torch.randint(0, 777, (11,), generator=g)
    zk = z.clone().requires_grad_(True)
    lp, ent = token_logprobs_from_logits_triton(zk, t, 0.8, True)
    (lp.sum() + 0.5 * ent.sum()).backward()
    zr = z.double().requires_grad_(True)
    lr, er = token_logprobs_from_logits(zr / 0.8, t, True)
    (lr.sum() + 0.5 * er.sum()).backward()
    assert_close(lp, lr, dtype, "logprob")
    assert_close(ent, er, dtype, "entropy")
    assert_close(zk.grad, zr.grad, dtype, "grad")


@pytest.mark.skipif(not HAS_TRITON, reason="triton is not installed")
def test_rocm_tuning_differs_only_in_constants(monkeypatch):
    from portagrpo.kernels import triton_logprob as tk

    monkeypatch.delenv("TRITON_INTERPRET")
    monkeypatch.setattr(tk, "is_hip", lambda: True)
    hip = tk.tuning()
    monkeypatch.setattr(tk, "is_hip", lambda: False)
    cuda = tk.tuning()
    assert set(hip) == set(cuda) == {"BLOCK_V", "num_warps"} and hip != cuda


def _scorer_grads(model, impl, ids, mask, responses, rmask):
    from portagrpo.model.scorer import ResponseScorer

    model.zero_grad(set_to_none=True)
    scorer = ResponseScorer(model, logprob_impl(impl))
    logp, ent, _, _ = scorer(ids, mask, responses, rmask, 0.9, True, False)
    if logp.requires_grad:  # not when every trainable (adapter) weight is switched off
        (logp.sum() + 0.1 * ent.sum()).backward()
    return logp.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


def _inputs(vocab):
    g = torch.Generator().manual_seed(9)
    ids = torch.randint(4, vocab, (3, 12), generator=g)
    mask = torch.ones_like(ids)
    mask[1, :2] = 0
    responses = ids[:, 8:]
    rmask = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [1, 0, 0, 0]], dtype=torch.bool)
    mask[:, 8:] = rmask.long()
    return ids, mask, responses, rmask


def test_tied_embeddings_get_both_gradients(tiny_model_dir):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).double()
    assert model.get_output_embeddings().weight is model.get_input_embeddings().weight
    inputs = _inputs(model.config.vocab_size)
    ref_logp, ref = _scorer_grads(model, "reference", *inputs)
    out_logp, out = _scorer_grads(model, "chunked", *inputs)
    assert_close(out_logp, ref_logp, torch.float64, "logprob")
    assert ref.keys() == out.keys() and "model.embed_tokens.weight" in ref
    for name in ref:
        assert_close(out[name], ref[name], torch.float64, "grad", name)


@pytest.mark.skipif(importlib.util.find_spec("peft") is None, reason="peft is not installed")
def test_lora_wrapped_head(tiny_model_dir):
    from peft import LoraConfig, get_peft_model
    from transformers import AutoModelForCausalLM

    from portagrpo.model.loading import position_ids_from_mask

    base = AutoModelForCausalLM.from_pretrained(
        tiny_model_dir, local_files_only=True, tie_word_embeddings=False
    ).double()
    model = get_peft_model(base, LoraConfig(r=4, lora_alpha=8, lora_dropout=0.0, target_modules=["lm_head"],
                                            init_lora_weights=False)).double()  # adapters are created in fp32
    inputs = _inputs(base.config.vocab_size)
    ref_logp, ref = _scorer_grads(model, "reference", *inputs)
    out_logp, out = _scorer_grads(model, "chunked", *inputs)
    head_lora = [n for n in ref if "lm_head" in n and "lora_" in n]
    assert len(head_lora) == 2  # A and B of the head adapter receive gradients
    for name in ref:
        assert_close(out[name], ref[name], torch.float64, "grad", name)
    # the adapter changes the log-probs: the effective head is used, not the base weight
    with model.disable_adapter():
        base_logp, _ = _scorer_grads(model, "chunked", *inputs)
    assert (base_logp - out_logp).abs().max() > 1e-6
    # full logits of the wrapped model equal what the kernel path sees
    ids, mask, responses, rmask = inputs
    with torch.no_grad():
        logits = model(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask)).logits
        logits = logits[:, 7:11][rmask] / 0.9
    direct, _ = token_logprobs_from_logits(logits, responses[rmask])
    assert_close(out_logp[rmask], direct, torch.float64, "logprob")


@pytest.mark.parametrize("entropy", [False, True])
def test_chunked_kernel_never_makes_the_host_wait(entropy):
    """Under FakeTensorMode an op whose output shape depends on the data (boolean-mask indexing,
    nonzero, .item()) raises: on a GPU each such op is a host synchronisation, once per vocabulary block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from portagrpo.kernels.chunked import token_logprobs_chunked

    with FakeTensorMode():
        h = torch.randn(12, 16, requires_grad=True)
        w = torch.randn(50, 16, requires_grad=True)
        logp, ent = token_logprobs_chunked(h, w, torch.randint(0, 50, (12,)), compute_entropy=entropy,
                                           chunk_elements=12 * 8)  # 7 vocabulary blocks
        (logp.sum() + (ent.sum() if entropy else 0)).backward()
        assert h.grad.shape == h.shape and w.grad.shape == w.shape


def test_lm_head_operands_stay_low_precision_with_fp32_results():
    from portagrpo.kernels.matmul import mm, operand_dtype

    bf, f32 = torch.ones(1, dtype=torch.bfloat16), torch.ones(1)
    assert operand_dtype(torch.float32, bf, bf) == torch.bfloat16
    assert operand_dtype(torch.float32, bf, f32) == torch.float32  # mixed inputs: no rounding of the fp32 one
    assert operand_dtype(torch.float64, bf, bf) == torch.float64
    a, b = torch.randn(5, 64), torch.randn(64, 7)
    out = mm(a, b, torch.bfloat16, torch.float32)
    assert out.dtype == torch.float32
    # the fp32 product of the bf16-rounded operands (bf16 -> fp32 is exact), not of the fp32 originals
    exact = a.to(torch.bfloat16).double() @ b.to(torch.bfloat16).double()
    assert (out.double() - exact).abs().max() < 1e-4 < (a.double() @ b.double() - exact).abs().max()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,parts,temperature,entropy", [(517, 2, 1.0, False), (1000, 3, 0.7, True),
                                                             (6, 4, 1.3, True)])
def test_streamed_head_matches_reference(dtype, vocab, parts, temperature, entropy):
    """The LM head read one block of rows at a time (an FSDP2 rank's rows each; model/parallel.py RankRows), here
    cut from one weight: uneven blocks, an empty one where the vocabulary is shorter than the parts need (6 rows in
    4 blocks of 2), several logits chunks within a block."""
    from portagrpo.kernels.streamed import SlicedHead, token_logprobs_streamed

    h, w, _, t = ragged_tokens(4, 9, 24, vocab, dtype, seed=vocab + parts)
    blocks = SlicedHead(vocab, parts)
    assert sum(blocks.rows) == vocab and (vocab != 6 or blocks.rows[-1] == 0)

    def streamed(h, w, t, bias=None, **kw):
        return token_logprobs_streamed(h, w, t, blocks, **kw)

    out = run(streamed, h, w, None, t, temperature, entropy, seed=1, chunk_elements=7 * 97)
    ref = run(token_logprobs_reference, h.double(), w.double(), None, t, temperature, entropy, seed=1)
    assert out[0].dtype == torch.float32
    for name, q, o, r in zip(["logp", "entropy", "grad_hidden", "grad_weight"], ["logprob", "entropy", "grad", "grad"],
                             out, ref):
        if r is None:
            assert o is None, name
            continue
        assert o.dtype == (dtype if name.startswith("grad") else torch.float32), name
        assert_close(o, r, dtype, q, f"streamed {name}")


def test_streamed_head_takes_its_blocks_in_the_parameter_dtype():
    """An FSDP2 run under bf16 keeps fp32 master shards and computes with bf16 copies (its mixed-precision policy):
    the streamed head multiplies bf16 blocks, as the gathered head's bf16 all-gather would, and hands the fp32
    shard an fp32 gradient."""
    from portagrpo.kernels.chunked import token_logprobs_chunked
    from portagrpo.kernels.streamed import SlicedHead, token_logprobs_streamed

    h, w, _, t = ragged_tokens(3, 7, 16, 300, torch.float32, seed=11)
    h = h.to(torch.bfloat16)
    out = run(lambda h, w, t, bias=None, **kw: token_logprobs_streamed(h, w, t, SlicedHead(300, 2),
                                                                       weight_dtype=torch.bfloat16, **kw),
              h, w, None, t, 1.0, True, seed=3)
    ref = run(token_logprobs_chunked, h, w.to(torch.bfloat16), None, t, 1.0, True, seed=3)
    assert out[3].dtype == torch.float32
    for o, r in zip(out[:3], ref[:3]):
        assert torch.allclose(o.float(), r.float(), rtol=1e-5, atol=1e-5)
    assert torch.allclose(out[3], ref[3].float(), rtol=2e-2, atol=1e-3)  # ref's gradient is rounded to bf16


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("vocab,parts,padding_idx", [(517, 2, None), (1000, 3, 7), (6, 4, 0)])
def test_streamed_lookup_matches_embedding(dtype, vocab, parts, padding_idx):
    """An input embedding held in blocks of rows (an FSDP2 rank's each), looked up one block at a time: the same
    rows as torch's embedding, and the same gradient (none for the padding row), accumulated in fp32."""
    from portagrpo.kernels.streamed import SlicedHead, embedding_streamed

    g = torch.Generator().manual_seed(vocab)
    weight = torch.randn(vocab, 24, generator=g).to(dtype)
    ids = torch.randint(0, vocab, (4, 9), generator=g)
    ids[0, :3] = padding_idx if padding_idx is not None else 1  # the padding row is used (its gradient stays zero)
    upstream = torch.randn(4, 9, 24, generator=g)
    w1, w2 = weight.clone().requires_grad_(True), weight.double().requires_grad_(True)
    out = embedding_streamed(ids, w1, SlicedHead(vocab, parts), padding_idx=padding_idx)
    ref = torch.nn.functional.embedding(ids, w2, padding_idx=padding_idx)
    assert out.dtype == dtype and torch.equal(out.double(), ref.detach())  # rows are copied, not computed
    (out.float() * upstream).sum().backward()
    (ref * upstream.double()).sum().backward()
    assert w1.grad.dtype == dtype
    assert_close(w1.grad, w2.grad, dtype, "grad", "embedding gradient")
    if padding_idx is not None:
        assert not w1.grad[padding_idx].any()
