"""Model forward to per-token statistics of the response: log-probs, entropy, vocab log-probs.

The model body stops at the final hidden states; the chosen kernel turns the response
positions' hidden states and the LM head into log-probs, so fused kernels never need
full-vocabulary logits.
"""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from typing import Callable, ContextManager

import torch

from .batch import RolloutBatch
from .kernels import TokenLogprobFn, logits_from_hidden, token_logprobs_from_logits
from .modeling import decoder_of, lm_head_of, position_ids_from_mask


@dataclass
class ResponseStats:
    logp: torch.Tensor  # [B, T] fp32 (fp64 for fp64 models), 0 off the mask
    entropy: torch.Tensor | None  # [B, T]
    logp_vocab: torch.Tensor | None  # [B, T, V] full log-distribution (only for the `full` KL)


def response_hidden(model, batch: RolloutBatch, autocast: Callable[[], ContextManager]) -> torch.Tensor:
    """Final hidden states at the positions that predict each response token: [B, T, H]."""
    attn = batch.attention_mask
    with autocast():
        out = decoder_of(model)(
            input_ids=batch.input_ids, attention_mask=attn, position_ids=position_ids_from_mask(attn), use_cache=False
        )
    hidden = out[0] if isinstance(out, tuple) else out.last_hidden_state
    p, t = batch.prompt_len, batch.responses.shape[1]
    return hidden[:, p - 1:p + t - 1]


def _scatter(values: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
    """Put N per-token values back on the [B, T] grid (zeros off the mask), keeping autograd."""
    out = torch.zeros(mask.shape + values.shape[1:], dtype=values.dtype, device=values.device)
    index = mask.nonzero(as_tuple=True)
    return out.index_put(index, values)


def response_stats(
    model,
    batch: RolloutBatch,
    *,
    temperature: float,
    kernel: TokenLogprobFn,
    compute_entropy: bool,
    vocab: bool = False,
    autocast: Callable[[], ContextManager] = contextlib.nullcontext,
) -> ResponseStats:
    hidden = response_hidden(model, batch, autocast)
    mask = batch.response_mask.bool()
    h = hidden[mask]  # [N, H]
    targets = batch.responses[mask]
    weight, bias = lm_head_of(model)
    if vocab:
        logits = logits_from_hidden(h, weight, bias, temperature)
        logp, entropy = token_logprobs_from_logits(logits, targets, compute_entropy)
        logp_vocab = _scatter(torch.log_softmax(logits, dim=-1), mask)
    else:
        logp, entropy = kernel(h, weight, targets, bias=bias, temperature=temperature, compute_entropy=compute_entropy)
        logp_vocab = None
    return ResponseStats(_scatter(logp, mask), None if entropy is None else _scatter(entropy, mask), logp_vocab)
