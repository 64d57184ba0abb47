"""A vision tower's attention asked of the backend like the decoder's (Backend.vision_attention_implementation),
the NPU's variable-length (TND) adapter and the decoder adapter serving vision windows, on CPU tensors with the
simulated Ascend's npu_fusion_attention (plugins/npu_sim, loaded alone: plain torch). The same on the emulated
device and the simulated Ascend itself: tests/emulated/test_vision_tower_devices.py."""
import dataclasses
import importlib.util
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F

from portagrpo.backends import BackendUnavailable, npu_varlen
from portagrpo.backends.base import BackendSpec, BaseBackend
from portagrpo.backends.cpu import CPUBackend
from portagrpo.backends.cuda import CUDABackend
from portagrpo.backends.npu import NPU_ATTENTION, NPUBackend, npu_attention_forward, register_npu_attention
from portagrpo.backends.npu_varlen import NPU_VISION_ATTENTION, npu_varlen_attention_forward
from portagrpo.backends.probe import RuntimeProbe
from portagrpo.model.vision import vision_support_problem
from portagrpo.tolerances import assert_close

SIM = Path(__file__).resolve().parents[2] / "plugins" / "npu_sim" / "torch_npu" / "attention.py"


def _sim():
    spec = importlib.util.spec_from_file_location("npu_sim_attention_varlen", SIM)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _per_window_sdpa(q, k, v, cu, scale, causal=False):
    groups = q.shape[1] // k.shape[1]
    return torch.cat([F.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b].repeat_interleave(groups, 1), v[:, :, a:b].repeat_interleave(groups, 1),
        scale=scale, is_causal=causal).transpose(1, 2) for a, b in zip(cu, cu[1:]) if b > a], 1)


def test_the_vision_tower_attention_is_asked_of_the_backend_like_the_decoders():
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    cpu = CPUBackend()
    assert [cpu.vision_attention_implementation(r, d) for r, d in
            (("auto", torch.float32), ("auto", torch.bfloat16), ("eager", torch.float32))] == ["sdpa", "sdpa", "eager"]
    with pytest.raises(BackendUnavailable, match="flash_attention_2.*not available on --device cpu"):
        cpu.vision_attention_implementation("flash_attention_2", torch.bfloat16)  # the decoder's refusal, as it is
    fa = CUDABackend(RuntimeProbe(torch_version="2.13", hip_version=None, cuda_version="12.8",
                                  has_module=lambda m: m == "flash_attn"))
    assert fa.vision_attention_implementation("auto", torch.bfloat16) == "flash_attention_2"  # varlen by itself
    assert fa.vision_attention_implementation("auto", torch.float32) == "sdpa"
    npu = NPUBackend()
    assert npu.vision_attention_implementation("auto", torch.bfloat16) == NPU_VISION_ATTENTION
    assert npu.vision_attention_implementation(NPU_ATTENTION, torch.float32) == NPU_VISION_ATTENTION
    assert NPU_VISION_ATTENTION in ALL_ATTENTION_FUNCTIONS.valid_keys()  # registered when answered
    assert npu.vision_attention_implementation("sdpa", torch.bfloat16) == "sdpa"
    assert npu.vision_attention_implementation("auto", torch.float64) == "sdpa"
    with pytest.raises(BackendUnavailable, match=r"^model.attn_implementation=npu_fusion runs the vision tower "
                                                 r"through npu_fusion_attention, which has no float64 kernels; use "):
        npu.vision_attention_implementation(NPU_ATTENTION, torch.float64)
    with pytest.raises(BackendUnavailable, match="npu_flash_varlen.*choose one of auto, npu_fusion, sdpa, eager"):
        npu.vision_attention_implementation(NPU_VISION_ATTENTION, torch.bfloat16)  # not a decoder attention
    vendor = BaseBackend(BackendSpec(name="acme", device_type="cpu", dist_backend="gloo", default_attention="acme_attn",
                                     attention_choices=("acme_attn", "sdpa")))
    with pytest.raises(BackendUnavailable, match=r"^model.attn_implementation='auto' gives acme_attn on --device acme, "
                                                 r"which has no form for a vision tower's variable-length windows; use "
                                                 r"sdpa or eager for a vision-language policy.$"):
        vendor.vision_attention_implementation("auto", torch.float32)
    vendor.spec = dataclasses.replace(vendor.spec, vision_attention=(("acme_attn", "sdpa"),))
    assert vendor.vision_attention_implementation("auto", torch.float32) == "sdpa"


def test_npu_vision_attention_follows_the_decoder_without_masking_utils(monkeypatch):
    from portagrpo.backends import npu

    monkeypatch.setattr(npu, "transformers_has_attention_masks", lambda: False)
    assert npu.NPUBackend().vision_attention_implementation("auto", torch.bfloat16) == "sdpa"


def test_npu_decoder_adapter_attends_in_full_where_the_caller_says_not_causal():
    """transformers calls a non-flash attention once per vision window with no mask and is_causal=False (and the
    vision module's is_causal is False): full attention, not the decoder's causal default."""
    q, k, v = torch.randn(1, 4, 6, 8), torch.randn(1, 2, 6, 8), torch.randn(1, 2, 6, 8)
    vision_module = torch.nn.Module().eval()
    vision_module.is_causal = False
    full = _per_window_sdpa(q, k, v, [0, 6], 0.3)
    fused = _sim().npu_fusion_attention
    for module, kwargs in ((vision_module, {}), (torch.nn.Module().eval(), {"is_causal": False})):
        out, _ = npu_attention_forward(module, q, k, v, None, scaling=0.3, fused_op=fused, **kwargs)
        assert_close(out, full, torch.float32, "logprob")
    out, _ = npu_attention_forward(torch.nn.Module().eval(), q, k, v, None, scaling=0.3, fused_op=fused)
    assert_close(out, _per_window_sdpa(q, k, v, [0, 6], 0.3, causal=True), torch.float32, "logprob")  # decoder


def test_varlen_adapter_is_one_tnd_call_equal_to_sdpa_per_window():
    seen, sim = [], _sim()

    def recording(query, key, value, head_num, layout, **kwargs):
        seen.append((layout, tuple(query.shape), kwargs["actual_seq_qlen"], kwargs["actual_seq_kvlen"]))
        return sim.npu_fusion_attention(query, key, value, head_num, layout, **kwargs)

    cu = [0, 5, 12, 12, 20]  # an empty window among them
    q, k, v = torch.randn(1, 4, 20, 8), torch.randn(1, 2, 20, 8), torch.randn(1, 2, 20, 8)
    module = torch.nn.Module().eval()
    out, _ = npu_varlen_attention_forward(module, q, k, v, scaling=0.3, fused_op=recording, is_causal=False,
                                          cu_seq_lens_q=torch.tensor(cu, dtype=torch.int32),
                                          cu_seq_lens_k=torch.tensor(cu, dtype=torch.int32))
    assert seen == [("TND", (20, 4, 8), [5, 12, 12, 20], [5, 12, 12, 20])]
    assert_close(out, _per_window_sdpa(q, k, v, cu, 0.3), torch.float32, "logprob")
    # the one-call-per-window form transformers uses for names without "flash": each batch row one sequence
    rows = [t[0].unflatten(1, (4, 5)).transpose(0, 1).contiguous() for t in (q, k, v)]  # [4 rows, N, 5, D]
    out, _ = npu_varlen_attention_forward(module, *rows, scaling=0.3, fused_op=sim.npu_fusion_attention,
                                          is_causal=False)
    assert_close(out.flatten(0, 1)[None], _per_window_sdpa(q, k, v, [0, 5, 10, 15, 20], 0.3), torch.float32,
                 "logprob")
    padded = {"is_causal": False, "attention_mask": torch.ones(1, 1, 20, 20, dtype=torch.bool)}
    for kwargs in ({"is_causal": True}, padded, {}):  # {}: is_causal unsaid, read from a (causal) module
        with pytest.raises(NotImplementedError, match="serves a vision tower's windows"):
            npu_varlen_attention_forward(module, q, k, v, fused_op=recording, **kwargs)


def test_more_windows_than_one_call_takes_are_split_between_windows(monkeypatch):
    """The op takes at most 1024 sequences (and 1M tokens) a call in the varlen case (the simulation refuses more):
    the adapter splits between windows, never inside one."""
    sim, calls = _sim(), []

    def recording(query, key, value, head_num, layout, **kwargs):
        calls.append(len(kwargs["actual_seq_qlen"]))
        return sim.npu_fusion_attention(query, key, value, head_num, layout, **kwargs)

    lengths = [1 + i % 2 for i in range(1500)]
    cu = [0] + torch.tensor(lengths).cumsum(0).tolist()
    q, k, v = (torch.randn(1, 1, cu[-1], 4) for _ in range(3))
    cu_t = torch.tensor(cu)
    module = torch.nn.Module().eval()
    out, _ = npu_varlen_attention_forward(module, q, k, v, fused_op=recording, is_causal=False, cu_seq_lens_q=cu_t)
    assert calls == [1024, 476]
    assert_close(out, _per_window_sdpa(q, k, v, cu, 0.5), torch.float32, "logprob")
    monkeypatch.setattr(npu_varlen, "MAX_TOKENS_PER_CALL", 40)  # by tokens too
    calls.clear()
    out, _ = npu_varlen_attention_forward(module, q, k, v, fused_op=recording, is_causal=False, cu_seq_lens_q=cu_t)
    assert max(calls) <= 27 and sum(calls) == 1500  # 40 tokens hold at most 26 or 27 windows of 1 and 2
    assert_close(out, _per_window_sdpa(q, k, v, cu, 0.5), torch.float32, "logprob")
    with pytest.raises(BackendUnavailable, match=r"^a vision window of 41 tokens is longer than npu_fusion_attention "
                                                 r"takes in one sequence \(40\); use smaller images"):
        npu_varlen_attention_forward(module, q, k, v, fused_op=recording, is_causal=False,
                                     cu_seq_lens_q=torch.tensor([0, 41, cu[-1]]))


def test_simulated_tnd_refuses_what_the_documented_op_refuses():
    fused = _sim().npu_fusion_attention
    q = torch.randn(6, 2, 8)
    cases = [({"actual_seq_qlen": torch.tensor([3, 6]), "actual_seq_kvlen": [3, 6]}, TypeError, "list of ints"),
             ({"actual_seq_qlen": [3, 6]}, RuntimeError, "must be the same and cannot be empty"),
             ({"actual_seq_qlen": [3, 5], "actual_seq_kvlen": [3, 5]}, RuntimeError, "must be the number of tokens, 6"),
             ({"actual_seq_qlen": [4, 3, 6], "actual_seq_kvlen": [4, 3, 6]}, RuntimeError, "non-decreasing"),
             ({"actual_seq_qlen": [6] * 1025, "actual_seq_kvlen": [6] * 1025}, RuntimeError, "at most 1024"),
             ({"actual_seq_qlen": [3, 6], "actual_seq_kvlen": [3, 6], "sparse_mode": 5}, RuntimeError, r"\[0,5\)")]
    for kwargs, error, words in cases:
        with pytest.raises(error, match=words):
            fused(q, q, q, 2, "TND", **kwargs)
    out = fused(q, q, q, 2, "TND", actual_seq_qlen=[3, 6, 0], actual_seq_kvlen=[3, 6, 0])  # a trailing 0: left out
    assert out[0].shape == (6, 2, 8) and out[1].shape == (6, 2, 8)


def _tiny_vl(where):
    from portagrpo.config import load_config
    from portagrpo.model import vision

    processor = vision.build_tiny_processor()
    tiny = load_config(None, ["model.tiny.vision=true", "model.tiny.num_heads=2"]).model.tiny
    vision.build_tiny_vl_model(tiny, processor.tokenizer, seed=0).save_pretrained(where)
    g = torch.Generator().manual_seed(0)
    pixels = torch.randn(64 + 48 + 16, 3 * 2 * 14 * 14, generator=g)  # 8x8, 6x8 and 4x4 patch grids
    return pixels, torch.tensor([[1, 8, 8], [1, 6, 8], [1, 4, 4]])


def _features(model, pixels, grids):
    from portagrpo.model.vision import vl_body

    with torch.no_grad():
        return torch.cat(vl_body(model).get_image_features(pixels, grids, return_dict=True).pooler_output)


@pytest.mark.skipif(vision_support_problem() is not None, reason=str(vision_support_problem()))
def test_a_vl_policy_loads_with_the_backends_vision_attention_and_matches_eager(tmp_path):
    """load_model(vision_attention=...) sets the tower's attention, the language model keeps the decoder's; the
    tower on the decoder adapter (what a VL model loaded with npu_fusion alone gets: one call per window) and on
    the TND adapter gives eager's features."""
    from portagrpo.backends.npu_varlen import register_npu_vision_attention
    from portagrpo.errors import UserError
    from portagrpo.model.loading import load_model
    from portagrpo.model.vision import vision_tower
    from portagrpo.model.vision_attention import set_vision_attention

    pixels, grids = _tiny_vl(tmp_path)
    ref = load_model(tmp_path, "eager", vision_attention="eager")
    expected = _features(ref, pixels, grids)
    fused = _sim().npu_fusion_attention
    register_npu_attention(fused_op=fused)
    register_npu_vision_attention(fused_op=fused)
    for decoder, tower in ((NPU_ATTENTION, None), ("sdpa", NPU_VISION_ATTENTION), (NPU_ATTENTION, "sdpa")):
        model = load_model(tmp_path, decoder, vision_attention=tower)
        assert vision_tower(model).config._attn_implementation == (tower or decoder)
        assert model.config.text_config._attn_implementation == decoder
        assert_close(_features(model, pixels, grids), expected, torch.float32, "logprob", f"{decoder}/{tower}")
    with pytest.raises(UserError, match=r"^the vision tower's attention 'nowhere' is not registered with "
                                          r"transformers in this process; ask the backend"):
        set_vision_attention(model, "nowhere")
