"""Shared fixtures: a tiny tokenizer and a tiny saved model, both built locally."""
from __future__ import annotations

import os

# Triton kernels run on the CPU only through the interpreter, which must be chosen before any
# kernel is decorated (i.e. before portagrpo.kernels.triton_logprob is imported).
os.environ.setdefault("TRITON_INTERPRET", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")

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
