"""One step's experience: the rollout pipeline's scored global batch (`ScoredRollout`, train/pipeline.py) with its
rollout correction and advantages, as a typed Experience; and the settings the pipeline samples with."""
from __future__ import annotations

from dataclasses import dataclass

import torch

from portagrpo.algo.objective import Shaping, shape_and_advantage
from portagrpo.algo.rollout_correction import RolloutCorrection, correct_rollout, gap_report, refusal
from portagrpo.batch import RolloutBatch, TrainBatch
from portagrpo.config import Config, correction_bounds
from portagrpo.errors import UserError
from portagrpo.metrics import pass_at_k


def seed_for(seed: int, step: int, salt: int) -> int:
    """One seed per (run seed, step, purpose): sampling, update order and validation never share a stream."""
    return (seed * 1_000_003 + step * 7_919 + salt) % (2**63 - 1)


@dataclass
class Experience:
    """What the update and the metrics need from one step, on every rank the same global batch."""

    batch: TrainBatch
    raw_scores: torch.Tensor  # [B] the reward function's scores
    scores: torch.Tensor  # [B] after shaping
    correct: torch.Tensor  # [B] 0/1
    entropy: torch.Tensor | None  # [B, T] from the scoring pass; None on on-policy steps (taken from the update)
    reward_errors: float
    rollout_corr: dict[str, float]  # `rollout_corr/*` metrics when the old log-probs came before the update
    t_gen: float  # perf_counter when generation ended
    t_scored: float  # perf_counter when the rewards were in (log-probs and advantages follow)
    gen_rounds: int = 1  # sampling rounds this step took (DAPO's dynamic sampling may need more than one)
    staleness: int | None = None  # rollout.mode=one_step_off: updates between the sampler's weights and the trainer's
    rollout_metrics: dict[str, float] | None = None  # the generator's own metrics, logged flat (tool/calls, ...)
    # a MoE policy's scoring pass: (agreeing, compared) route decisions against the batch's routes, this rank's;
    # and whether it recorded the batch's routes (R2: the old policy's, which the update replays)
    route_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    old_routes: bool = False


@dataclass
class ScoredRollout:
    """What the rollout pipeline hands the step: the global batch, sampled, rewarded and scored (identical on every
    rank, in rank order), before its rollout correction and advantages."""

    rollout: RolloutBatch
    scores: torch.Tensor  # [B] the rewards (with DAPO's overlong penalty when it is on)
    correct: torch.Tensor  # [B] 0/1
    reward_errors: float
    old_logp: torch.Tensor | None  # [B, T] from the scoring pass, if one ran
    ref_logp: torch.Tensor | None  # [B, T] with a reference model
    entropy: torch.Tensor | None  # [B, T] from the scoring pass
    t_gen: float  # perf_counter when generation ended
    t_scored: float  # perf_counter when the rewards were in
    gen_rounds: int = 1  # sampling rounds it took (DAPO's filtered sampling may need more than one)
    staleness: int | None = None  # updates between the sampler's weights and the trainer's (one_step_off)
    rollout_metrics: dict[str, float] | None = None  # the generator's own metrics (conversation: tool/calls, ...)
    # a MoE policy's scoring pass: (agreeing, compared) route decisions against the batch's routes, this rank's;
    # and whether it recorded the batch's routes (R2: the old policy's, which the update replays)
    route_counts: tuple[torch.Tensor, torch.Tensor] | None = None
    old_routes: bool = False


@dataclass
class Scored:
    """This rank's rewards and log-probs, then (after `gather`) the global batch's, in rank order."""

    scores: torch.Tensor  # [B] float32
    correct: torch.Tensor  # [B] 0/1 float32
    errors: torch.Tensor  # [1] reward failures
    old_logp: torch.Tensor | None
    ref_logp: torch.Tensor | None
    entropy: torch.Tensor | None

    def tensors(self) -> tuple[torch.Tensor | None, ...]:
        return (self.scores, self.correct, self.errors, self.old_logp, self.ref_logp, self.entropy)


def host_metrics(metrics: dict[str, torch.Tensor]) -> dict[str, float]:
    """Detached 0-dim metric tensors as floats, read in one host transfer (in fp64: no value is rounded)."""
    if not metrics:
        return {}
    return dict(zip(metrics, torch.stack([v.detach().to(torch.float64) for v in metrics.values()]).tolist()))


def solved_of(correct: torch.Tensor) -> torch.Tensor:
    """Per prompt, pass@k from its k samples' 0/1 correctness [P, k] (the same estimator as eval)."""
    k = correct.shape[1]
    return torch.tensor([pass_at_k(k, int(c), k) for c in correct.sum(dim=1).tolist()], dtype=torch.float64)


def correction_from(cfg: Config) -> RolloutCorrection:
    rc = cfg.algorithm.rollout_correction
    threshold, rejection = correction_bounds(cfg)  # verl's bound strings, parsed by the config
    return RolloutCorrection(rollout_is=rc.rollout_is, rollout_is_threshold=threshold,
                             rollout_is_batch_normalize=rc.rollout_is_batch_normalize, rollout_rs=rejection,
                             bypass_mode=rc.bypass_mode)


def is_on_policy(cfg: Config, stale: bool) -> bool:
    """One update on the whole batch: the policy that sampled is the one being updated, so the
    old log-probs are the update's own (detached) and their separate pass is skipped, as in
    verl and TRL. Importance weights of the rollout correction are then taken from the update's first
    forward too (each row's weights depend on its own log-probs only; the update applies them), as TRL does. A
    KL-in-reward, rejection sampling and batch-normalized weights need the whole batch's old log-probs before the
    update, so they keep the pass; in bypass mode the sampler's log-probs are the old ones, so no pass runs either
    way. `stale`: the schedule samples with an older policy than the one it updates (train/schedule.py)."""
    a, rc = cfg.actor, cfg.algorithm.rollout_correction
    return (not stale and a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.rollout_batch_size
            and not cfg.algorithm.use_kl_in_reward and not rc.rollout_rs
            and not (rc.rollout_is and rc.rollout_is_batch_normalize))


@dataclass(frozen=True)
class ExperienceSettings:
    """What turns a scored batch into the step's experience, and what that decides for the passes around it: whether
    the step is on-policy (no scoring pass: the update's first forward gives the old log-probs) and the rollout
    correction. The pipeline's settings are `RolloutSettings` (train/pipeline.py), the scoring passes'
    `ScoringSettings` (train/logprobs.py), the update's `UpdateSettings` (train/update.py)."""

    on_policy: bool
    correction: RolloutCorrection

    @classmethod
    def from_config(cls, cfg: Config, stale: bool = False) -> "ExperienceSettings":
        """`stale`: the run's schedule samples with an older policy than the one it updates (one_step_off)."""
        return cls(on_policy=is_on_policy(cfg, stale), correction=correction_from(cfg))

    @property
    def scoring_pass(self) -> bool:
        """Whether the policy scores the batch before the update (the old log-probs)."""
        return not (self.on_policy or self.correction.bypass_mode)

    @property
    def corrects_in_update(self) -> RolloutCorrection | None:
        """The rollout correction the update applies from its own first forward (an on-policy step with importance
        weights: no scoring pass ran); None when the correction, if any, came before the update."""
        c = self.correction
        return c if self.on_policy and c.reweights and not c.bypass_mode else None


class ExperienceMaker:
    """Turns the pipeline's scored global batch into the step's Experience: rollout correction and advantages,
    everything it computes returned, nothing kept."""

    def __init__(self, settings: ExperienceSettings, shaping: Shaping) -> None:
        self.settings, self.shaping = settings, shaping

    def prepare(self, scored: ScoredRollout) -> Experience:
        batch, shaped, corr = self.train_batch(scored.rollout, scored.scores, scored.old_logp, scored.ref_logp)
        corr = host_metrics(corr)  # the correction's one host read
        why = refusal(corr, self.settings.correction)
        if why is not None:
            raise UserError(why)
        return Experience(batch, raw_scores=scored.scores, scores=shaped, correct=scored.correct,
                          entropy=scored.entropy, reward_errors=scored.reward_errors, rollout_corr=corr,
                          t_gen=scored.t_gen, t_scored=scored.t_scored, gen_rounds=scored.gen_rounds,
                          staleness=scored.staleness, rollout_metrics=scored.rollout_metrics,
                          route_counts=scored.route_counts, old_routes=scored.old_routes)

    def train_batch(self, rb: RolloutBatch, raw_scores: torch.Tensor, old_logp: torch.Tensor | None,
                    ref_logp: torch.Tensor | None) -> tuple[TrainBatch, torch.Tensor, dict[str, torch.Tensor]]:
        """The global batch with its rollout correction and advantages; the shaped scores; the `rollout_corr/*`
        metrics of a batch scored before its update, as detached 0-dim tensors (empty otherwise)."""
        spec, sampled = self.settings.correction, rb.rollout_logp
        if spec.bypass_mode:
            if sampled is None:
                raise UserError("algorithm.rollout_correction.bypass_mode=true needs the sampler's log-probs, and "
                                "this rollout engine reports none; use rollout.engine=hf or vllm, or "
                                "bypass_mode=false.")
            old_logp = sampled
        weights, loss_mask, corr = None, None, {}
        if sampled is not None and old_logp is not None and not spec.bypass_mode:
            if spec.active:
                try:
                    weights, loss_mask, corr = correct_rollout(old_logp, sampled, rb.trained_mask, spec)
                except ValueError as err:
                    raise UserError(str(err)) from None
            else:
                corr = gap_report(old_logp, sampled, rb.trained_mask)
        elif spec.active and (sampled is None or self.settings.corrects_in_update is None):
            raise UserError("algorithm.rollout_correction.rollout_is/rollout_rs need the sampler's log-probs, and "
                            "this rollout engine reports none; use rollout.engine=hf or vllm.")
        mask = rb.trained_mask if loss_mask is None else loss_mask
        scores, adv = shape_and_advantage(raw_scores, rb.uid, mask, self.shaping, old_logp=old_logp,
                                          ref_logp=ref_logp)
        return TrainBatch(rb, adv, old_logp, ref_logp, is_weights=weights, loss_mask=loss_mask), scores, corr
