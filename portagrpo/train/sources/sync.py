"""The plain source: the step's prompts are sampled and scored when the step asks for them."""
from __future__ import annotations

from portagrpo.data.records import PromptRecord
from portagrpo.train.build import Models
from portagrpo.train.experience import ExperienceSettings, ScoredRollout
from portagrpo.train.sources import SOURCES, SourceInputs, SourceState


@SOURCES.register("sync")
class SyncSource:
    @classmethod
    def claims(cls, settings: ExperienceSettings) -> bool:
        return settings.mode == "sync" and settings.filter_metric is None

    def __init__(self, inputs: SourceInputs) -> None:
        self.sampling, self.loader = inputs.sampling, inputs.loader
        self.first: list[PromptRecord] | None = None  # a resumed run's first prompts, when already drawn

    def next(self, step: int) -> ScoredRollout:
        prompts, self.first = self.first or self.loader.next_batch(), None
        return self.sampling.sample_and_score(step, prompts)

    def push(self, models: Models) -> None:
        return None

    def state(self) -> SourceState | None:
        return None

    def restore(self, state: SourceState | None, step_done: int) -> None:
        self.first = resumed_prompts(state)


def resumed_prompts(state: SourceState | None) -> list[PromptRecord] | None:
    """An overlapped run's checkpoint resumed by a source that samples in the step: its loader already handed out
    the batch that was in flight, so the next step trains on those prompts (sampled again, now in step)."""
    return state.ranks[0].prompts if state is not None and state.ranks else None
