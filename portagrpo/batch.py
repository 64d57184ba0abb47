"""Typed batch containers. Shapes: B responses, P prompt tokens (left-padded), T response tokens (right-padded)."""
from __future__ import annotations

from dataclasses import dataclass, field, fields, replace
from typing import Any, Callable

import torch


@dataclass
class PromptImages:
    """The processed images of a rollout's distinct prompts, each kept once, and which prompt every row uses."""

    pixel_values: torch.Tensor  # [N, D]: every prompt's image patches, prompt after prompt
    grid_thw: torch.Tensor  # [M, 3] long: every image's (t, h, w) patch grid, prompt after prompt
    patch_spans: list[tuple[int, int]]  # per prompt: its rows of pixel_values
    image_spans: list[tuple[int, int]]  # per prompt: its rows of grid_thw
    row_prompt: list[int]  # per row of the batch: the prompt whose images it shows

    def select(self, idx: list[int]) -> "PromptImages":
        """The rows `idx`: the same pixels (no copy), fewer rows pointing at them."""
        return replace(self, row_prompt=[self.row_prompt[i] for i in idx])

    def to(self, device) -> "PromptImages":
        return replace(self, pixel_values=self.pixel_values.to(device), grid_thw=self.grid_thw.to(device))

    def map(self, tensor, rows: list[int] | None = None) -> "PromptImages":
        """As `RolloutBatch.map`: the rows `rows` (when given: the same pixels), each tensor moved by `tensor` unless
        it is selecting rows (the pixels are per prompt, not per row)."""
        if rows is not None:
            return self.select(rows)
        return replace(self, pixel_values=tensor(self.pixel_values), grid_thw=tensor(self.grid_thw))

    @classmethod
    def cat(cls, parts: list["PromptImages | None"], rows: list[int]) -> "PromptImages":
        """Batches' images one after the other (`rows`: each part's rows): their prompts in order, spans and row
        pointers moved past the parts before; a part without images gives each of its rows an imageless prompt."""
        present = [p for p in parts if p is not None]
        pixels = torch.cat([p.pixel_values for p in present])
        grids = torch.cat([p.grid_thw for p in present])
        patch_spans, image_spans, row_prompt = [], [], []
        n_patches = n_images = 0
        for part, count in zip(parts, rows):
            if part is None:
                part = cls(pixels[:0], grids[:0], [(0, 0)] * count, [(0, 0)] * count, list(range(count)))
            first = len(patch_spans)
            patch_spans += [(a + n_patches, b + n_patches) for a, b in part.patch_spans]
            image_spans += [(a + n_images, b + n_images) for a, b in part.image_spans]
            row_prompt += [q + first for q in part.row_prompt]
            n_patches, n_images = n_patches + part.pixel_values.shape[0], n_images + part.grid_thw.shape[0]
        return cls(pixels, grids, patch_spans, image_spans, row_prompt)

    def distinct(self) -> list[int]:
        """This batch's prompts, each once, in order of first use."""
        return list(dict.fromkeys(self.row_prompt))

    def take(self, prompts: list[int]) -> tuple[torch.Tensor, torch.Tensor]:
        patches = [i for p in prompts for i in range(*self.patch_spans[p])]
        images = [i for p in prompts for i in range(*self.image_spans[p])]
        device = self.pixel_values.device
        take = lambda t, i: t.index_select(0, torch.tensor(i, dtype=torch.long).to(device))  # noqa: E731
        return take(self.pixel_values, patches), take(self.grid_thw, images)

    def per_row(self) -> tuple[torch.Tensor, torch.Tensor]:
        """(pixel_values, image_grid_thw) with each row's images in row order (what `generate` takes)."""
        return self.take(self.row_prompt)

    def grids_per_row(self) -> torch.Tensor:
        """[M_rows, 3]: each row's image grids in row order."""
        images = [i for p in self.row_prompt for i in range(*self.image_spans[p])]
        return self.grid_thw.index_select(0, torch.tensor(images, dtype=torch.long).to(self.grid_thw.device))


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
    images: PromptImages | None = None
    # [B, T] float: 1 on the tokens the model sampled itself. A multi-turn rollout's response also holds tool
    # and template tokens: in the context (response_mask, which attention uses) and scored, never trained.
    # None: every response token is the model's.
    model_mask: torch.Tensor | None = None
    # int16 [B, P + T, L, k]: a mixture-of-experts policy's experts per token and MoE layer on this grid
    # (model/router_replay.py): the sampler's (R3), or the old policy's scoring pass's (R2); -1 where unknown.
    # None: none recorded.
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

    def map(self, tensor: Callable[[torch.Tensor], torch.Tensor], rows: list[int] | None = None) -> "RolloutBatch":
        """The batch with `tensor` applied to each of its tensors (and the images' tensors), or, with `rows`, its rows
        `rows` (host indices), each tensor passed through `tensor` after the selection: the one walk over its fields
        that `select`, `to` and the gather share."""
        out: dict[str, Any] = {}
        for f in fields(self):
            value = getattr(self, f.name)
            if value is None:
                out[f.name] = None
            elif torch.is_tensor(value):
                out[f.name] = tensor(value)
            elif f.name == "images":
                out[f.name] = value.map(tensor, rows)
            elif rows is not None:  # per-sample lists; a gathered global batch carries tensors and lengths only
                out[f.name] = [value[i] for i in rows] if value else []
            else:
                out[f.name] = value
        return RolloutBatch(**out)

    def select(self, idx: torch.Tensor | list[int]) -> "RolloutBatch":
        """The rows `idx` (host indices: a device tensor here would be a host synchronisation)."""
        idx_l = idx.tolist() if torch.is_tensor(idx) else list(idx)
        on_device: dict[torch.device, torch.Tensor] = {}

        def take(value: torch.Tensor) -> torch.Tensor:
            if value.device not in on_device:  # one asynchronous copy of the indices per device
                on_device[value.device] = torch.tensor(idx_l, dtype=torch.long).to(value.device, non_blocking=True)
            return value.index_select(0, on_device[value.device])

        return self.map(take, idx_l)

    @classmethod
    def cat(cls, parts: list["RolloutBatch"], pad_id: int) -> "RolloutBatch":
        """Batches one after the other (rounds of a step): tensors concatenated, prompts of different widths
        left-padded to the widest (`pad_id` under mask 0), lengths and per-sample lists joined, images joined so each
        row keeps its prompt's pixels. A part without a model mask trains all its response tokens."""
        width = max(p.prompt_len for p in parts)

        def joined(name: str) -> Any:
            values = [getattr(p, name) for p in parts]
            if name == "images":
                return None if all(v is None for v in values) else PromptImages.cat(values, [p.size for p in parts])
            if name == "model_mask":  # a part without one trains all its response tokens: its trained mask says so
                return torch.cat([p.trained_mask for p in parts]) if any(v is not None for v in values) else None
            if name == "lengths":
                return [x for p in parts for x in p.host_lengths()]
            if any(v is None for v in values):
                return None
            if not torch.is_tensor(values[0]):  # per-sample lists: kept where every part has them
                return [x for v in values for x in v] if all(values) else []
            if name in ("prompt_ids", "prompt_mask"):
                pad = pad_id if name == "prompt_ids" else 0
                values = [torch.nn.functional.pad(v, (width - v.shape[1], 0), value=pad) for v in values]
            if name == "routes":  # [B, P + T, L, k]: unknown (-1) routes on the added prompt columns
                values = [torch.nn.functional.pad(v, (0, 0, 0, 0, width - p.prompt_len, 0), value=-1)
                          for v, p in zip(values, parts)]
            return torch.cat(values)

        return cls(**{f.name: joined(f.name) for f in fields(cls)})

    def host_lengths(self) -> list[tuple[int, int]]:
        """(prompt tokens, response tokens) per response: the known ones, else one read from the device."""
        if not self.lengths:
            both = torch.stack([self.prompt_mask.sum(1), self.response_mask.sum(1).round().long()], dim=1)
            self.lengths = [(int(p), int(r)) for p, r in both.tolist()]
        return self.lengths

    def to(self, device: torch.device) -> "RolloutBatch":
        return self.map(lambda t: t.to(device))

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
