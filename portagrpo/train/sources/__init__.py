"""Batch sources: where a step's scored global batch comes from. The loop asks its one source for the next batch
(`BatchSource.next(step) -> ScoredRollout`) and never branches on how it was sampled.

- `sync.py`: sample the step's prompts, then score them (the default);
- `one_step_off.py`: batch k+1 sampled by a sampler process while the trainer updates on batch k;
- `filtered.py`: DAPO's dynamic sampling, rounds of prompts until the batch holds only groups with a spread.

A new source is one new module here: it registers its class in `SOURCES` and says, from the experience settings,
whether it samples this run (`claims`). Each is made of the same pieces (`train/sampling.py: Sampling`), so the
seed and group-id streams and the old/reference log-prob pair are written once.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import Any, Callable, Protocol

import torch

from portagrpo.data.records import PromptLoader, PromptRecord
from portagrpo.errors import UserError
from portagrpo.registry import Registry
from portagrpo.rollout.engines import AheadSampler
from portagrpo.train.build import Models
from portagrpo.train.experience import ExperienceSettings, ScoredRollout
from portagrpo.train.sampling import Sampling


@dataclass(frozen=True)
class InflightBatch:
    """One rank's batch sampled ahead of its step, kept whole in a checkpoint (`inflight.pt`)."""

    step: int  # the step that trains on it
    version: int  # the weight version the sampler held
    prompts: list[PromptRecord]  # the step's global prompt batch
    sampled: tuple[torch.Tensor | None, ...]  # the sampler's output (rollout.engines.Sampled, as a tuple)


@dataclass(frozen=True)
class SourceState:
    """A source's state in a checkpoint: every rank's batch in flight. On disk as the plain dict of `to_saved`,
    the layout earlier versions wrote, so their checkpoints still resume."""

    world_size: int
    pushed: int  # weight versions pushed to the sampler
    ranks: list[InflightBatch] = field(default_factory=list)

    def to_saved(self) -> dict[str, Any]:
        return {"world_size": self.world_size, "pushed": self.pushed,
                "ranks": [{"step": r.step, "version": r.version, "prompts": r.prompts, "sampled": r.sampled}
                          for r in self.ranks]}

    @classmethod
    def from_saved(cls, saved: dict[str, Any] | None) -> "SourceState | None":
        if saved is None:
            return None
        ranks = [InflightBatch(r["step"], r["version"], r["prompts"], tuple(r["sampled"])) for r in saved["ranks"]]
        return cls(saved["world_size"], saved["pushed"], ranks)


class BatchSource(Protocol):
    """Where the loop gets each step's scored global batch."""

    def next(self, step: int) -> ScoredRollout:
        """The scored global batch that step `step` trains on (every rank calls it: it may be a collective)."""

    def push(self, models: Models) -> None:
        """The policy after an update, for a sampler that holds its own copy (a no-op for the others)."""

    def state(self) -> SourceState | None:
        """What a checkpoint must keep to continue exactly (a collective); None when nothing is in flight."""

    def restore(self, state: SourceState | None, step_done: int) -> None:
        """After a resume to `step_done`, with the checkpoint's `state` (possibly another source's)."""


@dataclass(frozen=True)
class SourceInputs:
    """What a source is built from."""

    settings: ExperienceSettings
    sampling: Sampling
    loader: PromptLoader
    sampler: AheadSampler | None  # rollout.mode=one_step_off: this rank's sampler process
    total_steps: int
    log: Callable[[str], None]


class SourceKind(Protocol):
    """A registered source class."""

    @classmethod
    def claims(cls, settings: ExperienceSettings) -> bool:
        """Whether this source samples a run with these settings."""

    def __init__(self, inputs: SourceInputs) -> None: ...


SOURCES: Registry[SourceKind] = Registry("batch source")


def _discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def make_source(inputs: SourceInputs) -> BatchSource:
    """The one source that claims the run's settings."""
    _discover()
    claimed = [name for name in SOURCES.names() if SOURCES.get(name).claims(inputs.settings)]
    if len(claimed) != 1:
        raise UserError(f"rollout.mode={inputs.settings.mode} with these settings is claimed by "
                        f"{' and '.join(claimed) or 'no batch source'}; choose a setting one source samples "
                        f"({', '.join(SOURCES.names())}).")
    return SOURCES.get(claimed[0])(inputs)
