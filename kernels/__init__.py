"""Token log-prob / entropy implementations, chosen by name (`kernels.logprob`).

Each implementation has the signature of `token_logprobs_reference` and must match it.
"""
from __future__ import annotations

from typing import Protocol

import torch

from portagrpo.errors import UnknownNameError

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


_IMPLS: dict[str, object] = {
    "reference": lambda: token_logprobs_reference,
    "chunked": lambda: token_logprobs_chunked,
    "triton": _triton,
}


def logprob_impl(name: str) -> TokenLogprobFn:
    if name not in _IMPLS:
        raise UnknownNameError(f"kernels.logprob={name!r} is not a known implementation; choose one of {', '.join(_IMPLS)}.")
    return _IMPLS[name]()


def logprob_impl_names() -> list[str]:
    return list(_IMPLS)


__all__ = [
    "TokenLogprobFn",
    "logits_from_hidden",
    "logprob_impl",
    "logprob_impl_names",
    "token_logprobs_chunked",
    "token_logprobs_from_logits",
    "token_logprobs_reference",
]
