"""`vision`: a vision-language policy's rows. Each record is processed once (its image tokens expanded, its images to
patches); its prompt n times, left-padded, generated with the images; the batch keeps the images once per prompt
(`RolloutBatch.images`), and every later join or selection of rows keeps each row's pixels."""
from __future__ import annotations

from dataclasses import replace

from portagrpo.data.records import PromptRecord, left_pad
from portagrpo.errors import UserError
from portagrpo.model.vision import VisionError, vision_prompts, with_rows
from portagrpo.rollout.engines import GroupPrompts, RolloutEngine, rollout_batch
from portagrpo.rollout.generators import GENERATORS, VISION_NEEDS, Generated, GeneratorInputs, RoundPrompts, repeat
from portagrpo.rollout.settings import SamplingParams


@GENERATORS.register("vision")
class VisionRows:
    def __init__(self, inputs: GeneratorInputs) -> None:
        # a sampler process (rollout.mode=one_step_off) has no processor: it only generates rows whose prompts the
        # trainer made
        self.tokenizer, self.processor = inputs.tokenizer, inputs.processor

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        if self.processor is None:  # a text-only policy (the run's first round: one sentence, not an AttributeError)
            raise UserError(VISION_NEEDS)
        ids, images = vision_prompts(self.processor, records, device)
        return RoundPrompts(records, ids, images, uid_base)

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        rows = repeat(prompts.ids, n)
        ids, mask = left_pad(rows, engine.pad_id, width=width)
        group = GroupPrompts(prompts.records, n, rows, ids.to(device), mask.to(device), prompts.uid_base)
        images = with_rows(prompts.images, n)
        sampled = engine.generate(group.prompt_ids, group.prompt_mask, params, images=images)
        return Generated(replace(rollout_batch(self.tokenizer, group, sampled), images=images))

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        return None

    def check(self, engine: RolloutEngine) -> None:
        check_takes_images(engine)

    def close(self) -> None:
        return None


def check_takes_images(engine: RolloutEngine) -> None:
    if not engine.takes_images:
        raise VisionError(f"the rollout engine ({type(engine).__name__}) does not sample with images; use "
                          f"rollout.engine=hf or vllm for a vision-language policy.")


def vision_rollout(engine: RolloutEngine, processor, records: list[PromptRecord], n: int, params: SamplingParams,
                   device, *, uid_base: int = 0):
    """One process's vision-language rollout of `records` outside a run (eval, tests): the rows as `VisionRows`
    makes them, padded to their own widest prompt."""
    rows = VisionRows(GeneratorInputs(processor.tokenizer, processor, None))
    ready = rows.prompts(records, uid_base, device)
    return rows.generate(engine, ready, n, params, ready.widest, device).rollout
