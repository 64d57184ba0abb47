"""gather_images: every rank's prompts' images, gathered with the rows, equal the images of the whole prompt batch
processed on one process; any selection of the global rows takes exactly its rows' pixels."""
import io
import threading

import pytest
import torch

pytest.importorskip("PIL")
from PIL import Image  # noqa: E402

from portagrpo.data.records import PromptRecord  # noqa: E402
from portagrpo.model import vision  # noqa: E402
from portagrpo.model.vision_gather import gather_images  # noqa: E402

pytestmark = pytest.mark.skipif(vision.vision_support_problem() is not None,
                                reason=str(vision.vision_support_problem()))


class ThreadComm:
    """K ranks as K threads of one process: all-gathers meet at a barrier."""

    def __init__(self, rank: int, world: int, slots: list, barrier: threading.Barrier) -> None:
        self.rank, self.world_size, self.slots, self.barrier = rank, world, slots, barrier

    def all_gather_object(self, obj):
        self.slots[self.rank] = obj
        self.barrier.wait()
        out = list(self.slots)
        self.barrier.wait()
        return out

    def all_gather_cat(self, tensor: torch.Tensor) -> torch.Tensor:
        assert tensor.dtype in (torch.float32, torch.int64)  # what every collective library carries
        return torch.cat(self.all_gather_object(tensor.clone()))


def _png(size, rgb) -> bytes:
    out = io.BytesIO()
    Image.new("RGB", size, rgb).save(out, format="PNG")
    return out.getvalue()


def _record(i: int, *sizes) -> PromptRecord:
    content = "<image>" * len(sizes) + "colour?"
    images = tuple(_png(s, (40 * i % 256, 90, 30 * k)) for k, s in enumerate(sizes))
    return PromptRecord(i, [{"role": "user", "content": content}], "red", "x", images=images)


# rank 0: images of two sizes; rank 1: no image at all; rank 2: two images in one prompt, and a prompt without
SHARES = [[_record(0, (56, 56)), _record(1, (112, 84))], [_record(2), _record(3)],
          [_record(4, (84, 56), (56, 112)), _record(5)]]


def _gather_on_threads(shares, n: int):
    processor = vision.build_tiny_processor()
    world, out = len(shares), [None] * len(shares)
    slots, barrier = [None] * world, threading.Barrier(world)

    def rank(r):
        _, images = vision.vision_prompts(processor, shares[r], "cpu")
        out[r] = gather_images(ThreadComm(r, world, slots, barrier), vision.with_rows(images, n),
                               len(shares[r]) * n, "cpu")

    threads = [threading.Thread(target=rank, args=(r,)) for r in range(world)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return processor, out


def test_gathered_images_follow_the_rows_as_on_one_process():
    n = 2
    processor, gathered = _gather_on_threads(SHARES, n)
    _, whole = vision.vision_prompts(processor, [r for share in SHARES for r in share], "cpu")
    whole = vision.with_rows(whole, n)
    for g in gathered:  # the same on every rank
        # each prompt's patches once (not once per row), float32 as the processor made them
        assert g.pixel_values.shape[0] == whole.pixel_values.shape[0] == 16 + 48 + 24 + 32
        assert g.pixel_values.dtype == whole.pixel_values.dtype and torch.equal(g.grid_thw, whole.grid_thw)
        for rows in ([0, 1, 2, 3], [2], [5, 9], [11, 0, 8], [4, 6, 7], list(range(12))):  # micro-batches, slices
            mine, ref = g.select(rows), whole.select(rows)
            for got, want in zip(mine.per_row(), ref.per_row(), strict=True):
                assert torch.equal(got, want), rows
            assert torch.equal(mine.grids_per_row(), ref.grids_per_row())
            # the vision tower runs once per distinct prompt: the same images, in the same order
            for got, want in zip(mine.take(mine.distinct()), ref.take(ref.distinct()), strict=True):
                assert torch.equal(got, want), rows


def test_no_rank_with_an_image_gathers_none():
    _, gathered = _gather_on_threads([[_record(0)], [_record(1)]], 3)
    assert gathered == [None, None]
