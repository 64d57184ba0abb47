"""A step's metrics, assembled in one place from what the step produced: its Experience, its
UpdateStats and its clock (`StepTimes`)."""
from __future__ import annotations

from dataclasses import dataclass

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
    rb, adv, raw = exp.batch.rollout, exp.batch.advantages, exp.raw_scores
    mask, trained = rb.response_mask, rb.trained_mask  # trained: the model's own tokens (multi-turn: not tools)
    resp_tokens = float(mask.sum())
    prompt_tokens = float(rb.prompt_mask.sum())
    took = times.end - times.start
    peak, memory = runtime.memory.take(runtime.comm, runtime.device)
    adv_mean = masked_mean(adv, trained)
    return StepMetrics(
        step=step,
        reward_mean=float(raw.mean()),
        reward_std=float(raw.detach().cpu().double().std()) if raw.numel() > 1 else 0.0,  # no fp32 overflow
        acc=float(exp.correct.mean()),
        score_mean=float(exp.scores.mean()),
        adv_mean=float(adv_mean),
        adv_std=float(masked_mean((adv - adv_mean) ** 2, trained).sqrt()),
        loss_policy=stats.loss_policy,
        loss_kl=stats.loss_kl,
        kl=stats.kl,
        entropy=stats.entropy if exp.entropy is None else float(masked_mean(exp.entropy, trained)),
        clipfrac=stats.clipfrac,
        clipfrac_lower=stats.clipfrac_lower,
        ppo_kl=stats.ppo_kl,
        ratio_mean=stats.ratio_mean,
        grad_norm=stats.grad_norm,
        response_len_mean=resp_tokens / rb.size,
        prompt_len_mean=prompt_tokens / rb.size,
        response_clip_ratio=float((mask.sum(dim=1) >= mask.shape[1]).float().mean()),
        zero_std_group_frac=float(zero_std_group_fraction(raw, rb.uid)),
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
        response_tokens_per_s=resp_tokens / took,
        tokens_per_s_per_device=(resp_tokens + prompt_tokens) / (took * runtime.comm.world_size),
        mem_peak_gb=peak,
        memory=memory,
        world_size=runtime.comm.world_size,
        rollout_corr=exp.rollout_corr or _measured_in_update(exp, stats),
        rollout_metrics=exp.rollout_metrics,
        moe=route_metrics(exp.route_counts or stats.route_counts, runtime.comm),  # scoring pass's, else update's
    )


def _measured_in_update(exp: Experience, stats: UpdateStats) -> dict[str, float] | None:
    """Without a scoring pass the trainer's log-probs come from the update's own forwards."""
    rb = exp.batch.rollout
    if stats.trainer_logp is None or rb.rollout_logp is None:
        return None
    if stats.rollout_corr is not None:  # the correction the update applied, measured from its first forward
        return stats.rollout_corr
    return host_metrics(gap_report(stats.trainer_logp, rb.rollout_logp, rb.trained_mask))
