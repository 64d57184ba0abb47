"""The parity suite as pytest: every backend present x dtype x kernel against the float64 golden.

Devices that are absent are skipped with the reason their backend gives. The same code is
`portagrpo parity --device X`.
"""

import pytest
import torch

from portagrpo import algo
from portagrpo.backends import get_backend
from portagrpo.backends.base import BackendUnavailable
from portagrpo.tolerances import relative_error
from portagrpo.tools import parity

DEVICES = [pytest.param(d, marks=getattr(pytest.mark, d)) for d in ("cpu", "cuda", "rocm", "npu")]


def _backend_or_skip(device):
    try:
        return get_backend(device)
    except BackendUnavailable as err:
        pytest.skip(str(err))


def _kernels(backend):
    names = ["reference", "chunked"]
    try:
        backend.kernel_implementation("triton")
        names.append("triton")
    except BackendUnavailable:
        pass
    return names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_backend_matches_golden(device, dtype):
    backend = _backend_or_skip(device)
    if dtype == "bf16" and not backend.supports_dtype(torch.bfloat16):
        pytest.skip(f"{device} has no bf16")
    for kernel in _kernels(backend):
        chosen, rows = parity.run_parity(device, dtype, kernel)
        failed = [r for r in rows if not r.passed]
        assert not failed, parity.format_table(device, dtype, chosen, rows)


def test_fp64_on_cpu_is_the_golden():
    _, rows = parity.run_parity("cpu", "fp64", "chunked")
    assert all(r.passed for r in rows) and max(r.error for r in rows) < 1e-12


def test_regenerating_gives_the_stored_numbers(tmp_path):
    parity.regenerate(tmp_path)
    for name in (parity.SCENARIO_FILE, parity.GOLDEN_FILE):
        stored, fresh = parity.load_fixture(name), parity.load_fixture(name, tmp_path)
        assert stored.keys() == fresh.keys(), name
        for key in stored:
            assert relative_error(fresh[key], stored[key]) <= 1e-12, (name, key)


def test_golden_covers_every_stage():
    golden = parity.load_fixture(parity.GOLDEN_FILE)
    expected = {"adv/grpo", "adv/drgrpo", "logprob", "entropy", "total_loss", "grad_norm", "params_after_3_steps"}
    expected |= {f"loss_policy/{m}" for m in parity.AGG_MODES} | {f"kl/{k}" for k in parity.KL_TYPES}
    expected |= {f"rollout_is/{level}" for level in ("token", "sequence")}
    expected |= {f"loss_policy/rollout_is_{level}" for level in ("token", "sequence")}
    assert set(golden) == expected
    scenario = parity.load_fixture(parity.SCENARIO_FILE)
    scores = scenario["scores"].view(3, 4)
    assert (scores[1] == scores[1, 0]).all() and len(set(scores[0].tolist())) == 4  # tied and untied groups
    assert len(set(scenario["response_mask"].sum(1).tolist())) > 3  # ragged


def _off_by_one(hidden, weight, targets, **kw):
    """A kernel that reads the neighbouring token id: the classic shifted-label bug."""
    from portagrpo.kernels import token_logprobs_chunked

    return token_logprobs_chunked(hidden, weight, (targets + 1) % weight.shape[0], **kw)


def test_a_kernel_off_by_one_token_fails(monkeypatch, capsys):
    from portagrpo import kernels
    from portagrpo.cli import main

    monkeypatch.setitem(kernels.LOGPROB_KERNELS.mapping, "chunked", lambda: _off_by_one)
    _, rows = parity.run_parity("cpu", "fp32", "chunked")
    failed = {r.stage for r in rows if not r.passed}
    assert {"logprob", "total_loss", "grad_norm"} <= failed
    assert "adv/grpo" not in failed
    assert main(["parity", "--device", "cpu", "--kernels", "chunked"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_wrong_aggregation_fails(monkeypatch):
    # DrGRPO's normaliser forgotten: seq-mean-token-sum-norm computed as seq-mean-token-sum
    monkeypatch.setitem(algo.AGG_MODES._items, "seq-mean-token-sum-norm", algo.AGG_MODES.get("seq-mean-token-sum"))
    _, rows = parity.run_parity("cpu", "fp32", "chunked")
    failed = {r.stage for r in rows if not r.passed}
    assert failed == {"loss_policy/seq-mean-token-sum-norm"}


def test_cli_json_report(tmp_path):
    import json

    from portagrpo.cli import main

    out = tmp_path / "report.json"
    assert main(["parity", "--device", "cpu", "--dtype", "fp32", "--kernels", "reference", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    stages = len(parity.load_fixture(parity.GOLDEN_FILE))
    assert report["passed"] and report["device"] == "cpu" and len(report["stages"]) == stages
