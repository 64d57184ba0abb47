"""`echo`: the example generator of docs/design.md ("adding a generator"). Each response is its prompt's last
tokens said back, no model involved: it shows what a generator owns (its rows and its counts) and what it does not
(sharing the prompts, seeds, rewards, the gather, the group filter, the schedule: the pipeline's)."""
from __future__ import annotations

from portagrpo.rollout.engines import RolloutEngine, rollout_batch, sampled_rows
from portagrpo.rollout.generators import GENERATORS, Generated, PlainRows, RoundPrompts, group_rows
from portagrpo.rollout.settings import SamplingParams


@GENERATORS.register("echo")
class Echo(PlainRows):
    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        group = group_rows(prompts, n, engine.pad_id, width, device)
        said = [row[-params.max_tokens:] for row in group.ids]  # each prompt's last tokens, as its response
        # no sampler log-probs: nothing was sampled
        batch = rollout_batch(self.tokenizer, group, sampled_rows(said, engine.pad_id, params.max_tokens, device))
        return Generated(batch, {"echo/tokens": float(sum(len(s) for s in said)), "echo/rows": float(len(said))})

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        return {"echo/tokens_mean": counts["echo/tokens"] / max(counts["echo/rows"], 1.0)}
