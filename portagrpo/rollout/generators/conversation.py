"""`conversation`: multi-turn, tool-using rows (`rollout.multi_turn.enable`): each sample alternates model turns and
tool turns.

A sample goes on while its last model turn ended with an end token and called a tool: the calls run in the sandbox
(agent/), their results are rendered as a tool turn in the chat template and appended as token ids, and the model
writes its next turn. It stops when it answers without a tool call, reaches `rollout.multi_turn.max_assistant_turns`,
or fills `data.max_response_length`, which counts every token after the prompt. Each turn is generated in one batch
over the samples still going (left-padded contexts, with their prompts' images for a vision-language policy); the
model's own token ids are kept as sampled, never re-tokenized.

The response is everything after the prompt, and `RolloutBatch.model_mask` marks the model's own tokens: tool and
template tokens stay in the context (`response_mask`) and are scored, but never trained, and the sampler's log-probs
exist only for the model's tokens (0 elsewhere). The loss mask and the GRPO normalisers then count only trained tokens
(`TrainBatch.mask`). Prompts are rendered with the tools' schemas (`tools=`), as the chat template lists them for the
model. The sandbox runs where the generator runs: in the trainer's process, and in the sampler process under
rollout.mode=one_step_off.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field, replace
from typing import TYPE_CHECKING

import torch

from portagrpo.agent.hermes import ToolTurns
from portagrpo.agent.sandbox import Limits
from portagrpo.agent.toolbox import Toolbox, ToolCounts
from portagrpo.agent.tools import tool_workers_problem
from portagrpo.batch import RolloutBatch
from portagrpo.data.records import PromptRecord, left_pad, tokenize_prompts
from portagrpo.errors import UserError
from portagrpo.model.vision import PromptImages, vision_prompts, with_rows
from portagrpo.rollout.engines import RolloutEngine, decode_responses
from portagrpo.rollout.generators import (
    CONVERSATION_NEEDS,
    GENERATORS,
    Generated,
    GeneratorInputs,
    RoundPrompts,
    group_ids,
    repeat,
)
from portagrpo.rollout.generators.vision import check_takes_images
from portagrpo.rollout.settings import SamplingParams

if TYPE_CHECKING:
    from portagrpo.backends.dist import Collectives


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
        """Tokens after the conversation so far: a model turn's (`own`, counted as a turn) or a tool turn's."""
        self.tokens += tokens
        self.own += [1.0 if own else 0.0] * len(tokens)
        self.logp += logp if logp is not None else [0.0] * len(tokens)
        self.turns += 1 if own else 0


def tool_counts(counts: dict[str, float]) -> ToolCounts:
    """A generator's counts as the toolbox's `ToolCounts`."""
    return ToolCounts(**{k: int(v) for k, v in counts.items()})


@GENERATORS.register("conversation")
def conversations(inputs: GeneratorInputs) -> "Conversations":
    """The run's conversations: its tools (rollout.multi_turn.tool_config_path) in a sandbox started here."""
    mt = inputs.multi_turn
    if mt is None:
        raise UserError(CONVERSATION_NEEDS)
    too_many = tool_workers_problem(mt.tool_workers, inputs.local_world_size)
    if too_many:
        raise UserError(too_many)
    toolbox = Toolbox.from_file(mt.tool_config_path, Limits(mt.tool_timeout_s, mt.tool_memory_mb), mt.tool_workers,
                                sandbox=mt.sandbox, rank=inputs.rank)
    isolation = toolbox.sandbox.start()
    if inputs.rank == 0:
        inputs.log(isolation.describe())
    return Conversations(inputs.tokenizer, toolbox, ToolTurns(inputs.tokenizer, mt.max_tool_response_length),
                         mt.max_assistant_turns, processor=inputs.processor, lockstep=inputs.lockstep)


class Conversations:
    """Samples conversations with an engine and a toolbox (every rank its own share, as a plain rollout)."""

    def __init__(self, tokenizer, toolbox: Toolbox, turns: ToolTurns, max_turns: int, *, processor=None,
                 lockstep: Collectives | None = None) -> None:
        """`lockstep`: the training ranks, which then generate each turn together (an engine that spans ranks,
        vLLM's tensor-parallel group or generation under FSDP2, needs every rank in every `generate`)."""
        self.tokenizer, self.processor, self.toolbox, self.turns = tokenizer, processor, toolbox, turns
        self.max_turns = max_turns
        self.lockstep = lockstep if lockstep is not None and lockstep.world_size > 1 else None
        self.schemas = [spec.schema for spec in toolbox.specs.values()]

    def prompts(self, records: list[PromptRecord], uid_base: int, device) -> RoundPrompts:
        """Each prompt's tokens, rendered with the tools' schemas (Qwen's template writes them and the Hermes
        instructions into the system message); a vision-language policy's with their images' tokens."""
        if self.processor is not None:
            ids, images = vision_prompts(self.processor, records, device, self.schemas)
            return RoundPrompts(records, ids, images, uid_base)
        return RoundPrompts(records, tokenize_prompts(self.tokenizer, records, self.schemas), None, uid_base)

    def check_context(self, engine: RolloutEngine, ids: list[list[int]], max_tokens: int) -> None:
        """One sentence where a prompt with its tools' schemas and a whole response would not fit an engine's context
        (vLLM's max_model_len), which would end its conversation early, silently (or refuse the prompt)."""
        context = engine.max_model_len
        longest = max((len(x) for x in ids), default=0)
        if context is not None and longest + max_tokens > context:
            raise UserError(f"a prompt rendered with the tools' schemas, as multi-turn sends it, has {longest} tokens, "
                            f"which with data.max_response_length={max_tokens} exceeds vLLM's context of {context} "
                            f"tokens; set rollout.vllm_max_model_len to at least {longest + max_tokens}, or raise "
                            f"data.max_prompt_length to the prompts' length with their schemas.")

    def generate(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, params: SamplingParams, width: int,
                 device) -> Generated:
        rows = repeat(prompts.ids, n)
        self.check_context(engine, rows, params.max_tokens)
        prompt_ids, prompt_mask = left_pad(rows, engine.pad_id, width=width)
        talks = [Conversation(ids, {"ground_truth": prompts.records[i // n].ground_truth})
                 for i, ids in enumerate(rows)]
        images = with_rows(prompts.images, n)
        tools = ToolCounts()
        has_logp = self.converse(engine, talks, images, params, device, tools)
        counts = replace(tools, turns=sum(t.turns for t in talks), samples=len(talks))
        batch = self.batch(engine, prompts, n, prompt_ids.to(device), prompt_mask.to(device), talks,
                           params.max_tokens, has_logp, device)
        return Generated(replace(batch, images=images), {k: float(v) for k, v in asdict(counts).items()})

    def rollout(self, engine: RolloutEngine, records: list[PromptRecord], n: int, params: SamplingParams, device,
                uid_base: int = 0) -> Generated:
        """One process's conversations over `records` outside a run's pipeline (tests, tools), padded to their own
        widest prompt."""
        ready = self.prompts(records, uid_base, device)
        return self.generate(engine, ready, n, params, ready.widest, device)

    def metrics(self, counts: dict[str, float]) -> dict[str, float] | None:
        return tool_counts(counts).metrics()

    def check(self, engine: RolloutEngine) -> None:
        if self.processor is not None:
            check_takes_images(engine)

    def close(self) -> None:
        self.toolbox.close()

    # ---- the turns
    def converse(self, engine: RolloutEngine, talks: list[Conversation], images: PromptImages | None,
                 params: SamplingParams, device, counts: ToolCounts) -> bool:
        """Model and tool turns until no sample goes on (on any rank); False when the engine reported no log-probs.
        An engine that sleeps between rollouts (vLLM on GPU/NPU) stays awake for all of them: one wake, and the
        weights the step pushed, for every turn."""
        going, has_logp, eos = list(range(len(talks))), True, set(engine.eos_ids)
        with engine.turns():
            while True:
                room = max((params.max_tokens - len(talks[i].tokens) for i in going), default=0)
                if self.lockstep is not None:  # one turn on every rank while any rank has a sample going, one length
                    going_anywhere, room = self.lockstep.all_reduce_max(torch.tensor([len(going), room], device=device))
                    going_anywhere, room = int(going_anywhere), int(room)
                else:
                    going_anywhere = len(going)
                if not going_anywhere:
                    return has_logp
                has_logp &= self.model_turn(engine, talks, going or [0], bool(going), images, params, device, room)
                going = self.tool_turn(going, talks, params.max_tokens, eos, counts)

    def model_turn(self, engine: RolloutEngine, talks: list[Conversation], rows: list[int], keep: bool,
                   images: PromptImages | None, params: SamplingParams, device, room: int) -> bool:
        """One model turn for the samples `rows`, in one batch of at most `room` new tokens; False when the engine
        reports no log-probs. A rank with none going generates for its first sample and keeps nothing (`keep`)."""
        ids, mask = left_pad([talks[i].prompt + talks[i].tokens for i in rows], engine.pad_id)
        extra = {} if images is None else {"images": images.select(rows)}
        sampled = engine.generate(ids.to(device), mask.to(device), replace(params, max_tokens=room), **extra)
        tokens, kept = sampled.responses.tolist(), sampled.mask.tolist()  # the turn's one read
        logps = None if sampled.logp is None else sampled.logp.tolist()
        for k, i in enumerate(rows if keep else []):
            talk = talks[i]
            count = min(round(sum(kept[k])), params.max_tokens - len(talk.tokens))
            talk.add(tokens[k][:count], True, None if logps is None else logps[k][:count])
        return logps is not None

    def tool_turn(self, going: list[int], talks: list[Conversation], budget: int, eos: set[int],
                  counts: ToolCounts) -> list[int]:
        """The tools of every sample whose last turn ended (an `eos` token) and called some; the samples that go on."""
        asked = []
        for i in going:
            talk = talks[i]
            ended = bool(talk.tokens) and talk.own[-1] == 1.0 and talk.tokens[-1] in eos
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

    def batch(self, engine: RolloutEngine, prompts: RoundPrompts, n: int, prompt_ids: torch.Tensor,
              prompt_mask: torch.Tensor, talks: list[Conversation], width: int, has_logp: bool,
              device) -> RolloutBatch:
        pad = engine.pad_id
        rows = [t.tokens + [pad] * (width - len(t.tokens)) for t in talks]
        keeps = [[1.0] * len(t.tokens) + [0.0] * (width - len(t.tokens)) for t in talks]

        def tensor(values, dtype):
            return torch.tensor(values, dtype=dtype).to(device)

        records = prompts.records
        return RolloutBatch(
            prompt_ids=prompt_ids, prompt_mask=prompt_mask, responses=tensor(rows, torch.long),
            response_mask=tensor(keeps, torch.float32), uid=group_ids(prompts, n, device),
            prompt_index=torch.tensor(repeat([r.index for r in records], n), device=device),
            response_text=decode_responses(self.tokenizer, rows, keeps),
            ground_truth=repeat([r.ground_truth for r in records], n),
            data_source=repeat([r.data_source for r in records], n),
            extra_info=repeat([r.extra_info for r in records], n),
            lengths=[(len(t.prompt), len(t.tokens)) for t in talks],
            rollout_logp=tensor([t.logp + [0.0] * (width - len(t.tokens)) for t in talks], torch.float32)
            if has_logp else None,
            model_mask=tensor([t.own + [0.0] * (width - len(t.tokens)) for t in talks], torch.float32),
        )
