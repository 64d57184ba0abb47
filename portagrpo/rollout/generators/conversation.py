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
from portagrpo.rollout.engines import GroupPrompts, RolloutEngine, rollout_batch, sampled_rows
from portagrpo.rollout.generators import GENERATORS, Generated, GeneratorInputs, RoundPrompts, group_rows
from portagrpo.rollout.generators.vision import check_takes_images
from portagrpo.rollout.settings import SamplingParams

if TYPE_CHECKING:
    from portagrpo.backends.dist import Collectives
    from portagrpo.config.schema import Config


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


@dataclass(frozen=True)
class MultiTurnSettings:
    """rollout.multi_turn: what the conversation generator samples with."""

    max_assistant_turns: int
    tool_config_path: str
    max_tool_response_length: int  # tokens
    format: str
    tool_timeout_s: float
    tool_memory_mb: int
    tool_workers: int
    sandbox: str  # rollout.multi_turn.sandbox: auto, namespaces or process (agent/isolation.py)

    @classmethod
    def from_config(cls, cfg: Config) -> "MultiTurnSettings":
        m = cfg.rollout.multi_turn
        if not m.enable:
            raise UserError(CONVERSATION_NEEDS)
        return cls(m.max_assistant_turns, str(m.tool_config_path), m.max_tool_response_length, m.format,
                   m.tool_timeout_s, m.tool_memory_mb, m.tool_workers, m.sandbox)


CONVERSATION_NEEDS = ("rollout.generator=conversation needs rollout.multi_turn.enable=true and its tool_config_path "
                      "(the tools a conversation calls).")


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
        group = group_rows(prompts, n, engine.pad_id, width, device)
        self.check_context(engine, group.ids, params.max_tokens)
        talks = [Conversation(ids, {"ground_truth": prompts.records[i // n].ground_truth})
                 for i, ids in enumerate(group.ids)]
        images = with_rows(prompts.images, n)
        tools = ToolCounts()
        has_logp = self.converse(engine, talks, images, params, device, tools)
        counts = replace(tools, turns=sum(t.turns for t in talks), samples=len(talks))
        batch = self.batch(engine, group, talks, params.max_tokens, has_logp, device)
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

    def batch(self, engine: RolloutEngine, group: GroupPrompts, talks: list[Conversation], width: int,
              has_logp: bool, device) -> RolloutBatch:
        """The round's batch: each conversation after its prompt as the response, the model's own tokens marked
        (`model_mask`), the sampler's log-probs where the engine reported them."""
        rows = [t.tokens for t in talks]
        sampled = sampled_rows(rows, engine.pad_id, width, device, [t.logp for t in talks] if has_logp else None)
        own = torch.tensor([t.own + [0.0] * (width - len(t.own)) for t in talks], dtype=torch.float32)
        own = own.reshape(len(talks), width).to(device)
        return replace(rollout_batch(self.tokenizer, group, sampled), model_mask=own)


@GENERATORS.register("conversation")
class ConversationRows(Conversations):
    """The run's conversations: its tools (rollout.multi_turn.tool_config_path) in a sandbox started here."""

    settings = staticmethod(MultiTurnSettings.from_config)

    def __init__(self, inputs: GeneratorInputs, settings: MultiTurnSettings) -> None:
        too_many = tool_workers_problem(settings.tool_workers, inputs.local_world_size)
        if too_many:
            raise UserError(too_many)
        toolbox = Toolbox.from_file(settings.tool_config_path, Limits(settings.tool_timeout_s,
                                                                      settings.tool_memory_mb),
                                    settings.tool_workers, sandbox=settings.sandbox, rank=inputs.rank)
        isolation = toolbox.sandbox.start()
        if inputs.rank == 0:
            inputs.log(isolation.describe())
        super().__init__(inputs.tokenizer, toolbox, ToolTurns(inputs.tokenizer, settings.max_tool_response_length),
                         settings.max_assistant_turns, processor=inputs.processor, lockstep=inputs.lockstep)
