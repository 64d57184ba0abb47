"""Typed batch containers. Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded)."""
from __future__ import annotations

from dataclasses import dataclass, fields, replace
from typing import Any

import torch


@dataclass
class RolloutBatch:
    prompt_ids: torch.Tensor  # [B, P] long, left-padded
    prompt_mask: torch.Tensor  # [B, P] long
    responses: torch.Tensor  # [B, T] long, right-padded
    response_mask: torch.Tensor  # [B, T] float, 1 on response tokens up to and including EOS
    uid: torch.Tensor  # [B] long, group id (one per prompt)
    prompt_index: torch.Tensor  # [B] long, dataset index of the prompt
    response_text: list[str]
    ground_truth: list[str]
    data_source: list[str]
    extra_info: list[dict]

    @property
    def size(self) -> int:
        return self.responses.shape[0]

    @property
    def prompt_len(self) -> int:
        return self.prompt_ids.shape[1]

    @property
    def input_ids(self) -> torch.Tensor:
        """[B, P + T]."""
        return torch.cat([self.prompt_ids, self.responses], dim=1)

    @property
    def attention_mask(self) -> torch.Tensor:
        """[B, P + T]."""
        return torch.cat([self.prompt_mask, self.response_mask.long()], dim=1)

    def select(self, idx: torch.Tensor | list[int]) -> "RolloutBatch":
        idx_t = torch.as_tensor(idx, dtype=torch.long)
        idx_l = idx_t.tolist()
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                out[f.name] = value.index_select(0, idx_t.to(value.device))
            else:  # per-sample lists; a gathered global batch carries tensors only and keeps them empty
                out[f.name] = [value[i] for i in idx_l] if value else []
        return RolloutBatch(**out)

    def to(self, device: torch.device) -> "RolloutBatch":
        return replace(self, **{f.name: getattr(self, f.name).to(device) for f in fields(self)
                                if torch.is_tensor(getattr(self, f.name))})

    def tensors(self) -> dict[str, Any]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class TrainBatch:
    """A rollout plus what the update needs: rewards, advantages and reference log-probs."""

    rollout: RolloutBatch
    advantages: torch.Tensor  # [B, T] float32
    old_logp: torch.Tensor | None  # [B, T] float32; None on a fully on-policy step (the update's own, detached)
    ref_logp: torch.Tensor | None  # [B, T] float32

    def select(self, idx: torch.Tensor | list[int]) -> "TrainBatch":
        # Indices often come from the host (randperm with a CPU generator, arange): move them to the data.
        idx_t = torch.as_tensor(idx, dtype=torch.long).to(self.advantages.device)
        return TrainBatch(
            rollout=self.rollout.select(idx_t),
            advantages=self.advantages.index_select(0, idx_t),
            old_logp=None if self.old_logp is None else self.old_logp.index_select(0, idx_t),
            ref_logp=None if self.ref_logp is None else self.ref_logp.index_select(0, idx_t),
        )
