"""Token log-prob / entropy implementations, chosen by name (`kernels.logprob`).

Each implementation has the signature of `token_logprobs_reference` and must match it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from portagrpo.registry import Registry

from .chunked import token_logprobs_chunked
from .reference import logits_from_hidden, token_logprobs_from_logits, token_logprobs_reference


class TokenLogprobFn(Protocol):
    def __call__(
        self,
        hidden: torch.Tensor,
        weight: torch.Tensor,
        targets: torch.Tensor,
        *,
        bias: torch.Tensor | None = None,
        temperature: float = 1.0,
        compute_entropy: bool = False,
    ) -> tuple[torch.Tensor, torch.Tensor | None]: ...


def _triton() -> TokenLogprobFn:
    # Imported only when chosen: portagrpo never imports triton otherwise.
    from .triton_logprob import token_logprobs_triton

    return token_logprobs_triton


# kernels.logprob name -> a factory returning the implementation (triton is imported only when chosen)
LOGPROB_KERNELS: Registry = Registry("log-prob kernel")
LOGPROB_KERNELS.register("reference")(lambda: token_logprobs_reference)
LOGPROB_KERNELS.register("chunked")(lambda: token_logprobs_chunked)
LOGPROB_KERNELS.register("triton")(_triton)


def logprob_impl(name: str) -> TokenLogprobFn:
    return LOGPROB_KERNELS.get(name, field="kernels.logprob")()


__all__ = [
    "TokenLogprobFn",
    "logits_from_hidden",
    "logprob_impl",
    "token_logprobs_chunked",
    "token_logprobs_from_logits",
    "token_logprobs_reference",
]
