"""Injects a failure into one phase of one rank, for tests/distributed/test_rank_failure.py.

On the PYTHONPATH of a test's training processes only. PORTAGRPO_TEST_FAIL="PHASE@CALL" makes rank 1's
CALL-th call of that phase raise (phases: data, engine, update); the reward phase fails through a reward
file instead. The patch wraps portagrpo's own functions from outside, so the code under test is unchanged.
"""
import os

_SPEC = os.environ.get("PORTAGRPO_TEST_FAIL", "")
_RANK = os.environ.get("PORTAGRPO_TEST_FAIL_RANK", "1")


def _inject(phase: str, call: int) -> None:
    import importlib

    module, owner, method = {
        "data": ("portagrpo.data.records", "PromptLoader", "next_batch"),
        "engine": ("portagrpo.rollout.engines", "HFRollout", "generate"),
        "update": ("portagrpo.train.update", "Updater", "update"),
    }[phase]
    cls = getattr(importlib.import_module(module), owner)
    original, calls = getattr(cls, method), [0]

    def failing(self, *args, **kwargs):
        calls[0] += 1
        if calls[0] == call:
            raise RuntimeError(f"injected failure in the {phase} phase")
        return original(self, *args, **kwargs)

    setattr(cls, method, failing)


if _SPEC and os.environ.get("RANK") == _RANK:
    _phase, _, _call = _SPEC.partition("@")
    _inject(_phase, int(_call or 1))
