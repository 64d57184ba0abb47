"""AdamW's step form (`BackendSpec.fused_adamw`): fused where torch builds the kernel for the device, torch's default
elsewhere, and a loaded checkpoint does not carry the saving run's form over (train/build.py: keep_step_form)."""
import types

import torch

from portagrpo.backends import get_backend
from portagrpo.config import load_config
from portagrpo.train.build import build_optimization, keep_step_form


def _optimization(fused: bool):
    models = types.SimpleNamespace(scorer=torch.nn.Linear(8, 4))  # what build_optimization reads of the Models
    return build_optimization(load_config(None, []), models, total=4, fused=fused)


def test_the_cpu_row_steps_fused_and_a_checkpoint_keeps_the_loading_runs_form():
    assert get_backend("cpu").spec.fused_adamw
    fused, plain = _optimization(True), _optimization(False)  # plain: a device whose row has no fused kernel
    assert fused.step_form == {"fused": True, "foreach": None} and plain.step_form == {"fused": None, "foreach": None}
    for opt in (fused, plain):
        for p in opt.params:
            p.grad = torch.ones_like(p)
        opt.optimizer.step()
    plain.optimizer.load_state_dict(fused.optimizer.state_dict())
    assert plain.optimizer.param_groups[0]["fused"] is True  # torch takes the saved groups' settings whole
    keep_step_form(plain.optimizer, plain.step_form)
    assert plain.optimizer.param_groups[0]["fused"] is None and plain.optimizer.param_groups[0]["foreach"] is None
    plain.optimizer.step()  # the state loaded steps on in this run's form
    state = plain.optimizer.state[plain.params[0]]
    assert int(state["step"]) == 2


def test_the_fused_step_is_adamw_to_rounding():
    """The fused kernel is the same update as torch's per-parameter loop, rounded differently in the last bit."""
    torch.manual_seed(0)
    start = [torch.randn(300, 200), torch.randn(777)]
    out = []
    for kw in ({"fused": True}, {"foreach": False}):
        params = [torch.nn.Parameter(p.clone()) for p in start]
        opt = torch.optim.AdamW(params, lr=1e-3, weight_decay=0.01, **kw)
        g = torch.Generator().manual_seed(1)
        for _ in range(5):
            for p in params:
                p.grad = torch.randn(p.shape, generator=g)
            opt.step()
        out.append(params)
    for a, b in zip(*out):
        torch.testing.assert_close(a, b, rtol=1e-6, atol=1e-8)


def test_parameters_that_live_on_the_host_step_fused_whatever_the_device_row():
    """actor.offload keeps FSDP2's shards on the host: the NPU row (no fused kernel on the device) steps them with
    torch's fused CPU kernel, not the single-tensor loop (torch's foreach list has no cpu)."""
    from portagrpo.backends.npu import NPUBackend

    npu = NPUBackend()  # its row only: no runtime is started
    assert not npu.spec.fused_adamw
    assert npu.fused_adamw_for([torch.nn.Parameter(torch.ones(2))]) is True  # offloaded: in host memory
    assert npu.fused_adamw_for([torch.nn.Parameter(torch.ones(2, device="meta"))]) is False  # on its device
    assert npu.fused_adamw_for([]) is False


def test_pin_offload_false_keeps_offloaded_shards_pageable(monkeypatch):
    """actor.pin_offload=false (issue 51): the strategy the run builds is told not to pin, whatever the row says."""
    import portagrpo.train.build as build
    from portagrpo.backends.dist import Collectives, DistEnv

    seen = {}
    monkeypatch.setattr(build, "make_strategy", lambda *a, **k: seen.update(pinned=a[3]) or (_ for _ in ()).throw(
        RuntimeError("stop here")))
    runtime = types.SimpleNamespace(backend=types.SimpleNamespace(
        parallel_strategy=lambda requested: "fsdp2", spec=types.SimpleNamespace(pinned_offload=True)),
        comm=Collectives(DistEnv(rank=0, world_size=2)))
    for pin, pinned in ((True, True), (False, False)):
        cfg = load_config(None, [f"actor.pin_offload={str(pin).lower()}", "trainer.parallel=fsdp2"])
        try:
            build.build(cfg, runtime, None, print)
        except RuntimeError:
            pass
        assert seen["pinned"] is pinned
