"""DAPO's dynamic sampling (`algorithm.filter_groups`): groups whose metric is the same for every response
carry no advantage, so they are dropped and more prompts are sampled until the step's batch is full.

Every rank samples its share of each round; the rounds are gathered so that every rank keeps the same
groups; once `data.train_batch_size` groups are kept, each rank scores its contiguous share of them
(old and reference log-probs) and those are gathered back, as in a plain step.

How a round is sampled is the source's hook (`RoundSampler`): a plain rollout here, tool-using conversations for
the multi-turn source (train/sources/multi_turn.py), which runs these same rounds when the filter is on.
"""
from __future__ import annotations

import time
from typing import Protocol

import torch

from portagrpo.algo.advantages import groups_with_spread
from portagrpo.batch import RolloutBatch
from portagrpo.data.records import PromptRecord
from portagrpo.errors import UserError
from portagrpo.train.experience import ExperienceSettings, Scored, ScoredRollout
from portagrpo.train.sources import SOURCES, SourceInputs
from portagrpo.train.sources.sync import InStepSource


def concat_rollouts(parts: list[RolloutBatch], pad_id: int) -> RolloutBatch:
    """Gathered batches one after the other (token tensors, lengths and the model-token mask). Prompts of different
    widths (rounds of multi-turn prompts, rendered with the tools' schemas) are left-padded to the widest, with
    `pad_id` under mask 0."""
    width = max(p.prompt_len for p in parts)

    def cat(values, pad=None):
        if any(v is None for v in values):
            return None
        if pad is not None:
            values = [torch.nn.functional.pad(v, (width - v.shape[1], 0), value=pad) for v in values]
        return torch.cat(values)

    def field(name, pad=None):
        return cat([getattr(p, name) for p in parts], pad)

    # a part without a model mask trains all its response tokens: its trained mask says so
    model_mask = cat([p.trained_mask for p in parts]) if any(p.model_mask is not None for p in parts) else None
    return RolloutBatch(prompt_ids=field("prompt_ids", pad_id), prompt_mask=field("prompt_mask", 0),
                        responses=field("responses"), response_mask=field("response_mask"), uid=field("uid"),
                        prompt_index=field("prompt_index"), response_text=[], ground_truth=[], data_source=[],
                        extra_info=[], lengths=[x for p in parts for x in p.host_lengths()],
                        rollout_logp=field("rollout_logp"), model_mask=model_mask)


class RoundSampler(Protocol):
    def __call__(self, step: int, round_: int, prompts: list[PromptRecord]) -> RolloutBatch:
        """This rank's rollout of its share of a round's global `prompts` (not yet scored or gathered)."""


NOTICE_EVERY = 10  # sampling rounds between two notices while a step's batch is still not full


def round_notice(step: int, rounds: int, kept: int, dropped: int, groups: int, metric: str, limit: int) -> str:
    """The line that says a step is still sampling (a reward without spread can keep it going for ever)."""
    key = f"algorithm.filter_groups.max_num_gen_batches={limit}"
    bound = (f"{key} sets no limit, so this goes on until {groups} groups differ (set it to stop after that many "
             f"rounds)" if not limit else f"{key} stops the step after {limit} rounds")
    return (f"step {step}: still sampling after gen_rounds={rounds}: {kept} of {groups} prompt groups kept, "
            f"{dropped} dropped (the same {metric} for every response); {bound}.")


@SOURCES.register("filtered")
class FilteredSource(InStepSource):
    """DAPO's dynamic sampling as a batch source (`algorithm.filter_groups.enable`). `sample_round`: how each round
    is sampled (default: a plain rollout at `data.max_prompt_length`)."""

    @classmethod
    def claims(cls, settings: ExperienceSettings) -> bool:
        return settings.mode == "sync" and settings.filter_metric is not None

    def __init__(self, inputs: SourceInputs, sample_round: RoundSampler | None = None) -> None:
        super().__init__(inputs)
        self.sample_round = sample_round or self.plain_round

    def plain_round(self, step: int, round_: int, prompts: list[PromptRecord]) -> RolloutBatch:
        return self.sampling.sample(step, prompts, round_, width=self.sampling.settings.prompt_length)

    def gathered_round(self, step: int, round_: int, prompts: list[PromptRecord]) -> tuple[RolloutBatch, Scored]:
        """One sampling round over `prompts` (global), gathered: the batch and its scores (no log-probs yet)."""
        rb = self.sample_round(step, round_, prompts)
        return self.sampling.gather(rb, self.sampling.local_scored(step, rb, self.sampling.score(rb)))

    def scored(self, step: int, prompts: list[PromptRecord]) -> ScoredRollout:
        s, comm = self.sampling.settings, self.sampling.runtime.comm
        target = len(prompts) * s.n  # responses
        kept_rb: list[RolloutBatch] = []
        kept: list[Scored] = []
        have, round_, errors, dropped = 0, 0, 0.0, 0
        while have < target:
            if round_ and round_ % NOTICE_EVERY == 0 and comm.rank == 0 and round_ != s.max_rounds:
                self.log(round_notice(step, round_, have // s.n, dropped, len(prompts), s.filter_metric,
                                      s.max_rounds))
            if s.max_rounds and round_ >= s.max_rounds:
                raise UserError(f"step {step}: after {round_} sampling rounds (algorithm.filter_groups."
                                f"max_num_gen_batches={s.max_rounds}) only {have // s.n} of {len(prompts)} prompt "
                                f"groups had different {s.filter_metric} values; raise max_num_gen_batches (0: no "
                                f"limit), or use a task where responses differ.")
            full_rb, g = self.gathered_round(step, round_, prompts if round_ == 0 else self.loader.next_batch())
            values = g.correct if s.filter_metric == "acc" else g.scores
            rows = torch.nonzero(groups_with_spread(values, full_rb.uid)).flatten().cpu()  # the same on every rank
            errors += float(g.errors.sum())
            dropped += (full_rb.size - rows.numel()) // s.n
            if rows.numel():
                kept_rb.append(full_rb.select(rows))
                kept.append(Scored(g.scores[rows.to(g.scores.device)], g.correct[rows.to(g.scores.device)],
                                   g.errors, None, None, None))
                have += rows.numel()
            round_ += 1
        return self._scored(kept_rb, kept, target, errors, round_)

    def _scored(self, kept_rb: list[RolloutBatch], kept: list[Scored], target: int, errors: float,
                rounds: int) -> ScoredRollout:
        """The first `target` kept rows (whole groups), with log-probs: each rank scores its contiguous share, and
        the shares are gathered back in rank order, as in a plain step."""
        comm = self.sampling.runtime.comm
        t_gen = t_scored = time.perf_counter()
        batch = concat_rollouts(kept_rb, self.sampling.engine.pad_id).select(torch.arange(target))
        scores = torch.cat([k.scores for k in kept])[:target]
        correct = torch.cat([k.correct for k in kept])[:target]
        per = target // comm.world_size
        mine = batch.select(torch.arange(comm.rank * per, (comm.rank + 1) * per))
        gather = (lambda t: t) if comm.world_size == 1 else comm.all_gather_cat
        old, ref, entropy = (None if t is None else gather(t) for t in self.sampling.old_and_ref(mine))
        return ScoredRollout(batch, scores, correct, errors, old, ref, entropy, t_gen=t_gen, t_scored=t_scored,
                             gen_rounds=rounds)
