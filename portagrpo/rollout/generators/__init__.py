"""Generators: how one round's rows are made, by name (`rollout.generator`; auto picks `conversation` with
rollout.multi_turn, `vision` for a vision-language policy, else `text`).

The rollout pipeline (train/pipeline.py) runs every round in one order: share the prompts, `prompts()` (this rank's
records as token ids, with their images), one prompt width over the ranks, seed, `generate()` with an engine, then
score, gather and keep. A generator is one module in this package that registers its class in `GENERATORS`; it is
built from `GeneratorInputs` in the trainer (sampling in the step, and validation) and in a sampler process
(rollout.mode=one_step_off), where it generates with that process's engine, tools included. It never reads the
config, never collects over ranks except through `lockstep`, and returns its counts instead of keeping them:
`generate` answers `Generated(rollout, counts)`, the pipeline sums the counts over rounds and ranks and asks
`metrics(total)` for the step's logged values.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from portagrpo.batch import RolloutBatch
from portagrpo.registry import Registry
from portagrpo.rollout.settings import MultiTurnSettings, SamplingParams

if TYPE_CHECKING:
    from portagrpo.backends.dist import Collectives
    from portagrpo.data.records import PromptRecord
    from portagrpo.model.vision import PromptImages
    from portagrpo.rollout.engines import RolloutEngine


@dataclass(frozen=True)
class RoundPrompts:
    """One round's prompts on this rank, ready to generate: each record's prompt tokens (unpadded) and its images."""

    records: list[PromptRecord]
    ids: list[list[int]]  # per record
    images: PromptImages | None  # per record (row_prompt: the record), a vision-language policy's
    uid_base: int  # the first record's group id

    @property
    def widest(self) -> int:
        return max((len(x) for x in self.ids), default=0)

    def to(self, device) -> "RoundPrompts":
        images = None if self.images is None else self.images.to(device)
        return RoundPrompts(self.records, self.ids, images, self.uid_base)


@dataclass
class Generated:
    """A round's rows on this rank, and the generator's counts over them (summed over rounds and ranks, then turned
    into the step's metrics by `Generator.metrics`)."""

    rollout: RolloutBatch
    counts: dict[str, float] = field(default_factory=dict)

    def to(self, device) -> "Generated":
        return Generated(self.rollout.to(device), self.counts)


@dataclass(frozen=True)
class GeneratorInputs:
    """What a generator is built from."""

    tokenizer: Any  # a Hugging Face tokenizer (transformers' own type); a processor's tokenizer for a VL policy
    processor: Any  # a vision-language policy's processor, else None
    multi_turn: MultiTurnSettings | None  # rollout.multi_turn (its tools), when it is on
    rank: int = 0
    local_world_size: int = 1
    # ranks that generate every turn together (an engine spanning ranks: vLLM's tensor-parallel group, or generation
    # under FSDP2); None in a sampler process, whose engine is its own
    lockstep: Collectives | None = None
    log: Callable[[str], None] = print


class Generator(Protocol):
    """How one round's rows are made. Everything the pipeline and the sampler process use is declared here."""

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        """This rank's records of a round as prompt tokens (and images): no collective, no sampling."""

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        """Each prompt n times (a group, rows prompt after prompt), left-padded to `width` (at least), sampled with
        `engine` (its stream already seeded): this rank's rows and the generator's counts."""

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        """The step's logged values from its counts summed over rounds and ranks; None when it has none."""

    def check(self, engine: RolloutEngine) -> None:
        """One sentence where `engine` cannot sample this generator's rows."""

    def close(self) -> None:
        """Release what it started (a tool sandbox)."""


GENERATORS: Registry[Callable[[GeneratorInputs], Generator]] = Registry("generator")


def discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


CONVERSATION_NEEDS = ("rollout.generator=conversation needs rollout.multi_turn.enable=true and its tool_config_path "
                      "(the tools a conversation calls).")
VISION_NEEDS = ("rollout.generator=vision makes a vision-language policy's rows, and this policy is text-only (no "
                "processor at model.path, or model.tokenizer_path set); use rollout.generator=auto or text, or a "
                "vision-language model.")


def generator_problem(name: str, vision_policy: bool | None, multi_turn: bool) -> str | None:
    """Why rollout.generator=`name` cannot run, or None: an unknown name, `vision` for a policy known to be text-only
    (`vision_policy` False; None where this machine cannot tell), `conversation` without rollout.multi_turn. The
    same sentences the run stops with (`make_generator` and the generators' own)."""
    from portagrpo.errors import UnknownNameError

    if name == "auto":
        return None
    discover()
    try:
        GENERATORS.get(name, field="rollout.generator")
    except UnknownNameError as err:
        return str(err)
    if name == "vision" and vision_policy is False:
        return VISION_NEEDS
    if name == "conversation" and not multi_turn:
        return CONVERSATION_NEEDS
    return None


def make_generator(name: str, inputs: GeneratorInputs) -> Generator:
    """The generator `name` (rollout.generator, resolved), built from `inputs`."""
    discover()
    return GENERATORS.get(name, field="rollout.generator")(inputs)


def repeat(values: list, n: int) -> list:
    """Each value n times, in order (a group's rows)."""
    return [x for x in values for _ in range(n)]


def group_ids(prompts: RoundPrompts, n: int, device) -> torch.Tensor:
    """[B] each row's group id: its record's, from `uid_base` on."""
    return torch.arange(len(prompts.records), device=device).repeat_interleave(n) + prompts.uid_base
