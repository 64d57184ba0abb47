"""Rollout correction against verl 0.9.1's own outputs (tests/fixtures/verl_rollout_corr.pt, written by
tests/fixtures/make_verl_rollout_corr.py with verl installed), on random and adversarial inputs: huge
ratios, an all-masked row, single-token responses, NaN in the padding."""
from __future__ import annotations

import math
from pathlib import Path

import pytest
import torch

from portagrpo.algo.rollout_correction import (
    GAP_KEYS,
    PREFIX,
    RolloutCorrection,
    correct_rollout,
    gap_metrics,
    is_weights,
    rejection_mask,
)

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "verl_rollout_corr.pt"
CASES = torch.load(FIXTURE, weights_only=False)["cases"]


def _id(case) -> str:
    c = case["config"]
    return f"{case['input']}-is={c['rollout_is']}:{c['rollout_is_threshold']}:{c['rollout_is_batch_normalize']}" \
           f"-rs={c['rollout_rs']}:{c['rollout_rs_threshold']}"


def _close(a: float, b: float) -> bool:
    if math.isnan(a) or math.isnan(b):
        return math.isnan(a) and math.isnan(b)
    if math.isinf(a) or math.isinf(b):
        return a == b
    return math.isclose(a, b, rel_tol=1e-9, abs_tol=1e-12)


def test_the_fixture_covers_every_option_and_the_adversarial_inputs():
    assert torch.load(FIXTURE, weights_only=False)["verl_version"] == "0.9.1"
    inputs = {c["input"] for c in CASES}
    assert {"random", "huge_ratios", "all_masked_row", "single_token", "nan_padding"} <= inputs
    options = {o for c in CASES if c["config"]["rollout_rs"] for o in c["config"]["rollout_rs"].split(",")}
    assert len(options) == 11 and {c["config"]["rollout_is"] for c in CASES} == {None, "token", "sequence"}


@pytest.mark.parametrize("case", CASES, ids=_id)
def test_weights_mask_and_metrics_equal_verl(case):
    spec = RolloutCorrection(**case["config"])
    if "raises" in case:  # verl refuses these inputs: so must we
        with pytest.raises((ValueError, ZeroDivisionError, TypeError)):
            correct_rollout(case["old"], case["rollout"], case["mask"], spec)
        return
    weights, mask, metrics = correct_rollout(case["old"], case["rollout"], case["mask"], spec)
    if case["weights"] is None:
        assert weights is None
    else:
        assert weights is not None and weights.requires_grad is False
        assert torch.allclose(weights, case["weights"], rtol=1e-12, atol=0, equal_nan=True)
    assert torch.equal(mask, case["mask_out"]) and mask.dtype == case["mask"].dtype
    ours = {k: v for k, v in metrics.items() if k.removeprefix(PREFIX) not in GAP_KEYS}
    assert sorted(ours) == sorted(case["metrics"])
    wrong = {k: (ours[k], v) for k, v in case["metrics"].items() if not _close(ours[k], v)}
    assert not wrong


def test_rejection_never_touches_padding_and_a_sequence_option_drops_whole_rows():
    g = torch.Generator().manual_seed(3)
    mask = (torch.arange(6)[None, :] < torch.tensor([6, 3, 1, 5])[:, None]).float()
    old = -torch.rand(4, 6, generator=g, dtype=torch.float64)
    rollout = old.clone()
    rollout[1, 1] -= 4.0  # one token far off: seq_max_k2 rejects its whole row, token_k2 only that token
    seq, _ = rejection_mask(old - rollout, mask, "seq_max_k2", "1.0")
    tok, _ = rejection_mask(old - rollout, mask, "token_k2", "1.0")
    assert seq[1].sum() == 0 and torch.equal(seq[[0, 2, 3]], mask[[0, 2, 3]])
    assert tok[1].tolist() == [1, 0, 1, 0, 0, 0] and torch.equal(tok[[0, 2, 3]], mask[[0, 2, 3]])


def test_icepop_zeroes_outside_the_band_and_tis_only_truncates_above():
    log_ratio = torch.log(torch.tensor([[0.2, 0.8, 1.5, 9.0]], dtype=torch.float64))
    mask = torch.ones(1, 4, dtype=torch.float64)
    tis, _ = is_weights(log_ratio, mask, "token", 2.0)
    ice, _ = is_weights(log_ratio, mask, "token", "0.5_5.0")
    assert torch.allclose(tis, torch.tensor([[0.2, 0.8, 1.5, 2.0]], dtype=torch.float64))
    assert torch.allclose(ice, torch.tensor([[0.0, 0.8, 1.5, 0.0]], dtype=torch.float64))


def test_gap_metrics_are_zero_for_identical_policies_and_grow_with_the_gap():
    g = torch.Generator().manual_seed(5)
    old = -torch.rand(3, 5, generator=g, dtype=torch.float64)
    mask = torch.ones(3, 5, dtype=torch.float64)
    same = gap_metrics(old, old, mask)
    assert same == {"abs_logp_diff_mean": 0.0, "abs_logp_diff_max": 0.0, "eff_sample_size": pytest.approx(1.0)}
    off = gap_metrics(old, old + 0.5 * torch.randn(3, 5, generator=g, dtype=torch.float64), mask)
    assert off["abs_logp_diff_mean"] > 0.1 and off["eff_sample_size"] < 1.0
