"""actor.use_dynamic_bsz on two ranks (gloo, CPU): the ranks run as many micro-batches as the most any rank's plan
has, in the update and in every scoring pass, so FSDP2's collectives stay matched; each mini-batch's shares are
balanced by tokens (verl's balance_batch); and the update is the fixed-micro-batch one, in fp64, on identical
rollouts (tests/distributed/dp_worker.py's)."""
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from portagrpo.tolerances import relative_error, tolerance

HERE = Path(__file__).resolve().parent
sys.path.insert(0, str(HERE))
from test_data_parallel import ENV  # noqa: E402

# Responses of 1 to 40 tokens after prompts of about 13: a 72-token budget splits each rank's share unevenly.
LONGER = ["data.max_response_length=40"]
DYNAMIC = [*LONGER, "actor.use_dynamic_bsz=true", "actor.ppo_max_token_len_per_gpu=72"]


def run(out: Path, parallel: str, *overrides: str) -> tuple[dict, list[dict]]:
    """Two ranks of dynamic_batch_worker.py: rank 0's result and each rank's micro-batch plans."""
    out.mkdir(parents=True, exist_ok=True)
    cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", "2", str(HERE / "dynamic_batch_worker.py"),
           str(out), parallel, "fp64", *overrides]
    res = subprocess.run(cmd, env=ENV, capture_output=True, text=True, timeout=600, cwd="/")
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]
    plans = [torch.load(out / f"plans_rank{r}.pt") for r in (0, 1)]
    return torch.load(out / "result.pt", weights_only=False), plans


@pytest.fixture(scope="module")
def fixed(tmp_path_factory):
    """The reference: fixed micro-batches of 2, FSDP2 reducing once per mini-batch (the deferred switch)."""
    out = tmp_path_factory.mktemp("fixed")
    return run(out, "fsdp2", *LONGER, "actor.use_no_sync_for_gradient_accumulation=true")[0]


@pytest.mark.parametrize("parallel", ["fsdp2", "ddp"])
def test_dynamic_micro_batches_on_two_ranks_give_the_fixed_update(tmp_path, fixed, parallel):
    from portagrpo.backends.fsdp_compat import fsdp2_problem

    if parallel == "fsdp2" and fsdp2_problem(torch.float64):
        pytest.skip(fsdp2_problem(torch.float64))
    dynamic, plans = run(tmp_path / "dynamic", parallel, *DYNAMIC)
    # the ranks' own scoring plans differed at least once, and both ran the larger count
    assert any(a != b for a, b in zip(plans[0]["own_scoring"], plans[1]["own_scoring"])), plans
    assert [len(p) for p in plans[0]["scoring"]] == [len(p) for p in plans[1]["scoring"]]
    for own0, own1, ran in zip(plans[0]["own_scoring"], plans[1]["own_scoring"], plans[0]["scoring"]):
        assert len(ran) == max(own0, own1)
    assert plans[0]["update"] == plans[1]["update"]
    assert all(c >= own for p in plans for c, own in zip(p["update"], p["own_update"]))
    assert max(plans[0]["update"]) > 1  # the budget really split the update
    f64 = torch.float64
    assert len(dynamic["grads"]) == len(fixed["grads"])
    for step, (g_dyn, g_fix) in enumerate(zip(dynamic["grads"], fixed["grads"])):  # every optimizer step
        for name, g in g_fix.items():
            assert relative_error(g_dyn[name], g) <= tolerance(f64, "grad"), (parallel, step, name)
    for m_dyn, m_fix in zip(dynamic["metrics"], fixed["metrics"]):
        for key in ("loss_policy", "loss_kl", "kl", "entropy", "clipfrac"):
            assert m_dyn[key] == pytest.approx(m_fix[key], rel=tolerance(f64, "loss"), abs=1e-14), (parallel, key)
        assert m_dyn["grad_norm"] == pytest.approx(m_fix["grad_norm"], rel=tolerance(f64, "grad_norm"))
    for name, p in fixed["state"].items():
        assert relative_error(dynamic["state"][name], p) <= tolerance(f64, "params"), (parallel, name)
