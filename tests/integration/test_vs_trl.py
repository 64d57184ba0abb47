"""bench/vs_trl.py: portagrpo and TRL's GRPOTrainer on the same model, data and settings."""
import importlib.util
import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
SCRIPT = ROOT / "bench" / "vs_trl.py"
pytest.importorskip("trl", reason="TRL comes with the optional `bench` extra")


def load_script():
    spec = importlib.util.spec_from_file_location("vs_trl", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


@pytest.mark.slow
def test_both_trainers_run_the_same_work_and_are_compared(tmp_path):
    out = tmp_path / "report.json"
    res = subprocess.run([sys.executable, str(SCRIPT), "--size", "3m", "--rounds", "1", "--steps", "2", "--warmup", "1",
                          "--max-new-tokens", "8", "--n", "4", "--threads", "2", "--variants", "sync-fp32,one_step_off",
                          "--workdir", str(tmp_path / "work"), "--json", str(out)],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path)
    assert res.returncode == 0, res.stderr[-3000:]
    report = json.loads(out.read_text())
    assert set(report["step_s_median"]) == {"trl", "sync-fp32", "one_step_off"}
    assert all(t > 0 for t in report["step_s_median"].values())
    assert report["ratio_portagrpo_over_trl"] == pytest.approx(
        report["step_s_median"]["sync-fp32"] / report["step_s_median"]["trl"])
    assert report["settings"]["completions_per_prompt"] == 4 and report["settings"]["max_new_tokens"] == 8
    assert report["settings"]["threads"] == 2  # every system's processes together: one_step_off ran 1 + 1
    # completions really were sampled by all, at most max_new_tokens long
    assert all(0 < n <= 8 for n in report["completion_len_mean"].values())
    assert report["throughput_over_sync_fp32"]["sync-fp32"] == 1.0
    assert "x TRL" in res.stdout


def test_runs_with_other_settings_are_refused(monkeypatch, tmp_path):
    vs = load_script()
    args = vs.main.__globals__["argparse"].Namespace(prompts=1, n=4, max_new_tokens=8, threads=1, engine="hf")
    asked = vs.wanted_settings(args)
    assert vs.differing(asked, dict(asked)) == []
    ran = {
        **asked,
        "top_k": 50,
        "lr": 1e-5 * (1 + 1e-12),
    }  # a silently different sampler; float noise is not a difference
    assert vs.differing(asked, ran) == ["top_k: asked None, ran 50"]
    # with vLLM the engines' dtypes are compared too: vLLM's `auto` samples an fp32 checkpoint in bf16
    vllm_args = vs.main.__globals__["argparse"].Namespace(prompts=1, n=4, max_new_tokens=8, threads=1, engine="vllm",
                                                           sampler_dtype="fp32")
    vllm_asked = vs.wanted_settings(vllm_args)
    assert vllm_asked["sampler_dtype"] == "float32" and "sampler_dtype" not in asked
    assert vs.differing(vllm_asked, {**vllm_asked, "sampler_dtype": "bfloat16"}) == [
        "sampler_dtype: asked 'float32', ran 'bfloat16'"]

    monkeypatch.setattr(vs, "build_workdir", lambda *a, **k: {"model": "m", "data": "d"})
    monkeypatch.setattr(vs, "spawn", lambda system, spec, threads: {
        "settings": ran if system == "trl" else asked, "step_s": [1.0], "completion_len_mean": 8})
    args = vs.main.__globals__["argparse"].Namespace(prompts=1, n=4, max_new_tokens=8, threads=1, size="3m", rounds=1,
                                                      steps=1, warmup=0, workdir=str(tmp_path), argv=[],
                                                      variants=["sync-fp32"], engine="hf")
    with pytest.raises(SystemExit, match=r"refusing to compare: the trl run trained with other settings than asked "
                                         r"\(top_k: asked None, ran 50\)"):
        vs.compare(args)
