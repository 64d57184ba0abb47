"""Rollout engines (by name): turn left-padded prompts into right-padded responses."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, Callable, ClassVar, ContextManager, Iterable, Iterator, NamedTuple, Protocol

import torch

from portagrpo.registry import Registry
from portagrpo.rollout.settings import EngineSettings, SamplingParams

if TYPE_CHECKING:  # annotations only: the engines are handed these, they import nothing of the trainer
    from portagrpo.backends import Backend
    from portagrpo.backends.dist import Collectives
    from portagrpo.model.vision import PromptImages


def hf_model_of(model):
    """The transformers model whose `generate` runs under wrappers (our scorer's `.lm`, peft)."""
    lm = getattr(model, "lm", model)
    return lm.get_base_model() if hasattr(lm, "get_base_model") else lm


def stop_token_ids(tokenizer, model=None) -> list[int]:
    """The tokenizer's EOS ids, then those of the model's generation_config (Qwen2.5-Instruct ends
    a turn with <|im_end|> but its generation_config adds <|endoftext|>): a response ends at any."""
    ids: list[int] = []
    gen = getattr(hf_model_of(model), "generation_config", None) if model is not None else None
    for source in (tokenizer.eos_token_id, getattr(gen, "eos_token_id", None)):
        for e in ([source] if isinstance(source, int) else list(source or [])):
            if e not in ids:
                ids.append(int(e))
    return ids


def explicit_generation_config(params: SamplingParams, eos_ids: list[int], pad_id: int):
    """A GenerationConfig with every sampling field set, to be used with the model's own
    generation_config swapped for a blank one: transformers fills unset (None) fields from the
    model's config first (top_k=20, repetition_penalty=1.1 on Qwen2.5-Instruct), then from its
    global defaults (top_k=50). Its warpers are off: `SampledLogprobs` applies them (same
    classes, same order) so that it sees the very scores each token is drawn from."""
    from transformers import GenerationConfig

    greedy = params.temperature <= 0
    return GenerationConfig(
        # no minimum length, and neither min_new_tokens nor min_length named: transformers warns at every generate
        # that sees both set (5.x: min_length not None; 4.57: min_length None), and the blank generation config
        # the model gets meanwhile holds no minimum
        do_sample=not greedy, num_beams=1, max_new_tokens=params.max_tokens,
        temperature=1.0, top_k=0, top_p=1.0, min_p=None,
        typical_p=1.0, epsilon_cutoff=0.0, eta_cutoff=0.0, no_repeat_ngram_size=0,
        repetition_penalty=params.repetition_penalty, encoder_repetition_penalty=1.0,
        eos_token_id=list(eos_ids), pad_token_id=pad_id,
    )


class SampledLogprobs:
    """The last of `generate`'s logits processors: applies the sampling warpers itself (temperature,
    top-k, top-p, min-p: transformers' classes, in transformers' order, after its repetition
    penalty) and records, for each drawn token, its log-prob under the distribution it was drawn
    from, i.e. renormalised over the tokens truncation kept. Greedy decoding applies no warper."""

    def __init__(self, params: SamplingParams) -> None:
        from transformers.generation.logits_process import (
            MinPLogitsWarper,
            TemperatureLogitsWarper,
            TopKLogitsWarper,
            TopPLogitsWarper,
        )

        self.warpers = []
        if params.temperature > 0:
            if params.temperature != 1.0:
                self.warpers.append(TemperatureLogitsWarper(params.temperature))
            if params.top_k > 0:
                self.warpers.append(TopKLogitsWarper(top_k=params.top_k))
            if params.top_p < 1.0:
                self.warpers.append(TopPLogitsWarper(top_p=params.top_p))
            if params.min_p > 0:
                self.warpers.append(MinPLogitsWarper(min_p=params.min_p))
        self.reset()

    def reset(self) -> None:
        self.pending: torch.Tensor | None = None  # [B, V] log-probs of the step whose token is not yet known
        self.taken: list[torch.Tensor] = []

    def __call__(self, input_ids: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
        self._take(input_ids[:, -1])  # the previous step's token is the last one now
        for warp in self.warpers:
            scores = warp(input_ids, scores)
        self.pending = torch.log_softmax(scores.float(), dim=-1)
        return scores

    def _take(self, tokens: torch.Tensor) -> None:
        if self.pending is not None:
            self.taken.append(self.pending.gather(1, tokens[:, None].to(self.pending.device)).squeeze(1))
            self.pending = None

    def result(self, sequences: torch.Tensor) -> torch.Tensor:
        """[B, generated tokens]: one log-prob per token `generate` appended."""
        self._take(sequences[:, -1])
        if not self.taken:
            return torch.zeros(sequences.shape[0], 0, device=sequences.device)
        return torch.stack(self.taken, dim=1)


class blank_generation_config:
    """Within the block the model's own generation_config is a blank one (nothing to inherit)."""

    def __init__(self, model) -> None:
        self.lm = hf_model_of(model)

    def __enter__(self):
        from transformers import GenerationConfig

        self.saved = getattr(self.lm, "generation_config", None)
        if self.saved is not None:
            self.lm.generation_config = GenerationConfig()
        return self

    def __exit__(self, *exc) -> None:
        if self.saved is not None:
            self.lm.generation_config = self.saved


@dataclass
class EngineInputs:
    """What an engine may take from the run when it builds itself (`from_run`)."""

    settings: EngineSettings  # what the engine reads of the config (rollout/settings.py)
    scorer: torch.nn.Module  # the policy's scorer (anything with `generate`)
    policy: torch.nn.Module  # the Hugging Face model under it (its config)
    tokenizer: Any  # a Hugging Face tokenizer (transformers' own type)
    autocast: Callable[[], Any]
    generate_kwargs: dict  # the parallel strategy's (`synced_gpus` under FSDP2)
    backend: Backend
    rank: int
    world_size: int
    init_model_dir: Path  # the run's saved initial model (what an engine with its own weights loads)
    comm: Collectives | None = None  # the training ranks (engines that span ranks use it)


class Sampled(NamedTuple):
    """What an engine's `generate` returns, all [B, max_tokens]."""

    responses: torch.Tensor  # long, right-padded
    mask: torch.Tensor  # float, 1 up to and including EOS
    logp: torch.Tensor | None  # float32: each token's log-prob under the distribution it was sampled from
    # int16 [B, P + max_tokens, L, k]: a mixture-of-experts policy's experts per token and MoE layer, on the prompt and
    # response grid (model/router_replay.py), -1 where unknown; None: a dense model, or an engine that does not say
    routes: torch.Tensor | None = None


class RolloutEngine(Protocol):
    """What the rollout pipeline and its generators (rollout/generators/) ask of an engine, all of it declared."""

    # True when the engine keeps its own copy of the weights (vLLM): the trainer pushes them after each
    # update; False when it samples with the training model itself (a sharded one is gathered for it).
    holds_weights: ClassVar[bool]
    # True while an engine that holds its own weights was built without real ones (vLLM starts from dummy
    # weights): the trainer pushes the policy before the first rollout.
    needs_weights: bool
    # True when `generate` samples vision-language rows with their images (`images=`)
    takes_images: ClassVar[bool]
    pad_id: int  # what prompts are left-padded and responses right-padded with
    eos_ids: list[int]  # a response (a conversation's turn) ends at any of these
    # The engine's context in tokens, prompt and response together (vLLM's max_model_len); None: no fixed limit.
    max_model_len: int | None

    @classmethod
    def from_run(cls, inputs: EngineInputs) -> "RolloutEngine":
        """The engine for this run, its settings read from the config."""

    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 images: PromptImages | None = None) -> Sampled:
        """prompt_ids, prompt_mask: [B, P] -> responses, response mask and sampler log-probs, [B, T] with
        T = max_tokens. `images`: each row's images (an engine that `takes_images`)."""

    def update_weights(self, named_tensors) -> None:
        """The policy's (name, tensor) pairs after an update; called only on an engine that `holds_weights`."""

    def turns(self) -> ContextManager:
        """Around a conversation's turns (multi-turn): an engine that sleeps between generates stays awake, with
        one load of the weights, for all of them; nothing to hold for the others."""


ROLLOUT_ENGINES: Registry[type] = Registry("rollout engine")
ROLLOUT_ENGINES.register_module("vllm", "portagrpo.rollout.vllm")  # imports vLLM only for a run that uses it


def response_mask_from_tokens(responses: torch.Tensor, eos_ids: list[int]) -> torch.Tensor:
    """1 on every token up to and including the first EOS (all tokens when there is none). [B, T] float."""
    is_eos = torch.zeros_like(responses, dtype=torch.bool)
    for e in eos_ids:
        is_eos |= responses == e
    # Count of EOS seen strictly before each position: tokens after the first EOS have count >= 1.
    before = torch.cumsum(is_eos.long(), dim=1) - is_eos.long()
    return (before == 0).float()


@ROLLOUT_ENGINES.register("hf")
class HFRollout:
    """transformers `generate` with sampling; runs wherever the model runs. Samples vision-language rows too
    (`images`: their prompts' processed images, model/vision.py)."""

    holds_weights = False
    needs_weights = False
    takes_images = True
    max_model_len = None  # the model's own positions bound it, not an engine's reserve

    def turns(self) -> ContextManager:
        return contextlib.nullcontext()

    @classmethod
    def from_run(cls, inputs: EngineInputs) -> "HFRollout":
        # a static KV cache where the backend has one, but not under sharded (lockstep) generation
        extra = {} if inputs.generate_kwargs else {"cache": inputs.backend.spec.decode_cache}
        return cls(inputs.scorer, inputs.tokenizer, inputs.autocast, inputs.generate_kwargs,
                   routers=inputs.scorer.routers, **extra)

    def __init__(self, model, tokenizer, autocast, generate_kwargs: dict | None = None,
                 share_prefill: bool = True, cache: str = "dynamic", notice=None, routers=None) -> None:
        """`model` is anything with transformers' `generate` (the LM, or a wrapper forwarding to it);
        `generate_kwargs` adds engine options such as `synced_gpus` for sharded models.
        `share_prefill`: prompts repeated in the batch (a group's n samples) are prefilled once and
        their KV cache copied to every repeat (not under sharded generation, where every rank must
        run the same forwards).
        `cache`: "dynamic" (eager decoding) or "static", the backend's answer where a preallocated KV cache
        lets transformers compile the decode step (CUDA); a static attempt that fails falls back to
        dynamic for the rest of the run, with one notice."""
        self.model, self.tokenizer, self.autocast = model, tokenizer, autocast
        from portagrpo.model.router_replay import RouterHooks

        # a MoE policy's router hooks (the scorer's own, else installed on this model once): generate records routes
        self.routers = routers if routers is not None else RouterHooks.install(model)
        self.generate_kwargs = dict(generate_kwargs or {})
        self.cache = cache
        self.notice = notice or (lambda message: print(f"portagrpo: {message}"))
        self.share_prefill = share_prefill and not self.generate_kwargs
        self.eos_ids = stop_token_ids(tokenizer, model)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, images=None) -> Sampled:
        gen = explicit_generation_config(params, self.eos_ids, self.pad_id)
        from portagrpo.model.router_replay import GenerationRoutes

        record = SampledLogprobs(params)
        routes = GenerationRoutes(self.routers, self.model)  # a MoE policy's experts, recorded in these very forwards
        was_training = self.model.training
        self.model.eval()
        try:
            with self.autocast(), blank_generation_config(self.model), routes.recording():
                out = self._generate(prompt_ids, prompt_mask, gen, record, images)
        finally:
            self.model.train(was_training)
        logp = record.result(out)
        responses = out[:, prompt_ids.shape[1]:]
        pad = params.max_tokens - responses.shape[1]
        if pad > 0:
            responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_id)
            logp = torch.nn.functional.pad(logp, (0, pad))
        mask = response_mask_from_tokens(responses, self.eos_ids)
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id))
        # after EOS a finished row draws padding, which truncation may have ruled out (-inf): keep 0 there
        return Sampled(responses, mask, torch.where(mask.bool(), logp, torch.zeros_like(logp)).to(torch.float32),
                       routes.grid(prompt_ids, prompt_mask, prompt_ids.shape[1] + params.max_tokens))

    def _generate(self, prompt_ids, prompt_mask, gen, record: SampledLogprobs, images=None):
        from transformers import LogitsProcessorList

        processors = LogitsProcessorList([record])
        if images is not None:
            # each row's patches, grids and token types (the multimodal positions come from them); the prompt's
            # KV cache is not shared across a group here, and the decode stays eager
            from portagrpo.model.vision import generate_inputs

            return self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen,
                                       logits_processor=processors, **generate_inputs(self.model, prompt_ids, images),
                                       **self.generate_kwargs)
        if self.cache == "static":
            gen.cache_implementation = "static"
            try:
                return self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen,
                                           logits_processor=processors, **self.generate_kwargs)
            except Exception as err:  # noqa: BLE001 - any compile/cache failure: decode eagerly instead
                self.cache = "dynamic"
                self.notice(f"a static KV cache with a compiled decode step failed here ({type(err).__name__}: "
                            f"{str(err).splitlines()[0][:200]}); generating with the dynamic cache from now on.")
                gen.cache_implementation = None
                record.reset()
        cache = self._shared_prefill(prompt_ids, prompt_mask) if self.share_prefill else None
        extra = {} if cache is None else {"past_key_values": cache}
        return self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen,
                                   logits_processor=processors, **extra, **self.generate_kwargs)

    def _shared_prefill(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor):
        """A KV cache of every row's prompt but its last token, computed once per distinct prompt and
        copied to its repeats; `generate` then starts from the last prompt token. None when no
        prompt repeats (nothing to share)."""
        from transformers import DynamicCache

        from portagrpo.model.loading import decoder_of, position_ids_from_mask

        width = prompt_ids.shape[1]
        if width < 2:
            return None
        rows = torch.cat([prompt_ids, prompt_mask.to(prompt_ids.dtype)], dim=1)
        distinct, inverse = torch.unique(rows, dim=0, return_inverse=True)
        if distinct.shape[0] == rows.shape[0]:
            return None
        ids, mask = distinct[:, :width - 1], distinct[:, width:2 * width - 1]
        lm = hf_model_of(self.model)
        cache = DynamicCache(config=lm.config)
        decoder_of(lm)(input_ids=ids, attention_mask=mask, position_ids=position_ids_from_mask(mask),
                       past_key_values=cache, use_cache=True)
        cache.batch_select_indices(inverse)
        return cache


PEFT_PREFIX = "base_model.model."


def hf_weight_names(state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]], *,
                      tied_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face parameter names as vLLM's `load_weights` expects them.

    vLLM loads checkpoints by their Hugging Face names (it fuses q/k/v and gate/up itself), so
    names pass through, except: peft's wrapper prefix is removed (adapters are merged before
    this), LoRA factors are never sent, and a tied LM head is skipped (vLLM ties it itself).
    """
    for name, tensor in (state.items() if isinstance(state, dict) else state):
        if "lora_" in name:
            continue
        name = name.removeprefix("lm.").removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if tied_embeddings and name == "lm_head.weight":
            continue
        yield name, tensor


@ROLLOUT_ENGINES.register("fixed")
class FixedRollout:
    """Deterministic pseudo-responses that depend only on the prompt's tokens and the sample's
    index in its group, never on the model, the batch composition, the rank or the device.

    For equivalence tests (1 process vs K processes vs Ray workers must see identical
    rollouts) and for exercising the pipeline without sampling. Not for training a model.
    """

    holds_weights = False
    needs_weights = False
    takes_images = False
    max_model_len = None

    def turns(self) -> ContextManager:
        return contextlib.nullcontext()

    @classmethod
    def from_run(cls, inputs: EngineInputs) -> "FixedRollout":
        return cls(inputs.scorer, inputs.tokenizer, inputs.autocast, inputs.generate_kwargs, n=inputs.settings.n)

    def __init__(self, model, tokenizer, autocast, generate_kwargs: dict | None = None, n: int = 1) -> None:
        eos = tokenizer.eos_token_id
        self.eos_id = eos if isinstance(eos, int) else list(eos)[0]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.eos_ids = stop_token_ids(tokenizer)
        self.vocab = len(tokenizer)
        self.n = n

    def generate(self, prompt_ids, prompt_mask, params: SamplingParams, images=None) -> Sampled:
        import zlib

        rows, masks = [], []
        for i, (ids, m) in enumerate(zip(prompt_ids.tolist(), prompt_mask.tolist())):
            prompt = [t for t, keep in zip(ids, m) if keep]
            key = zlib.crc32(bytes(str(prompt), "utf8")) * 31 + i % self.n
            g = torch.Generator().manual_seed(key)
            length = int(torch.randint(1, params.max_tokens + 1, (1,), generator=g))
            tokens = torch.randint(4, self.vocab, (params.max_tokens,), generator=g)
            if length < params.max_tokens:
                tokens[length - 1] = self.eos_id
            mask = (torch.arange(params.max_tokens) < length).float()
            rows.append(torch.where(mask.bool(), tokens, torch.full_like(tokens, self.pad_id)))
            masks.append(mask)
        # not sampled from any distribution: no sampler log-probs
        return Sampled(torch.stack(rows).to(prompt_ids.device), torch.stack(masks).to(prompt_ids.device), None)


@dataclass
class GroupPrompts:
    """A rollout's prompts before sampling: each record's prompt n times (a group), left-padded."""

    records: list
    n: int
    ids: list[list[int]]  # each row's prompt tokens, unpadded
    prompt_ids: torch.Tensor  # [B, P]
    prompt_mask: torch.Tensor
    uid_base: int


def group_prompts(tokenizer, records: list, n: int, pad_id: int, device, *, uid_base: int = 0,
                  prompt_width: int | None = None) -> GroupPrompts:
    from portagrpo.data.records import left_pad, tokenize_prompts

    ids = [x for x in tokenize_prompts(tokenizer, records) for _ in range(n)]
    prompt_ids, prompt_mask = left_pad(ids, pad_id, width=prompt_width)
    return GroupPrompts(records, n, ids, prompt_ids.to(device), prompt_mask.to(device), uid_base)


def rollout_batch(tokenizer, group: GroupPrompts, sampled: Sampled):
    """The RolloutBatch of `group`'s prompts and the engine's answer to them, decoded."""
    from portagrpo.batch import RolloutBatch

    records, n, device = group.records, group.n, group.prompt_ids.device
    responses, mask, sampled_logp, routes = (None if t is None else t.to(device) for t in sampled)
    rep = lambda xs: [x for x in xs for _ in range(n)]  # noqa: E731
    rows, keeps = responses.tolist(), mask.tolist()  # the step's one read of the responses (rewards need text)
    return RolloutBatch(
        prompt_ids=group.prompt_ids, prompt_mask=group.prompt_mask, responses=responses, response_mask=mask,
        uid=torch.arange(len(records), device=device).repeat_interleave(n) + group.uid_base,
        prompt_index=torch.tensor(rep([r.index for r in records]), device=device),
        response_text=decode_responses(tokenizer, rows, keeps),
        ground_truth=rep([r.ground_truth for r in records]), data_source=rep([r.data_source for r in records]),
        extra_info=rep([r.extra_info for r in records]),
        lengths=[(len(p), round(sum(k))) for p, k in zip(group.ids, keeps)], rollout_logp=sampled_logp,
        routes=routes,
    )


def sampled_rows(rows: list[list[int]], pad_id: int, width: int, device,
                 logp: list[list[float]] | None = None) -> Sampled:
    """Responses a generator made itself (its own tokens, a conversation's turns), right-padded to `width`, as an
    engine answers: what `rollout_batch` takes. `logp`: each row's sampler log-probs (0 for tokens not sampled)."""
    pad = [width - len(r) for r in rows]
    tokens = torch.tensor([r + [pad_id] * k for r, k in zip(rows, pad)], dtype=torch.long).reshape(len(rows), width)
    mask = torch.tensor([[1.0] * len(r) + [0.0] * k for r, k in zip(rows, pad)]).reshape(len(rows), width)
    sampled = None if logp is None else torch.tensor([x + [0.0] * k for x, k in zip(logp, pad)]).reshape(len(rows),
                                                                                                          width)
    return Sampled(tokens.to(device), mask.to(device), None if sampled is None else sampled.to(device))


def rollout_groups(engine, tokenizer, records: list, n: int, params: SamplingParams, device, *, uid_base: int = 0,
                   prompt_width: int | None = None):
    """Each record's prompt n times (a group), left-padded, generated, decoded: a RolloutBatch.
    The one prompt -> responses path of training, validation and eval."""
    group = group_prompts(tokenizer, records, n, engine.pad_id, device, uid_base=uid_base, prompt_width=prompt_width)
    return rollout_batch(tokenizer, group, engine.generate(group.prompt_ids, group.prompt_mask, params))


def decode_responses(tokenizer, rows: list[list[int]], keeps: list[list[float]]) -> list[str]:
    """Responses as text: each row's kept tokens (host lists, read from the device once)."""
    out = []
    for row, m in zip(rows, keeps):
        ids = [t for t, keep in zip(row, m) if keep]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out
