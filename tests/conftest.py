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
# Under pytest-xdist (the README's `pytest -n auto`) each worker is one of several test processes on the
# machine: it computes with one thread, and so do the processes its tests start (a second thread beside other
# busy processes slows every one of them down many-fold on a 2-core machine).
XDIST_WORKER = os.environ.get("PYTEST_XDIST_WORKER")
if XDIST_WORKER:
    os.environ["OMP_NUM_THREADS"] = "1"

import pytest  # noqa: E402
import torch  # noqa: E402

if XDIST_WORKER:
    torch.set_num_threads(1)
# `--dist loadfile` keeps a file's tests on one worker, one after another: a module's fixtures are made once (the
# stack check builds portagrpo's wheel in the source tree's build/ folder, which two builds at once would share).
# (pytest-xdist 3.8's `loadgroup` names groups through an attribute pytest 9 no longer reads: it groups nothing.)


@pytest.hookimpl(optionalhook=True)  # pytest-xdist's hook: a machine without it (the hardware check's) runs serially
def pytest_xdist_auto_num_workers(config):
    """`-n auto`: one worker per core, at most 4 (a test may start two ranks of its own)."""
    return max(1, min(os.cpu_count() or 1, 4))


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
