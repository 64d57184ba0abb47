"""The update: epochs, mini-batches and micro-batches over one step's batch, as UpdateStats."""
from __future__ import annotations

import math
from dataclasses import dataclass, replace
from typing import Callable

import torch

from portagrpo import algo
from portagrpo.algo.losses import masked_mean
from portagrpo.algo.objective import LossMetrics, Objective, total_loss
from portagrpo.algo.rollout_correction import RolloutCorrection, correct_rollout, is_weights, refusal
from portagrpo.batch import RolloutBatch, TrainBatch, balanced_shares, micro_batches, token_budget_groups
from portagrpo.config import Config
from portagrpo.errors import UserError
from portagrpo.model.router_replay import Routing, add_counts
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.train.build import Models, Optimization, Runtime
from portagrpo.train.experience import host_metrics, seed_for
from portagrpo.train.layout import BatchPlan


@dataclass(frozen=True)
class UpdateSettings:
    seed: int
    ppo_epochs: int
    mini_batch_size: int  # responses per optimizer step, over all ranks
    micro_batch_size: int  # responses per forward/backward on one rank
    token_budget: int | None  # instead: micro-batches of at most this many prompt + response tokens
    grad_clip: float
    temperature: float  # the sampling temperature, which scoring divides the logits by
    entropy_coeff: float
    full_vocab_kl: bool  # the KL loss needs both models' full-vocabulary log-probs
    # No scoring pass ran before the update (on-policy or bypass): the entropy metric and the
    # trainer's log-probs for the rollout_corr metrics come from the update's own first-epoch forwards.
    measure_in_update: bool
    # FSDP2: gradients stay unsharded over a mini-batch's micro-batches and reduce-scatter once, after its last
    # (actor.use_no_sync_for_gradient_accumulation); by default every micro-batch's backward reduce-scatters.
    defer_grad_sync: bool = False
    # An on-policy step's importance weights, taken from the update's own first forward (no scoring pass ran:
    # `ExperienceSettings.corrects_in_update`); None: any correction came with the batch
    correction: RolloutCorrection | None = None
    routing: str | None = None  # actor.router_replay: what a MoE policy's update forwards do with the batch's routes

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, measure_in_update: bool,
                    correction: RolloutCorrection | None = None) -> "UpdateSettings":
        """`measure_in_update`: no scoring pass runs before the update (`ExperienceSettings.scoring_pass` is false);
        `correction`: `ExperienceSettings.corrects_in_update`."""
        a, batches = cfg.actor, BatchPlan.of(cfg, world_size)  # the run layout's cut (train/layout.py)
        return cls(seed=cfg.trainer.seed, ppo_epochs=a.ppo_epochs, mini_batch_size=a.ppo_mini_batch_size,
                   micro_batch_size=batches.update_micro_batch, grad_clip=a.grad_clip,
                   token_budget=batches.update_token_budget,
                   temperature=cfg.rollout.temperature,
                   entropy_coeff=a.entropy_coeff,
                   full_vocab_kl=a.use_kl_loss and a.kl_loss_type.rstrip("+") == "full",
                   measure_in_update=measure_in_update, correction=correction,
                   defer_grad_sync=a.use_no_sync_for_gradient_accumulation, routing=a.router_replay)


@dataclass(frozen=True)
class UpdateStats:
    """One step's update, averaged over its optimizer steps (losses) or its tokens (the rest)."""

    loss_policy: float
    clipfrac: float
    clipfrac_lower: float
    ppo_kl: float
    ratio_mean: float
    grad_norm: float  # mean over optimizer steps, before clipping
    lr: float  # the rate the optimizer steps used
    entropy: float | None  # from the update's own forward: on-policy steps only
    kl: float | None  # with a reference model
    loss_kl: float | None  # with a KL loss
    # [B, T] the trainer's log-probs of the global batch from the first epoch's forwards, when no scoring
    # pass ran and the engine reported its own (for the rollout_corr metrics); else None
    trainer_logp: torch.Tensor | None = None
    # `rollout_corr/*` of an on-policy step corrected in the update (from `trainer_logp`), read to the host
    rollout_corr: dict[str, float] | None = None
    # a MoE policy's update forwards: (agreeing, compared) route decisions against the batch's routes, this rank's
    route_counts: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class LossMeans:
    """A step's loss metrics over every rank: loss terms averaged over optimizer steps, the rest token-weighted."""

    loss_policy: float
    ppo_kl: float
    clipfrac: float
    clipfrac_lower: float
    ratio_mean: float
    kl: float | None = None
    loss_kl: float | None = None
    entropy: float | None = None


class MetricSums:
    """The micro-batches' `LossMetrics`, summed: loss terms add up (each carries its share of the mini-batch);
    the token means are summed as value x tokens, with the tokens."""

    def __init__(self) -> None:
        self.losses: dict[str, torch.Tensor] = {}
        self.weighted: dict[str, torch.Tensor] = {}
        self.tokens: dict[str, float] = {}
        self.routes: tuple[torch.Tensor, torch.Tensor] | None = None  # a MoE policy's route agreement counts

    def add(self, metrics: LossMetrics, tokens: int) -> None:
        for k, v in metrics.loss_terms().items():
            self.losses[k] = self.losses.get(k, 0.0) + v.detach().double()
        for k, v in metrics.token_means().items():
            self.weighted[k] = self.weighted.get(k, 0.0) + v.detach().double() * tokens
            self.tokens[k] = self.tokens.get(k, 0.0) + tokens

    def add_routes(self, counts: tuple[torch.Tensor, torch.Tensor] | None) -> None:
        """A MoE policy's micro-batch: its (agreeing, compared) route decisions."""
        self.routes = add_counts(self.routes, counts)

    def reduce(self, comm, device, n_updates: int) -> LossMeans:
        """Over every rank in one exact fp64 sum on the host (never an fp64 collective)."""
        losses, means = sorted(self.losses), sorted(self.weighted)
        parts = [self.losses[k] for k in losses] + [self.weighted[k] for k in means] + [self.tokens[k] for k in means]
        values = torch.stack([torch.as_tensor(v, dtype=torch.float64, device=device) for v in parts])
        total = comm.sum_on_host(values).tolist()
        out = {k: total[i] / n_updates for i, k in enumerate(losses)}
        for i, k in enumerate(means):
            out[k] = total[len(losses) + i] / max(total[len(losses) + len(means) + i], 1.0)
        return LossMeans(**out)


class Updater:
    """ppo_epochs over shuffled mini-batches of one step's global batch: gradients, optimizer and schedule steps."""

    def __init__(self, settings: UpdateSettings, runtime: Runtime, models: Models, optim: Optimization,
                 objective: Objective, log: Callable[[str], None]) -> None:
        self.settings, self.runtime, self.objective, self.log = settings, runtime, objective, log
        self.scorer, self.ref_scorer, self.strategy = models.scorer, models.ref_scorer, models.strategy
        self.params, self.optimizer, self.scheduler = optim.params, optim.optimizer, optim.scheduler
        group = getattr(self.scorer, "sequence_parallel", None)  # model/ulysses.py: ranks holding the same rows
        self.sp, self.sp_rank = (1, 0) if group is None else (group.size, group.rank)

    def update(self, batch: TrainBatch, step: int, old_routes: bool = False) -> UpdateStats:
        """Update on `batch` (step `step`'s global batch): each rank takes its slice of every
        mini-batch and accumulates gradients over micro-batches; then the schedule steps. `old_routes`: the batch's
        routes are the old policy's, recorded by this step's scoring pass (R2 replays them)."""
        s, comm = self.settings, self.runtime.comm
        routing = Routing.update(s.routing, old_routes)
        g = torch.Generator().manual_seed(seed_for(s.seed, step, 2))
        sums, grad_norms, lr = MetricSums(), [], self.scheduler.get_last_lr()[0]
        seen = None  # the first epoch's log-probs, each rank its rows
        if s.measure_in_update and batch.rollout.rollout_logp is not None:
            seen = torch.zeros_like(batch.rollout.rollout_logp)
        self.scorer.train()
        with self.runtime.phase("update"):
            for epoch in range(s.ppo_epochs):
                order = torch.randperm(batch.rollout.size, generator=g)
                for mini_idx in order.split(s.mini_batch_size):
                    # under sequence parallelism a group of ranks shares one row of the data-parallel split
                    shares = rank_shares(batch.rollout, mini_idx, comm.world_size // self.sp,
                                         balance=s.token_budget is not None)
                    rows = shares[comm.rank // self.sp]
                    self._accumulate_gradients(batch.select(rows), sums, rows, seen if epoch == 0 else None,
                                               self._micro_count(batch.rollout, shares), routing)
                    grad_norms.append(self._clip_and_step(step))
            n_updates = s.ppo_epochs * (batch.rollout.size // s.mini_batch_size)
            m = sums.reduce(comm, self.runtime.device, n_updates * self.sp)  # a group's ranks add alike
            if seen is not None and comm.world_size > 1:  # every row was written by exactly one rank
                seen = comm.all_reduce_sum(seen)
        self.scheduler.step()
        return UpdateStats(loss_policy=m.loss_policy, clipfrac=m.clipfrac, clipfrac_lower=m.clipfrac_lower,
                           ppo_kl=m.ppo_kl, ratio_mean=m.ratio_mean, grad_norm=sum(grad_norms) / len(grad_norms),
                           lr=lr, entropy=m.entropy, kl=m.kl, loss_kl=m.loss_kl, trainer_logp=seen,
                           rollout_corr=self._corrected_in_update(batch, seen), route_counts=sums.routes)

    def _corrected_in_update(self, batch: TrainBatch, seen: torch.Tensor | None) -> dict[str, float] | None:
        """The `rollout_corr/*` metrics of a correction applied in the update, over the whole batch's first-forward
        log-probs (one host read); a batch the correction could not weigh is refused, as before an update."""
        spec, sampled = self.settings.correction, batch.rollout.rollout_logp
        if spec is None or seen is None or sampled is None:
            return None
        corr = host_metrics(correct_rollout(seen, sampled, batch.rollout.trained_mask, spec)[2])
        why = refusal(corr, spec)
        if why is not None:
            raise UserError(why)
        return corr

    def _micro_count(self, rollout: RolloutBatch, shares: list[torch.Tensor]) -> int | None:
        """With a token budget, the most micro-batches any rank's share needs: every rank runs that many, so the
        sharded forwards and gradient reductions stay in lockstep (verl all-reduces the count; here every rank
        plans every share from the host lengths, alike, and asks no one). None with fixed sizes (equal shares
        give every rank as many)."""
        budget = self.settings.token_budget
        if budget is None:
            return None
        lengths = rollout.host_lengths()
        return max(len(token_budget_groups([sum(lengths[i]) for i in share.tolist()], budget)) for share in shares)

    def _accumulate_gradients(self, mine: TrainBatch, sums: MetricSums, rows: torch.Tensor,
                              seen: torch.Tensor | None, count: int | None = None,
                              routing: Routing | None = None) -> None:
        """This rank's slice `rows` of one mini-batch, micro-batch by micro-batch (`count` of them with a token
        budget), normalised over all ranks; each micro-batch's log-probs go to `seen` when it is given."""
        s = self.settings
        # Counts are whole numbers: reduced exactly as int64 (no vendor reduces float64 everywhere).
        counts = torch.stack(algo.loss_normalizers(mine.mask)).round().long()
        n_tok, n_seq = (self.runtime.comm.all_reduce_sum(counts) // self.sp).to(torch.float64).unbind()
        self.optimizer.zero_grad(set_to_none=True)
        micros = micro_batches(mine.rollout, s.micro_batch_size, s.token_budget, count)
        for i, micro_idx in enumerate(micros):
            # Lean by default: each backward reduce-scatters, so a sharded rank holds only its gradient shard.
            self.strategy.gradient_sync(self.scorer, enabled=not s.defer_grad_sync or i == len(micros) - 1)
            micro = mine.select(micro_idx)
            loss, m, logp, routes = self.micro_loss(micro, n_tok, n_seq, routing)
            sums.add_routes(routes)
            if seen is not None and self.sp_rank == 0:  # a sequence-parallel group's first rank speaks for it
                seen.index_copy_(0, rows[micro_idx].to(seen.device), logp.to(seen.dtype))
            loss.backward()
            sums.add(m, sum(r for _, r in micro.rollout.host_lengths()))
        self.strategy.sync_grads(self.params)

    def micro_loss(self, micro: TrainBatch, num_tokens, num_seqs, routing: Routing | None = None,
                   ) -> tuple[torch.Tensor, dict[str, torch.Tensor], torch.Tensor, tuple | None]:
        """The micro-batch's loss, its metrics, its log-probs (detached), and what a MoE policy's routers did
        (`routing`: what they do with the batch's routes)."""
        s = self.settings
        rb, mask = micro.rollout, micro.mask
        full_kl = s.full_vocab_kl
        on_policy = micro.old_logp is None
        stats = response_stats(self.scorer, rb, temperature=s.temperature, compute_entropy=s.entropy_coeff != 0
                               or s.measure_in_update, vocab=full_kl, autocast=self.runtime.autocast, shared_rows=True,
                               routing=routing)
        logp = stats.logp  # fp32 (fp64 for an fp64 model): kernels never return bf16
        old = logp.detach() if on_policy else micro.old_logp  # on-policy: the policy that sampled is this one
        weights = micro.is_weights
        if on_policy and s.correction is not None and rb.rollout_logp is not None:  # TRL's: from this very forward
            c = s.correction
            weights = is_weights(old - rb.rollout_logp, mask, c.rollout_is, c.rollout_is_threshold)[0]
        loss, m = total_loss(logp, old, micro.advantages, mask, self.objective, num_tokens=num_tokens,
                             num_seqs=num_seqs, ref_logp=micro.ref_logp, entropy=stats.entropy,
                             logp_vocab=stats.logp_vocab, ref_logp_vocab=self._ref_vocab(rb) if full_kl else None,
                             is_weights=weights)
        if s.measure_in_update:  # the entropy metric comes from this forward (no separate scoring pass ran)
            m = replace(m, entropy=masked_mean(stats.entropy.detach(), mask))
        return loss, m, logp.detach(), stats.route_counts

    @torch.no_grad()
    def _ref_vocab(self, batch: RolloutBatch) -> torch.Tensor:
        with eval_mode(self.ref_scorer):
            return response_stats(self.ref_scorer, batch, temperature=self.settings.temperature,
                                  compute_entropy=False, vocab=True, autocast=self.runtime.autocast,
                                  shared_rows=True).logp_vocab

    def _clip_and_step(self, step: int) -> float:
        # The one host read of an optimizer step: whether the norm is finite decides the step.
        norm = float(self.strategy.clip_grad_norm(self.params, self.settings.grad_clip))
        if math.isfinite(norm):
            self.optimizer.step()
        else:
            self.log(f"step {step}: gradient norm is {norm}, optimizer step skipped")
        self.optimizer.zero_grad(set_to_none=True)
        return norm


def rank_shares(rollout: RolloutBatch, mini_idx: torch.Tensor, world: int, balance: bool) -> list[torch.Tensor]:
    """Every rank's rows of one mini-batch (`mini_idx`, host indices): contiguous slices, or with `balance` equal
    counts whose prompt + response tokens are evened out (`balanced_shares`, verl's balance_batch), so no rank's
    micro-batches wait on a longer share. Every rank computes all of them alike, from the host lengths."""
    per = len(mini_idx) // world
    if not balance:
        return [mini_idx[r * per:(r + 1) * per] for r in range(world)]
    lengths = rollout.host_lengths()
    tokens = [sum(lengths[i]) for i in mini_idx.tolist()]
    return [mini_idx[torch.tensor(share, dtype=torch.long)] for share in balanced_shares(tokens, world)]
