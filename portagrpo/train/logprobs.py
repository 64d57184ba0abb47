"""The log-prob passes of the rollout pipeline's last stage: the policy's old log-probs (when a scoring pass runs)
and the reference model's, over each rank's share of the step's kept batch, in one micro-batch plan."""
from __future__ import annotations

from dataclasses import dataclass, replace

import torch

from portagrpo.batch import RolloutBatch, micro_batches
from portagrpo.config import Config
from portagrpo.model.router_replay import Routing, add_counts, in_row_order
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.train.build import Models, Runtime


@dataclass(frozen=True)
class Passes:
    """What a step's log-prob passes give: the policy's (old) and the reference's log-probs, the scoring pass's
    entropy, the routes it recorded (R2) and its route agreement counts (a MoE policy); None where not computed."""

    old: torch.Tensor | None = None
    ref: torch.Tensor | None = None
    entropy: torch.Tensor | None = None
    routes: torch.Tensor | None = None
    route_counts: tuple[torch.Tensor, torch.Tensor] | None = None


@dataclass(frozen=True)
class ScoringSettings:
    """What the log-prob passes read: the scoring micro-batch (or token budget), the sampling temperature the logits
    are divided by, whether the policy's scoring pass runs (`ExperienceSettings.scoring_pass`), and what a MoE
    policy's scoring pass does with its routes (actor.router_replay)."""

    micro_batch_size: int
    token_budget: int | None
    temperature: float
    scoring_pass: bool
    routing: str | None = None

    @classmethod
    def from_config(cls, cfg: Config, world_size: int, scoring_pass: bool) -> "ScoringSettings":
        from portagrpo.train.layout import BatchPlan

        batches = BatchPlan.of(cfg, world_size)  # the run layout's cut (train/layout.py)
        return cls(batches.scoring_micro_batch, batches.scoring_token_budget, cfg.rollout.temperature, scoring_pass,
                   cfg.actor.router_replay)


class LogProbs:
    def __init__(self, settings: ScoringSettings, runtime: Runtime, models: Models) -> None:
        self.settings, self.runtime = settings, runtime
        self.scorer, self.ref_scorer = models.scorer, models.ref_scorer
        self.strategy = models.strategy

    def old_and_ref(self, rb: RolloutBatch) -> Passes:
        """The old log-probs (when a scoring pass runs), the reference log-probs (with a reference model), the
        entropy of the scoring pass, the routes it took (a MoE policy under actor.router_replay=R2, which the update
        replays) and its route agreement counts, over `rb` (both passes in one micro-batch plan)."""
        if not self.settings.scoring_pass and self.ref_scorer is None:
            return Passes()
        plan = self.micro_plan(rb)
        old = (self.passes(self.scorer, rb, entropy=True, plan=plan, routing=Routing.scoring(self.settings.routing))
               if self.settings.scoring_pass else Passes())
        ref = self.logprobs(self.ref_scorer, rb, entropy=False, plan=plan)[0] if self.ref_scorer is not None else None
        return replace(old, ref=ref)

    def micro_plan(self, batch: RolloutBatch) -> list[torch.Tensor]:
        """This rank's scoring micro-batches of `batch`. With a token budget on several ranks, as many as the most
        any rank plans (verl all-reduces the count too), so sharded forwards stay in lockstep."""
        s, comm = self.settings, self.runtime.comm
        plan = micro_batches(batch, s.micro_batch_size, s.token_budget)
        if s.token_budget is None or comm.world_size == 1:
            return plan
        # host read: one per step's scoring, with a token budget on several ranks
        count = int(comm.all_reduce_max(torch.tensor(len(plan), device=self.runtime.device)))
        return micro_batches(batch, s.micro_batch_size, s.token_budget, count)

    def logprobs(self, scorer, batch: RolloutBatch, *, entropy: bool,
                 plan: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None]:
        """Log-probs [B, T] (and entropy) of `scorer`'s model over the batch, in micro-batches (`plan`, else
        `micro_plan`'s)."""
        out = self.passes(scorer, batch, entropy=entropy, plan=plan)
        return out.old, out.entropy

    @torch.no_grad()
    def passes(self, scorer, batch: RolloutBatch, *, entropy: bool, plan: list[torch.Tensor] | None = None,
               routing: Routing | None = None) -> Passes:
        """`logprobs` (as `old`), and with a MoE policy's `routing` the routes its forwards recorded, in row order,
        and their agreement counts."""
        s = self.settings
        logps, ents, order, recorded, counts = [], [], [], [], None
        # scoring is deterministic: no dropout (LoRA's or the model's), as in verl
        with eval_mode(scorer), self.runtime.phase("logprobs"):
            for rows in self.micro_plan(batch) if plan is None else plan:
                part = batch.select(rows)
                stats = response_stats(scorer, part, temperature=s.temperature, compute_entropy=entropy,
                                       autocast=self.runtime.autocast, routing=routing)
                logps.append(stats.logp)
                order += rows.tolist()
                if stats.routes is not None:
                    recorded.append(stats.routes)
                counts = add_counts(counts, stats.route_counts)
                if entropy:
                    ents.append(stats.entropy)
            self.strategy.release(getattr(scorer, "scorer", scorer))  # AdaptersOff wraps the policy's scorer
        logp, ent = torch.cat(logps), (torch.cat(ents) if entropy else None)
        # R2: the update replays them
        routes = in_row_order(recorded, order, batch.responses.device) if recorded else None
        if order != sorted(order):  # token-budget groups are not in row order
            back = _inverse(order, batch.responses.device)
            logp, ent = logp.index_select(0, back), (None if ent is None else ent.index_select(0, back))
        return Passes(logp, None, ent, routes, counts)


def _inverse(order: list[int], device) -> torch.Tensor:
    """Positions that put rows gathered in `order` back in row order (host indices, copied without waiting)."""
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return torch.tensor(back, dtype=torch.long).to(device, non_blocking=True)
