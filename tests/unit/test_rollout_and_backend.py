"""Response masks from EOS, the hf engine's shapes, and backend selection."""
import pytest
import torch

from portagrpo.backends import BackendUnavailable, get_backend
from portagrpo.rollout.engines import HFRollout, SamplingParams, decode_responses, response_mask_from_tokens


def test_response_mask_includes_first_eos_only():
    responses = torch.tensor([[5, 6, 2, 7, 2], [5, 5, 5, 5, 5], [2, 9, 9, 9, 9]])
    mask = response_mask_from_tokens(responses, [2])
    assert mask.tolist() == [[1, 1, 1, 0, 0], [1, 1, 1, 1, 1], [1, 0, 0, 0, 0]]


def test_hf_engine_shapes_and_padding(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM
    import contextlib

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    engine = HFRollout(model, tokenizer, contextlib.nullcontext)
    prompts = [tokenizer("u:repeat 4\na:")["input_ids"], tokenizer("a:")["input_ids"]]
    from portagrpo.data.records import left_pad

    ids, mask = left_pad(prompts, tokenizer.pad_token_id)
    torch.manual_seed(0)
    responses, rmask = engine.generate(ids, mask, SamplingParams(max_tokens=7, temperature=1.0))
    assert responses.shape == (2, 7) and rmask.shape == (2, 7)
    assert (responses[rmask == 0] == tokenizer.pad_token_id).all()
    greedy_a, _ = engine.generate(ids, mask, SamplingParams(max_tokens=7, temperature=0.0))
    greedy_b, _ = engine.generate(ids, mask, SamplingParams(max_tokens=7, temperature=0.0))
    assert torch.equal(greedy_a, greedy_b)
    assert len(decode_responses(tokenizer, responses, rmask)) == 2


def test_left_padding_does_not_change_greedy_output(tiny_model_dir, tokenizer):
    """Position ids follow the mask, so a padded prompt generates what it generates alone."""
    from transformers import AutoModelForCausalLM
    import contextlib
    from portagrpo.data.records import left_pad

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    engine = HFRollout(model, tokenizer, contextlib.nullcontext)
    short = tokenizer("a:7")["input_ids"]
    long = tokenizer("u:repeat 1234\na:")["input_ids"]
    ids, mask = left_pad([short, long], tokenizer.pad_token_id)
    together, _ = engine.generate(ids, mask, SamplingParams(max_tokens=5, temperature=0.0))
    alone, _ = engine.generate(torch.tensor([short]), torch.ones(1, len(short), dtype=torch.long),
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
