"""A rollout's tools: an assistant turn's calls parsed, checked, run in the sandbox, and counted."""
from __future__ import annotations

from dataclasses import dataclass

from portagrpo.agent.hermes import parse_tool_calls
from portagrpo.agent.sandbox import Limits, ToolJob, ToolResult, ToolSandbox
from portagrpo.agent.tools import argument_problem
from portagrpo.config.tool_file import ToolSpec, load_tool_config


@dataclass
class ToolCounts:
    """Tool use over a rollout: `tool/calls`, `tool/errors` (timeouts included), `tool/timeouts`, and its turns."""

    calls: int = 0
    errors: int = 0
    timeouts: int = 0
    turns: int = 0  # assistant turns of the rollout's samples (`turns_mean` = turns / samples)
    samples: int = 0

    def add(self, result: ToolResult) -> None:
        self.calls += 1
        self.errors += result.error is not None
        self.timeouts += result.error == "timeout"

    def metrics(self) -> dict[str, float]:
        return {"tool/calls": float(self.calls), "tool/errors": float(self.errors),
                "tool/timeouts": float(self.timeouts), "turns_mean": self.turns / max(self.samples, 1)}


class Toolbox:
    """The declared tools and the sandbox their calls run in."""

    def __init__(self, specs: dict[str, ToolSpec], limits: Limits, workers: int = 2, sandbox: str = "auto",
                 rank: int = 0) -> None:
        """`sandbox`: rollout.multi_turn.sandbox (agent/isolation.py's levels, or auto)."""
        self.specs = specs
        untrusted = tuple(name for name, s in specs.items() if s.untrusted)  # tools that run model-written code
        self.sandbox = ToolSandbox({name: s.target for name, s in specs.items()}, limits, workers, setting=sandbox,
                                   untrusted=untrusted, rank=rank)

    @classmethod
    def from_file(cls, path: str, limits: Limits, workers: int = 2, sandbox: str = "auto",
                  rank: int = 0) -> "Toolbox":
        return cls(load_tool_config(path), limits, workers, sandbox, rank)

    def answer(self, turns: list[tuple[str, dict]], counts: ToolCounts | None = None) -> list[list[ToolResult] | None]:
        """For each assistant turn (its text and the sample's context): None when it calls no tool (it answered),
        else one result per call. Every call is run, and every failure is a result with an error."""
        out: list[list[ToolResult] | None] = []
        jobs, where = [], []
        for k, (text, context) in enumerate(turns):
            calls = parse_tool_calls(text)
            if not calls:
                out.append(None)
                continue
            row: list[ToolResult | None] = []
            for call in calls:
                row.append(self._refusal(call))
                if row[-1] is None:
                    spec = self.specs[call.name]
                    jobs.append(ToolJob(spec.name, spec.target, call.arguments, context, spec.network))
                    where.append((k, len(row) - 1))
            out.append(row)  # type: ignore[arg-type]
        for (k, j), result in zip(where, self.sandbox.run(jobs) if jobs else []):
            out[k][j] = result  # type: ignore[index]
        if counts is not None:
            for row in out:
                for result in row or []:
                    counts.add(result)
        return out

    def _refusal(self, call) -> ToolResult | None:
        if call.problem is not None:
            return ToolResult(f"Error: {call.problem}.", "parse")
        if call.name not in self.specs:
            return ToolResult(f"Error: there is no tool {call.name!r}; the tools are {', '.join(self.specs)}.",
                              "unknown_tool")
        problem = argument_problem(self.specs[call.name], call.arguments)
        return None if problem is None else ToolResult(f"Error: {problem}.", "arguments")

    def close(self) -> None:
        self.sandbox.close()
