"""The log-prob passes of the rollout pipeline's last stage: the policy's old log-probs (when a scoring pass runs)
and the reference model's, over each rank's share of the step's kept batch, in one micro-batch plan."""
from __future__ import annotations

import torch

from portagrpo.batch import RolloutBatch, micro_batches
from portagrpo.model import moe
from portagrpo.model.scorer import eval_mode, response_stats
from portagrpo.train.build import Models, Runtime
from portagrpo.train.experience import ExperienceSettings


class LogProbs:
    def __init__(self, settings: ExperienceSettings, runtime: Runtime, models: Models) -> None:
        self.settings, self.runtime = settings, runtime
        self.scorer, self.ref_scorer = models.scorer, models.ref_scorer
        self.strategy = models.strategy

    def old_and_ref(self, rb: RolloutBatch) -> tuple[torch.Tensor | None, ...]:
        """The old log-probs (when a scoring pass runs), the reference log-probs (with a reference model), the
        entropy of the scoring pass, and the routes the scoring pass took (a MoE policy under actor.router_replay=R2,
        which the update replays; else None), over `rb` (both passes in one micro-batch plan)."""
        if not self.settings.scoring_pass and self.ref_scorer is None:
            return None, None, None, None
        plan = self.micro_plan(rb)
        old, entropy, routes = (self.passes(self.scorer, rb, entropy=True, plan=plan) if self.settings.scoring_pass
                                else (None, None, None))
        ref = self.logprobs(self.ref_scorer, rb, entropy=False, plan=plan)[0] if self.ref_scorer is not None else None
        return old, ref, entropy, routes

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
        return self.passes(scorer, batch, entropy=entropy, plan=plan)[:2]

    @torch.no_grad()
    def passes(self, scorer, batch: RolloutBatch, *, entropy: bool,
               plan: list[torch.Tensor] | None = None) -> tuple[torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """`logprobs`, and the routes its forwards took in row order (a MoE policy recording them; else None)."""
        s = self.settings
        logps, ents, order, parts = [], [], [], []
        # scoring is deterministic: no dropout (LoRA's or the model's), as in verl
        with eval_mode(scorer), self.runtime.phase("logprobs"):
            for rows in self.micro_plan(batch) if plan is None else plan:
                part = batch.select(rows)
                stats = response_stats(scorer, part, temperature=s.temperature, compute_entropy=entropy,
                                       autocast=self.runtime.autocast)
                logps.append(stats.logp)
                order += rows.tolist()
                parts.append(part)
                if entropy:
                    ents.append(stats.entropy)
            self.strategy.release(getattr(scorer, "scorer", scorer))  # AdaptersOff wraps the policy's scorer
        logp, ent = torch.cat(logps), (torch.cat(ents) if entropy else None)
        routes = moe.in_row_order(scorer, parts, order, batch.responses.device)  # R2: the update replays them
        if order != sorted(order):  # token-budget groups are not in row order
            back = _inverse(order, batch.responses.device)
            logp, ent = logp.index_select(0, back), (None if ent is None else ent.index_select(0, back))
        return logp, ent, routes


def _inverse(order: list[int], device) -> torch.Tensor:
    """Positions that put rows gathered in `order` back in row order (host indices, copied without waiting)."""
    back = [0] * len(order)
    for position, row in enumerate(order):
        back[row] = position
    return torch.tensor(back, dtype=torch.long).to(device, non_blocking=True)
