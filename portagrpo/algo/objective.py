"""The step-level composition, in one place: reward shaping then the advantage (docs/design.md
order), and the total loss (policy + KL - entropy with the aggregation normalisers).

The trainer calls these two functions and the parity suite calls the very same ones, so the
parity suite tests the composition training runs, not a copy of it.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from portagrpo.algo.advantages import (
    ADV_ESTIMATORS,
    batch_normalize_scores,
    clip_advantages,
    clip_scores,
    kl_penalized_scores,
    scores_to_token_rewards,
    whiten_advantages,
)
from portagrpo.algo.losses import aggregate_loss, clipped_policy_loss, kl_penalty, masked_mean


@dataclass(frozen=True)
class Shaping:
    """Reward shaping and the advantage estimator (the `algorithm` section)."""

    adv_estimator: str = "grpo"
    norm_by_std: bool = True
    reward_clip: float | None = None
    shift: bool = False
    scale: bool = False
    kl_in_reward_coef: float | None = None  # None: no KL in the reward
    whiten: bool = False
    advantage_clip: float | None = None


def shape_and_advantage(scores: torch.Tensor, uid: torch.Tensor, mask: torch.Tensor, spec: Shaping, *,
                        old_logp: torch.Tensor | None = None,
                        ref_logp: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """scores [B] -> (shaped scores [B], advantages [B, T]): clip, batch shift/scale, KL in the
    reward (k1 between the sampling policy and the reference), the group estimator, whitening,
    advantage clipping."""
    if spec.reward_clip is not None:
        scores = clip_scores(scores, spec.reward_clip)
    if spec.shift or spec.scale:
        scores = batch_normalize_scores(scores, shift=spec.shift, scale=spec.scale)
    if spec.kl_in_reward_coef is not None:
        kl = kl_penalty("kl", old_logp, ref_logp)
        _, scores = kl_penalized_scores(scores_to_token_rewards(scores, mask), kl, mask, kl_coef=spec.kl_in_reward_coef)
    estimator = ADV_ESTIMATORS.get(spec.adv_estimator, field="algorithm.adv_estimator")
    adv = estimator(scores, uid, mask, norm_by_std=spec.norm_by_std)
    if spec.whiten:
        adv = whiten_advantages(adv, mask)
    if spec.advantage_clip is not None:
        adv = clip_advantages(adv, spec.advantage_clip) * mask
    return scores, adv


@dataclass(frozen=True)
class Objective:
    """The actor loss (the `actor` section)."""

    clip_low: float
    clip_high: float
    clip_c: float
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: float | None = None
    kl_loss_type: str | None = None  # None: no KL loss
    kl_loss_coef: float = 0.0
    entropy_coeff: float = 0.0


@dataclass(frozen=True)
class LossMetrics:
    """One micro-batch's loss metrics, detached 0-dim tensors. The loss terms already carry the micro-batch's share
    of its mini-batch (normalised by the mini-batch's counts), so they add up over micro-batches; the others are
    means over the micro-batch's tokens."""

    loss_policy: torch.Tensor
    ppo_kl: torch.Tensor
    clipfrac: torch.Tensor
    clipfrac_lower: torch.Tensor
    ratio_mean: torch.Tensor
    kl: torch.Tensor | None = None  # with a reference: the KL-loss estimator, or k1 without a KL loss
    loss_kl: torch.Tensor | None = None  # with a KL loss
    entropy: torch.Tensor | None = None  # set by the caller when this forward's entropy is the step's metric

    def loss_terms(self) -> dict[str, torch.Tensor]:
        """The terms that add up over micro-batches."""
        return {k: v for k, v in (("loss_policy", self.loss_policy), ("loss_kl", self.loss_kl)) if v is not None}

    def token_means(self) -> dict[str, torch.Tensor]:
        """The means over this micro-batch's tokens (a mini-batch's is their token-weighted mean)."""
        pairs = (("ppo_kl", self.ppo_kl), ("clipfrac", self.clipfrac), ("clipfrac_lower", self.clipfrac_lower),
                 ("ratio_mean", self.ratio_mean), ("kl", self.kl), ("entropy", self.entropy))
        return {k: v for k, v in pairs if v is not None}


def total_loss(logp: torch.Tensor, old_logp: torch.Tensor, advantages: torch.Tensor, mask: torch.Tensor,
               spec: Objective, *, num_tokens, num_seqs, ref_logp: torch.Tensor | None = None,
               entropy: torch.Tensor | None = None, logp_vocab: torch.Tensor | None = None,
               ref_logp_vocab: torch.Tensor | None = None,
               is_weights: torch.Tensor | None = None) -> tuple[torch.Tensor, LossMetrics]:
    """loss = policy - (KL loss: + coef x KL) - entropy_coeff x entropy, each aggregated with the
    mini-batch normalisers `num_tokens`/`num_seqs` (so micro-batches add up to the mini-batch).
    `mask` is the loss mask (rejection sampling may have removed tokens); `is_weights` (rollout
    correction, detached) multiply the clipped per-token policy loss, as in verl.
    Returns the loss and detached metrics (`kl` whenever a reference is given: the KL-loss
    estimator, or k1 without a KL loss)."""
    agg = dict(num_tokens=num_tokens, num_seqs=num_seqs, loss_scale_factor=spec.loss_scale_factor)
    pg_mat, metrics = clipped_policy_loss(logp, old_logp, advantages, mask, clip_low=spec.clip_low,
                                          clip_high=spec.clip_high, clip_c=spec.clip_c)
    if is_weights is not None:
        pg_mat = pg_mat * is_weights
    loss = aggregate_loss(pg_mat, mask, spec.loss_agg_mode, **agg)
    loss_policy, kl, loss_kl = loss.detach(), None, None
    if ref_logp is not None:
        kl_mat = kl_penalty(spec.kl_loss_type or "kl", logp, ref_logp, logp_vocab=logp_vocab,
                            ref_logp_vocab=ref_logp_vocab)
        kl = masked_mean(kl_mat, mask).detach()
        if spec.kl_loss_type is not None:
            kl_term = aggregate_loss(kl_mat, mask, spec.loss_agg_mode, **agg)
            loss = loss + spec.kl_loss_coef * kl_term
            loss_kl = kl_term.detach()
    if spec.entropy_coeff != 0:
        loss = loss - spec.entropy_coeff * aggregate_loss(entropy, mask, spec.loss_agg_mode, **agg)
    return loss, LossMetrics(loss_policy=loss_policy, kl=kl, loss_kl=loss_kl, **metrics)
