"""Plain-torch token log-probs and entropy from hidden states and the LM head.

This is the definition every fused implementation must match, forward and backward.
It builds the full logits, so it is the memory baseline, not the fast path.
"""
from __future__ import annotations

import torch

from portagrpo.algo.losses import entropy_from_logits


def compute_dtype(*tensors: torch.Tensor | None) -> torch.dtype:
    """float64 when any input is float64, float32 otherwise: never accumulate in bf16/fp16."""
    return torch.float64 if any(t is not None and t.dtype == torch.float64 for t in tensors) else torch.float32


def logits_from_hidden(
    hidden: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None = None, temperature: float = 1.0
) -> torch.Tensor:
    """hidden: [N, H], weight: [V, H], bias: [V] -> logits [N, V] in the compute dtype, divided by temperature."""
    dtype = compute_dtype(hidden, weight, bias)
    logits = hidden.to(dtype) @ weight.to(dtype).t()
    if bias is not None:
        logits = logits + bias.to(dtype)
    return logits / temperature


def token_logprobs_from_logits(
    logits: torch.Tensor, targets: torch.Tensor, compute_entropy: bool = False
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """logits: [..., V] (already temperature-scaled), targets: [...] -> (logp [...], entropy [...] or None)."""
    logits = logits.to(compute_dtype(logits))
    logp_vocab = torch.log_softmax(logits, dim=-1)
    logp = logp_vocab.gather(-1, targets.unsqueeze(-1).long()).squeeze(-1)
    entropy = None
    if compute_entropy:
        entropy = entropy_from_logits(logits)
    return logp, entropy


def token_logprobs_reference(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    targets: torch.Tensor,
    *,
    bias: torch.Tensor | None = None,
    temperature: float = 1.0,
    compute_entropy: bool = False,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """hidden: [N, H], weight: [V, H], targets: [N] -> (logp [N], entropy [N] or None), fp32 or fp64."""
    logits = logits_from_hidden(hidden, weight, bias, temperature)
    return token_logprobs_from_logits(logits, targets, compute_entropy)
