"""Generators: how one round's rows are made, by name (`rollout.generator`; auto picks `conversation` with
rollout.multi_turn, `vision` for a vision-language policy, else `text`).

The rollout pipeline (train/pipeline.py) runs every round in one order: share the prompts, `prompts()` (this rank's
records as token ids, with their images), one prompt width over the ranks, seed, `generate()` with an engine, then
score, gather and keep. A generator is one module in this package that registers one class in `GENERATORS`: its
`settings(cfg)` reads its own part of the config into a frozen value (or refuses the config in one sentence), and
`cls(inputs, settings)` builds it. The run carries one `GeneratorSpec` (the name and those settings) to wherever the
generator is built: the trainer (sampling in the step, and validation) and a sampler process (rollout.mode=
one_step_off), where it generates with that process's engine, tools included. Apart from `settings`, it never reads
the config, never collects over ranks except through `lockstep`, and returns its counts instead of keeping them:
`generate` answers `Generated(rollout, counts)`, the pipeline sums the counts over rounds and ranks and asks
`metrics(total)` for the step's logged values. `PlainRows` and `group_rows` are what most generators share: prompts
tokenized with the chat template, each prompt n times left-padded, and the batch made by `rollout_batch`.
"""
from __future__ import annotations

import importlib
import pkgutil
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, Callable, Protocol

import torch

from portagrpo.batch import RolloutBatch
from portagrpo.data.records import PromptRecord, left_pad, tokenize_prompts
from portagrpo.registry import Registry
from portagrpo.rollout.engines import GroupPrompts
from portagrpo.rollout.settings import SamplingParams

if TYPE_CHECKING:
    from portagrpo.backends.dist import Collectives
    from portagrpo.config.schema import Config
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
    """What a generator is built from besides its own settings: what every generator may use."""

    tokenizer: Any  # a Hugging Face tokenizer (transformers' own type); a processor's tokenizer for a VL policy
    processor: Any = None  # a vision-language policy's processor, else None
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


class GeneratorKind(Protocol):
    """What `GENERATORS` holds: a generator class, with its settings read next to it."""

    def settings(self, cfg: Config) -> Any:
        """This generator's settings from the run's config: a frozen, picklable value (it crosses to a sampler
        process), None where it has none; a `UserError` in one sentence where the config cannot run it."""

    def __call__(self, inputs: GeneratorInputs, settings: Any) -> Generator: ...


GENERATORS: Registry[GeneratorKind] = Registry("generator")


@dataclass(frozen=True)
class GeneratorSpec:
    """The run's generator, as the trainer and a sampler process build it: its registered name and its settings."""

    name: str
    settings: Any = None


def discover() -> None:
    for module in pkgutil.iter_modules(__path__):
        importlib.import_module(f"{__name__}.{module.name}")


def generator_name(cfg: Config) -> str:
    """rollout.generator, with `auto` resolved: a conversation with rollout.multi_turn on, vision rows for a
    vision-language policy, else text."""
    from portagrpo.paths import uses_vision

    chosen = cfg.rollout.generator
    if chosen != "auto":
        return chosen
    return "conversation" if cfg.rollout.multi_turn.enable else "vision" if uses_vision(cfg.model) else "text"


def generator_spec(cfg: Config) -> GeneratorSpec:
    """The run's generator: rollout.generator resolved, and the settings that generator reads from `cfg`."""
    name = generator_name(cfg)
    discover()
    return GeneratorSpec(name, GENERATORS.get(name, field="rollout.generator").settings(cfg))


VISION_NEEDS = ("rollout.generator=vision makes a vision-language policy's rows, and this policy is text-only (no "
                "processor at model.path, or model.tokenizer_path set); use rollout.generator=auto or text, or a "
                "vision-language model.")


def generator_problem(cfg: Config, vision_policy: bool | None) -> str | None:
    """Why the run's generator cannot run, or None: an unknown name, `vision` for a policy known to be text-only
    (`vision_policy` False; None where this machine cannot tell), or what the generator's own settings refuse (a
    conversation without rollout.multi_turn). The same sentences the run stops with."""
    from portagrpo.errors import UserError

    if cfg.rollout.generator == "vision" and vision_policy is False:
        return VISION_NEEDS
    try:
        generator_spec(cfg)
    except UserError as err:
        return str(err)
    return None


def make_generator(spec: GeneratorSpec, inputs: GeneratorInputs) -> Generator:
    """The generator `spec` names, built from `inputs` and its settings."""
    discover()
    return GENERATORS.get(spec.name, field="rollout.generator")(inputs, spec.settings)


def one_round(generator: Generator, engine: RolloutEngine, records: list[PromptRecord], n: int,
              params: SamplingParams, device, uid_base: int = 0) -> RolloutBatch:
    """One process's round of `records` outside a run's pipeline (evaluation, tests): the generator's rows, padded to
    their own widest prompt, without the pipeline's sharing, seeding, scoring or gather."""
    ready = generator.prompts(records, uid_base, device)
    return generator.generate(engine, ready, n, params, ready.widest, device).rollout


# ---- what most generators share


def repeat(values: list, n: int) -> list:
    """Each value n times, in order (a group's rows)."""
    return [x for x in values for _ in range(n)]


def group_ids(prompts: RoundPrompts, n: int, device) -> torch.Tensor:
    """[B] each row's group id: its record's, from `uid_base` on."""
    return torch.arange(len(prompts.records), device=device).repeat_interleave(n) + prompts.uid_base


def group_rows(prompts: RoundPrompts, n: int, pad_id: int, width: int, device) -> GroupPrompts:
    """Each prompt n times (a group, rows prompt after prompt), left-padded to `width` at least, on `device`: what
    an engine samples from, and what `rollout_batch` (rollout/engines.py) makes the round's batch of."""
    rows = repeat(prompts.ids, n)
    ids, mask = left_pad(rows, pad_id, width=width)
    return GroupPrompts(prompts.records, n, rows, ids.to(device), mask.to(device), prompts.uid_base)


class PlainRows:
    """What a text generator needs beyond its `generate`: no settings, the prompts tokenized with the chat template,
    no metrics, nothing to check or release. A generator may take any of these over."""

    def __init__(self, inputs: GeneratorInputs, settings: Any = None) -> None:
        self.tokenizer = inputs.tokenizer

    @staticmethod
    def settings(cfg: Config) -> Any:
        return None

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        return RoundPrompts(records, tokenize_prompts(self.tokenizer, records), None, uid_base)

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        return None

    def check(self, engine: RolloutEngine) -> None:
        return None

    def close(self) -> None:
        return None
