"""The learning-rate schedule, part of the numerics contract: the multiplier of `actor.lr` at each
optimizer step of the run (the scheduler steps once per training step)."""
from __future__ import annotations

import math

LR_SCHEDULES = ("constant", "cosine")


def lr_multiplier(step: int, *, warmup_steps: int, total_steps: int, kind: str) -> float:
    """Linear warm-up from 0 at step 0 over `warmup_steps` (verl's convention), then `constant` (1) or
    `cosine` (half a cosine from 1 down to 0 at `total_steps`, held at 0 after)."""
    if kind not in LR_SCHEDULES:
        raise ValueError(f"unknown learning-rate schedule {kind!r}; one of {', '.join(LR_SCHEDULES)}")
    if warmup_steps and step < warmup_steps:
        return step / warmup_steps
    if kind == "cosine":
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))
    return 1.0
