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


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")
