"""A rollout's images across ranks: the global batch's `PromptImages`, gathered so that they follow its rows.

Each rank samples its share of the prompts with their images (`PromptImages`: patches and grids once per prompt,
each row pointing at its prompt). `Pipeline.gather` makes the global batch every rank holds, rows in rank order;
`gather_images` makes its images: every rank's prompts in rank order, their patch and image spans and the row
pointers moved past the ranks before. Images differ in size, so ranks hold different numbers of patches: the
small host part (spans, grids, row pointers) travels as one object, and the patches padded to the largest
rank's count, as float32 (what the processor makes, and a dtype every collective library carries). Every
selection of the global rows (mini-batches, a rank's slice, micro-batches, token-budget groups) then keeps
exactly the pixels of its rows.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch

from portagrpo.model.vision import PromptImages


@dataclass(frozen=True)
class RankImages:
    """One rank's images on the host side: counts, spans, grids and row pointers (no pixels)."""

    patches: int
    width: int  # values per patch (0 where the rank has no images)
    patch_spans: list[tuple[int, int]]
    image_spans: list[tuple[int, int]]
    grids: list[list[int]]
    row_prompt: list[int]


def rank_images(images: PromptImages | None, rows: int) -> RankImages:
    """This rank's part of the global images; a rank whose prompts have no image gives each of its rows an
    imageless prompt of its own."""
    if images is None:
        return RankImages(0, 0, [(0, 0)] * rows, [(0, 0)] * rows, [], list(range(rows)))
    return RankImages(images.pixel_values.shape[0], images.pixel_values.shape[1], list(images.patch_spans),
                      list(images.image_spans), images.grid_thw.tolist(), list(images.row_prompt))


def gather_images(comm, images: PromptImages | None, rows: int, device) -> PromptImages | None:
    """The global batch's images, the same on every rank, in rank order (one process: unchanged; no rank
    with an image: None). `rows`: this rank's rows, which point at its prompts."""
    if comm.world_size == 1:
        return images
    parts: list[RankImages] = comm.all_gather_object(rank_images(images, rows))
    if not any(part.grids for part in parts):
        return None
    width = max(part.width for part in parts)
    pixels = gather_patches(comm, None if images is None else images.pixel_values, [p.patches for p in parts],
                            width, device)
    patch_spans, image_spans, grids, row_prompt = [], [], [], []
    n_patches = n_images = n_prompts = 0
    for part in parts:
        patch_spans += [(a + n_patches, b + n_patches) for a, b in part.patch_spans]
        image_spans += [(a + n_images, b + n_images) for a, b in part.image_spans]
        row_prompt += [p + n_prompts for p in part.row_prompt]
        grids += part.grids
        n_patches, n_images, n_prompts = n_patches + part.patches, n_images + len(part.grids), len(patch_spans)
    grid_thw = torch.tensor(grids, dtype=torch.long).reshape(-1, 3).to(device)
    return PromptImages(pixels, grid_thw, patch_spans, image_spans, row_prompt)


def gather_patches(comm, local: torch.Tensor | None, counts: list[int], width: int, device) -> torch.Tensor:
    """Every rank's patches [counts[r], width] concatenated in rank order: each rank's part is padded to the
    largest count for the all-gather, and the padding dropped again."""
    most = max(counts)
    padded = torch.zeros(most, width, dtype=torch.float32, device=device)
    if local is not None and local.shape[0]:
        padded[:local.shape[0]] = local.to(device=device, dtype=torch.float32)
    everyone = comm.all_gather_cat(padded)  # [world * most, width]
    return torch.cat([everyone[r * most:r * most + n] for r, n in enumerate(counts)])
