"""`text`: each prompt tokenized as the model sees it (its chat template), n times, one `generate` of the engine."""
from __future__ import annotations

from portagrpo.rollout.engines import RolloutEngine, rollout_batch
from portagrpo.rollout.generators import GENERATORS, Generated, PlainRows, RoundPrompts, group_rows
from portagrpo.rollout.settings import SamplingParams


@GENERATORS.register("text")
class TextRows(PlainRows):
    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        group = group_rows(prompts, n, engine.pad_id, width, device)
        return Generated(rollout_batch(self.tokenizer, group, engine.generate(group.prompt_ids, group.prompt_mask,
                                                                              params)))
