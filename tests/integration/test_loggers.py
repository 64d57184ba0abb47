"""trainer.logger=[..., wandb]: a real W&B run in offline mode (WANDB_MODE=offline), read back from the
run file wandb writes: the metrics as portagrpo logs them, the config as the run's config, and the same
W&B run continued after a resume."""
from __future__ import annotations

import json
import struct
import time
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.config import ConfigError, load_config
from portagrpo.metrics import read_metrics

wandb = pytest.importorskip("wandb", reason="the wandb extra is not installed (pip install 'portagrpo[wandb]')")

FAST = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=4", "actor.ppo_mini_batch_size=8",
        "data.train_size=16", "data.val_size=4", "data.max_response_length=4", "trainer.test_freq=2",
        "trainer.tensorboard=false", "trainer.plot=false"]


def wandb_records(run_file: Path) -> list:
    """The records of a .wandb file: a LevelDB-style log (7-byte file header; 32 KiB blocks of chunks, each
    with crc32, length and kind: 1 full, 2 first, 3 middle, 4 last), each record a wandb protobuf Record."""
    from wandb.proto import wandb_internal_pb2 as pb

    data, block, pos, pending, out = run_file.read_bytes(), 32768, 7, b"", []
    assert data[:4] == b":W&B"
    while pos + 7 <= len(data):
        if block - pos % block < 7:
            pos += block - pos % block
            continue
        _, length, kind = struct.unpack("<IHB", data[pos:pos + 7])
        pending += data[pos + 7:pos + 7 + length]
        pos += 7 + length
        if kind in (1, 4):
            record = pb.Record()
            record.ParseFromString(pending)
            out.append(record)
            pending = b""
        elif kind == 0 and length == 0:
            continue
    return out


def history(run_dir: Path) -> tuple[list[dict], dict, object]:
    runs = sorted((run_dir / "wandb").glob("offline-run-*/run-*.wandb"))
    rows, config, run = [], {}, None
    for f in runs:
        for r in wandb_records(f):
            kind = r.WhichOneof("record_type")
            if kind == "history":
                rows.append({i.key or "/".join(i.nested_key): json.loads(i.value_json) for i in r.history.item})
            elif kind == "run":
                run = r.run
                config.update({i.key: json.loads(i.value_json) for i in r.run.config.update})
    return rows, config, run


def test_wandb_offline_run_holds_the_metrics_and_config(tmp_path, monkeypatch):
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    run_dir = tmp_path / "run"
    common = ["--output-dir", str(run_dir), *FAST, "trainer.logger=[console,wandb]", "trainer.project_name=proj",
              "trainer.experiment_name=exp", "trainer.save_freq=2"]
    assert main(["train", *common, "trainer.total_steps=2"]) == 0
    # W&B names an offline run's directory by its id and the second it started (offline-run-%Y%m%d_%H%M%S-<id>): a
    # resume within the same second would write into the first run's directory and replace its file
    time.sleep(1.0 - time.time() % 1.0 + 0.05)
    assert main(["train", *common, "trainer.total_steps=3", "--resume", str(run_dir)]) == 0
    logged = read_metrics(run_dir / "metrics.jsonl")
    rows, config, run = history(run_dir)
    assert run.project == "proj" and run.display_name == "exp"
    assert config["actor"]["lr"] == load_config(None, FAST).actor.lr  # the config is the run's config
    assert config["trainer"]["logger"] == ["console", "wandb"] and config["rollout"]["n"] == 4
    by_step = {r["_step"]: r for r in rows}
    assert sorted(by_step) == [1, 2, 3]  # one W&B run, continued after the resume
    for row in logged:
        wb = by_step[row["step"]]
        for key, value in row.items():
            if key != "step" and isinstance(value, float):
                assert wb[key] == pytest.approx(value, rel=1e-12), key
    assert "val/reward_mean" in by_step[2]
    assert len({f.parent.name.split("-")[-1] for f in (run_dir / "wandb").glob("offline-run-*/run-*.wandb")}) == 1


def test_mlflow_file_store_holds_the_metrics_and_params(tmp_path, monkeypatch):
    pytest.importorskip("mlflow", reason="the mlflow extra is not installed (pip install 'portagrpo[mlflow]')")
    from mlflow import MlflowClient

    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    run_dir = tmp_path / "run"
    common = ["--output-dir", str(run_dir), *FAST, "trainer.logger=[console,mlflow]", "trainer.project_name=proj",
              "trainer.experiment_name=exp", "trainer.save_freq=2", "rollout.val_n=2",
              "rollout.val_temperature=1.0"]
    assert main(["train", *common, "trainer.total_steps=2"]) == 0
    assert main(["train", *common, "trainer.total_steps=3", "--resume", str(run_dir)]) == 0
    client = MlflowClient((run_dir / "mlruns").resolve().as_uri())
    runs = client.search_runs([client.get_experiment_by_name("proj").experiment_id])
    assert len(runs) == 1 and runs[0].info.run_name == "exp"  # one run, continued after the resume
    run = runs[0]
    assert run.data.params["actor.lr"] == str(load_config(None, FAST).actor.lr)
    logged = read_metrics(run_dir / "metrics.jsonl")
    history = {m.step: m.value for m in client.get_metric_history(run.info.run_id, "reward_mean")}
    assert history == {r["step"]: pytest.approx(r["reward_mean"]) for r in logged}
    assert [m.step for m in client.get_metric_history(run.info.run_id, "val/pass_at_2")] == [2, 3]


def test_missing_loggers_are_one_sentence(monkeypatch):
    import importlib.util

    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("wandb", "mlflow") else real(name, *a))
    with pytest.raises(ConfigError, match=r"wandb, which is not installed; pip install 'portagrpo\[wandb\]'"):
        load_config(None, ["trainer.logger=[wandb]"])
    with pytest.raises(ConfigError, match=r"mlflow, which is not installed; pip install 'portagrpo\[mlflow\]'"):
        load_config(None, ["trainer.logger=[mlflow]"])
