"""The rollout's memory phase (`mem/rollout_peak_gb`) encloses the sharded policy's gather for generation: sampling
with the training model itself under FSDP2 gathers every unit first, and those bytes (and the gather's transients)
are the rollout's. The phase once sat inside the gather (b3fbf0d fixed it; the rollout pipeline's rewrite undid it),
so the peak missed them."""
import contextlib
import types

import torch

from portagrpo.train.pipeline import Pipeline, RoundRequest


def _pipeline(events: list[str], holds_weights: bool) -> Pipeline:
    @contextlib.contextmanager
    def region(name):
        events.append(f"{name} in")
        yield
        events.append(f"{name} out")

    pipeline = object.__new__(Pipeline)  # only what `here` reads
    pipeline.engine = types.SimpleNamespace(holds_weights=holds_weights)
    pipeline.scorer = torch.nn.Linear(2, 2)
    pipeline.strategy = types.SimpleNamespace(generation=lambda scorer: region("gather"))
    pipeline.runtime = types.SimpleNamespace(phase=lambda label: region(f"phase {label}"), device=torch.device("cpu"))
    pipeline.generator = types.SimpleNamespace(generate=lambda *a: events.append("generate") or "made")
    return pipeline


def test_the_rollout_phase_encloses_the_policys_gather():
    events: list[str] = []
    made = _pipeline(events, holds_weights=False).here(RoundRequest(None, 8, 0), 2, None)
    assert made == "made"
    assert events == ["phase rollout in", "gather in", "generate", "gather out", "phase rollout out"]


def test_an_engine_with_its_own_weights_gathers_nothing():
    events: list[str] = []
    _pipeline(events, holds_weights=True).here(RoundRequest(None, 8, 0), 2, None)
    assert events == ["phase rollout in", "generate", "phase rollout out"]
