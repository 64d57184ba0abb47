"""The vision tower's attention as a backend answers it (`Backend.vision_attention_implementation`), on a tiny
Qwen2.5-VL: image features, response log-probs and vision-tower gradients on DEVICE (cpu, emu, or npu: the
simulated Ascend) against the eager reference (the CPU, float32). Run as `python vision_checks.py DEVICE CHECK`
(emu and npu need their device in their own process); prints ok. Used by test_vision_tower_devices.py."""
import contextlib
import functools
import io
import sys
import tempfile

import torch
from PIL import Image

from portagrpo.backends import get_backend
from portagrpo.config import load_config
from portagrpo.data.records import PromptRecord
from portagrpo.kernels import token_logprobs_reference
from portagrpo.model import vision
from portagrpo.model.loading import load_model
from portagrpo.model.scorer import ResponseScorer
from portagrpo.tolerances import assert_close, relative_error

backend = get_backend(sys.argv[1])
DEV = backend.device(0)
# 112x112: a windowed block's 4 windows of 16 patches; 112x84: windows of 16 and 8 patches; 56x56: one window
SIZES = ((112, 112), (112, 84), (56, 56))
RESPONSE = 5


def _png(size, seed) -> bytes:
    g = torch.Generator().manual_seed(seed)
    pixels = torch.randint(0, 256, (size[1], size[0], 3), generator=g, dtype=torch.uint8).numpy()
    out = io.BytesIO()
    Image.fromarray(pixels).save(out, format="PNG")
    return out.getvalue()


def _saved_model(where: str):
    """A tiny VL model and its processor, saved; its prompts with images, left-padded, and random responses."""
    tiny = load_config(None, ["model.tiny.vision=true", "model.tiny.num_heads=2"]).model.tiny
    processor = vision.build_tiny_processor()
    vision.build_tiny_vl_model(tiny, processor.tokenizer, seed=0).save_pretrained(where)
    processor.save_pretrained(where)
    records = [PromptRecord(i, [{"role": "user", "content": f"<image>what is {i}?"}], "x", "x",
                            images=(_png(size, i),)) for i, size in enumerate(SIZES)]
    ids, images = vision.vision_prompts(processor, records, "cpu")
    width = max(map(len, ids))
    prompt = torch.tensor([[processor.tokenizer.pad_token_id] * (width - len(r)) + r for r in ids])
    g = torch.Generator().manual_seed(1)
    responses = torch.randint(5, 40, (len(ids), RESPONSE), generator=g)
    mask = torch.cat([torch.tensor([[0] * (width - len(r)) + [1] * len(r) for r in ids]),
                      torch.ones(len(ids), RESPONSE, dtype=torch.long)], 1)
    return torch.cat([prompt, responses], 1), mask, responses, images


def _run(model, batch, autocast=contextlib.nullcontext, device=None):
    """(image features, response log-probs) of `model` on `batch` (moved to `device`, DEV by default), through
    the trainer's scorer."""
    ids, mask, responses, images = (t.to(device or DEV) for t in batch)
    pixels, grids = images.take(images.distinct())
    with autocast():
        features = torch.cat(vision.vl_body(model).get_image_features(pixels, grids, return_dict=True).pooler_output)
    logp = ResponseScorer(model, token_logprobs_reference)(ids, mask, responses, torch.ones_like(responses).bool(),
                                                           1.0, False, False, autocast=autocast, images=images)[0]
    return features, logp


def _tower_grads(model) -> torch.Tensor:
    return torch.cat([p.grad.flatten().cpu() for p in vision.vision_tower(model).blocks.parameters()])


def features_and_logprobs_match_eager():
    """fp32 and bf16 (autocast) on DEVICE with the backend's decoder and vision attention, against eager in fp32 on
    the CPU: features and log-probs within the dtype's log-prob tolerance, fp32 vision gradients within its grad
    tolerance."""
    with tempfile.TemporaryDirectory() as where:
        batch = _saved_model(where)
        ref = load_model(where, "eager", vision_attention="eager")
        assert vision.vision_tower(ref).config._attn_implementation == "eager"
        ref_features, ref_logp = _run(ref, batch, device="cpu")
        ref_logp.sum().backward()
        ref_grads = _tower_grads(ref)
        for dtype in (torch.float32, torch.bfloat16):
            attn = backend.attention_implementation("auto", dtype)
            chosen = backend.vision_attention_implementation("auto", dtype)
            model = load_model(where, attn, vision_attention=chosen).to(DEV)
            assert vision.vision_tower(model).config._attn_implementation == chosen
            assert model.config.text_config._attn_implementation == attn
            features, logp = _run(model, batch, functools.partial(backend.autocast, dtype))
            assert features.device.type == DEV.type
            what = f"{backend.name} {chosen} {dtype}"
            print(what, "features", relative_error(features.float().cpu(), ref_features),
                  "log-probs", relative_error(logp.float().cpu(), ref_logp))
            assert_close(features.float().cpu(), ref_features, dtype, "logprob", f"features ({what})")
            assert_close(logp.float().cpu(), ref_logp, dtype, "logprob", f"log-probs ({what})")
            if dtype == torch.float32:
                logp.sum().backward()
                assert_close(_tower_grads(model), ref_grads, dtype, "grad", f"vision gradients ({what})")
        print(f"{backend.name}: vision attention {backend.vision_attention_implementation('auto', torch.float32)}")


def _recording_fused_op(seen: list):
    """torch_npu.npu_fusion_attention replaced by one that records its layout and cumulative lengths (npu only)."""
    import torch_npu

    fused = torch_npu.npu_fusion_attention

    def recording(query, key, value, head_num, input_layout, **kwargs):
        seen.append((input_layout, kwargs.get("actual_seq_qlen"), kwargs.get("actual_seq_kvlen"), query.device.type))
        return fused(query, key, value, head_num, input_layout, **kwargs)

    torch_npu.npu_fusion_attention = recording
    return fused


def windows_in_one_tnd_call():
    """Each vision block is one TND call for all its windows, the op's cumulative lengths (host lists) are the
    cu_seqlens the block was given (variable-length windows in the windowed block, one per image in the full one),
    and changing one image changes no other image's features (no attention across a cu_seqlens boundary)."""
    seen, windows = [], []
    _recording_fused_op(seen)
    chosen = backend.vision_attention_implementation("auto", torch.float32)
    with tempfile.TemporaryDirectory() as where:
        ids, mask, responses, images = _saved_model(where)
        model = load_model(where, backend.attention_implementation("auto", torch.float32),
                           vision_attention=chosen).to(DEV).eval()
    tower = vision.vision_tower(model)
    for block in tower.blocks:
        block.register_forward_pre_hook(lambda m, a, kw: windows.append(kw["cu_seqlens"].cpu().tolist()),
                                        with_kwargs=True)
    pixels, grids = images.to(DEV).take([0, 1, 2])
    with torch.no_grad():
        features = vision.vl_body(model).get_image_features(pixels, grids, return_dict=True).pooler_output
    assert [s[0] for s in seen] == ["TND"] * len(tower.blocks), seen  # one call per block, not per window
    assert [s[1] for s in seen] == [s[2] for s in seen] == [cu[1:] for cu in windows], (seen, windows)
    assert all(type(x) is int for s in seen for x in s[1]) and {s[3] for s in seen} == {"npu"}
    windowed, full = (windows[i] for i in (0, 1))  # blocks 0 (windowed) and 1 (fullatt_block_indexes=[1])
    assert full == [0, 64, 112, 128] and len(windowed) > len(full)
    assert len({b - a for a, b in zip(windowed, windowed[1:])}) > 1, windowed  # windows of different lengths
    other = pixels.clone()
    other[64:112] += 1.0  # the second image's patches
    with torch.no_grad():
        changed = vision.vl_body(model).get_image_features(other, grids, return_dict=True).pooler_output
    assert torch.equal(changed[0].cpu(), features[0].cpu()) and torch.equal(changed[2].cpu(), features[2].cpu())
    assert not torch.allclose(changed[1].cpu(), features[1].cpu(), atol=1e-3)


def varlen_adapter_equals_sdpa_per_window():
    """The backend's registered vision attention on the device against plain sdpa run window by window (CPU,
    float32), in fp32 and bf16; a change to one window's keys and values changes no other window's output."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    chosen = backend.vision_attention_implementation("auto", torch.bfloat16)
    attend = ALL_ATTENTION_FUNCTIONS[chosen]
    cu = [0, 16, 32, 40, 41, 64, 100]
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, cu[-1], 16, generator=g) for _ in range(3))
    module = torch.nn.Module().eval()
    ref = torch.cat([torch.nn.functional.scaled_dot_product_attention(
        q[:, :, a:b], k[:, :, a:b], v[:, :, a:b], scale=0.25).transpose(1, 2) for a, b in zip(cu, cu[1:])], 1)

    def run(q, k, v, dtype):
        cu_dev = torch.tensor(cu, dtype=torch.int32, device=DEV)
        out, _ = attend(module, *(t.to(DEV, dtype) for t in (q, k, v)), attention_mask=None, scaling=0.25,
                        cu_seq_lens_q=cu_dev, cu_seq_lens_k=cu_dev, is_causal=False)
        return out.float().cpu()

    for dtype in (torch.float32, torch.bfloat16):
        out = run(q, k, v, dtype)
        assert out.shape == ref.shape
        # attention outputs from bf16 inputs carry their rounding, as log-probs do: the log-prob bound
        assert_close(out, ref, dtype, "logprob", f"{chosen} vs sdpa per window ({dtype})")
    k2, v2 = k.clone(), v.clone()
    k2[:, :, 16:32] += 3.0
    v2[:, :, 16:32] -= 3.0
    moved = run(q, k2, v2, torch.float32)
    same = torch.ones(cu[-1], dtype=torch.bool)
    same[16:32] = False
    assert torch.equal(moved[:, same], run(q, k, v, torch.float32)[:, same])
    assert (moved[:, 16:32] - ref[:, 16:32]).abs().max() > 0.1


def installed_op_refuses_what_the_wrapper_refuses():
    """The installed stand-in refuses q/k/v off the NPU (the wrapper's "only npu tensor is supported") and
    cumulative lengths given as a tensor (the op takes host lists)."""
    import torch_npu

    q = torch.randn(6, 2, 8)
    lengths = {"actual_seq_qlen": [3, 6], "actual_seq_kvlen": [3, 6]}
    for args, kwargs, error, words in (((q, q, q), lengths, RuntimeError, "only npu tensor is supported"),
                                       ((q.to(DEV),) * 3, {**lengths, "actual_seq_qlen": torch.tensor([3, 6])},
                                        TypeError, "list of ints")):
        try:
            torch_npu.npu_fusion_attention(*args, 2, "TND", **kwargs)
        except error as err:
            assert words in str(err), str(err)
        else:
            raise AssertionError(f"accepted: {words}")
    out = torch_npu.npu_fusion_attention(*(q.to(DEV),) * 3, 2, "TND", **lengths)
    assert out[0].device.type == "npu" and out[1].shape == (6, 2, 8)


if __name__ == "__main__":
    globals()[sys.argv[2]]()
    print("ok")
