"""Response masks from EOS, the hf engine's shapes, and backend selection."""
import pytest
import torch

from portagrpo.backends import BackendUnavailable, get_backend
from portagrpo.rollout.engines import HFRollout, decode_responses, response_mask_from_tokens
from portagrpo.rollout.settings import SamplingParams


def test_response_mask_includes_first_eos_only():
    responses = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    mask = response_mask_from_tokens(responses, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_hf_engine_shapes_and_padding(tiny_model_dir, tokenizer):
    import contextlib

    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    engine = HFRollout(model, tokenizer, contextlib.nullcontext)
    prompts = [tokenizer("u:repeat 4\na:")["input_ids"], tokenizer("a:")["input_ids"]]
    from portagrpo.data.records import left_pad

    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    torch.manual_seed(0)
    responses, rmask, *_ = engine.generate(ids, mask, SamplingParams(max_tokens=7, temperature=1.0))
    assert responses.shape == (2, 7) and rmask.shape == (2, 7)
    assert (responses[rmask == 0] == tokenizer.pad_token_id).all()
    greedy_a, _, *_ = engine.generate(ids, mask, SamplingParams(max_tokens=7, temperature=0.0))
    greedy_b, _, *_ = engine.generate(ids, mask, SamplingParams(max_tokens=7, temperature=0.0))
    assert torch.equal(greedy_a, greedy_b)
    assert len(decode_responses(tokenizer, responses.tolist(), rmask.tolist())) == 2


def test_left_padding_does_not_change_greedy_output(tiny_model_dir, tokenizer):
    """Position ids follow the mask, so a padded prompt generates what it generates alone."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from portagrpo.data.records import left_pad

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    engine = HFRollout(model, tokenizer, contextlib.nullcontext)
    short = tokenizer("a:7")["input_ids"]
    long = tokenizer("u:repeat 1234\na:")["input_ids"]
    ids, mask = left_pad([short, long], tokenizer.pad_token_id)
    together, _, *_ = engine.generate(ids, mask, SamplingParams(max_tokens=5, temperature=0.0))
    alone, _, *_ = engine.generate(torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long),
                               SamplingParams(max_tokens=5, temperature=0.0))
    assert torch.equal(together[0], alone[0])


def test_cpu_backend_selected():
    b = get_backend("cpu")
    assert b.name == "cpu" and b.device_type == "cpu" and b.dist_backend == "gloo"
    assert get_backend("auto").name in ("cpu", "cuda", "rocm", "npu")


def test_unknown_device_is_one_sentence():
    with pytest.raises(BackendUnavailable, match="trainer.device='tpu' is not a known device"):
        get_backend("tpu")


def test_env_default(monkeypatch):
    monkeypatch.setenv("PORTAGRPO_DEVICE", "cpu")
    assert get_backend(None).name == "cpu"


def test_kernel_choice_validated(monkeypatch):
    b = get_backend("cpu")
    assert b.kernel_implementation("auto") == "chunked"
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    with pytest.raises(BackendUnavailable, match="kernels.logprob='triton' is not available on --device cpu"):
        b.kernel_implementation("triton")
    with pytest.raises(BackendUnavailable, match="kernels.logprob='cuda_magic' is not available"):
        b.kernel_implementation("cuda_magic")


def test_repeated_prompts_share_one_prefill(tiny_model_dir, tokenizer):
    """A group's n samples: the prompt is prefilled once per distinct prompt (the decoder's first call
    sees 2 rows, not 6), and greedy decoding from the shared cache equals decoding without it,
    left padding included."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from portagrpo.data.records import left_pad
    from portagrpo.model.loading import decoder_of

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    prompts = [tokenizer("a:7")["input_ids"]] * 3 + [tokenizer("u:repeat 1234\na:")["input_ids"]] * 3
    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    rows_seen = []
    hook = decoder_of(model).register_forward_pre_hook(lambda m, a, kw: rows_seen.append(kw["input_ids"].shape),
                                                       with_kwargs=True)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    try:
        shared, shared_mask, *_ = HFRollout(model, tokenizer, contextlib.nullcontext).generate(ids, mask, greedy)
        first_call = rows_seen[0]
        rows_seen.clear()
        plain, plain_mask, *_ = HFRollout(model, tokenizer, contextlib.nullcontext, share_prefill=False).generate(
            ids, mask, greedy)
    finally:
        hook.remove()
    assert first_call == (2, ids.shape[1] - 1)  # two distinct prompts, all but the last token
    assert rows_seen[0] == ids.shape  # without sharing: every row's whole prompt
    assert torch.equal(shared, plain) and torch.equal(shared_mask, plain_mask)


def test_scoring_skips_columns_no_row_uses(tiny_model_dir, tokenizer):
    """Log-probs of a batch with all-padding prompt columns and responses shorter than the response
    width equal those computed on the full padded grid, in the same [B, T] shape."""
    from transformers import AutoModelForCausalLM

    from portagrpo.batch import RolloutBatch
    from portagrpo.kernels import logprob_impl
    from portagrpo.model.scorer import ResponseScorer, response_stats, trim_padding

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True).double()
    scorer = ResponseScorer(model, logprob_impl("reference"))
    g = torch.Generator().manual_seed(3)
    prompt = torch.randint(4, 40, (3, 9), generator=g)
    pmask = torch.ones_like(prompt)
    pmask[:, :3] = 0  # three padding columns in every row
    pmask[1, 3] = 0
    responses = torch.randint(4, 40, (3, 10), generator=g)
    rmask = (torch.arange(10) < torch.tensor([[4], [6], [2]])).float()  # longest response: 6 of 10
    batch = RolloutBatch(prompt, pmask, responses, rmask, torch.zeros(3, dtype=torch.long),
                         torch.zeros(3, dtype=torch.long), [], [], [], [])
    trimmed, width = trim_padding(batch)
    assert trimmed.prompt_ids.shape == (3, 6) and trimmed.responses.shape == (3, 6) and width == 10
    from portagrpo.model.loading import decoder_of

    shapes = []
    hook = decoder_of(model).register_forward_pre_hook(lambda m, a, kw: shapes.append(kw["input_ids"].shape),
                                                       with_kwargs=True)
    try:
        stats = response_stats(scorer, batch, temperature=1.0, compute_entropy=True)
    finally:
        hook.remove()
    assert shapes == [(1, int(trimmed.attention_mask.sum()))]  # one packed row of the real tokens
    full_logp, full_ent, _, _ = scorer(batch.input_ids, batch.attention_mask, responses, rmask.bool(), 1.0, True, False)
    assert stats.logp.shape == (3, 10)
    torch.testing.assert_close(stats.logp, full_logp, rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(stats.entropy, full_ent, rtol=1e-12, atol=1e-12)


def test_packing_is_chosen_only_where_it_saves_work():
    from portagrpo.model.scorer import packing_pays

    assert packing_pays(280, 8, 46, 512, "sdpa")  # the 24M benchmark's micro-batch: 24% padding
    assert not packing_pays(368, 8, 46, 512, "sdpa")  # no padding
    assert not packing_pays(3000, 8, 400, 64, "sdpa")  # a dense mask over 3000 tokens costs more than the padding
    assert packing_pays(3000, 8, 400, 64, "flash_attention_2")  # variable-length kernel: each sequence alone
    assert not packing_pays(280, 8, 46, 512, "npu_fusion")  # an implementation that may not read packed positions
    assert not packing_pays(6000, 64, 100, 4096, "sdpa")  # the [N, N] mask would be too large


def test_static_cache_decoding_matches_and_falls_back_to_eager(tiny_model_dir, tokenizer):
    """The backend's static KV cache (compiled decode on CUDA) gives the greedy tokens of the dynamic
    cache; where it fails, the engine says so once and decodes with the dynamic cache from then on."""
    import contextlib

    from transformers import AutoModelForCausalLM

    from portagrpo.backends.cuda import SPEC as CUDA
    from portagrpo.data.records import left_pad

    assert CUDA.decode_cache == "static" and get_backend("cpu").spec.decode_cache == "dynamic"
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    ids, mask = left_pad([tokenizer("a:7")["input_ids"], tokenizer("u:repeat 1234\na:")["input_ids"]],
                         tokenizer.pad_token_id)
    greedy = SamplingParams(max_tokens=6, temperature=0.0)
    static = HFRollout(model, tokenizer, contextlib.nullcontext, cache="static")
    plain = HFRollout(model, tokenizer, contextlib.nullcontext)
    assert torch.equal(static.generate(ids, mask, greedy)[0], plain.generate(ids, mask, greedy)[0])
    assert static.cache == "static"

    notices, real = [], model.generate

    def no_static(**kw):
        if kw["generation_config"].cache_implementation == "static":
            raise RuntimeError("torch.compile is not available here")
        return real(**kw)

    model.generate = no_static
    broken = HFRollout(model, tokenizer, contextlib.nullcontext, cache="static", notice=notices.append)
    for _ in range(2):
        assert torch.equal(broken.generate(ids, mask, greedy)[0], plain.generate(ids, mask, greedy)[0])
    assert broken.cache == "dynamic" and len(notices) == 1 and "torch.compile is not available" in notices[0]


def test_engines_declare_whether_they_hold_weights_and_vllm_loads_only_when_asked(monkeypatch):
    """The trainer pushes weights to an engine that declares it keeps its own (vLLM), and gathers a sharded
    policy for one that samples with the training model; vLLM's module is imported only when named."""
    import sys

    import portagrpo.rollout
    from portagrpo.errors import UnknownNameError
    from portagrpo.rollout.engines import ROLLOUT_ENGINES, FixedRollout

    assert HFRollout.holds_weights is False and FixedRollout.holds_weights is False
    with monkeypatch.context() as mp:
        # vLLM's module unimported, and afterwards as it was (or unimported again): both its sys.modules entry and
        # the package's attribute, which `import portagrpo.rollout.vllm as m` reads; the import below sets both
        mp.setitem(sys.modules, "portagrpo.rollout.vllm", None)
        mp.delitem(sys.modules, "portagrpo.rollout.vllm")
        mp.setattr(portagrpo.rollout, "vllm", None, raising=False)
        mp.delattr(portagrpo.rollout, "vllm")
        mp.setattr(ROLLOUT_ENGINES, "_items", {k: v for k, v in ROLLOUT_ENGINES.mapping.items() if k != "vllm"})
        assert "vllm" in ROLLOUT_ENGINES and "vllm" in ROLLOUT_ENGINES.names()
        assert "portagrpo.rollout.vllm" not in sys.modules
        vllm_engine = ROLLOUT_ENGINES.get("vllm", field="rollout.engine")
        assert vllm_engine.holds_weights is True and "portagrpo.rollout.vllm" in sys.modules
        with pytest.raises(
            UnknownNameError, match=r"rollout.engine='vlm' is not a known rollout engine \(did you mean 'vllm'"
        ):
            ROLLOUT_ENGINES.get("vlm", field="rollout.engine")
    # afterwards one vLLM module again: a test that patches `import portagrpo.rollout.vllm as m` patches the
    # module whose engine the registry builds
    import portagrpo.rollout.vllm as engine_mod

    assert ROLLOUT_ENGINES.get("vllm") is engine_mod.VLLMRollout
    assert sys.modules["portagrpo.rollout.vllm"] is engine_mod


def test_the_engines_generate_calls_warn_nothing(tiny_model_dir, tokenizer, monkeypatch):
    """transformers warns at every generate that sees min_new_tokens and min_length both set (146 times in a 2-step
    multi-turn run, issue 49): the engine names neither (no minimum length)."""
    import contextlib

    import transformers.generation.utils as gen_utils
    from transformers import AutoModelForCausalLM

    from portagrpo.data.records import left_pad

    said = []
    monkeypatch.setattr(gen_utils.logger, "warning", lambda message, *a, **k: said.append(str(message)))
    monkeypatch.setattr(gen_utils.logger, "warning_once", lambda message, *a, **k: said.append(str(message)),
                        raising=False)
    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    engine = HFRollout(model, tokenizer, contextlib.nullcontext)
    ids, mask = left_pad([tokenizer("u:repeat 4\na:")["input_ids"]], tokenizer.pad_token_id)
    for temperature in (1.0, 0.0):
        responses, rmask, *_ = engine.generate(ids, mask, SamplingParams(max_tokens=5, temperature=temperature))
        assert responses.shape == (1, 5)
    assert not [m for m in said if "min_new_tokens" in m or "min_length" in m], said
