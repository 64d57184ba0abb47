"""One step's experience: rollout, reward, log-probs, gather and advantages, as a typed Experience."""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any, Callable

import torch

from portagrpo.algo.advantages import overlong_penalty
from portagrpo.algo.objective import Shaping, shape_and_advantage
from portagrpo.algo.rollout_correction import RolloutCorrection, correct_rollout, gap_report
from portagrpo.batch import RolloutBatch, TrainBatch, micro_batches
from portagrpo.config import Config, correction_bounds
from portagrpo.data.records import PromptRecord, tokenize_prompts
from portagrpo.errors import UserError
from portagrpo.metrics import pass_at_k
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.rewards.functions import ScoredBatch, score_responses
from portagrpo.rollout.engines import SamplingParams, rollout_groups
from portagrpo.train.build import Data, Models, Runtime
from portagrpo.train.record import StepRecord


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


def _inverse(order: list[int], device) -> torch.Tensor:
    """Positions that put rows gathered in `order` back in row order (host indices, copied without waiting)."""
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return torch.tensor(back, dtype=torch.long).to(device, non_blocking=True)


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


def dapo_settings(cfg: Config) -> dict[str, Any]:
    ob, fg = cfg.reward.overlong_buffer, cfg.algorithm.filter_groups
    return {"overlong": (cfg.data.max_response_length, ob.len, ob.penalty_factor) if ob.enable else None,
            "filter_metric": fg.metric if fg.enable else None, "max_rounds": fg.max_num_gen_batches,
            "prompt_length": cfg.data.max_prompt_length}


def is_on_policy(cfg: Config) -> bool:
    """One update on the whole batch: the policy that sampled is the one being updated, so the
    old log-probs are the update's own (detached) and their separate pass is skipped, as in
    verl. A KL-in-reward and a rollout correction need old log-probs before the update, so they keep
    the pass; in bypass mode the sampler's log-probs are the old ones, so no pass runs either way."""
    a, rc = cfg.actor, cfg.algorithm.rollout_correction
    if cfg.rollout.mode != "sync":  # the batch was sampled by an older policy than the one it updates
        return False
    return (a.ppo_epochs == 1 and a.ppo_mini_batch_size == cfg.rollout_batch_size
            and not cfg.algorithm.use_kl_in_reward and not (rc.rollout_is or rc.rollout_rs))


@dataclass(frozen=True)
class ExperienceSettings:
    seed: int
    n: int  # responses per prompt
    micro_batch_size: int  # scoring micro-batch
    token_budget: int | None  # instead: scoring micro-batches of at most this many tokens
    temperature: float  # the sampling temperature, which scoring divides the logits by as well
    sampling: SamplingParams
    val_sampling: SamplingParams
    val_n: int
    val_batch_size: int  # prompts per validation rollout, over all ranks
    max_error_frac: float
    on_policy: bool
    correction: RolloutCorrection
    overlong: tuple[int, int, float] | None = None  # DAPO: (max response length, buffer, penalty factor)
    filter_metric: str | None = None  # DAPO dynamic sampling: keep groups whose metric has a spread
    max_rounds: int = 0  # sampling rounds per step at most (0: no limit)
    prompt_length: int = 0  # data.max_prompt_length: one prompt width for every round

    @classmethod
    def from_config(cls, cfg: Config, world_size: int) -> "ExperienceSettings":
        r = cfg.rollout

        def sampling(temperature: float) -> SamplingParams:
            return SamplingParams(cfg.data.max_response_length, temperature, r.top_p, r.top_k, r.min_p,
                                  r.repetition_penalty)

        a = cfg.actor
        budget = (a.log_prob_max_token_len_per_gpu or a.ppo_max_token_len_per_gpu) if a.use_dynamic_bsz else None
        return cls(seed=cfg.trainer.seed, n=r.n, micro_batch_size=cfg.logprob_micro_batch(world_size),
                   token_budget=budget,
                   temperature=r.temperature, sampling=sampling(r.temperature),
                   val_sampling=sampling(r.val_temperature), val_n=r.val_n, val_batch_size=cfg.data.train_batch_size,
                   max_error_frac=cfg.reward.max_error_frac, on_policy=is_on_policy(cfg),
                   correction=correction_from(cfg), **dapo_settings(cfg))

    @property
    def scoring_pass(self) -> bool:
        """Whether the policy scores the batch before the update (the old log-probs)."""
        return not (self.on_policy or self.correction.bypass_mode)


class ExperienceMaker:
    """Turns a step's prompts into an Experience: the same global batch on every rank."""

    def __init__(self, settings: ExperienceSettings, runtime: Runtime, data: Data, models: Models, engine,
                 shaping: Shaping, log: Callable[[str], None]) -> None:
        self.settings, self.runtime, self.shaping, self.log = settings, runtime, shaping, log
        self.tokenizer, self.reward, self.reward_pool = data.tokenizer, data.reward, data.reward_pool
        self.scorer, self.ref_scorer, self.strategy = models.scorer, models.ref_scorer, models.strategy
        self.engine = engine
        self.corr_metrics: dict[str, float] = {}

    def make(self, step: int, prompts: list[PromptRecord]) -> Experience:
        """Rollout, reward, log-probs and advantages for `step` of the global prompt batch `prompts`
        (DAPO's dynamic sampling is `train/dapo.py: make_filtered`; a rollout sampled ahead,
        `train/overlap.py`)."""
        s, comm = self.settings, self.runtime.comm
        records = self.local_records(prompts)
        width = self.prompt_width(records)
        self.runtime.backend.seed(seed_for(s.seed, step, 1 + 10 * comm.rank))
        uid_base = step * len(prompts) + comm.rank * len(records)
        rb = self.rollout(records, s.n, s.sampling, uid_base=uid_base, prompt_width=width)
        return self.make_from_rollout(step, rb, time.perf_counter())

    def make_from_rollout(self, step: int, rb: RolloutBatch, t_gen: float) -> Experience:
        """The experience of this rank's rollout `rb` (generation ended at `t_gen`)."""
        scored = self.score(rb)
        t_scored = time.perf_counter()
        s = self.settings
        old_logp, entropy = self.logprobs(self.scorer, rb, entropy=True) if s.scoring_pass else (None, None)
        ref_logp = self.logprobs(self.ref_scorer, rb, entropy=False)[0] if self.ref_scorer is not None else None
        local = self.local_scored(step, rb, scored, old_logp, ref_logp, entropy)
        full_rb, g = self.gather(rb, local)
        batch, scores = self.train_batch(full_rb, g.scores, g.old_logp, g.ref_logp)
        return Experience(batch, raw_scores=g.scores, scores=scores, correct=g.correct, entropy=g.entropy,
                          reward_errors=float(g.errors.sum()), rollout_corr=self.corr_metrics, t_gen=t_gen,
                          t_scored=t_scored)

    def from_record(self, record: StepRecord) -> Experience:
        """Rebuild a recorded step's global batch on this backend: log-probs and advantages are
        recomputed here; rollout tokens and rewards are exactly the recorded ones."""
        d, t_start = self.runtime.device, time.perf_counter()
        rb = record.rollout_batch(d)
        scoring = self.settings.scoring_pass
        old_logp, entropy = self.logprobs(self.scorer, rb, entropy=True) if scoring else (None, None)
        ref_logp = self.logprobs(self.ref_scorer, rb, entropy=False)[0] if self.ref_scorer is not None else None
        raw = record.scores.to(d)
        batch, scores = self.train_batch(rb, raw, old_logp, ref_logp)
        return Experience(batch, raw_scores=raw, scores=scores, correct=record.correct.to(d), entropy=entropy,
                          reward_errors=0.0, rollout_corr=self.corr_metrics,
                          t_gen=t_start, t_scored=t_start)  # nothing generated or scored: both times are 0

    def train_batch(self, rb: RolloutBatch, raw_scores: torch.Tensor, old_logp: torch.Tensor | None,
                    ref_logp: torch.Tensor | None) -> tuple[TrainBatch, torch.Tensor]:
        """The global batch with its rollout correction and advantages; also the shaped scores.
        Sets `corr_metrics` (the `rollout_corr/*` metrics of a batch scored before its update)."""
        spec, sampled = self.settings.correction, rb.rollout_logp
        if spec.bypass_mode:
            if sampled is None:
                raise UserError("algorithm.rollout_correction.bypass_mode=true needs the sampler's log-probs, and "
                                "this rollout engine reports none; use rollout.engine=hf or vllm, or "
                                "bypass_mode=false.")
            old_logp = sampled
        weights, loss_mask, self.corr_metrics = None, None, {}
        if sampled is not None and old_logp is not None and not spec.bypass_mode:
            if spec.active:
                try:
                    weights, loss_mask, self.corr_metrics = correct_rollout(old_logp, sampled, rb.response_mask, spec)
                except ValueError as err:
                    raise UserError(str(err)) from None
            else:
                self.corr_metrics = gap_report(old_logp, sampled, rb.response_mask)
        elif spec.active:
            raise UserError("algorithm.rollout_correction.rollout_is/rollout_rs need the sampler's log-probs, and "
                            "this rollout engine reports none; use rollout.engine=hf or vllm.")
        mask = rb.response_mask if loss_mask is None else loss_mask
        scores, adv = shape_and_advantage(raw_scores, rb.uid, mask, self.shaping, old_logp=old_logp,
                                          ref_logp=ref_logp)
        return TrainBatch(rb, adv, old_logp, ref_logp, is_weights=weights, loss_mask=loss_mask), scores

    def local_scored(self, step: int, rb: RolloutBatch, scored: ScoredBatch, old_logp: torch.Tensor | None = None,
                     ref_logp: torch.Tensor | None = None, entropy: torch.Tensor | None = None) -> Scored:
        """This rank's rewards (with any overlong penalty) and log-probs as tensors; the first reward
        failures are logged."""
        for failure in scored.failures[:3]:
            self.log(f"step {step}: reward failed on sample {failure.sample} (prompt id {failure.prompt_id}): "
                     f"{failure.message}")
        device = self.runtime.device
        return Scored(self.shaped_scores(rb, scored.scores),
                      torch.tensor(scored.correct, dtype=torch.float32, device=device),
                      torch.tensor([float(len(scored.failures))], device=device), old_logp, ref_logp, entropy)

    def shaped_scores(self, rb: RolloutBatch, scores: list[float]) -> torch.Tensor:
        """The reward function's scores, with DAPO's overlong penalty when it is on."""
        out = torch.tensor(scores, dtype=torch.float32, device=self.runtime.device)
        if self.settings.overlong is not None:
            max_len, buffer, factor = self.settings.overlong
            lengths = torch.tensor([r for _, r in rb.host_lengths()], device=out.device)
            out = out + overlong_penalty(lengths, max_len, buffer, factor)
        return out

    def local_records(self, records: list[PromptRecord]) -> list[PromptRecord]:
        """This rank's share of the global prompt batch (whole prompts, so whole groups)."""
        comm = self.runtime.comm
        per = len(records) // comm.world_size
        return records[comm.rank * per:(comm.rank + 1) * per]

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, uid_base: int,
                prompt_width: int | None = None) -> RolloutBatch:
        # Sampling with the training model itself (not an engine holding its own weights): a sharded
        # policy is gathered once for the whole rollout.
        gather = nullcontext() if self.engine.holds_weights else self.strategy.generation(self.scorer)
        with gather, self.runtime.backend.region("rollout"):
            return rollout_groups(self.engine, self.tokenizer, records, n, params, self.runtime.device,
                                  uid_base=uid_base, prompt_width=prompt_width)

    def prompt_width(self, records: list[PromptRecord]) -> int:
        """One left-padded prompt width for all ranks, so rollouts can be gathered."""
        local = max(len(x) for x in tokenize_prompts(self.tokenizer, records))
        return int(self.runtime.comm.all_reduce_max(torch.tensor(local, device=self.runtime.device)))

    def score(self, batch: RolloutBatch) -> ScoredBatch:
        return score_responses(
            self.reward, batch.response_text, batch.ground_truth, batch.data_source, batch.prompt_index.tolist(),
            batch.extra_info, max_error_frac=self.settings.max_error_frac, pool=self.reward_pool,
        )

    @torch.no_grad()
    def logprobs(self, scorer, batch: RolloutBatch, *, entropy: bool) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, T] (and entropy) of `scorer`'s model over the batch, in micro-batches."""
        s = self.settings
        logps, ents, order = [], [], []
        # scoring is deterministic: no dropout (LoRA's or the model's), as in verl
        with eval_mode(scorer), self.runtime.backend.region("logprobs"):
            for rows in micro_batches(batch, s.micro_batch_size, s.token_budget):
                part = batch.select(rows)
                stats = response_stats(scorer, part, temperature=s.temperature, compute_entropy=entropy,
                                       autocast=self.runtime.autocast)
                logps.append(stats.logp)
                order += rows.tolist()
                if entropy:
                    ents.append(stats.entropy)
        logp, ent = torch.cat(logps), (torch.cat(ents) if entropy else None)
        if order != sorted(order):  # token-budget groups are not in row order
            back = _inverse(order, batch.responses.device)
            logp, ent = logp.index_select(0, back), (None if ent is None else ent.index_select(0, back))
        return logp, ent

    def gather(self, rb: RolloutBatch, local: Scored) -> tuple[RolloutBatch, Scored]:
        """The global batch, identical on every rank, in rank order (one process: unchanged)."""
        comm = self.runtime.comm
        if comm.world_size == 1:
            return rb, local
        g = comm.all_gather_cat
        full = RolloutBatch(
            prompt_ids=g(rb.prompt_ids), prompt_mask=g(rb.prompt_mask), responses=g(rb.responses),
            response_mask=g(rb.response_mask), uid=g(rb.uid), prompt_index=g(rb.prompt_index),
            response_text=[], ground_truth=[], data_source=[], extra_info=[],
            # the step's one read of the global lengths, so every rank's update plans on the host
            lengths=[(p, r) for p, r in g(torch.tensor(rb.host_lengths(), device=self.runtime.device)).tolist()],
            rollout_logp=None if rb.rollout_logp is None else g(rb.rollout_logp),
        )
        return full, Scored(*(None if v is None else g(v) for v in local.tensors()))

    def validate(self, step: int, val_records: list[PromptRecord]) -> dict[str, float]:
        """Held-out mean reward and accuracy after `step`; the split is shared across ranks and reduced."""
        if not val_records:
            return {}
        s, comm = self.settings, self.runtime.comm
        params = s.val_sampling
        state = torch.get_rng_state()  # validation must not shift the training RNG stream
        self.runtime.backend.seed(seed_for(s.seed, step, 3 + 10 * comm.rank))
        world, rank = comm.world_size, comm.rank
        per = -(-len(val_records) // world)
        mine = val_records[rank * per:(rank + 1) * per]
        weights = [1.0] * len(mine) + [0.0] * (per - len(mine))
        mine = mine + [val_records[0]] * (per - len(mine))  # equal work per rank; padding weighs 0
        bs = max(s.val_batch_size // world, 1)
        k = s.val_n
        totals = torch.zeros(4, dtype=torch.float64)  # score sum, correct sum, samples, prompts solved (pass@k)
        for start in range(0, per, bs):
            records = mine[start:start + bs]
            rb = self.rollout(records, k, params, uid_base=0, prompt_width=self.prompt_width(records))
            s = self.score(rb)
            w = torch.tensor(weights[start:start + bs], dtype=torch.float64)
            scores = torch.tensor(s.scores, dtype=torch.float64).view(-1, k)
            correct = torch.tensor(s.correct, dtype=torch.float64).view(-1, k)
            totals += torch.stack([(w[:, None] * scores).sum(), (w[:, None] * correct).sum(), w.sum() * k,
                                   (w * solved_of(correct)).sum()])
        torch.set_rng_state(state)
        score_sum, correct_sum, count, solved = comm.sum_on_host(totals).tolist()
        out = {"val/reward_mean": score_sum / count, "val/acc": correct_sum / count}
        if k > 1:
            out[f"val/pass@{k}"] = solved / (count / k)
        return out
