"""Policy loss, KL estimators, loss aggregation and entropy as pure tensor functions.

Shapes: `B` responses, `T` response tokens, `mask: [B, T]` is 1 on response tokens.
Metrics come back as detached 0-d tensors; the loop decides when to synchronise.
"""
from __future__ import annotations

from typing import Protocol

import torch

from portagrpo.errors import UnknownNameError
from portagrpo.registry import Registry

LOG_RATIO_CLAMP = 20.0
K3_CLAMP = 10.0


def masked_mean(x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    m = mask.to(x.dtype)
    return (x * m).sum() / m.sum().clamp(min=1)


def clipped_policy_loss(
    logp: torch.Tensor,
    old_logp: torch.Tensor,
    advantages: torch.Tensor,
    mask: torch.Tensor,
    *,
    clip_low: float,
    clip_high: float,
    clip_c: float,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """PPO clipped surrogate with dual clip, per token.

    logp, old_logp, advantages, mask: [B, T]. Returns (loss matrix [B, T], metrics).
    `d = clamp(logp - old_logp, -20, 20)`, `r = exp(d)`, `L1 = -A r`,
    `L2 = -A clamp(r, 1 - clip_low, 1 + clip_high)`, `Lclip = max(L1, L2)`;
    where `A < 0`: `L = min(Lclip, -A clip_c)`.
    """
    if clip_c <= 1.0:
        raise ValueError(f"clip_c must be > 1, got {clip_c}")
    d = (logp - old_logp).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    ratio = torch.exp(d)
    l1 = -advantages * ratio
    l2 = -advantages * ratio.clamp(1.0 - clip_low, 1.0 + clip_high)
    lclip = torch.maximum(l1, l2)
    l3 = -advantages * clip_c
    negative = advantages < 0
    loss = torch.where(negative, torch.minimum(lclip, l3), lclip)
    with torch.no_grad():
        metrics = {
            "ppo_kl": masked_mean(-d, mask).detach(),
            "clipfrac": masked_mean((l2 > l1).to(logp.dtype), mask).detach(),
            "clipfrac_lower": masked_mean(((lclip > l3) & negative).to(logp.dtype), mask).detach(),
            "ratio_mean": masked_mean(ratio, mask).detach(),
        }
    return loss, metrics


# ---------------------------------------------------------------- KL estimators


class KLEstimator(Protocol):
    def __call__(self, x: torch.Tensor) -> torch.Tensor: ...


KL_ESTIMATORS: Registry[KLEstimator] = Registry("KL estimator")


@KL_ESTIMATORS.register("kl", "k1")
def kl_k1(x: torch.Tensor) -> torch.Tensor:
    """x = logp - ref_logp, per token."""
    return x


@KL_ESTIMATORS.register("abs")
def kl_abs(x: torch.Tensor) -> torch.Tensor:
    return x.abs()


@KL_ESTIMATORS.register("mse", "k2")
def kl_k2(x: torch.Tensor) -> torch.Tensor:
    return 0.5 * x * x


@KL_ESTIMATORS.register("low_var_kl", "k3")
def kl_k3(x: torch.Tensor) -> torch.Tensor:
    y = (-x).clamp(-LOG_RATIO_CLAMP, LOG_RATIO_CLAMP)
    return (torch.exp(y) - y - 1.0).clamp(-K3_CLAMP, K3_CLAMP)


FULL_KL = "full"


def full_kl(logp_vocab: torch.Tensor, ref_logp_vocab: torch.Tensor) -> torch.Tensor:
    """Exact KL(pi || ref) per token from full log-distributions [..., V]. Returns [...]."""
    p = logp_vocab.exp()
    return (p * (logp_vocab - ref_logp_vocab)).sum(-1)


def kl_type_names() -> list[str]:
    base = KL_ESTIMATORS.names() + [FULL_KL]
    return base + [n + "+" for n in base]


def parse_kl_type(name: str) -> tuple[str, bool]:
    """Split `k3+` into (`k3`, True); validate the base name."""
    straight_through = name.endswith("+")
    base = name[:-1] if straight_through else name
    if base != FULL_KL and base not in KL_ESTIMATORS:
        raise UnknownNameError(
            f"actor.kl_loss_type={name!r} is not a known KL estimator; use one of "
            f"{', '.join(KL_ESTIMATORS.names() + [FULL_KL])}, optionally with a '+' suffix (e.g. k3+)."
        )
    return base, straight_through


def kl_penalty(
    name: str,
    logp: torch.Tensor,
    ref_logp: torch.Tensor,
    *,
    logp_vocab: torch.Tensor | None = None,
    ref_logp_vocab: torch.Tensor | None = None,
) -> torch.Tensor:
    """Per-token KL estimate [B, T] by estimator name (`k1`, `k3+`, `full`, ...).

    `full` needs the full log-distributions `logp_vocab`, `ref_logp_vocab`: [B, T, V].
    A `+` suffix keeps the estimator's value with k2's gradient (straight-through).
    """
    base, straight_through = parse_kl_type(name)
    x = logp - ref_logp
    if base == FULL_KL:
        if logp_vocab is None or ref_logp_vocab is None:
            raise ValueError("kl_loss_type 'full' needs logp_vocab and ref_logp_vocab")
        value = full_kl(logp_vocab, ref_logp_vocab)
    else:
        value = KL_ESTIMATORS.get(base)(x)
    if not straight_through:
        return value
    k2 = kl_k2(x)
    return k2 + (value - k2).detach()


# ---------------------------------------------------------------- aggregation


def loss_normalizers(mask: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(number of response tokens, number of sequences with at least one token) of mask [B, T]."""
    m = mask.to(torch.float64)
    return m.sum(), (m.sum(-1) > 0).to(torch.float64).sum()


class Aggregator(Protocol):
    def __call__(
        self, loss_mat: torch.Tensor, mask: torch.Tensor, *, num_tokens: torch.Tensor, num_seqs: torch.Tensor,
        loss_scale_factor: float | None,
    ) -> torch.Tensor: ...


AGG_MODES: Registry[Aggregator] = Registry("loss aggregation mode")


@AGG_MODES.register("token-mean")
def agg_token_mean(loss_mat, mask, *, num_tokens, num_seqs, loss_scale_factor):
    return (loss_mat * mask).sum() / num_tokens


@AGG_MODES.register("seq-mean-token-sum")
def agg_seq_mean_token_sum(loss_mat, mask, *, num_tokens, num_seqs, loss_scale_factor):
    return (loss_mat * mask).sum() / num_seqs


@AGG_MODES.register("seq-mean-token-mean")
def agg_seq_mean_token_mean(loss_mat, mask, *, num_tokens, num_seqs, loss_scale_factor):
    per_seq_tokens = mask.sum(-1)
    per_seq = (loss_mat * mask).sum(-1) / per_seq_tokens.clamp(min=1)
    return per_seq.sum() / num_seqs


@AGG_MODES.register("seq-mean-token-sum-norm")
def agg_seq_mean_token_sum_norm(loss_mat, mask, *, num_tokens, num_seqs, loss_scale_factor):
    if loss_scale_factor is None:
        raise ValueError("seq-mean-token-sum-norm needs loss_scale_factor (default: the max response length)")
    return (loss_mat * mask).sum() / (num_seqs * loss_scale_factor)


def aggregate_loss(
    loss_mat: torch.Tensor,
    mask: torch.Tensor,
    mode: str,
    *,
    num_tokens: torch.Tensor | float | None = None,
    num_seqs: torch.Tensor | float | None = None,
    loss_scale_factor: float | None = None,
) -> torch.Tensor:
    """Reduce a per-token loss matrix [B, T] to a scalar by `mode`.

    `num_tokens` and `num_seqs` are the counts of the whole mini-batch (across micro-batches
    and ranks); summing the micro-batch results then equals the mini-batch result exactly.
    When omitted they are those of `mask` itself.
    """
    agg = AGG_MODES.get(mode, field="actor.loss_agg_mode")
    local_tokens, local_seqs = loss_normalizers(mask)
    n_tok = local_tokens if num_tokens is None else num_tokens
    n_seq = local_seqs if num_seqs is None else num_seqs
    m = mask.to(loss_mat.dtype)
    n_tok = torch.as_tensor(n_tok, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
    n_seq = torch.as_tensor(n_seq, dtype=loss_mat.dtype, device=loss_mat.device).clamp(min=1)
    return agg(loss_mat, m, num_tokens=n_tok, num_seqs=n_seq, loss_scale_factor=loss_scale_factor)


# ---------------------------------------------------------------- entropy


def entropy_from_logits(logits: torch.Tensor) -> torch.Tensor:
    """Per-token entropy [...] of logits [..., V]: `logsumexp(z) - sum(softmax(z) z)`."""
    lse = torch.logsumexp(logits, dim=-1)
    return lse - (torch.softmax(logits, dim=-1) * logits).sum(-1)
