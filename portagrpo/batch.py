"""Typed batch containers. Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
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
    # Per response, on the host: (prompt tokens, response tokens). Scoring and the update take every
    # shape they need from these, so their micro-batch loops never wait for the device; empty when
    # not known yet (`host_lengths` then reads them once).
    lengths: list[tuple[int, int]] = field(default_factory=list)
    # [B, T] float32: the log-prob each response token was sampled with, over the distribution the
    # engine sampled from (after temperature, penalties and top-k/top-p/min-p truncation,
    # renormalised over the kept tokens); 0 after the response. None: the engine does not say.
    rollout_logp: torch.Tensor | None = None
    # Vision-language rows: their prompts' processed images, kept once per prompt, and which prompt each row
    # shows (model/vision.py: PromptImages; selecting rows copies no pixels). None: text only.
    images: Any = None
    # [B, T] float: 1 on the tokens the model sampled itself. A multi-turn rollout's response also holds tool
    # and template tokens: in the context (response_mask, which attention uses) and scored, never trained.
    # None: every response token is the model's.
    model_mask: torch.Tensor | None = None
    # int16 [B, P + T, L, k]: a mixture-of-experts policy's experts per token and MoE layer on this grid (model/moe.py):
    # the sampler's (R3), or the old policy's scoring pass's (R2); -1 where unknown. None: none recorded.
    routes: torch.Tensor | None = None

    @property
    def trained_mask(self) -> torch.Tensor:
        """The response tokens the loss may count: the model's own (all of them in a single-turn rollout)."""
        return self.response_mask if self.model_mask is None else self.model_mask

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
        """The rows `idx` (host indices: a device tensor here would be a host synchronisation)."""
        idx_l = idx.tolist() if torch.is_tensor(idx) else list(idx)
        on_device = {}
        out = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if torch.is_tensor(value):
                if value.device not in on_device:  # one asynchronous copy of the indices per device
                    on_device[value.device] = torch.tensor(idx_l, dtype=torch.long).to(value.device, non_blocking=True)
                out[f.name] = value.index_select(0, on_device[value.device])
            elif value is None:
                out[f.name] = None
            elif hasattr(value, "row_prompt"):  # PromptImages: the same pixels, the selected rows
                out[f.name] = value.select(idx_l)
            else:  # per-sample lists; a gathered global batch carries tensors and lengths only
                out[f.name] = [value[i] for i in idx_l] if value else []
        return RolloutBatch(**out)

    def host_lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, response tokens) per response: the known ones, else one read from the device."""
        if not self.lengths:
            both = torch.stack([self.prompt_mask.sum(1), self.response_mask.sum(1).round().long()], dim=1)
            self.lengths = [(int(p), int(r)) for p, r in both.tolist()]
        return self.lengths

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
    # Rollout correction (algo/rollout_correction.py): importance weights on the policy loss, and the
    # loss mask with rejected tokens removed (None: the rollout's trained mask).
    is_weights: torch.Tensor | None = None
    loss_mask: torch.Tensor | None = None

    @property
    def mask(self) -> torch.Tensor:
        """The tokens the loss counts: the model's own response tokens less what rejection sampling removed
        (`loss_mask`, made from the trained mask)."""
        return self.rollout.trained_mask if self.loss_mask is None else self.loss_mask

    def select(self, idx: torch.Tensor | list[int]) -> "TrainBatch":
        # Indices come from the host (randperm with a CPU generator, arange): copied to the data without waiting.
        idx_l = idx.tolist() if torch.is_tensor(idx) else list(idx)
        idx_t = torch.tensor(idx_l, dtype=torch.long).to(self.advantages.device, non_blocking=True)
        take = lambda t: None if t is None else t.index_select(0, idx_t)  # noqa: E731
        return TrainBatch(rollout=self.rollout.select(idx_l), advantages=take(self.advantages),
                          old_logp=take(self.old_logp), ref_logp=take(self.ref_logp),
                          is_weights=take(self.is_weights), loss_mask=take(self.loss_mask))


def _fill(order: list[int], lengths: list[int], k: int) -> tuple[list[list[int]], list[int]]:
    """`order`'s indices dealt into k groups, each to the lightest so far (ties to the lowest group); the loads."""
    groups: list[list[int]] = [[] for _ in range(k)]
    loads = [0] * k
    for i in order:
        g = min(range(k), key=lambda j: (loads[j], j))
        groups[g].append(i)
        loads[g] += lengths[i]
    return groups, loads


def token_budget_groups(lengths: list[int], budget: int) -> list[list[int]]:
    """Indices into `lengths` grouped into micro-batches of at most `budget` tokens, balanced: k groups,
    from ceil(total / budget) up until every group fits, filled longest first into the lightest group
    (ties to the lowest index). A length over the budget gets a group of its own. Deterministic; each
    group's indices ascending, groups ordered by their first index."""
    alone = [[i] for i, n in enumerate(lengths) if n > budget]
    rest = [i for i, n in enumerate(lengths) if n <= budget]
    groups: list[list[int]] = []
    if rest:
        order = sorted(rest, key=lambda i: (-lengths[i], i))
        k = max(1, -(-sum(lengths[i] for i in rest) // budget))
        while True:
            groups, loads = _fill(order, lengths, k)
            if max(loads) <= budget:
                break
            k += 1
    return sorted((sorted(g) for g in groups + alone if g), key=lambda g: g[0])


def split_groups(groups: list[list[int]], lengths: list[int], count: int) -> list[list[int]]:
    """`groups` split up to `count` groups: the heaviest group of two or more rows (ties to the lowest first
    index) dealt into two, longest row first, until there are `count` or every group is one row. A split never
    adds tokens to a group, so groups that fit a budget still do. Each group ascending, ordered by first index."""
    groups = [list(g) for g in groups]
    while len(groups) < count:
        splittable = [g for g in groups if len(g) > 1]
        if not splittable:
            break
        heaviest = max(splittable, key=lambda g: (sum(lengths[i] for i in g), -g[0]))
        groups.remove(heaviest)
        groups += _fill(sorted(heaviest, key=lambda i: (-lengths[i], i)), lengths, 2)[0]
    return sorted((sorted(g) for g in groups), key=lambda g: g[0])


def balanced_shares(lengths: list[int], parts: int) -> list[list[int]]:
    """Indices into `lengths` dealt into `parts` shares of len(lengths) // parts each, their token sums balanced:
    longest first, each to the lightest share with room (ties to the lowest share), as verl's `balance_batch`
    evens out its data-parallel ranks. Deterministic; each share ascending."""
    per = len(lengths) // parts
    shares: list[list[int]] = [[] for _ in range(parts)]
    loads = [0] * parts
    for i in sorted(range(len(lengths)), key=lambda i: (-lengths[i], i)):
        s = min((j for j in range(parts) if len(shares[j]) < per), key=lambda j: (loads[j], j))
        shares[s].append(i)
        loads[s] += lengths[i]
    return [sorted(s) for s in shares]


def micro_batches(batch: RolloutBatch, size: int, token_budget: int | None = None,
                  count: int | None = None) -> list[torch.Tensor]:
    """Host row indices of each micro-batch: fixed `size` in row order, or, with a `token_budget`,
    balanced groups of prompt + response tokens (`token_budget_groups`), planned from host lengths.
    `count` (with a token budget): how many micro-batches every rank runs, the most any rank's plan has, so
    that sharded forwards stay in lockstep; the groups are split up to it (`split_groups`). Ranks hold as many
    rows each, so a plan of `count` exists; fewer rows than `count` is refused (a rank would wait alone)."""
    if token_budget is None:
        return list(torch.arange(batch.size).split(size))
    lengths = [p + r for p, r in batch.host_lengths()]
    groups = token_budget_groups(lengths, token_budget)
    if count is not None:
        groups = split_groups(groups, lengths, count)
        if len(groups) != count:
            raise ValueError(f"{batch.size} rows cannot make the {count} micro-batches another rank runs")
    return [torch.tensor(g, dtype=torch.long) for g in groups]
