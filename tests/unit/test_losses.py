"""Policy loss, KL estimators, aggregation modes and entropy against hand values and fp64 references."""
import math

import pytest
import torch

from portagrpo import algo
from portagrpo.algo.losses import kl_type_names, masked_mean

CLIP = dict(clip_low=0.2, clip_high=0.28, clip_c=3.0)


def test_clipped_loss_hand_values():
    old = torch.zeros(1, 4, dtype=torch.float64)
    # ratios: 1.5 (clipped high for A>0), 0.5 (clipped low for A<0), 1.1 (inside), 10 (dual clip for A<0)
    logp = torch.log(torch.tensor([[1.5, 0.5, 1.1, 10.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0, 2.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 4, dtype=torch.float64)
    loss, m = algo.clipped_policy_loss(logp, old, adv, mask, **CLIP)
    # token 0: L1=-1.5, L2=-1.28 -> max = -1.28
    # token 1: L1=0.5, L2=0.8 -> max=0.8; dual clip min(0.8, 3) = 0.8
    # token 2: L1=L2=-2.2
    # token 3: L1=10, L2=1.28 -> Lclip=10; dual clip -> 3
    assert torch.allclose(loss, torch.tensor([[-1.28, 0.8, -2.2, 3.0]], dtype=torch.float64))
    assert math.isclose(float(m["clipfrac"]), 2 / 4)  # tokens 0 and 1 have L2 > L1
    assert math.isclose(float(m["clipfrac_lower"]), 1 / 4)


def test_dual_clip_acts_only_where_advantage_negative():
    old = torch.zeros(1, 2, dtype=torch.float64)
    logp = torch.log(torch.tensor([[50.0, 50.0]], dtype=torch.float64))
    adv = torch.tensor([[1.0, -1.0]], dtype=torch.float64)
    mask = torch.ones(1, 2, dtype=torch.float64)
    with_dual, _ = algo.clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=3.0)
    wide, _ = algo.clipped_policy_loss(logp, old, adv, mask, clip_low=0.2, clip_high=0.2, clip_c=1e9)
    assert with_dual[0, 0] == wide[0, 0]  # A > 0: untouched by the dual clip
    assert with_dual[0, 1] == 3.0 and math.isclose(float(wide[0, 1]), 50.0, rel_tol=1e-12)


def test_log_ratio_is_clamped():
    logp = torch.tensor([[100.0]], dtype=torch.float64)
    loss, m = algo.clipped_policy_loss(
        logp, torch.zeros(1, 1, dtype=torch.float64), torch.ones(1, 1, dtype=torch.float64), torch.ones(1, 1), **CLIP
    )
    assert torch.isfinite(loss).all() and math.isclose(float(m["ratio_mean"]), math.exp(20), rel_tol=1e-12)


def test_ppo_kl_metric_is_mean_negative_log_ratio():
    logp = torch.tensor([[0.1, 0.3, 9.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0]])
    _, m = algo.clipped_policy_loss(logp, torch.zeros_like(logp), torch.ones_like(logp), mask, **CLIP)
    assert math.isclose(float(m["ppo_kl"]), -0.2, rel_tol=1e-12)


def test_clip_c_must_exceed_one():
    x = torch.zeros(1, 1)
    with pytest.raises(ValueError):
        algo.clipped_policy_loss(x, x, x, x, clip_low=0.2, clip_high=0.2, clip_c=1.0)


# ---------------------------------------------------------------- KL

X = torch.tensor([-2.0, -0.5, 0.0, 0.7, 3.0], dtype=torch.float64)


@pytest.mark.parametrize(
    "name,expected",
    [
        ("kl", X),
        ("k1", X),
        ("abs", X.abs()),
        ("mse", 0.5 * X * X),
        ("k2", 0.5 * X * X),
        ("low_var_kl", torch.exp(-X) + X - 1),
        ("k3", torch.exp(-X) + X - 1),
    ],
)
def test_kl_estimator_values(name, expected):
    out = algo.kl_penalty(name, X, torch.zeros_like(X))
    assert torch.allclose(out, expected.clamp(-10, 10) if name in ("k3", "low_var_kl") else expected, atol=1e-12)


def test_k3_clamps():
    out = algo.kl_penalty("k3", torch.tensor([-30.0], dtype=torch.float64), torch.zeros(1, dtype=torch.float64))
    assert float(out) == 10.0


@pytest.mark.parametrize("base", ["kl", "abs", "k3", "low_var_kl", "k2"])
def test_straight_through_value_of_estimator_gradient_of_k2(base):
    logp = X.clone().requires_grad_(True)
    ref = torch.zeros_like(X)
    value = algo.kl_penalty(base + "+", logp, ref)
    assert torch.allclose(value.detach(), algo.kl_penalty(base, X, ref))
    value.sum().backward()
    assert torch.allclose(logp.grad, X)  # d/dx of x^2/2


def test_full_kl_matches_definition_and_straight_through():
    g = torch.Generator().manual_seed(1)
    zp = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    zr = torch.randn(2, 3, 7, generator=g, dtype=torch.float64)
    lp, lr = zp.log_softmax(-1), zr.log_softmax(-1)
    full = algo.full_kl(lp, lr)
    manual = sum(lp[..., v].exp() * (lp[..., v] - lr[..., v]) for v in range(7))
    assert torch.allclose(full, manual) and (full >= 0).all()
    tok = torch.tensor([[1, 2, 3], [0, 6, 5]])
    logp = lp.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    ref = lr.gather(-1, tok.unsqueeze(-1)).squeeze(-1)
    out = algo.kl_penalty("full", logp, ref, logp_vocab=lp, ref_logp_vocab=lr)
    assert torch.allclose(out, full)
    st = algo.kl_penalty("full+", logp, ref, logp_vocab=lp, ref_logp_vocab=lr)
    assert torch.allclose(st, full)


def test_kl_type_names_cover_plus_forms():
    names = kl_type_names()
    for n in ("k1", "k3+", "low_var_kl+", "full", "full+", "mse+"):
        assert n in names


# ---------------------------------------------------------------- aggregation

M = torch.tensor([[1.0, 2.0, 3.0, 4.0], [5.0, 6.0, 0.0, 0.0], [7.0, 0.0, 0.0, 0.0]], dtype=torch.float64)
MASK = torch.tensor([[1, 1, 1, 1], [1, 1, 0, 0], [0, 0, 0, 0]], dtype=torch.float64)


@pytest.mark.parametrize(
    "mode,expected",
    [
        ("token-mean", (1 + 2 + 3 + 4 + 5 + 6) / 6),
        ("seq-mean-token-sum", (10 + 11) / 2),  # the empty row is not a sequence
        ("seq-mean-token-mean", (10 / 4 + 11 / 2) / 2),
        ("seq-mean-token-sum-norm", (10 + 11) / (2 * 8)),
    ],
)
def test_aggregation_hand_values(mode, expected):
    out = algo.aggregate_loss(M, MASK, mode, loss_scale_factor=8)
    assert math.isclose(float(out), expected, rel_tol=1e-12)


def test_unknown_mode_names_field():
    with pytest.raises(ValueError, match="actor.loss_agg_mode"):
        algo.aggregate_loss(M, MASK, "token_mean")


def _loss_for(params, x, mask, mode, num_tokens=None, num_seqs=None):
    """A per-token loss that depends on the parameters: quadratic in a linear map."""
    per_token = ((x @ params) ** 2).sum(-1)  # [B, T]
    return algo.aggregate_loss(per_token, mask, mode, num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=6.0)


@pytest.mark.parametrize("mode", ["token-mean", "seq-mean-token-sum", "seq-mean-token-mean", "seq-mean-token-sum-norm"])
@pytest.mark.parametrize("micro", [1, 2, 4])
def test_micro_batch_accumulation_equals_one_mini_batch(mode, micro):
    g = torch.Generator().manual_seed(11)
    x = torch.randn(8, 6, 3, generator=g, dtype=torch.float64)
    lengths = torch.tensor([6, 1, 3, 0, 5, 2, 6, 4])
    mask = (torch.arange(6).unsqueeze(0) < lengths.unsqueeze(1)).double()
    w0 = torch.randn(3, 2, generator=g, dtype=torch.float64)

    full = w0.clone().requires_grad_(True)
    _loss_for(full, x, mask, mode).backward()

    acc = w0.clone().requires_grad_(True)
    n_tok, n_seq = algo.loss_normalizers(mask)
    total = 0.0
    for idx in torch.arange(8).split(micro):
        loss = _loss_for(acc, x[idx], mask[idx], mode, num_tokens=n_tok, num_seqs=n_seq)
        loss.backward()
        total += float(loss.detach())
    assert torch.allclose(acc.grad, full.grad, rtol=1e-13, atol=1e-15)
    assert math.isclose(total, float(_loss_for(w0, x, mask, mode)), rel_tol=1e-13)


def test_local_normalisers_differ_from_global():
    """Guard: with per-micro-batch normalisers, accumulation would NOT match (why globals exist)."""
    x = torch.randn(4, 5, 3, dtype=torch.float64)
    mask = torch.tensor([[1, 1, 1, 1, 1], [1, 0, 0, 0, 0], [1, 1, 0, 0, 0], [1, 1, 1, 0, 0]], dtype=torch.float64)
    w = torch.randn(3, 2, dtype=torch.float64)
    whole = float(_loss_for(w, x, mask, "token-mean"))
    local = sum(float(_loss_for(w, x[i:i + 2], mask[i:i + 2], "token-mean")) for i in (0, 2))
    assert not math.isclose(whole, local, rel_tol=1e-6)


# ---------------------------------------------------------------- entropy


def test_entropy_matches_definition():
    z = torch.randn(3, 5, 11, dtype=torch.float64)
    p = z.softmax(-1)
    expected = -(p * p.log()).sum(-1)
    assert torch.allclose(algo.entropy_from_logits(z), expected, atol=1e-12)
    uniform = torch.zeros(1, 8, dtype=torch.float64)
    assert math.isclose(float(algo.entropy_from_logits(uniform)), math.log(8), rel_tol=1e-12)


def test_masked_mean():
    assert float(masked_mean(torch.tensor([[1.0, 3.0, 100.0]]), torch.tensor([[1, 1, 0]]))) == 2.0
