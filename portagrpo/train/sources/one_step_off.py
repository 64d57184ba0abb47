"""rollout.mode=one_step_off: batch k+1 is sampled while the trainer updates on batch k.

Weight versions: v0 is the initial policy, v_k the policy after k updates. Step k trains on batch k,
starting from v_{k-1}. Batch k is requested right after step k-1 took batch k-1, when the sampler holds
v_{k-2} (v0 for the first two batches), so every batch from the second on is exactly one update stale
(`rollout_staleness` = 1). The old log-probs come from the trainer's v_{k-1} (a scoring pass runs),
so the PPO ratio is the usual one and `algorithm.rollout_correction` (or its metrics alone) measures
and corrects the sampler's staleness and precision; in verl's bypass mode the sampler's log-probs are
the old ones instead (no scoring pass), and PPO's clip alone bounds the off-policy update.

Checkpoints: the batch in flight at a save is taken (waited for) and saved with the checkpoint, per
rank (`inflight.pt`, a `SourceState`), with the version it was sampled with; a resumed run trains on it next, so it
continues exactly as the uninterrupted run would have. Regenerating it instead would need v_{k-1},
which a checkpoint of step k does not hold.
"""
from __future__ import annotations

import time
from dataclasses import dataclass

import torch

from portagrpo.data.records import PromptRecord
from portagrpo.rollout.engines import GroupPrompts, Sampled, group_prompts, rollout_batch
from portagrpo.train.build import Models, push_weights
from portagrpo.train.experience import ExperienceSettings, ScoredRollout
from portagrpo.train.sources import SOURCES, InflightBatch, SourceInputs, SourceState


@dataclass
class Pending:
    step: int  # the step that will train on it
    prompts: list[PromptRecord]  # the global prompt batch
    group: GroupPrompts  # this rank's prompts
    version: int  # the weight version the sampler held
    sampled: Sampled | None = None  # taken from the process (at a save, or when its step comes)


@SOURCES.register("one_step_off")
class OneStepOffSource:
    """Keeps one rollout request in flight ahead of the trainer."""

    @classmethod
    def claims(cls, settings: ExperienceSettings) -> bool:
        return settings.mode == "one_step_off"

    def __init__(self, inputs: SourceInputs) -> None:
        self.sampling, self.sampler, self.total_steps = inputs.sampling, inputs.sampler, inputs.total_steps
        self.loader, self.log = inputs.loader, inputs.log
        self.pushed = 0  # the weight version the sampler holds once its queue is drained
        self.pending: Pending | None = None

    def _group(self, step: int, prompts: list[PromptRecord]) -> GroupPrompts:
        sp = self.sampling
        records, first_uid = sp.round_ids(step, 0, prompts)
        width = sp.prompt_width(records)  # a collective: every rank submits in the same step
        return group_prompts(sp.tokenizer, records, sp.settings.n, self.sampler.pad_id, sp.runtime.device,
                             uid_base=first_uid, prompt_width=width)

    def submit(self, step: int, prompts: list[PromptRecord]) -> None:
        s = self.sampling.settings
        group = self._group(step, prompts)
        # the sampler process draws with the stream `round_ids` just seeded: its seed travels with the request
        self.sampler.submit(group.prompt_ids, group.prompt_mask, s.sampling, self.sampling.stream_seed(step))
        self.pending = Pending(step, prompts, group, self.pushed)

    def _taken(self) -> Pending:
        p = self.pending
        if p.sampled is None:
            p.sampled = self.sampler.result()
        return p

    def next(self, step: int) -> ScoredRollout:
        """Step `step`'s batch from the request in flight (made now if none is), after putting the next step's
        request in flight."""
        if self.pending is None or self.pending.step != step:
            self.submit(step, self.loader.next_batch())
        taken = self._taken()
        self.pending = None
        t_gen = time.perf_counter()
        if step < self.total_steps:
            self.submit(step + 1, self.loader.next_batch())
        rb = rollout_batch(self.sampling.tokenizer, taken.group, taken.sampled)
        return self.sampling.scored_rollout(step, rb, t_gen, staleness=(step - 1) - taken.version)

    def push(self, models: Models) -> None:
        push_weights(self.sampler, models)
        self.pushed += 1

    # ---- checkpoints
    def state(self) -> SourceState | None:
        """The in-flight batch for a checkpoint (a collective; rank 0's return value is what is saved)."""
        comm = self.sampling.runtime.comm
        mine = None
        if self.pending is not None:
            p = self._taken()
            mine = InflightBatch(p.step, p.version, p.prompts, tuple(p.sampled))
        everyone = comm.all_gather_object(mine)
        if everyone[0] is None:
            return None
        return SourceState(comm.world_size, self.pushed, everyone)

    def restore(self, state: SourceState | None, step_done: int) -> None:
        """After a resume to `step_done`: the sampler has those weights (pushed by the loop), and the saved
        in-flight batch, if any, is the next step's."""
        self.pushed = step_done
        if state is None:
            return
        comm, log = self.sampling.runtime.comm, self.log
        if state.world_size != comm.world_size:
            log(f"note: the checkpoint's in-flight batch was sampled by {state.world_size} rank(s), not "
                f"{comm.world_size}; step {step_done + 1} samples its prompts again with the resumed weights")
            first = state.ranks[0]
            self.submit(first.step, first.prompts)
            return
        mine = state.ranks[comm.rank]
        group = self._group(mine.step, mine.prompts)
        sampled = Sampled(*(None if t is None else torch.as_tensor(t) for t in mine.sampled))
        want = (group.prompt_ids.shape[0], self.sampling.settings.sampling.max_tokens)
        if tuple(sampled.responses.shape) != want:  # resumed with another rollout.n or response length
            log(f"note: the checkpoint's in-flight batch has {tuple(sampled.responses.shape)} responses, this run "
                f"samples {want}; step {step_done + 1} samples its prompts again with the resumed weights")
            self.submit(mine.step, mine.prompts)
            return
        self.pending = Pending(mine.step, mine.prompts, group, mine.version, sampled)
