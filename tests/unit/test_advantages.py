"""Group advantages and reward/advantage shaping against hand values and a loop reference."""
import math
import statistics

import pytest
import torch

from portagrpo import algo
from portagrpo.algo.advantages import scores_to_token_rewards, zero_std_group_fraction


def loop_reference(scores, uid, norm_by_std, eps=1e-6):
    """Direct transcription of docs/design.md, one group at a time, in Python floats."""
    out = []
    for s, u in zip(scores, uid):
        group = [x for x, v in zip(scores, uid) if v == u]
        if len(group) < 2 or max(group) == min(group):
            out.append(0.0)
            continue
        mean = sum(group) / len(group)
        std = statistics.stdev(group)
        out.append((s - mean) / (std + eps) if norm_by_std else s - mean)
    return out


def test_hand_computed_group():
    scores = torch.tensor([1.0, 0.0, 0.0, 1.0], dtype=torch.float64)
    uid = torch.tensor([7, 7, 7, 7])
    mask = torch.ones(4, 3, dtype=torch.float64)
    adv = algo.group_advantages(scores, uid, mask, norm_by_std=True)
    # mean 0.5, unbiased std sqrt(1/3)
    expected = 0.5 / (math.sqrt(1 / 3) + 1e-6)
    assert torch.allclose(adv[:, 0], torch.tensor([expected, -expected, -expected, expected], dtype=torch.float64))
    assert torch.equal(adv[:, 0], adv[:, 2])


def test_drgrpo_is_mean_only():
    scores = torch.tensor([3.0, 1.0, 2.0, 10.0], dtype=torch.float64)
    uid = torch.tensor([0, 0, 1, 1])
    adv = algo.group_advantages(scores, uid, torch.ones(4, 1, dtype=torch.float64), norm_by_std=False)
    assert adv[:, 0].tolist() == [1.0, -1.0, -4.0, 4.0]


def test_equal_scores_and_singletons_give_exact_zero():
    scores = torch.tensor([0.1, 0.1, 0.1, 0.7, 0.3], dtype=torch.float64)
    uid = torch.tensor([0, 0, 0, 1, 2])
    adv = algo.group_advantages(scores, uid, torch.ones(5, 2, dtype=torch.float64), norm_by_std=True)
    assert torch.isfinite(adv).all()
    assert adv.abs().sum() == 0


@pytest.mark.parametrize("norm", [True, False])
def test_random_groups_match_loop_reference(norm):
    g = torch.Generator().manual_seed(3)
    uid = torch.randint(0, 6, (40,), generator=g)
    scores = torch.randint(0, 4, (40,), generator=g).double() / 3
    mask = (torch.rand(40, 5, generator=g) > 0.3).double()
    adv = algo.group_advantages(scores, uid, mask, norm_by_std=norm)
    ref = torch.tensor(loop_reference(scores.tolist(), uid.tolist(), norm), dtype=torch.float64)
    assert torch.allclose(adv, ref.unsqueeze(-1) * mask, rtol=0, atol=1e-12)


def test_mask_zeroes_padding():
    scores = torch.tensor([1.0, 0.0])
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]])
    adv = algo.group_advantages(scores, torch.tensor([0, 0]), mask)
    assert adv[0, 2] == 0 and adv[1, 1] == 0 and adv[1, 2] == 0 and adv[0, 0] > 0


def test_zero_std_group_fraction():
    scores = torch.tensor([1.0, 1.0, 0.0, 1.0])
    assert float(zero_std_group_fraction(scores, torch.tensor([0, 0, 1, 1]))) == 0.5


def test_reward_clip():
    assert algo.clip_scores(torch.tensor([-5.0, 0.5, 9.0]), 2.0).tolist() == [-2.0, 0.5, 2.0]


def test_batch_normalize_variants():
    s = torch.tensor([1.0, 2.0, 3.0, 6.0], dtype=torch.float64)
    mean, std = 3.0, statistics.stdev([1, 2, 3, 6])
    both = algo.batch_normalize_scores(s, shift=True, scale=True)
    assert torch.allclose(both, (s - mean) / (std + 1e-6))
    assert torch.allclose(algo.batch_normalize_scores(s, shift=True, scale=False), s - mean)
    assert torch.allclose(algo.batch_normalize_scores(s, shift=False, scale=True), s / (std + 1e-6))


def test_kl_in_reward_subtracts_coef_times_kl_sum():
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 0.0, 0.0]], dtype=torch.float64)
    scores = torch.tensor([1.0, 0.5], dtype=torch.float64)
    token_rewards = scores_to_token_rewards(scores, mask)
    assert token_rewards.tolist() == [[0.0, 1.0, 0.0], [0.5, 0.0, 0.0]]
    kl = torch.tensor([[0.2, 0.4, 9.0], [0.1, 9.0, 9.0]], dtype=torch.float64)
    _, shaped = algo.kl_penalized_scores(token_rewards, kl, mask, kl_coef=0.5)
    assert torch.allclose(shaped, torch.tensor([1.0 - 0.5 * 0.6, 0.5 - 0.5 * 0.1], dtype=torch.float64))


def test_whiten_advantages_masked_unbiased():
    adv = torch.tensor([[1.0, 2.0, 100.0], [3.0, 4.0, 100.0]], dtype=torch.float64)
    mask = torch.tensor([[1.0, 1.0, 0.0], [1.0, 1.0, 0.0]], dtype=torch.float64)
    out = algo.whiten_advantages(adv, mask)
    vals = [1.0, 2.0, 3.0, 4.0]
    mean, var = 2.5, statistics.variance(vals)
    expected = [(v - mean) / math.sqrt(var + 1e-8) for v in vals]
    assert torch.allclose(out[mask.bool()], torch.tensor(expected, dtype=torch.float64))
    assert (out[:, 2] == 0).all()


def test_advantage_clip():
    assert algo.clip_advantages(torch.tensor([-3.0, 0.5, 4.0]), 1.0).tolist() == [-1.0, 0.5, 1.0]
