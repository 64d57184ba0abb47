"""Rollout correction: the sampler's policy is not exactly the trainer's (another program, another
dtype, truncated sampling), so its samples are reweighted (importance sampling, `rollout_is`),
filtered (rejection sampling, `rollout_rs`) and the gap is measured (`rollout_corr/*` metrics).

Semantics are verl 0.9.1's `compute_rollout_correction_and_rejection_mask`
(`verl/trainer/ppo/rollout_corr_helper.py`), the parity suite holds its outputs, and
`tests/unit/test_rollout_correction.py` compares them on random and adversarial inputs:

- `log_ratio = old_logp - rollout_logp` (log pi_train / pi_rollout); every log-ratio that is
  exponentiated is clamped to +-20 first.
- IS weights, token level: exp(clamped per-token log-ratio); sequence level: exp(clamped *sum*
  over the sequence's tokens), the same for every token of it. A number U as the threshold truncates
  from above (TIS); a pair (L, U) zeroes weights outside [L, U] (IcePop). Weights are detached; batch
  normalisation divides by their mean over valid tokens (token level) or sequences (sequence level).
- Rejection options (comma-separated, all must pass): token_k1/k2/k3, seq_sum_k1/k2/k3,
  seq_mean_k1/k2/k3, seq_max_k2/k3, with k1 = -log_ratio, k2 = log_ratio^2 / 2,
  k3 = exp(log_ratio) - 1 - log_ratio. A rejected sequence option removes the whole sequence from
  the loss mask; the response mask (attention) is never touched.

Everything is a pure function of tensors and numbers: verl's threshold strings ("0.5_5.0", "2.0,1.0") are
parsed, strictly, by the config (`config/bounds.py: correction_bounds`), never here. Metrics come back as detached
0-dim tensors and nothing here reads a value to the host (STYLE rule 1): the caller reads a batch's metrics once
and hands them to `refusal`, which says why a batch cannot be corrected (verl raises there).
"""
from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Mapping, Optional, Union

import torch

SAFETY_BOUND = 20.0
RS_OPTIONS = ("token_k1", "token_k2", "token_k3", "seq_sum_k1", "seq_sum_k2", "seq_sum_k3", "seq_mean_k1",
              "seq_mean_k2", "seq_mean_k3", "seq_max_k2", "seq_max_k3")
PREFIX = "rollout_corr/"


IsThreshold = Union[float, tuple[float, float]]  # U: TIS upper bound; (L, U): IcePop band
RsBounds = tuple[tuple[str, Optional[float], float], ...]  # (option, lower, upper); lower None for k2/k3


@dataclass(frozen=True)
class RolloutCorrection:
    """`algorithm.rollout_correction` (verl's keys and meanings), its bounds parsed into numbers."""

    rollout_is: str | None = None  # None | "token" | "sequence"
    rollout_is_threshold: IsThreshold | None = 2.0
    rollout_is_batch_normalize: bool = False
    rollout_rs: RsBounds = ()  # rejection options (RS_OPTIONS) with their bounds; () is off
    bypass_mode: bool = False  # old log-probs := the sampler's (no separate scoring pass)

    @property
    def reweights(self) -> bool:
        return self.rollout_is is not None and self.rollout_is_threshold is not None

    @property
    def active(self) -> bool:
        return self.reweights or len(self.rollout_rs) > 0


Metrics = dict[str, torch.Tensor]  # name -> detached 0-dim tensor


def _detached(metrics: Metrics) -> Metrics:
    return {k: v.detach() for k, v in metrics.items()}


def _zero(like: torch.Tensor) -> torch.Tensor:
    return torch.zeros((), dtype=like.dtype, device=like.device)


def _sum(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Sum over valid entries; whatever sits at masked positions (NaN, inf) is dropped."""
    m = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    kept = torch.where(mask.bool(), x, torch.zeros_like(x)) * m
    return kept.sum() if dim is None else kept.sum(dim)


def _mean(x: torch.Tensor, mask: torch.Tensor, dim=None) -> torch.Tensor:
    """Mean over valid entries (an empty row gives 0)."""
    m = mask.to(x.dtype) if mask.dtype == torch.bool else mask
    return _sum(x, mask, dim) / ((m.sum() if dim is None else m.sum(dim)) + 1e-8)


# Statistics over the entries a bool `valid` selects, each 0 where it selects none: what indexing `x[valid]` and
# asking `.numel()` gave, without a data-dependent shape (no host sync).
def _masked_mean(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    n = valid.sum()
    return torch.where(n > 0, _sum(x, valid) / n.clamp(min=1), _zero(x))


def _masked_std(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    """The unbiased standard deviation (0 for <= 1 entry)."""
    n = valid.sum()
    centered = torch.where(valid, x - _masked_mean(x, valid), torch.zeros_like(x))
    return torch.where(n > 1, (centered.square().sum() / (n - 1).clamp(min=1)).sqrt(), _zero(x))


def _masked_max(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    top = torch.where(valid, x, torch.full_like(x, -float("inf"))).max()
    return torch.where(valid.any(), top, _zero(x))


def _masked_min(x: torch.Tensor, valid: torch.Tensor) -> torch.Tensor:
    bottom = torch.where(valid, x, torch.full_like(x, float("inf"))).min()
    return torch.where(valid.any(), bottom, _zero(x))


def _spread(values: torch.Tensor, mask: torch.Tensor, low: float, high: float) -> torch.Tensor:
    """Population standard deviation of `values` clamped to [low, high] over valid entries (0 for <= 1 entry)."""
    c = values.clamp(min=low, max=high)
    std = torch.sqrt(torch.clamp(_mean(c.square(), mask) - _mean(c, mask).square(), min=0.0))
    return torch.where(mask.sum() <= 1, _zero(std), std)


def _fraction(flags: torch.Tensor) -> torch.Tensor:
    """The share of True entries, averaged in fp32 as verl's `.float().mean()` does (0 of none)."""
    return flags.float().mean() if flags.numel() else torch.zeros((), device=flags.device)


def _is_bounds(threshold) -> tuple[float, float | None]:
    """(upper, lower) of an IS threshold: a number U (TIS, no lower bound) or a pair (L, U) (IcePop)."""
    if isinstance(threshold, tuple) and len(threshold) == 2:
        return threshold[1], threshold[0]
    if isinstance(threshold, (int, float)) and not isinstance(threshold, bool):
        return threshold, None
    raise TypeError(f"rollout_is_threshold={threshold!r}: pass a number or a (lower, upper) pair (the config parses "
                    f"verl's strings, config/bounds.py: is_threshold).")


def is_weights(log_ratio: torch.Tensor, mask: torch.Tensor, level: str, threshold: IsThreshold,
               batch_normalize: bool = False) -> tuple[torch.Tensor, Metrics]:
    """Truncated importance weights [B, T] (detached) and their metrics; `threshold` U truncates above (TIS),
    (L, U) zeroes the weights outside [L, U] (IcePop)."""
    if level not in ("token", "sequence"):
        raise ValueError(f"algorithm.rollout_correction.rollout_is={level!r} must be 'token' or 'sequence'.")
    upper, lower = _is_bounds(threshold)
    m = mask.to(log_ratio.dtype)
    if level == "token":
        stat = log_ratio
        raw = torch.exp(log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND))
    else:
        stat = _sum(log_ratio, mask, -1).unsqueeze(-1)
        raw = torch.exp(stat.clamp(-SAFETY_BOUND, SAFETY_BOUND)).expand_as(log_ratio)
    raw = raw * m
    if lower is None:
        weights = raw.clamp(max=upper)
    else:
        weights = torch.where((raw >= lower) & (raw <= upper), raw, torch.zeros_like(raw))
    metrics = _is_metrics(weights, raw, stat, mask, level, upper, lower)
    if lower is not None:
        metrics["rollout_is_oob_ratio"] = _mean(((raw < lower) | (raw > upper)).to(raw.dtype), mask)
    weights = weights.detach()
    if batch_normalize:
        if level == "token":
            mean = _mean(weights, mask)
        else:
            per_seq = _mean(weights, mask, -1)
            valid = (m.sum(-1) > 0).to(weights.dtype)
            mean = (per_seq * valid).sum() / valid.sum().clamp(min=1e-8)
        factor = torch.where(mean > 1e-8, mean, torch.ones_like(mean))  # NaN is not: the weights stay as they are
        weights = weights / factor
        metrics["rollout_is_batch_norm_factor"] = factor
    return weights, _detached(metrics)


def _is_metrics(w: torch.Tensor, raw: torch.Tensor, stat: torch.Tensor, mask: torch.Tensor, level: str,
                upper: float, lower: float | None) -> Metrics:
    low = lower if lower is not None else 1.0 / upper
    valid = mask.bool()
    out = {"rollout_is_mean": _mean(w, mask)}
    if level == "token":
        out["rollout_is_max"] = _masked_max(w, valid)
        out["rollout_is_min"] = _masked_min(w, valid)
        out["rollout_is_ratio_fraction_high"] = _mean((raw > upper).to(w.dtype), mask)
        out["rollout_is_ratio_fraction_low"] = _mean((raw < low).to(w.dtype), mask)
    else:
        s = stat.squeeze(-1)
        out["rollout_is_max"] = torch.exp(s.max().clamp(max=SAFETY_BOUND))
        out["rollout_is_min"] = torch.exp(s.min())
        out["rollout_is_ratio_fraction_high"] = _fraction(s > math.log(upper))
        out["rollout_is_ratio_fraction_low"] = _fraction(s < math.log(low))
    out["rollout_is_std"] = _spread(w, mask, 0.0, upper)
    c = w.clamp(min=0.0, max=upper)
    normalized = c / (_mean(c, mask) + 1e-8)
    # in fp64, as the host read it: 1 / 0 = inf where IcePop zeroed every weight (verl divides by zero; `refusal`)
    out["rollout_is_eff_sample_size"] = 1.0 / _mean(normalized.square(), mask).double()
    seq = _mean(w, mask, -1)
    out["rollout_is_seq_mean"] = seq.mean()
    out["rollout_is_seq_std"] = seq.std() if seq.numel() > 1 else _zero(seq)
    out["rollout_is_seq_max"] = seq.max()
    out["rollout_is_seq_min"] = seq.min()
    out["rollout_is_seq_max_deviation"] = (seq - 1.0).abs().max()
    raw_seq = _mean(raw, mask, -1)
    out["rollout_is_seq_fraction_high"] = _fraction(raw_seq > upper)
    out["rollout_is_seq_fraction_low"] = _fraction(raw_seq < low)
    return out


def _divergence(name: str, lr: torch.Tensor) -> torch.Tensor:
    if name.endswith("k1"):
        return -lr
    if name.endswith("k2"):
        return 0.5 * lr.square()
    return torch.exp(lr) - 1.0 - lr


def rejection_mask(log_ratio: torch.Tensor, mask: torch.Tensor, bounds: RsBounds) -> tuple[torch.Tensor, Metrics]:
    """The loss mask with rejected tokens (or whole sequences) set to 0, and per-option metrics. `bounds`:
    (option, lower, upper) per option; k1 options bound the ratio to [lower, upper], k2/k3 options their
    divergence to at most `upper` (lower None)."""
    unknown = [b[0] for b in bounds if b[0] not in RS_OPTIONS]
    if unknown:
        raise ValueError(f"rejection options {unknown} are unknown; use {', '.join(RS_OPTIONS)}.")
    lr = log_ratio.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    valid = mask.bool()
    valid_rows = valid.any(-1)
    keep_all = torch.ones_like(lr)
    metrics: Metrics = {}
    for name, lower, upper in bounds:
        k1 = name.endswith("k1")
        lo, hi = (math.log(lower), math.log(upper)) if k1 else (0.0, upper)
        div = _divergence(name, lr)
        if name.startswith("token_"):
            stat, per_seq = div, None
        elif name.startswith("seq_sum_"):
            per_seq = _sum(div, mask, -1)
        elif name.startswith("seq_mean_"):
            per_seq = _mean(div, mask, -1)
        else:
            per_seq = torch.where(valid, div, torch.full_like(div, -float("inf"))).max(-1).values
            per_seq = torch.where(valid_rows, per_seq, torch.zeros_like(per_seq))
        if per_seq is not None:
            stat = per_seq.unsqueeze(-1).expand_as(div)
        keep = (stat >= lo) & (stat <= hi) if k1 else stat <= hi
        keep_all = keep_all * keep.to(lr.dtype)
        metrics.update(_rs_metrics(f"rollout_rs_{name}", stat, per_seq, keep, mask, lo, hi, k1))
    metrics["rollout_rs_masked_fraction"] = _mean(1.0 - keep_all, mask)
    rejected_row = ((keep_all == 0) & valid).any(-1)
    metrics["rollout_rs_seq_masked_fraction"] = _fraction(rejected_row)
    return (mask * keep_all).to(mask.dtype), _detached(metrics)


def _rs_metrics(p: str, stat: torch.Tensor, per_seq: torch.Tensor | None, keep: torch.Tensor, mask: torch.Tensor,
                lo: float, hi: float, k1: bool) -> Metrics:
    valid = mask.bool()
    rows = valid.any(-1)  # the `_seq_*` statistics are over the sequences with a valid token
    seq = _mean(stat, mask, -1) if per_seq is None else per_seq
    if per_seq is None:  # token level: over valid tokens
        high, low = _mean((stat > hi).float(), mask), _mean((stat < lo).float(), mask) if k1 else None
        top, bottom = _masked_max(stat, valid), _masked_min(stat, valid)
    else:
        high, low = _masked_mean((seq > hi).float(), rows), _masked_mean((seq < lo).float(), rows) if k1 else None
        top, bottom = _masked_max(seq, rows), _masked_min(seq, rows)
    out = {f"{p}_mean": _mean(stat, mask), f"{p}_max": top, f"{p}_min": bottom, f"{p}_fraction_high": high,
           f"{p}_fraction_low": _zero(high) if low is None else low,
           f"{p}_std": _spread(stat, mask, lo if k1 else 0.0, hi),
           f"{p}_seq_mean": _masked_mean(seq, rows), f"{p}_seq_std": _masked_std(seq, rows),
           f"{p}_seq_max": _masked_max(seq, rows), f"{p}_seq_min": _masked_min(seq, rows),
           f"{p}_seq_max_deviation": _masked_max(seq.abs(), rows),
           f"{p}_seq_fraction_high": _masked_mean((seq > hi).float(), rows)}
    if k1:
        out[f"{p}_seq_fraction_low"] = _masked_mean((seq < lo).float(), rows)
    out[f"{p}_masked_fraction"] = _mean((~keep).to(stat.dtype), mask)
    rows_hit = ((~keep) & valid).any(-1)
    out[f"{p}_seq_masked_fraction"] = _masked_mean(rows_hit.to(stat.dtype), rows)
    return out


def mismatch_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor | None, mask: torch.Tensor) -> Metrics:
    """How far the sampler's policy is from the trainer's (verl's off-policy metrics, unprefixed)."""
    lp_t = old_logp
    mlp_t = _mean(lp_t, mask, -1)
    out = {"training_ppl": torch.exp(-mlp_t).mean(), "training_log_ppl": (-mlp_t).mean()}
    if rollout_logp is None:
        return _detached(out)
    lp_r = rollout_logp
    mlp_r = _mean(lp_r, mask, -1)
    lr = lp_t - lp_r
    diff = mlp_r - mlp_t
    lrc = lr.clamp(-SAFETY_BOUND, SAFETY_BOUND)
    out.update({
        "kl": _mean(lp_r - lp_t, mask),
        "k3_kl": _mean(torch.exp(lr) - lr - 1.0, mask),
        "rollout_ppl": torch.exp(-mlp_r).mean(),
        "rollout_log_ppl": (-mlp_r).mean(),
        "log_ppl_diff": diff.mean(),
        "log_ppl_abs_diff": diff.abs().mean(),
        "log_ppl_diff_max": diff.max(),
        "log_ppl_diff_min": diff.min(),
        "ppl_ratio": torch.exp(diff).mean(),
        # the "- 1" in fp64, as verl takes it on the host
        "chi2_token": _mean(torch.exp(lrc).square(), mask).double() - 1.0,
        "chi2_seq": torch.exp(2.0 * _sum(lr, mask, -1).clamp(-SAFETY_BOUND, SAFETY_BOUND)).mean().double() - 1.0,
    })
    return _detached(out)


# portagrpo's own, beside verl's: the plain per-token gap and an effective sample size that exists
# whether or not importance weights are on (verl reports its ESS only with rollout_is).
GAP_KEYS = ("abs_logp_diff_mean", "abs_logp_diff_max", "eff_sample_size")


def gap_metrics(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """|old - rollout| log-prob per token (mean, max) and the normalised ESS of the token ratios, in (0, 1]
    (inf, 1 / 0 in fp64, for a batch without a valid token)."""
    gap = torch.where(mask.bool(), (old_logp - rollout_logp).abs(), torch.zeros_like(old_logp))
    ratio = torch.exp((old_logp - rollout_logp).clamp(-SAFETY_BOUND, SAFETY_BOUND))
    normalized = ratio / (_mean(ratio, mask) + 1e-8)
    return _detached({"abs_logp_diff_mean": _mean(gap, mask), "abs_logp_diff_max": gap.max(),
                      "eff_sample_size": 1.0 / _mean(normalized.square(), mask).double()})


def gap_report(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor) -> Metrics:
    """The `rollout_corr/*` metrics of a batch without correction: verl's off-policy set and the gap."""
    out = {**mismatch_metrics(old_logp, rollout_logp, mask), **gap_metrics(old_logp, rollout_logp, mask)}
    return {PREFIX + k: v for k, v in out.items()}


def correct_rollout(old_logp: torch.Tensor, rollout_logp: torch.Tensor, mask: torch.Tensor,
                    spec: RolloutCorrection) -> tuple[torch.Tensor | None, torch.Tensor, Metrics]:
    """(IS weights [B, T] or None, loss mask [B, T], `rollout_corr/*` metrics) for one batch. Whether the batch
    can be corrected at all is read from the metrics on the host: `refusal`."""
    if old_logp.shape != rollout_logp.shape or old_logp.shape != mask.shape:
        raise ValueError(f"rollout correction: shapes differ ({tuple(old_logp.shape)}, {tuple(rollout_logp.shape)}, "
                         f"{tuple(mask.shape)}).")
    log_ratio = old_logp - rollout_logp
    metrics: Metrics = {}
    weights = None
    if spec.reweights:
        weights, m = is_weights(log_ratio, mask, spec.rollout_is, spec.rollout_is_threshold,
                                spec.rollout_is_batch_normalize)
        metrics.update(m)
    loss_mask = mask.clone()
    if spec.rollout_rs:
        loss_mask, m = rejection_mask(log_ratio, mask, spec.rollout_rs)
        metrics.update(m)
    metrics.update(mismatch_metrics(old_logp, rollout_logp, mask))
    metrics.update(gap_metrics(old_logp, rollout_logp, mask))
    return weights, loss_mask, {PREFIX + k: v for k, v in metrics.items()}


def refusal(metrics: Mapping[str, float], spec: RolloutCorrection) -> str | None:
    """Why a corrected batch cannot be trained on, read from its `rollout_corr/*` metrics once the caller has them
    on the host; None when it can (and always for a batch only measured, `spec` inactive). An infinite effective
    sample size is a batch with no weight left: no valid token, or every importance weight outside IcePop's band
    (where verl divides by zero)."""
    if not spec.active:
        return None
    if metrics.get(PREFIX + "eff_sample_size") == math.inf:
        return "rollout correction needs at least one valid token."
    if metrics.get(PREFIX + "rollout_is_eff_sample_size") == math.inf:
        upper, lower = _is_bounds(spec.rollout_is_threshold)
        return (f"algorithm.rollout_correction.rollout_is_threshold: every importance weight of the batch is outside "
                f"[{lower}, {upper}] (IcePop set them all to 0); widen the bounds.")
    return None
