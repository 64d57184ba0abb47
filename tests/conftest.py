"""Shared fixtures: a tiny tokenizer and a tiny saved model, both built locally."""
from __future__ import annotations

import os

# Triton kernels run on the CPU only through the interpreter, which must be chosen before any
# kernel is decorated (i.e. before portagrpo.kernels.triton_logprob is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")
# Every Ray process the tests start binds to 127.0.0.1 (Ray reads this when imported; see
# portagrpo.ray_launcher.LOOPBACK_ONLY), and needs no token for a cluster that never leaves loopback.
os.environ.setdefault("RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER", "0")
os.environ.setdefault("RAY_AUTH_MODE", "disabled")
os.environ.setdefault("RAY_USAGE_STATS_ENABLED", "0")

import pytest  # noqa: E402
import torch  # noqa: E402


@pytest.fixture(scope="session")
def tokenizer():
    from portagrpo.model.loading import build_char_tokenizer

    return build_char_tokenizer()


@pytest.fixture(scope="session")
def tiny_model_dir(tmp_path_factory, tokenizer):
    """A tiny Llama saved in Hugging Face layout by the test itself (no hub)."""
    from portagrpo.config import ModelConfig, TinyModelConfig
    from portagrpo.model.loading import build_tiny_model

    path = tmp_path_factory.mktemp("tiny_model")
    cfg = ModelConfig(tiny=TinyModelConfig(hidden_size=32, num_layers=1, num_heads=2, intermediate_size=64))
    model = build_tiny_model(cfg, tokenizer, seed=123)
    model.save_pretrained(path, safe_serialization=True)
    tokenizer.save_pretrained(path)
    return path


@pytest.fixture(autouse=True)
def _seed():
    torch.manual_seed(0)
