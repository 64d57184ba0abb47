"""A step's metrics, assembled in one place from what the step produced: its Experience, its
UpdateStats and its clock (`StepTimes`)."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from portagrpo.algo.advantages import zero_std_group_fraction
from portagrpo.algo.losses import masked_mean
from portagrpo.algo.rollout_correction import gap_report
from portagrpo.metrics import StepMetrics
from portagrpo.model.router_replay import route_metrics
from portagrpo.train.build import Runtime
from portagrpo.train.experience import Experience, host_metrics
from portagrpo.train.update import UpdateStats


@dataclass(frozen=True)
class StepTimes:
    """perf_counter readings: step start, generation done, rewards in, update start, step end."""

    start: float
    generated: float
    scored: float
    update: float
    end: float


def step_metrics(step: int, exp: Experience, stats: UpdateStats, times: StepTimes, runtime: Runtime) -> StepMetrics:
    rb = exp.batch.rollout
    v = _device_statistics(exp)
    took = times.end - times.start
    peak, memory = runtime.memory.take(runtime.comm, runtime.device)
    return StepMetrics(
        step=step,
        reward_mean=v["reward_mean"],
        reward_std=v["reward_std"],
        acc=v["acc"],
        score_mean=v["score_mean"],
        adv_mean=v["adv_mean"],
        adv_std=v["adv_std"],
        loss_policy=stats.loss_policy,
        loss_kl=stats.loss_kl,
        kl=stats.kl,
        entropy=stats.entropy if exp.entropy is None else v["entropy"],
        clipfrac=stats.clipfrac,
        clipfrac_lower=stats.clipfrac_lower,
        ppo_kl=stats.ppo_kl,
        ratio_mean=stats.ratio_mean,
        grad_norm=stats.grad_norm,
        response_len_mean=v["response_tokens"] / rb.size,
        prompt_len_mean=v["prompt_tokens"] / rb.size,
        response_clip_ratio=v["response_clip_ratio"],
        zero_std_group_frac=v["zero_std_group_frac"],
        reward_errors=exp.reward_errors,
        gen_rounds=exp.gen_rounds,
        rollout_staleness=exp.staleness,
        lr=stats.lr,
        time_step_s=took,
        time_gen_s=times.generated - times.start,
        time_prep_s=times.update - times.generated,
        time_reward_s=times.scored - times.generated,
        time_logprob_s=times.update - times.scored,
        time_update_s=times.end - times.update,
        response_tokens_per_s=v["response_tokens"] / took,
        tokens_per_s_per_device=(v["response_tokens"] + v["prompt_tokens"]) / (took * runtime.comm.world_size),
        mem_peak_gb=peak,
        memory=memory,
        world_size=runtime.comm.world_size,
        rollout_corr=exp.rollout_corr or _measured_in_update(exp, stats),
        rollout_metrics=exp.rollout_metrics,
        moe=route_metrics(exp.route_counts or stats.route_counts, runtime.comm),  # scoring pass's, else update's
    )


def _device_statistics(exp: Experience) -> dict[str, float]:
    """The step's statistics of its global batch, computed on the device as each was alone, read to the host at once
    (with the raw rewards, whose standard deviation is taken there in fp64: no fp32 overflow)."""
    rb, adv, raw = exp.batch.rollout, exp.batch.advantages, exp.raw_scores
    mask, trained = rb.response_mask, rb.trained_mask  # trained: the model's own tokens (multi-turn: not tools)
    adv_mean = masked_mean(adv, trained)
    parts = {"response_tokens": mask.sum(), "prompt_tokens": rb.prompt_mask.sum(), "reward_mean": raw.mean(),
             "acc": exp.correct.mean(), "score_mean": exp.scores.mean(), "adv_mean": adv_mean,
             "adv_std": masked_mean((adv - adv_mean) ** 2, trained).sqrt(),
             "response_clip_ratio": (mask.sum(dim=1) >= mask.shape[1]).float().mean(),
             "zero_std_group_frac": zero_std_group_fraction(raw, rb.uid)}
    if exp.entropy is not None:
        parts["entropy"] = masked_mean(exp.entropy, trained)
    scalars = torch.stack([t.detach().reshape(()).to(torch.float64) for t in parts.values()])
    host = torch.cat([scalars, raw.detach().reshape(-1).to(torch.float64)]).cpu()  # host read: the step's one
    out = dict(zip(parts, host[:len(parts)].tolist()))
    out["reward_std"] = float(host[len(parts):].std()) if raw.numel() > 1 else 0.0
    return out


def _measured_in_update(exp: Experience, stats: UpdateStats) -> dict[str, float] | None:
    """Without a scoring pass the trainer's log-probs come from the update's own forwards."""
    rb = exp.batch.rollout
    if stats.trainer_logp is None or rb.rollout_logp is None:
        return None
    if stats.rollout_corr is not None:  # the correction the update applied, measured from its first forward
        return stats.rollout_corr
    return host_metrics(gap_report(stats.trainer_logp, rb.rollout_logp, rb.trained_mask))
