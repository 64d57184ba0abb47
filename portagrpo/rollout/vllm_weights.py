"""The policy's weights on their way into vLLM: their names as vLLM's loader takes them, buckets of a bounded size,
the current weights for a reload after a level-2 sleep, and a counted pass of a push (the in-place push into vLLM's CPU
build is rollout/vllm_cpu_push.py)."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

from portagrpo.model.weight_push import push_pairs
from portagrpo.rollout.engines import hf_weight_names


def vllm_weight_names(state, *, tied_embeddings: bool):
    """vLLM loads checkpoints by their Hugging Face names (`hf_weight_names`), and a mixture-of-experts policy's
    packed experts by a hub checkpoint's per-expert names (model/expert_packing.py: `per_expert_names`)."""
    from portagrpo.model.expert_packing import per_expert_names

    return per_expert_names(hf_weight_names(state, tied_embeddings=tied_embeddings))


def bucket_tensors(
    named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int
) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


class PolicyWeights:
    """The policy's current weights as the trainer pushes them (train/build.py: push_weights): a LoRA adapter
    merged for the while, each tensor gathered when asked (a sharded policy's gather is a collective, which every
    rank reaches together: ranks generate in step), the tied LM head left out. The engine reloads from it when
    it must generate after a level-2 sleep without a push in between (validation, DAPO's extra rounds)."""

    def __init__(self, scorer: torch.nn.Module, policy: torch.nn.Module, *, lora: bool, tied: bool,
                 wanted=None) -> None:
        self.scorer, self.policy, self.lora, self.tied = scorer, policy, lora, tied
        self.wanted = wanted  # the engine's experts under vLLM's expert parallelism (model/weight_push.py push_pairs)

    @contextlib.contextmanager
    def __call__(self) -> Iterator[Iterator[tuple[str, torch.Tensor]]]:
        if self.lora:
            self.policy.merge_adapter()
        try:
            named = hf_weight_names(self.scorer.state_dict().items(), tied_embeddings=self.tied)
            yield push_pairs(named, self.wanted)  # packed experts one at a time, never a layer's whole tensor
        finally:
            if self.lora:
                self.policy.unmerge_adapter()


class Counted:
    """The (name, tensor) pairs of a push, passed through once to vLLM's loader, counting them."""

    def __init__(self, named: Iterable[tuple[str, torch.Tensor]]) -> None:
        self.named, self.count = named, 0

    def __iter__(self) -> Iterator[tuple[str, torch.Tensor]]:
        for pair in self.named:
            self.count += 1
            yield pair
