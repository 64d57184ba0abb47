"""`vision`: a vision-language policy's rows. Each record is processed once (its image tokens expanded, its images to
patches); its prompt n times, left-padded, generated with the images; the batch keeps the images once per prompt
(`RolloutBatch.images`), and every later join or selection of rows keeps each row's pixels."""
from __future__ import annotations

from dataclasses import replace
from typing import Any

from portagrpo.data.records import PromptRecord
from portagrpo.errors import UserError
from portagrpo.model.vision import VisionError, vision_prompts, with_rows
from portagrpo.rollout.engines import RolloutEngine, rollout_batch
from portagrpo.rollout.generators import (
    GENERATORS,
    VISION_NEEDS,
    Generated,
    GeneratorInputs,
    PlainRows,
    RoundPrompts,
    group_rows,
)
from portagrpo.rollout.settings import SamplingParams


@GENERATORS.register("vision")
class VisionRows(PlainRows):
    def __init__(self, inputs: GeneratorInputs, settings: Any = None) -> None:
        # a sampler process (rollout.mode=one_step_off) has no processor: it only generates rows whose prompts the
        # trainer made
        super().__init__(inputs)
        self.processor = inputs.processor

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        if self.processor is None:  # a text-only policy (the run's first round: one sentence, not an AttributeError)
            raise UserError(VISION_NEEDS)
        ids, images = vision_prompts(self.processor, records, device)
        return RoundPrompts(records, ids, images, uid_base)

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        group = group_rows(prompts, n, engine.pad_id, width, device)
        images = with_rows(prompts.images, n)
        sampled = engine.generate(group.prompt_ids, group.prompt_mask, params, images=images)
        return Generated(replace(rollout_batch(self.tokenizer, group, sampled), images=images))

    def check(self, engine: RolloutEngine) -> None:
        check_takes_images(engine)


def check_takes_images(engine: RolloutEngine) -> None:
    if not engine.takes_images:
        raise VisionError(f"the rollout engine ({type(engine).__name__}) does not sample with images; use "
                          f"rollout.engine=hf or vllm for a vision-language policy.")
