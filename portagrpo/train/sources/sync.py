"""The plain source: the step's prompts are sampled and scored when the step asks for them."""
from __future__ import annotations

from portagrpo.data.records import PromptRecord
from portagrpo.train.build import Models
from portagrpo.train.experience import ExperienceSettings, ScoredRollout
from portagrpo.train.sources import SOURCES, SourceInputs, SourceState


class InStepSource:
    """What every source that samples when its step asks has in common: nothing is in flight between steps (no
    state to save, no sampler of its own to push to), and a resumed overlapped checkpoint's in-flight prompts are
    its first step's prompts. A subclass writes `scored(step, prompts)`."""

    def __init__(self, inputs: SourceInputs) -> None:
        self.sampling, self.loader, self.log = inputs.sampling, inputs.loader, inputs.log
        self.first: list[PromptRecord] | None = None  # a resumed run's first prompts, when already drawn

    def next(self, step: int) -> ScoredRollout:
        prompts, self.first = self.first or self.loader.next_batch(), None
        return self.scored(step, prompts)

    def scored(self, step: int, prompts: list[PromptRecord]) -> ScoredRollout:
        raise NotImplementedError

    def push(self, models: Models) -> None:
        return None

    def state(self) -> SourceState | None:
        return None

    def restore(self, state: SourceState | None, step_done: int) -> None:
        self.first = resumed_prompts(state)


@SOURCES.register("sync")
class SyncSource(InStepSource):
    @classmethod
    def claims(cls, settings: ExperienceSettings) -> bool:
        return settings.mode == "sync" and settings.filter_metric is None

    def scored(self, step: int, prompts: list[PromptRecord]) -> ScoredRollout:
        return self.sampling.sample_and_score(step, prompts)


def resumed_prompts(state: SourceState | None) -> list[PromptRecord] | None:
    """An overlapped run's checkpoint resumed by a source that samples in the step: its loader already handed out
    the batch that was in flight, so the next step trains on those prompts (sampled again, now in step)."""
    return state.ranks[0].prompts if state is not None and state.ranks else None
