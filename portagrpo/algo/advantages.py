"""Scores to advantages: group advantages and the optional shaping steps.

Every function is pure: tensors in, tensors out, no config, no device calls, no `.item()`.
Shapes: `B` responses, `T` response tokens, `mask: [B, T]` is 1 on response tokens.
"""
from __future__ import annotations

from typing import Protocol

import torch

from portagrpo.registry import Registry

ADV_EPS = 1e-6
WHITEN_EPS = 1e-8


class AdvantageEstimator(Protocol):
    def __call__(
        self, scores: torch.Tensor, uid: torch.Tensor, mask: torch.Tensor, *, norm_by_std: bool, eps: float = ADV_EPS
    ) -> torch.Tensor: ...


ADV_ESTIMATORS: Registry[AdvantageEstimator] = Registry("advantage estimator")


def _groups(scores: torch.Tensor, uid: torch.Tensor) -> tuple[torch.Tensor, int, torch.Tensor]:
    """(group index [B], number of groups, tied [G]: whether a group's scores are all equal)."""
    ids, group = torch.unique(uid, return_inverse=True)
    num_groups = ids.shape[0]  # group indices are 0..G-1, every one used: no read of group.max() needed
    gmax = torch.full((num_groups,), float("-inf"), dtype=scores.dtype, device=scores.device)
    gmin = torch.full((num_groups,), float("inf"), dtype=scores.dtype, device=scores.device)
    gmax = gmax.scatter_reduce(0, group, scores, reduce="amax")
    gmin = gmin.scatter_reduce(0, group, scores, reduce="amin")
    return group, num_groups, gmax == gmin


@ADV_ESTIMATORS.register("grpo")
def group_advantages(
    scores: torch.Tensor, uid: torch.Tensor, mask: torch.Tensor, *, norm_by_std: bool = True, eps: float = ADV_EPS
) -> torch.Tensor:
    """GRPO group-relative advantage, broadcast over response tokens.

    scores: [B] sequence scores; uid: [B] integer group ids; mask: [B, T].
    Returns advantages [B, T] (already multiplied by the mask).
    `A_i = (s_i - mean_g) / (std_g + eps)` with the unbiased std, or `s_i - mean_g` when
    `norm_by_std` is False (DrGRPO). Groups of one and groups of equal scores give 0.
    """
    group, num_groups, tied = _groups(scores, uid)
    dtype = scores.dtype
    count = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, group, torch.ones_like(scores))
    total = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, group, scores)
    mean = total / count
    centered = scores - mean[group]
    # The variance is taken of centered/scale (scale = the group's largest |centered|), so squares
    # cannot overflow however large the rewards are (1e30 squared is inf in fp32); same formula.
    scale = torch.zeros(num_groups, dtype=dtype, device=scores.device).scatter_reduce(
        0, group, centered.abs(), reduce="amax")
    safe = torch.where(scale > 0, scale, torch.ones_like(scale))
    unit = centered / safe[group]
    sq = torch.zeros(num_groups, dtype=dtype, device=scores.device).index_add_(0, group, unit * unit)
    unit_std = (sq / (count - 1).clamp(min=1)).sqrt()  # std / scale
    # Ties and singletons carry no signal: force an exact 0 instead of rounding noise / NaN.
    no_signal = (count < 2) | tied
    adv = unit / (unit_std[group] + eps / safe[group]) if norm_by_std else centered
    adv = torch.where(no_signal[group], torch.zeros_like(adv), adv)
    return adv.unsqueeze(-1) * mask.to(dtype)


def zero_std_group_fraction(scores: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """Fraction of groups whose scores are all equal (no learning signal). scores, uid: [B]."""
    return _groups(scores, uid)[2].to(scores.dtype).mean()


def groups_with_spread(values: torch.Tensor, uid: torch.Tensor) -> torch.Tensor:
    """[B] bool: the response's group has more than one distinct value (DAPO keeps only those groups)."""
    group, _, tied = _groups(values, uid)
    return ~tied[group]


def overlong_penalty(response_lengths: torch.Tensor, max_length: int, buffer: int, factor: float) -> torch.Tensor:
    """DAPO's soft overlong punishment per response: 0 up to max_length - buffer tokens, then falling
    linearly to -factor at max_length (verl's DAPO reward manager)."""
    exceed = response_lengths.to(torch.float32) - (max_length - buffer)
    return torch.clamp(-exceed / buffer * factor, max=0.0)


def clip_scores(scores: torch.Tensor, clip: float) -> torch.Tensor:
    """`reward_clip`: clamp scores [B] to [-clip, clip]."""
    return scores.clamp(-clip, clip)


def batch_normalize_scores(
    scores: torch.Tensor, *, shift: bool, scale: bool, eps: float = ADV_EPS
) -> torch.Tensor:
    """`reward_norm: batch` (shift and scale), or `reward_shift` / `reward_scale` alone. scores: [B].

    The std is the unbiased one; a batch of one is returned unchanged by the scale step.
    """
    out = scores
    if shift:
        out = out - scores.mean()
    if scale and scores.numel() > 1:
        size = (scores - scores.mean()).abs().max()  # std of scores/size: no overflow for huge rewards
        size = torch.where(size > 0, size, torch.ones_like(size))
        out = out / ((scores / size).std(unbiased=True) * size + eps)
    return out


def kl_penalized_scores(
    token_rewards: torch.Tensor, kl: torch.Tensor, mask: torch.Tensor, *, kl_coef: float
) -> tuple[torch.Tensor, torch.Tensor]:
    """`use_kl_in_reward`: subtract `kl_coef * kl_t` from every response token's reward.

    token_rewards, kl, mask: [B, T]. Returns (token_rewards' [B, T], scores' [B]) with
    `scores' = sum_t r_t - kl_coef * sum_t kl_t`.
    """
    m = mask.to(token_rewards.dtype)
    shaped = (token_rewards - kl_coef * kl.to(token_rewards.dtype)) * m
    return shaped, shaped.sum(-1)


def whiten_advantages(adv: torch.Tensor, mask: torch.Tensor, eps: float = WHITEN_EPS) -> torch.Tensor:
    """Standardise advantages [B, T] over all response tokens (masked, unbiased variance)."""
    m = mask.to(adv.dtype)
    n = m.sum()
    mean = (adv * m).sum() / n
    var = (((adv - mean) ** 2) * m).sum() / (n - 1).clamp(min=1)
    return (adv - mean) * torch.rsqrt(var + eps) * m


def clip_advantages(adv: torch.Tensor, clip: float) -> torch.Tensor:
    """`advantage_clip`: clamp advantages to [-clip, clip]."""
    return adv.clamp(-clip, clip)


def scores_to_token_rewards(scores: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Place each sequence score [B] on its last response token, giving token rewards [B, T]."""
    m = mask.to(scores.dtype)
    length = m.sum(-1).long()
    last = (length - 1).clamp(min=0)
    out = torch.zeros_like(m)
    out.scatter_(1, last.unsqueeze(-1), scores.unsqueeze(-1))
    return out * m
