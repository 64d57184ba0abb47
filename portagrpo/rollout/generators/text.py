"""`text`: each prompt tokenized as the model sees it (its chat template), n times, one `generate` of the engine."""
from __future__ import annotations

from portagrpo.data.records import PromptRecord, left_pad, tokenize_prompts
from portagrpo.rollout.engines import GroupPrompts, RolloutEngine, rollout_batch
from portagrpo.rollout.generators import GENERATORS, Generated, GeneratorInputs, RoundPrompts, repeat
from portagrpo.rollout.settings import SamplingParams


@GENERATORS.register("text")
class TextRows:
    def __init__(self, inputs: GeneratorInputs) -> None:
        self.tokenizer = inputs.tokenizer

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        return RoundPrompts(records, tokenize_prompts(self.tokenizer, records), None, uid_base)

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        rows = repeat(prompts.ids, n)
        ids, mask = left_pad(rows, engine.pad_id, width=width)
        group = GroupPrompts(prompts.records, n, rows, ids.to(device), mask.to(device), prompts.uid_base)
        return Generated(rollout_batch(self.tokenizer, group, engine.generate(group.prompt_ids, group.prompt_mask,
                                                                              params)))

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        return None

    def check(self, engine: RolloutEngine) -> None:
        return None

    def close(self) -> None:
        return None
