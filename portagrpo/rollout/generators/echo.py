"""`echo`: the example generator of docs/design.md ("adding a generator"). Each response is its prompt's last
tokens said back, no model involved: it shows what a generator owns (its rows and its counts) and what it does not
(sharing the prompts, seeds, rewards, the gather, the group filter, the schedule: the pipeline's)."""
from __future__ import annotations

import torch

from portagrpo.batch import RolloutBatch
from portagrpo.data.records import PromptRecord, left_pad, tokenize_prompts
from portagrpo.rollout.engines import RolloutEngine, decode_responses
from portagrpo.rollout.generators import GENERATORS, Generated, GeneratorInputs, RoundPrompts, group_ids, repeat
from portagrpo.rollout.settings import SamplingParams


@GENERATORS.register("echo")
class Echo:
    def __init__(self, inputs: GeneratorInputs) -> None:
        self.tokenizer = inputs.tokenizer

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        return RoundPrompts(records, tokenize_prompts(self.tokenizer, records), None, uid_base)

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        rows = repeat(prompts.ids, n)
        ids, mask = left_pad(rows, engine.pad_id, width=width)
        said = [row[-params.max_tokens:] for row in rows]  # each prompt's last tokens, as its response
        keeps = [[1.0] * len(s) + [0.0] * (params.max_tokens - len(s)) for s in said]
        responses = [s + [engine.pad_id] * (params.max_tokens - len(s)) for s in said]
        batch = RolloutBatch(
            prompt_ids=ids.to(device), prompt_mask=mask.to(device), responses=torch.tensor(responses).to(device),
            response_mask=torch.tensor(keeps).to(device), uid=group_ids(prompts, n, device),
            prompt_index=torch.tensor(repeat([r.index for r in prompts.records], n), device=device),
            response_text=decode_responses(self.tokenizer, responses, keeps),
            ground_truth=repeat([r.ground_truth for r in prompts.records], n),
            data_source=repeat([r.data_source for r in prompts.records], n),
            extra_info=repeat([r.extra_info for r in prompts.records], n),
            lengths=[(len(r), len(s)) for r, s in zip(rows, said)])  # no sampler log-probs: nothing was sampled
        return Generated(batch, {"echo/tokens": float(sum(len(s) for s in said)), "echo/rows": float(len(said))})

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        return {"echo/tokens_mean": counts["echo/tokens"] / max(counts["echo/rows"], 1.0)}

    def check(self, engine: RolloutEngine) -> None:
        return None

    def close(self) -> None:
        return None
