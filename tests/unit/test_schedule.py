"""The learning-rate schedule (algo/schedule.py), part of the numerics contract."""
import math

import pytest

from portagrpo.algo.schedule import lr_multiplier


def test_warmup_rises_linearly_from_zero_then_holds():
    got = [lr_multiplier(s, warmup_steps=4, total_steps=10, kind="constant") for s in range(7)]
    assert got == [0.0, 0.25, 0.5, 0.75, 1.0, 1.0, 1.0]


def test_cosine_falls_from_one_to_zero_after_warmup_and_stays_there():
    f = lambda s: lr_multiplier(s, warmup_steps=2, total_steps=10, kind="cosine")  # noqa: E731
    assert f(1) == 0.5 and f(2) == 1.0
    assert f(6) == pytest.approx(0.5)  # halfway through the 8 decay steps
    assert f(10) == pytest.approx(0.0, abs=1e-12) and f(15) == pytest.approx(0.0, abs=1e-12)
    assert f(3) == pytest.approx(0.5 * (1 + math.cos(math.pi / 8)))
    decay = [f(s) for s in range(2, 11)]
    assert all(a > b for a, b in zip(decay, decay[1:]))


def test_no_warmup_starts_at_the_full_rate():
    assert lr_multiplier(0, warmup_steps=0, total_steps=5, kind="cosine") == 1.0
    assert lr_multiplier(0, warmup_steps=0, total_steps=5, kind="constant") == 1.0


def test_an_unknown_schedule_is_refused():
    with pytest.raises(ValueError, match="unknown learning-rate schedule 'linear'"):
        lr_multiplier(0, warmup_steps=0, total_steps=5, kind="linear")
