"""The parity suite as pytest: every backend present x dtype x kernel against the float64 golden.

Devices that are absent are skipped with the reason their backend gives. The same code is
`portagrpo parity --device X`.
"""

import pytest
import torch

from portagrpo import algo
from portagrpo.backends import get_backend
from portagrpo.backends.base import BackendUnavailable
from portagrpo.batch import RolloutBatch
from portagrpo.model.vision import PromptImages
from portagrpo.tolerances import relative_error
from portagrpo.tools import parity, parity_moe, parity_stages

DEVICES = [pytest.param(d, marks=getattr(pytest.mark, d)) for d in ("cpu", "cuda", "rocm", "npu")]


def _backend_or_skip(device):
    try:
        return get_backend(device)
    except BackendUnavailable as err:
        pytest.skip(str(err))


def _kernels(backend):
    names = ["reference", "chunked"]
    try:
        backend.kernel_implementation("triton")
        names.append("triton")
    except BackendUnavailable:
        pass
    return names


@pytest.mark.parametrize("device", DEVICES)
@pytest.mark.parametrize("dtype", ["fp32", "bf16"])
def test_backend_matches_golden(device, dtype):
    backend = _backend_or_skip(device)
    if dtype == "bf16" and not backend.supports_dtype(torch.bfloat16):
        pytest.skip(f"{device} has no bf16")
    for kernel in _kernels(backend):
        chosen, rows = parity.run_parity(device, dtype, kernel)
        failed = [r for r in rows if not r.passed]
        assert not failed, parity.format_table(device, dtype, chosen, rows)
        # skipped only where the stack's transformers cannot run the vision-language or the MoE stage
        skipped = (parity_stages.VLM if parity_stages.vlm_unavailable() else set()) | (
            parity_moe.STAGES if parity_moe.moe_unavailable() else set())
        assert {r.stage for r in rows if r.skipped} == skipped


def test_fp64_on_cpu_is_the_golden():
    _, rows = parity.run_parity("cpu", "fp64", "chunked")
    assert all(r.passed for r in rows) and max(r.error for r in rows if not r.skipped) < 1e-12


def _needs_vision():
    why = parity_stages.vlm_unavailable()
    if why is not None:
        pytest.skip(why)


def test_regenerating_gives_the_stored_numbers(tmp_path):
    _needs_vision()
    parity.regenerate(tmp_path)
    names = [parity.SCENARIO_FILE, parity.GOLDEN_FILE] + [parity_moe.SCENARIO_FILE, parity_moe.GOLDEN_FILE] * (
        parity_moe.moe_unavailable() is None)
    for name in names:
        stored, fresh = parity.load_fixture(name), parity.load_fixture(name, tmp_path)
        assert stored.keys() == fresh.keys(), name
        for key in stored:
            assert relative_error(fresh[key], stored[key]) <= 1e-12, (name, key)


def test_golden_covers_every_stage():
    golden = parity.load_fixture(parity.GOLDEN_FILE)
    expected = {"adv/grpo", "adv/drgrpo", "logprob", "entropy", "total_loss", "grad_norm", "params_after_3_steps"}
    expected |= {f"loss_policy/{m}" for m in parity.AGG_MODES} | {f"kl/{k}" for k in parity.KL_TYPES}
    expected |= {f"rollout_is/{level}" for level in ("token", "sequence")}
    expected |= {f"loss_policy/rollout_is_{level}" for level in ("token", "sequence")}
    expected |= parity_stages.STAGES
    assert set(golden) == expected
    scenario = parity.load_fixture(parity.SCENARIO_FILE)
    scores = scenario["scores"].view(3, 4)
    assert (scores[1] == scores[1, 0]).all() and len(set(scores[0].tolist())) == 4  # tied and untied groups
    assert len(set(scenario["response_mask"].sum(1).tolist())) > 3  # ragged
    # multi-turn: tool spans inside responses (one up to the response's end), and single-turn rows among them
    response, model = scenario["mt.response_mask"].bool(), scenario["mt.model_mask"].bool()
    tool = response & ~model
    assert not (model & ~response).any() and tool.any(1).sum() == 6 and (model.sum(1) == response.sum(1)).sum() == 2
    assert tool[3, response[3].sum() - 1]  # row 3's tool reply runs to its end
    assert golden["multi_turn/tool_span_grad"].shape == (int(tool.sum()), parity.MODEL_CONFIG["hidden_size"])
    assert (golden["multi_turn/tool_span_grad"] == 0).all() and golden["multi_turn/grad"].norm() > 0
    # vision-language: two images of different sizes, one prompt without an image
    assert scenario["vl.image_grid_thw"].tolist() == [[1, 4, 4], [1, 4, 6]]
    assert scenario["vl.image_spans"].tolist() == [[0, 1], [1, 2], [2, 2]]
    assert golden["vlm/grad/vision"].norm() > 0


def test_tool_spans_are_held_to_exactly_zero_in_every_dtype():
    for dtype in (torch.float64, torch.float32, torch.bfloat16):
        assert parity._tolerance("multi_turn/tool_span_grad", dtype) == 0.0
        assert parity._tolerance("multi_turn/grad", dtype) == parity.tolerance(dtype, "grad")


def test_ignoring_the_model_mask_fails(monkeypatch):
    # a multi-turn batch trained on every response token: tool and template tokens get loss and gradient
    monkeypatch.setattr(RolloutBatch, "trained_mask", property(lambda self: self.response_mask))
    _, rows = parity.run_parity("cpu", "fp32", "chunked")
    failed = {r.stage for r in rows if not r.passed}
    assert failed == {"multi_turn/adv", "multi_turn/total_loss", "multi_turn/grad", "multi_turn/tool_span_grad"}


def test_scoring_without_the_images_fails(monkeypatch):
    _needs_vision()
    # the vision tower sees blank pixels: the images no longer reach the log-probs
    take = PromptImages.take

    def blank(self, prompts):
        pixels, grids = take(self, prompts)
        return torch.zeros_like(pixels), grids

    monkeypatch.setattr(PromptImages, "take", blank)
    _, rows = parity.run_parity("cpu", "fp32", "chunked")
    failed = {r.stage for r in rows if not r.passed}
    assert failed == {"vlm/logprob", "vlm/entropy", "vlm/grad/vision", "vlm/grad/language"}


def _off_by_one(hidden, weight, targets, **kw):
    """A kernel that reads the neighbouring token id: the classic shifted-label bug."""
    from portagrpo.kernels import token_logprobs_chunked

    return token_logprobs_chunked(hidden, weight, (targets + 1) % weight.shape[0], **kw)


def test_a_kernel_off_by_one_token_fails(monkeypatch, capsys):
    from portagrpo import kernels
    from portagrpo.cli import main

    monkeypatch.setitem(kernels.LOGPROB_KERNELS.mapping, "chunked", lambda: _off_by_one)
    _, rows = parity.run_parity("cpu", "fp32", "chunked")
    failed = {r.stage for r in rows if not r.passed}
    assert {"logprob", "total_loss", "grad_norm"} <= failed
    assert "adv/grpo" not in failed
    assert main(["parity", "--device", "cpu", "--kernels", "chunked"]) == 1
    assert "FAIL" in capsys.readouterr().out


def test_a_wrong_aggregation_fails(monkeypatch):
    # DrGRPO's normaliser forgotten: seq-mean-token-sum-norm computed as seq-mean-token-sum
    monkeypatch.setitem(algo.AGG_MODES._items, "seq-mean-token-sum-norm", algo.AGG_MODES.get("seq-mean-token-sum"))
    _, rows = parity.run_parity("cpu", "fp32", "chunked")
    failed = {r.stage for r in rows if not r.passed}
    assert failed == {"loss_policy/seq-mean-token-sum-norm"}


def test_a_transformers_without_the_vision_path_skips_that_stage_in_one_sentence(monkeypatch, tmp_path, capsys):
    import json

    from portagrpo.cli import main
    from portagrpo.errors import UserError
    from portagrpo.model import vision

    # image rotary positions placed as a video's (the version is read in one place: transformers itself replaces its
    # lazy module object on a first submodule import, so patching its attribute does not last)
    monkeypatch.setattr(vision, "transformers_version", lambda: "5.5.3")
    _, rows = parity.run_parity("cpu", "fp32", "reference")
    skipped = {r.stage: r.skipped for r in rows if r.skipped and r.stage not in parity_moe.STAGES}
    assert set(skipped) == parity_stages.VLM and all(r.passed for r in rows)
    assert "transformers 5.5.3" in next(iter(skipped.values())) and "5.5.4" in next(iter(skipped.values()))
    out = tmp_path / "report.json"
    assert main(["parity", "--device", "cpu", "--kernels", "reference", "--json", str(out)]) == 0
    moe_skipped = len(parity_moe.STAGES) if parity_moe.moe_unavailable() else 0  # transformers 4.x: the MoE stage
    assert f"{4 + moe_skipped} skipped" in capsys.readouterr().out
    stages = {s["stage"]: s for s in json.loads(out.read_text())["stages"]}
    assert stages["vlm/logprob"]["error"] is None and "5.5.4" in stages["vlm/logprob"]["skipped"]
    assert "skipped" not in stages["multi_turn/grad"] and stages["multi_turn/grad"]["passed"]
    with pytest.raises(UserError, match="cannot be regenerated here"):
        parity.regenerate(tmp_path / "fixtures")
    assert not (tmp_path / "fixtures").exists()


def test_cli_json_report(tmp_path):
    import json

    from portagrpo.cli import main

    out = tmp_path / "report.json"
    assert main(["parity", "--device", "cpu", "--dtype", "fp32", "--kernels", "reference", "--json", str(out)]) == 0
    report = json.loads(out.read_text())
    stages = len(parity.load_fixture(parity.GOLDEN_FILE)) + len(parity_moe.STAGES)
    assert report["passed"] and report["device"] == "cpu" and len(report["stages"]) == stages


def test_moe_golden_covers_its_stages():
    assert set(parity.load_fixture(parity_moe.GOLDEN_FILE)) == parity_moe.STAGES
