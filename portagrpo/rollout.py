"""Rollout engines (by name): turn left-padded prompts into right-padded responses."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Protocol

import torch

from .registry import Registry


@dataclass(frozen=True)
class SamplingParams:
    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off


class RolloutEngine(Protocol):
    def generate(
        self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams
    ) -> tuple[torch.Tensor, torch.Tensor]:
        """prompt_ids, prompt_mask: [B, P] -> (responses [B, T], response_mask [B, T]) with T = max_tokens."""


ROLLOUT_ENGINES: Registry[type] = Registry("rollout engine")


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
    """transformers `generate` with sampling; runs wherever the model runs."""

    def __init__(self, model, tokenizer, autocast, generate_kwargs: dict | None = None) -> None:
        """`model` is anything with transformers' `generate` (the LM, or a wrapper forwarding to it);
        `generate_kwargs` adds engine options such as `synced_gpus` for sharded models."""
        self.model, self.tokenizer, self.autocast = model, tokenizer, autocast
        self.generate_kwargs = dict(generate_kwargs or {})
        eos = tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]

    @torch.no_grad()
    def generate(self, prompt_ids, prompt_mask, params: SamplingParams):
        from transformers import GenerationConfig

        greedy = params.temperature <= 0
        gen = GenerationConfig(
            do_sample=not greedy,
            temperature=None if greedy else params.temperature,
            top_p=None if greedy else params.top_p,
            top_k=None if greedy or params.top_k <= 0 else params.top_k,
            max_new_tokens=params.max_tokens,
            eos_token_id=self.eos_ids,
            pad_token_id=self.pad_id,
        )
        was_training = self.model.training
        self.model.eval()
        try:
            with self.autocast():
                out = self.model.generate(input_ids=prompt_ids, attention_mask=prompt_mask, generation_config=gen,
                                          **self.generate_kwargs)
        finally:
            self.model.train(was_training)
        responses = out[:, prompt_ids.shape[1]:]
        pad = params.max_tokens - responses.shape[1]
        if pad > 0:
            responses = torch.nn.functional.pad(responses, (0, pad), value=self.pad_id)
        mask = response_mask_from_tokens(responses, self.eos_ids)
        responses = torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id))
        return responses, mask


@ROLLOUT_ENGINES.register("fixed")
class FixedRollout:
    """Deterministic pseudo-responses that depend only on the prompt's tokens and the sample's
    index in its group, never on the model, the batch composition, the rank or the device.

    For equivalence tests (1 process vs K processes vs Ray workers must see identical
    rollouts) and for exercising the pipeline without sampling. Not for training a model.
    """

    def __init__(self, model, tokenizer, autocast, generate_kwargs: dict | None = None, n: int = 1) -> None:
        eos = tokenizer.eos_token_id
        self.eos_id = eos if isinstance(eos, int) else list(eos)[0]
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_id
        self.vocab = len(tokenizer)
        self.n = n

    def generate(self, prompt_ids, prompt_mask, params: SamplingParams):
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
        return torch.stack(rows).to(prompt_ids.device), torch.stack(masks).to(prompt_ids.device)


def decode_responses(tokenizer, responses: torch.Tensor, mask: torch.Tensor) -> list[str]:
    out = []
    for row, m in zip(responses.tolist(), mask.tolist()):
        ids = [t for t, keep in zip(row, m) if keep]
        out.append(tokenizer.decode(ids, skip_special_tokens=True))
    return out
