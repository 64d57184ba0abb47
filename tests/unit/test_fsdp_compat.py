"""FSDP2 sums gradients on every supported torch: natively from 2.8, through the one private
attribute on 2.6/2.7 (the oldest CI leg runs torch 2.7.1). If a torch in that range renames the
attribute, these tests fail loudly instead of FSDP2 silently averaging."""
import pytest
import torch
import torch.distributed as dist

from portagrpo.backends import fsdp_compat

# Each check runs in its own process: FSDP2 places states by the process's registered devices, and
# another test module may have registered the emulated PrivateUse1 device in this one.
SCRIPT = """
import sys, tempfile, torch, torch.distributed as dist
from torch.distributed.fsdp import FSDPModule, fully_shard
from portagrpo.backends import fsdp_compat
dist.init_process_group("gloo", init_method="file://" + tempfile.mktemp(), rank=0, world_size=1)
model = torch.nn.Sequential(torch.nn.Linear(4, 4), torch.nn.Linear(4, 2))
fully_shard(model[0]); fully_shard(model)
units = [m for m in model.modules() if isinstance(m, FSDPModule)]
if sys.argv[1] == "sum":
    for unit in units:
        fsdp_compat.sum_gradients(unit)
    if fsdp_compat.native_sum():
        print("native")
    else:
        assert fsdp_compat.torch_minor() in fsdp_compat.PRIVATE_FALLBACK_TORCH
        ops = {str(u._get_fsdp_state()._fsdp_param_group.reduce_scatter_reduce_op) for u in units}
        model(torch.ones(3, 4)).sum().backward()  # the reduce-scatter runs with that op
        assert all(p.grad is not None for p in model.parameters())
        print("private", sorted(ops))
else:
    delattr(model._get_fsdp_state()._fsdp_param_group, "reduce_scatter_reduce_op")
    try:
        fsdp_compat.sum_gradients(model)
    except RuntimeError as err:
        print("refused:", err)
"""


def _run(mode: str) -> str:
    import subprocess
    import sys

    res = subprocess.run([sys.executable, "-c", SCRIPT, mode], capture_output=True, text=True, timeout=600)
    assert res.returncode == 0, res.stderr[-3000:]
    return res.stdout.strip().splitlines()[-1]


def test_sum_gradients_makes_every_unit_sum():
    out = _run("sum")
    if fsdp_compat.native_sum():
        assert out == "native" and fsdp_compat.fsdp2_problem() is None
    else:
        assert out == f"private {[str(dist.ReduceOp.SUM)]}"


def test_a_changed_private_attribute_fails_loudly():
    if fsdp_compat.native_sum():
        pytest.skip(f"torch {torch.__version__} sums natively; the private path is for 2.6/2.7")
    assert "changed FSDPParamGroup" in _run("changed")


def test_untested_torch_versions_and_averaging_dtypes_are_refused(monkeypatch):
    monkeypatch.setattr(fsdp_compat, "native_sum", lambda: False)
    monkeypatch.setattr(fsdp_compat, "torch_minor", lambda: (2, 7))
    assert fsdp_compat.fsdp2_problem(torch.float32) is None
    assert "averages them" in fsdp_compat.fsdp2_problem(torch.float64)
    monkeypatch.setattr(fsdp_compat, "torch_minor", lambda: (2, 5))
    assert "no tested way to sum" in fsdp_compat.fsdp2_problem(torch.float32)
