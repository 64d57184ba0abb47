"""Checks that need the emulated device installed in their own process (PrivateUse1 is process-global).

Run as `python placement_checks.py NAME`; exits 0 when the check holds. Used by test_emulated_device.py.
"""
import sys

import torch

from portagrpo.backends import get_backend

backend = get_backend("emu")  # installs the device
DEV = backend.device(0)


def index_needs_same_device():
    """The emulated device refuses what a GPU refuses: a host index for device data."""
    data = torch.arange(6.0, device=DEV)
    try:
        data.index_select(0, torch.tensor([0, 2]))
    except RuntimeError as err:
        assert "Expected all tensors to be on the same device" in str(err)
    else:
        raise AssertionError("a CPU index was accepted for emu data")
    assert data[torch.tensor([1, 3])].cpu().tolist() == [1.0, 3.0]  # advanced indexing moves indices, as CUDA


def train_batch_select_with_host_indices():
    from portagrpo.batch import RolloutBatch, TrainBatch

    b, t = 6, 4
    rb = RolloutBatch(prompt_ids=torch.ones(b, 3, dtype=torch.long, device=DEV),
                      prompt_mask=torch.ones(b, 3, dtype=torch.long, device=DEV),
                      responses=torch.arange(b * t, device=DEV).view(b, t), response_mask=torch.ones(b, t, device=DEV),
                      uid=torch.arange(b, device=DEV), prompt_index=torch.arange(b, device=DEV), response_text=[],
                      ground_truth=[], data_source=[], extra_info=[])
    batch = TrainBatch(rb, torch.randn(b, t, device=DEV), torch.randn(b, t, device=DEV), None)
    order = torch.randperm(b, generator=torch.Generator().manual_seed(0))  # host indices, as the update makes
    part = batch.select(order[:3]).select(torch.arange(2))
    assert part.advantages.device.type == "emu"
    assert part.rollout.uid.cpu().tolist() == order[:2].tolist()


def device_rng_is_its_own():
    """Seeding the CPU alone does not fix device sampling; torch.manual_seed seeds both."""
    torch.manual_seed(1)
    a = torch.rand(4, device=DEV).cpu()
    torch.manual_seed(1)
    b = torch.rand(4, device=DEV).cpu()
    torch.manual_seed(1)
    torch.emu.manual_seed_all(99)
    c = torch.rand(4, device=DEV).cpu()
    assert torch.equal(a, b) and not torch.equal(a, c)
    try:
        torch.rand(4, device=DEV, generator=torch.Generator())
    except RuntimeError as err:
        assert "device type for generator" in str(err)
    else:
        raise AssertionError("a CPU generator was accepted for a device op")


def npu_attention_under_autocast():
    """bf16 autocast: the projections are bf16, RoPE promotes q/k back to fp32; the fused op needs one dtype."""
    from transformers import LlamaConfig, LlamaForCausalLM

    from portagrpo.backends.npu import NPU_ATTENTION, register_npu_attention

    def fused(query, key, value, head_num, layout, *, atten_mask=None, scale=1.0, keep_prob=1.0):
        if not query.dtype == key.dtype == value.dtype:
            raise RuntimeError(f"npu_fusion_attention: dtypes differ ({query.dtype}, {key.dtype}, {value.dtype})")
        scores = (query @ key.transpose(-1, -2)) * scale
        probs = torch.softmax(scores.masked_fill(atten_mask, -10000.0).float(), -1).to(value.dtype)
        return probs @ value, None

    register_npu_attention(fused_op=fused)
    cfg = LlamaConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                      num_attention_heads=4, num_key_value_heads=2)
    model = LlamaForCausalLM(cfg).to(DEV).eval()
    ids = torch.randint(3, 50, (2, 7), device=DEV)
    with torch.no_grad(), backend.autocast(torch.bfloat16):
        ref = model(input_ids=ids).logits.float().cpu()
        model.config._attn_implementation = NPU_ATTENTION
        out = model(input_ids=ids).logits.float().cpu()
    assert (out - ref).norm() / ref.norm() < 2e-2


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")
