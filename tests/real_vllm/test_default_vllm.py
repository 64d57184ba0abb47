"""`portagrpo train rollout.engine=vllm` on the embedded default, as the README runs it: no model setting at all. The
built-in tiny policy's heads are 32 wide (model.tiny: hidden 64, 2 heads), a size vLLM's CPU attention runs
(vllm/v1/attention/backends/cpu_attn.py: `get_supported_head_sizes`); at 16 (4 heads, the default before issue 40)
the run was refused. Two steps of the default batch (16 prompts x 8 samples) through real vLLM.
"""
from __future__ import annotations

import sys
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).resolve().parent))
from test_vllm_features import _assert_real_vllm, _sampler_matches_trainer, _train  # noqa: E402

pytestmark = pytest.mark.real_vllm


def test_the_embedded_default_trains_with_vllm_and_no_model_setting(tmp_path):
    from portagrpo.config import load_config
    from portagrpo.config.schema import TinyModelConfig

    rows, log = _train(tmp_path / "run", "trainer.total_steps=2")
    _assert_real_vllm(log)
    saved = load_config(tmp_path / "run" / "config.yaml").model
    assert saved.path is None and saved.tiny == TinyModelConfig()  # the built-in policy, as defaulted
    assert saved.tiny.hidden_size // saved.tiny.num_heads == 32
    assert [r["step"] for r in rows] == [1, 2]
    for row in rows:
        assert row["response_len_mean"] > 0
        _sampler_matches_trainer(row)
