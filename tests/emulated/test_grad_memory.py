"""The lean update on two emulated ranks (FSDP2): by default every micro-batch's backward reduce-scatters, so a rank
holds only its shard of the gradients between micro-batches; actor.use_no_sync_for_gradient_accumulation=true
defers the reduce-scatter to a mini-batch's last micro-batch and holds the whole model's unsharded fp32 gradients
(4 bytes a parameter, on every rank) in between. The emulated device counts each rank's bytes
(tests/emulated/grad_memory_check.py); docs/config.md quotes these numbers."""
import json
import subprocess
import sys

import pytest
from test_emulated_device import ENV, HERE, pytestmark  # noqa: F401 - the same skip rule

OPTIMIZER_STEPS = 2  # 16 responses, mini-batches of 8


def held(tmp_path, defer: bool) -> dict:
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(HERE / "grad_memory_check.py"),
           str(tmp_path / "run"), f"actor.use_no_sync_for_gradient_accumulation={str(defer).lower()}"]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd=tmp_path)
    assert res.returncode == 0, res.stdout[-2000:] + res.stderr[-3000:]
    return json.loads(res.stdout.strip().splitlines()[-1])


@pytest.fixture(scope="module")
def runs(tmp_path_factory):
    return {defer: held(tmp_path_factory.mktemp(f"defer-{defer}"), defer) for defer in (False, True)}


def test_lean_update_holds_a_shard_of_the_gradients(runs):
    lean, deferred = runs[False], runs[True]
    whole = 4 * lean["parameters"]  # fp32 gradients of every parameter
    assert deferred["held_grad_bytes"][-1] == pytest.approx(whole, rel=0.01), deferred  # all of them, unsharded
    assert lean["held_grad_bytes"][-1] <= 0.51 * whole, lean  # its half of them (dim-0 shards, padded)
    assert max(lean["held_grad_bytes"]) < min(deferred["held_grad_bytes"])
    assert lean["update_peak_mib"] < deferred["update_peak_mib"], (lean, deferred)


def test_lean_update_reduce_scatters_every_micro_batch(runs):
    """One reduce-scatter per FSDP unit (the decoder layers and the root) per micro-batch by default; per optimizer
    step when deferred."""
    lean, deferred = runs[False], runs[True]
    units = lean["layers"] + 1
    assert lean["micro_batches"] == deferred["micro_batches"] == 4 * OPTIMIZER_STEPS
    assert lean["reduce_scatters"] == units * lean["micro_batches"]
    assert deferred["reduce_scatters"] == units * OPTIMIZER_STEPS
