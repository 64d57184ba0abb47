"""The rollout copy's attention is chosen at the dtype the copy computes in (issue 31 item 4): with
model.dtype=bf16, flash-attention serves a one_step_off or rollout.precision=bf16 copy, and an fp32 copy
that cannot run it is one sentence naming rollout.precision."""
from types import SimpleNamespace

import pytest

from portagrpo.backends.cuda import CUDABackend
from portagrpo.backends.probe import RuntimeProbe
from portagrpo.config import load_config
from portagrpo.errors import UserError
from portagrpo.rollout.sampler_copy import CopySource
from portagrpo.rollout.settings import EngineSettings


class _Devices:
    def is_available(self):
        return True

    def device_count(self):
        return 2


def _cuda(flash_attn=True):
    modules = ("flash_attn",) if flash_attn else ()
    return CUDABackend(RuntimeProbe(torch_version="9.9.9", cuda_version="12.8", has_module=lambda m: m in modules,
                                    device_module=lambda t: _Devices()))


POLICY = SimpleNamespace(config=SimpleNamespace(tie_word_embeddings=False))


def _source(tmp_path, *overrides, backend=None):
    cfg = load_config(None, ["model.dtype=bf16", "model.attn_implementation=flash_attention_2", *overrides])
    return CopySource.of(EngineSettings.from_config(cfg), backend or _cuda(), POLICY, tmp_path / "init_model")


@pytest.mark.parametrize("overrides", [["rollout.mode=one_step_off"], ["rollout.precision=bf16"],
                                       ["rollout.mode=one_step_off", "rollout.precision=bf16"]],
                         ids=["one_step_off", "precision-bf16", "both"])
def test_flash_attention_serves_a_bf16_copy(tmp_path, overrides):
    assert _source(tmp_path, *overrides).attn == "flash_attention_2"


@pytest.mark.parametrize("precision", ["fp32", "int8"])
def test_an_fp32_copy_refuses_flash_attention_naming_rollout_precision(tmp_path, precision):
    with pytest.raises(UserError, match=rf"computes in float32 \(rollout.precision={precision}\); use "
                                        r"rollout.precision=bf16"):
        _source(tmp_path, f"rollout.precision={precision}")


def test_a_missing_flash_attn_package_is_still_its_own_reason(tmp_path):
    with pytest.raises(UserError, match="needs the flash_attn package"):
        _source(tmp_path, "rollout.precision=fp32", backend=_cuda(flash_attn=False))


def test_auto_attention_of_a_bf16_copy_is_flash_attention(tmp_path):
    cfg = load_config(None, ["model.dtype=bf16", "rollout.mode=one_step_off"])
    assert CopySource.of(EngineSettings.from_config(cfg), _cuda(), POLICY, tmp_path).attn == "flash_attention_2"
    cfg = load_config(None, ["model.dtype=bf16", "rollout.precision=fp32"])
    assert CopySource.of(EngineSettings.from_config(cfg), _cuda(), POLICY, tmp_path).attn == "sdpa"
