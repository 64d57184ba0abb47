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


def several_devices_per_process():
    """PORTAGRPO_EMU_DEVICES=3: three devices in this process, as a node's process sees its accelerators;
    each local rank binds its own, trains there (backward on any index), and devices never mix."""
    assert backend.device_count() == 3 and torch.emu.device_count() == 3
    for local_rank in (2, 1):
        backend.set_device(local_rank)
        dev = backend.device(local_rank)
        assert dev == torch.device("emu", local_rank) and torch.emu.current_device() == local_rank
        layer = torch.nn.Linear(4, 3).to(dev)
        layer(torch.randn(5, 4, device=dev)).square().sum().backward()
        assert layer.weight.grad.device == dev
        assert torch.emu.memory_allocated(local_rank) > 0
    try:
        torch.ones(2, device="emu:0") + torch.ones(2, device="emu:2")
    except RuntimeError as err:
        assert "Expected all tensors to be on the same device" in str(err)
    else:
        raise AssertionError("emu:0 and emu:2 were mixed")
    try:
        backend.device(3)
    except Exception as err:  # noqa: BLE001 - BackendUnavailable, one sentence
        assert "local rank 3 has no emu device: this process sees 3" in str(err), str(err)
    else:
        raise AssertionError("local rank 3 got a device of a 3-device process")
    # the sampler process of one_step_off: local rank r of 1 samples on device 1 + r
    assert backend.sampler_process_device(0, 1, 1) == "emu:1"


def collectives_on_the_bound_device():
    """A rank's collectives run on the device it bound: a tensor on another one is refused, as NCCL/HCCL
    communicators belong to one device."""
    import torch.distributed as dist

    backend.set_device(1)
    dist.init_process_group(backend.dist_backend, store=dist.HashStore(), rank=0, world_size=1)
    t = torch.ones(3, device="emu:1")
    dist.all_reduce(t)
    try:
        dist.all_reduce(torch.ones(3, device="emu:0"))
    except RuntimeError as err:
        assert "runs on emu:1 (set_device), got a tensor on emu:0" in str(err), str(err)
    else:
        raise AssertionError("a collective took a tensor of another device")
    dist.destroy_process_group()


if __name__ == "__main__":
    globals()[sys.argv[1]]()
    print("ok")
