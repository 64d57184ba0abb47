"""Record and replay: CPU-to-CPU across dtypes and kernels, and a divergence that is caught."""
import json

import pytest
import torch

from portagrpo.cli import main
from portagrpo.metrics import read_metrics

FAST = ["trainer.progress_bar=false", "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "actor.micro_batch_size=4", "data.train_size=64", "trainer.test_freq=0", "trainer.save_freq=0"]


@pytest.fixture(scope="module")
def recorded(tmp_path_factory):
    run = tmp_path_factory.mktemp("recorded")
    assert (
        main(["train", "--output-dir", str(run), "trainer.record_rollouts=true", "trainer.total_steps=5", *FAST]) == 0
    )
    return run


def test_recording_holds_rollouts_metrics_and_fingerprints(recorded):
    files = sorted((recorded / "rollouts").glob("step_*.pt"))
    assert len(files) == 5
    rec = torch.load(files[0], weights_only=False)
    for key in ("prompt_ids", "prompt_mask", "responses", "response_mask", "uid", "scores", "metrics", "fingerprint"):
        assert key in rec, key
    assert rec["responses"].shape[0] == 16 and rec["setting"] == {"device": "cpu", "dtype": "fp32", "kernel": "chunked"}
    assert rec["metrics"] == read_metrics(recorded / "metrics.jsonl")[0]


@pytest.mark.parametrize("overrides", [["kernels.logprob=reference"], ["model.dtype=bf16"]])
def test_replay_across_kernels_and_dtypes_matches(recorded, tmp_path, overrides, capsys):
    out = tmp_path / "replay"
    assert main(["replay", str(recorded), "--device", "cpu", "--output-dir", str(out), *overrides]) == 0
    text = capsys.readouterr().out
    assert "replay matches the recorded run" in text
    report = json.loads((out / "replay.json").read_text())
    assert len(report["steps"]) == 5 and report["passed"]
    assert (out / "replay.png").stat().st_size > 5000
    if overrides == ["kernels.logprob=reference"]:
        # same dtype, another kernel: agreement at fp32 level
        assert report["verdict"]["loss_policy"]["error"] < 1e-5 and report["verdict"]["params"]["error"] < 1e-6


def test_same_setting_replays_exactly(recorded, tmp_path):
    out = tmp_path / "same"
    assert main(["replay", str(recorded), "--device", "cpu", "--steps", "3", "--output-dir", str(out)]) == 0
    report = json.loads((out / "replay.json").read_text())
    assert len(report["steps"]) == 3
    assert all(v["error"] < 1e-12 for v in report["verdict"].values())


def test_a_diverging_replay_is_reported(recorded, tmp_path, capsys):
    # a different loss normaliser is a different algorithm: the verdict must say so
    out = tmp_path / "bad"
    assert main(["replay", str(recorded), "--device", "cpu", "--output-dir", str(out),
                 "actor.loss_agg_mode=seq-mean-token-sum"]) == 1
    assert "replay DIVERGES" in capsys.readouterr().out


def test_replay_needs_recorded_rollouts(tmp_path, capsys):
    run = tmp_path / "plain"
    assert main(["train", "--output-dir", str(run), "trainer.total_steps=1", *FAST]) == 0
    assert main(["replay", str(run), "--device", "cpu"]) == 2
    assert "trainer.record_rollouts=true" in capsys.readouterr().err


def test_a_drgrpo_run_without_kl_replays(tmp_path, capsys):
    """DrGRPO has no reference model, so its metrics have no kl/loss_kl: replay compares what was logged
    (it ended in KeyError: 'loss_kl' while plotting)."""
    run = tmp_path / "drgrpo"
    drgrpo = str(__import__("pathlib").Path(__file__).resolve().parents[2] / "configs" / "drgrpo.yaml")
    assert main(["train", "--config", drgrpo, "--output-dir", str(run), "trainer.record_rollouts=true",
                 "trainer.total_steps=2", "trainer.plot=false", "trainer.tensorboard=false", *FAST]) == 0
    assert "loss_kl" not in read_metrics(run / "metrics.jsonl")[0]
    assert main(["replay", str(run), "--device", "cpu", "--output-dir", str(tmp_path / "replay")]) == 0
    out = capsys.readouterr().out
    assert "replay matches the recorded run" in out and "loss_kl diff" not in out
    assert (tmp_path / "replay" / "replay.png").is_file()
