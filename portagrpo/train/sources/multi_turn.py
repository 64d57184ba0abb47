"""Multi-turn, tool-using rollouts (`rollout.multi_turn.enable`): each sample alternates model turns and tool turns.

A sample goes on while its last model turn ended with an end token and called a tool: the calls run in the
sandbox (agent/), their results are rendered as a tool turn in the chat template and appended as token ids, and
the model writes its next turn. It stops when it answers without a tool call, reaches
`rollout.multi_turn.max_assistant_turns`, or fills `data.max_response_length`, which counts every token after the
prompt. Each turn is generated in one batch over the samples still going (left-padded contexts); the model's own
token ids are kept as sampled, never re-tokenized.

The response is everything after the prompt, and `RolloutBatch.model_mask` marks the model's own tokens: tool and
template tokens stay in the context (`response_mask`) and are scored, but never trained, and the sampler's
log-probs exist only for the model's tokens (0 elsewhere). The loss mask and the GRPO normalisers then count only
trained tokens (`TrainBatch.mask`).
"""
from __future__ import annotations

import time
from contextlib import nullcontext
from dataclasses import dataclass, field, replace

import torch

from portagrpo.agent.hermes import ToolTurns
from portagrpo.agent.sandbox import Limits
from portagrpo.agent.toolbox import Toolbox, ToolCounts
from portagrpo.agent.tools import tool_workers_problem
from portagrpo.batch import RolloutBatch
from portagrpo.data.records import PromptRecord, left_pad, tokenize_prompts
from portagrpo.errors import UserError
from portagrpo.rollout.engines import GroupPrompts, SamplingParams, decode_responses, stop_token_ids
from portagrpo.train.experience import ExperienceSettings, ScoredRollout
from portagrpo.train.sources import SOURCES, SourceInputs
from portagrpo.train.sources.filtered import FilteredSource
from portagrpo.train.sources.sync import InStepSource


@dataclass
class Conversation:
    """One sample's response so far: token ids after the prompt, which are the model's, their sampler log-probs."""

    prompt: list[int]
    context: dict  # what a tool may ask for (ground_truth)
    tokens: list[int] = field(default_factory=list)
    own: list[float] = field(default_factory=list)
    logp: list[float] = field(default_factory=list)
    turns: int = 0

    def add(self, tokens: list[int], own: bool, logp: list[float] | None = None) -> None:
        self.tokens += tokens
        self.own += [1.0 if own else 0.0] * len(tokens)
        self.logp += logp if logp is not None else [0.0] * len(tokens)


class MultiTurnRollout:
    """Samples conversations with an engine and a toolbox (every rank its own share, as a plain rollout)."""

    def __init__(self, engine, tokenizer, toolbox: Toolbox, turns: ToolTurns, max_turns: int, comm=None) -> None:
        """`comm`: the training ranks, which then generate each turn together (an engine that spans ranks, vLLM's
        tensor-parallel group or generation under FSDP2, needs every rank in every `generate`)."""
        self.engine, self.tokenizer, self.toolbox, self.turns, self.max_turns = (engine, tokenizer, toolbox, turns,
                                                                                 max_turns)
        self.comm = comm if comm is not None and comm.world_size > 1 else None
        self.eos = set(getattr(engine, "eos_ids", None) or stop_token_ids(tokenizer))
        self.schemas = [spec.schema for spec in toolbox.specs.values()]

    def prompt_ids(self, records: list[PromptRecord]) -> list[list[int]]:
        """Each prompt's tokens; chat prompts are rendered with the tools' schemas (`tools=`), as the chat template
        lists them for the model (Qwen's writes them and the Hermes instructions into the system message)."""
        return tokenize_prompts(self.tokenizer, records, self.schemas)

    def check_context(self, ids: list[list[int]], max_tokens: int) -> None:
        """One sentence where a prompt with its tools' schemas and a whole response would not fit an engine's context
        (vLLM's max_model_len), which would end its conversation early, silently (or refuse the prompt)."""
        context = self.engine.max_model_len
        longest = max((len(x) for x in ids), default=0)
        if context is not None and longest + max_tokens > context:
            raise UserError(f"a prompt rendered with the tools' schemas, as multi-turn sends it, has {longest} tokens, "
                            f"which with data.max_response_length={max_tokens} exceeds vLLM's context of {context} "
                            f"tokens; set rollout.vllm_max_model_len to at least {longest + max_tokens}, or raise "
                            f"data.max_prompt_length to the prompts' length with their schemas.")

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, device, *, uid_base: int,
                prompt_width: int | None, counts: ToolCounts) -> RolloutBatch:
        ids = [x for x in self.prompt_ids(records) for _ in range(n)]
        self.check_context(ids, params.max_tokens)
        prompt_ids, prompt_mask = left_pad(ids, self.engine.pad_id, width=prompt_width)
        group = GroupPrompts(records, n, ids, prompt_ids.to(device), prompt_mask.to(device), uid_base)
        talks = [Conversation(ids, {"ground_truth": records[i // n].ground_truth})
                 for i, ids in enumerate(group.ids)]
        has_logp = self.converse(talks, params, device, counts)
        counts.turns += sum(t.turns for t in talks)
        counts.samples += len(talks)
        return self.batch(group, talks, params.max_tokens, has_logp)

    def converse(self, talks: list[Conversation], params: SamplingParams, device, counts: ToolCounts) -> bool:
        """Model and tool turns until no sample goes on (on any rank); False when the engine reported no log-probs.
        An engine that sleeps between rollouts (vLLM on GPU/NPU) stays awake for all of them: one wake, and the
        weights the step pushed, for every turn."""
        going, has_logp = list(range(len(talks))), True
        with self.engine.turns():  # vLLM that sleeps: one wake and one weights load for every turn
            while True:
                room = max((params.max_tokens - len(talks[i].tokens) for i in going), default=0)
                if self.comm is not None:  # one turn on every rank while any rank has a sample going, of one length
                    going_anywhere, room = self.comm.all_reduce_max(torch.tensor([len(going), room], device=device))
                    going_anywhere, room = int(going_anywhere), int(room)
                else:
                    going_anywhere = len(going)
                if not going_anywhere:
                    return has_logp
                has_logp &= self.model_turn([talks[i] for i in going], params, device, room, spare=talks[0])
                going = self.tool_turn(going, talks, params.max_tokens, counts)

    def model_turn(self, talks: list[Conversation], params: SamplingParams, device, room: int,
                   spare: Conversation) -> bool:
        """One model turn for every sample still going, in one batch of at most `room` new tokens; False when the
        engine reports no log-probs. A rank with none going generates for `spare` and keeps nothing."""
        ids, mask = left_pad([t.prompt + t.tokens for t in talks or [spare]], self.engine.pad_id)
        sampled = self.engine.generate(ids.to(device), mask.to(device), replace(params, max_tokens=room))
        tokens, keep = sampled.responses.tolist(), sampled.mask.tolist()  # the turn's one read
        logps = None if sampled.logp is None else sampled.logp.tolist()
        for k, talk in enumerate(talks):
            count = min(round(sum(keep[k])), params.max_tokens - len(talk.tokens))
            talk.add(tokens[k][:count], True, None if logps is None else logps[k][:count])
            talk.turns += 1
        return logps is not None

    def tool_turn(self, going: list[int], talks: list[Conversation], budget: int, counts: ToolCounts) -> list[int]:
        """The tools of every sample whose last turn ended and called some; the samples that go on."""
        asked = []
        for i in going:
            talk = talks[i]
            ended = bool(talk.tokens) and talk.own[-1] == 1.0 and talk.tokens[-1] in self.eos
            if ended and talk.turns < self.max_turns and len(talk.tokens) < budget:
                asked.append(i)
        last = [self.last_turn_text(talks[i]) for i in asked]
        answers = self.toolbox.answer([(text, talks[i].context) for i, text in zip(asked, last)], counts)
        still = []
        for i, results in zip(asked, answers):
            if results is None:  # it answered
                continue
            talk = talks[i]
            talk.add(self.turns.ids([r.text for r in results])[:budget - len(talk.tokens)], False)
            if len(talk.tokens) < budget:
                still.append(i)
        return still

    def last_turn_text(self, talk: Conversation) -> str:
        start = len(talk.own)
        while start > 0 and talk.own[start - 1] == 1.0:
            start -= 1
        return self.tokenizer.decode(talk.tokens[start:], skip_special_tokens=True)

    def batch(self, group, talks: list[Conversation], width: int, has_logp: bool) -> RolloutBatch:
        device, pad, n = group.prompt_ids.device, self.engine.pad_id, group.n
        rows = [t.tokens + [pad] * (width - len(t.tokens)) for t in talks]
        keeps = [[1.0] * len(t.tokens) + [0.0] * (width - len(t.tokens)) for t in talks]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        records = group.records
        rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
        return RolloutBatch(
            prompt_ids=group.prompt_ids, prompt_mask=group.prompt_mask, responses=tensor(rows, torch.long),
            response_mask=tensor(keeps, torch.float32),
            uid=torch.arange(len(records), device=device).repeat_interleave(n) + group.uid_base,
            prompt_index=torch.tensor(rep([r.index for r in records]), device=device),
            response_text=decode_responses(self.tokenizer, rows, keeps),
            ground_truth=rep([r.ground_truth for r in records]), data_source=rep([r.data_source for r in records]),
            extra_info=rep([r.extra_info for r in records]),
            lengths=[(len(t.prompt), len(t.tokens)) for t in talks],
            rollout_logp=tensor([t.logp + [0.0] * (width - len(t.tokens)) for t in talks], torch.float32)
            if has_logp else None,
            model_mask=tensor([t.own + [0.0] * (width - len(t.tokens)) for t in talks], torch.float32),
        )


@SOURCES.register("multi_turn")
class MultiTurnSource(InStepSource):
    """The step's prompts sampled as tool-using conversations, then scored as a plain step scores; with DAPO's
    filter (`algorithm.filter_groups.enable`), FilteredSource's rounds, each sampled as conversations."""

    @classmethod
    def claims(cls, settings: ExperienceSettings) -> bool:
        return settings.mode == "multi_turn"

    def __init__(self, inputs: SourceInputs) -> None:
        super().__init__(inputs)
        mt = inputs.settings.multi_turn
        comm = self.sampling.runtime.comm
        too_many = tool_workers_problem(mt.tool_workers, comm.env.local_world_size)
        if too_many:
            raise UserError(too_many)
        self.toolbox = Toolbox.from_file(mt.tool_config_path, Limits(mt.tool_timeout_s, mt.tool_memory_mb),
                                         mt.tool_workers, sandbox=mt.sandbox, rank=comm.rank)
        isolation = self.toolbox.sandbox.start()
        if comm.rank == 0:
            inputs.log(isolation.describe())
        turns = ToolTurns(self.sampling.tokenizer, mt.max_tool_response_length)
        self.rollouts = MultiTurnRollout(self.sampling.engine, self.sampling.tokenizer, self.toolbox, turns,
                                         mt.max_assistant_turns, comm=self.sampling.runtime.comm)
        self.counts = ToolCounts()  # the current step's
        # Held-out validation (Sampling.validate) samples through `Sampling.rollout`: this run's rollouts are
        # conversations, so this source's rollout takes its place on this Sampling object (validation included).
        self.sampling.rollout = self.rollout
        # DAPO's filter on: the step's batch is FilteredSource's rounds, each round sampled as conversations
        self.rounds = (FilteredSource(inputs, sample_round=self.sample_round)
                       if inputs.settings.filter_metric is not None else None)

    def rollout(self, records: list[PromptRecord], n: int, params: SamplingParams, uid_base: int,
                prompt_width: int | None = None) -> RolloutBatch:
        """`Sampling.rollout` for this run: conversations. Sampling with the training model itself (not an engine
        holding its own weights), a sharded policy is gathered once for the whole rollout."""
        s = self.sampling
        gather = nullcontext() if s.engine.holds_weights else s.strategy.generation(s.scorer)
        with s.runtime.phase("rollout"), gather:  # the gather is a part of the rollout's peak
            return self.rollouts.rollout(records, n, params, s.runtime.device, uid_base=uid_base,
                                         prompt_width=prompt_width, counts=self.counts)

    def sample_round(self, step: int, round_: int, prompts: list[PromptRecord]) -> RolloutBatch:
        """This rank's conversations over its share of a round's `prompts`, left-padded to the widest prompt over
        ranks (rendered with the tools' schemas, a prompt may be wider than data.max_prompt_length)."""
        s = self.sampling
        records, first_uid = s.round_ids(step, round_, prompts)
        local = max(len(x) for x in self.rollouts.prompt_ids(records))  # one width over ranks, for the gather
        width = int(s.runtime.comm.all_reduce_max(torch.tensor(local, device=s.runtime.device)))
        s.runtime.backend.seed(s.stream_seed(step, round_))
        return self.rollout(records, s.settings.n, s.settings.sampling, uid_base=first_uid, prompt_width=width)

    def scored(self, step: int, prompts: list[PromptRecord]) -> ScoredRollout:
        self.counts = ToolCounts()  # the step's tool use, over every round it samples
        if self.rounds is not None:
            scored = self.rounds.scored(step, prompts)
        else:
            scored = self.sampling.scored_rollout(step, self.sample_round(step, 0, prompts), time.perf_counter())
        scored.rollout_metrics = self.global_metrics(self.counts)
        return scored

    def global_metrics(self, counts: ToolCounts) -> dict[str, float]:
        """The step's tool use over every rank (one host sum)."""
        local = torch.tensor([counts.calls, counts.errors, counts.timeouts, counts.turns, counts.samples],
                             dtype=torch.float64, device=self.sampling.runtime.device)
        calls, errors, timeouts, turns, samples = self.sampling.runtime.comm.sum_on_host(local).tolist()
        return ToolCounts(int(calls), int(errors), int(timeouts), int(turns), int(samples)).metrics()

