"""`code`: a code-execution environment. Each answer's Python program (its last fenced ```python block, else its last
fenced block) is run in the tool sandbox (agent/sandbox.py: its own process, isolated at rollout.code.sandbox's
level, limited by rollout.code's timeout, memory and output), and what it printed is written to the row's
`extra_info["execution"]` (`output`, and `error`: None, no_code, or the sandbox's kind: exception, timeout, memory,
output, crash). `reward.function=execution` grades it: the program's last printed line against the ground truth.

The program is the model's own text, so it never runs in the trainer: a sandbox worker forks a process per program,
which holds nothing of the run (agent/sandbox.py says what crosses). `auto` takes namespaces where the host allows
them and refuses the process level, as for the `python` tool. The sampling is `text`'s: one `generate` per round.
This module is the whole generator: its settings, read here from rollout.code, and its class.
"""
from __future__ import annotations

import re
from dataclasses import dataclass, replace
from typing import TYPE_CHECKING

from portagrpo.agent.sandbox import Limits, ToolJob, ToolSandbox
from portagrpo.agent.tools import tool_workers_problem
from portagrpo.errors import UserError
from portagrpo.rollout.engines import RolloutEngine, rollout_batch
from portagrpo.rollout.generators import GENERATORS, Generated, GeneratorInputs, PlainRows, RoundPrompts, group_rows
from portagrpo.rollout.settings import SamplingParams

if TYPE_CHECKING:
    from portagrpo.config.schema import Config

FENCED = re.compile(r"```([A-Za-z0-9_+-]*)[ \t]*\n(.*?)```", re.DOTALL)
ERRORS = ("no_code", "exception", "timeout", "memory", "output", "crash")  # the counted kinds (and "other")


@dataclass(frozen=True)
class CodeSettings:
    """rollout.code: how each program runs."""

    timeout_s: float
    memory_mb: int
    max_output_bytes: int
    workers: int
    sandbox: str

    @classmethod
    def from_config(cls, cfg: Config) -> "CodeSettings":
        from portagrpo.rewards.functions import parse_weighted

        reward = cfg.reward.function
        user = ":" in reward  # path/to/file.py:function reads extra_info["execution"] as it likes
        weighted = None if user else parse_weighted(reward)
        if not user and "execution" not in ([name for name, _ in weighted] if weighted else [reward]):
            raise UserError(f"rollout.generator=code runs each answer's program, and reward.function={reward!r} "
                            f"does not read what it printed; use reward.function=execution (alone, or weighted "
                            f"with others: 'execution*1.0 + format_think*0.1').")
        c = cfg.rollout.code
        return cls(c.timeout_s, c.memory_mb, c.max_output_bytes, c.workers, c.sandbox)


def program_of(text: str) -> str | None:
    """The program an answer gives: its last fenced block marked python (or py), else its last fenced block; None
    without one."""
    blocks = FENCED.findall(text)
    marked = [body for lang, body in blocks if lang.lower() in ("python", "py", "python3")]
    chosen = marked or [body for _, body in blocks]
    return chosen[-1] if chosen else None


@GENERATORS.register("code")
class CodeRows(PlainRows):
    settings = staticmethod(CodeSettings.from_config)

    def __init__(self, inputs: GeneratorInputs, settings: CodeSettings) -> None:
        super().__init__(inputs)
        field = "rollout.code.workers"
        too_many = tool_workers_problem(settings.workers, inputs.local_world_size, field)
        if too_many:
            raise UserError(too_many)
        limits = Limits(settings.timeout_s, settings.memory_mb, settings.max_output_bytes)
        # the `python` tool's target: the program runs as __main__ in the call's process, its output read there
        self.sandbox = ToolSandbox({"python": "builtin:python"}, limits, settings.workers, setting=settings.sandbox,
                                   untrusted=("python",), rank=inputs.rank, field="rollout.code.sandbox",
                                   source="rollout.generator=code")
        isolation = self.sandbox.start()
        if inputs.rank == 0:
            inputs.log(isolation.describe())

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        group = group_rows(prompts, n, engine.pad_id, width, device)
        batch = rollout_batch(self.tokenizer, group, engine.generate(group.prompt_ids, group.prompt_mask, params))
        outcomes = self.run(batch.response_text)
        counts = {"code/rows": float(len(outcomes))}
        for kind in (*ERRORS, "other"):
            counts[f"code/{kind}"] = float(sum(o["error"] == kind or (kind == "other" and o["error"] is not None
                                                                       and o["error"] not in ERRORS)
                                               for o in outcomes))
        extra = [{**info, "execution": outcome} for info, outcome in zip(batch.extra_info, outcomes)]
        return Generated(replace(batch, extra_info=extra), counts)

    def run(self, answers: list[str]) -> list[dict]:
        """Each answer's program run in the sandbox (in parallel over its workers): {"output", "error"}."""
        programs = [program_of(text) for text in answers]
        jobs = [ToolJob("python", "builtin:python", {"code": p}, {}) for p in programs if p is not None]
        results = iter(self.sandbox.run(jobs) if jobs else [])
        outcomes = []
        for program in programs:
            if program is None:
                outcomes.append({"output": "", "error": "no_code"})
                continue
            result = next(results)
            outcomes.append({"output": result.text, "error": result.error})
        return outcomes

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        rows = max(counts["code/rows"], 1.0)
        ran = rows - counts["code/no_code"]
        out = {"code/program_frac": ran / rows}
        out.update({f"code/{kind}_frac": counts[f"code/{kind}"] / rows for kind in (*ERRORS[1:], "other")})
        return out

    def close(self) -> None:
        self.sandbox.close()
