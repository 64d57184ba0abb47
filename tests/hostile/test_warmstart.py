"""`portagrpo warmstart --out` writes only a new or empty directory, or replaces an earlier warm start (export's rule):
a run directory, an export, "", a file, and every argument out of range are one sentence before any training, and
nothing on disk changes."""
import json
import math
from pathlib import Path

import pytest
from test_refusals import one_error, snapshot  # the house's one-sentence and nothing-changed checks

from portagrpo.cli import main
from portagrpo.errors import UserError
from portagrpo.tools import warmstart

FAST = ["--steps", "1", "--batch-size", "2"]


@pytest.fixture
def no_training(monkeypatch):
    """A refusal comes before any training: the trainer is not reached."""
    def trained(*args, **kwargs):
        raise AssertionError("warm_start ran")
    monkeypatch.setattr(warmstart, "warm_start", trained)


def make_export(d: Path) -> Path:
    out = d / "runs" / "r" / "export"
    out.mkdir(parents=True)
    for name in ("model.safetensors", "config.json", "tokenizer.json"):
        (out / name).write_text(f"the user's {name}")
    (out / ".portagrpo-export.json").write_text(json.dumps({"run": "r", "checkpoint": "global_step_2"}))
    return out


def make_run(d: Path) -> Path:
    run = d / "runs" / "r"
    (run / "checkpoints" / "global_step_2").mkdir(parents=True)
    (run / "config.yaml").write_text("trainer: {total_steps: 2}\n")
    (run / "metrics.jsonl").write_text('{"step": 1}\n')
    return run


def make_file(d: Path) -> Path:
    (d / "notes.txt").write_text("mine")
    return d / "notes.txt"


@pytest.mark.parametrize("make,expected", [
    (make_export, "is not empty and is not an earlier portagrpo warmstart output; pass a new or empty directory"),
    (make_run, "is not empty and is not an earlier portagrpo warmstart output; pass a new or empty directory"),
    (make_file, "notes.txt is a file; pass a directory"),
    (lambda d: make_file(d) / "policy", "notes.txt is a file, so nothing can be created under it"),
    (lambda d: d / ("x" * 300), "is 300 bytes, over the 255-byte limit of a file name"),
], ids=["export", "run_dir", "file", "under_a_file", "long_name"])
def test_an_out_that_is_not_a_warm_starts_is_refused_before_training(tmp_path, capsys, no_training, make, expected):
    out = make(tmp_path)
    before = snapshot(tmp_path)
    assert main(["warmstart", "--out", str(out), *FAST]) == 2
    line = one_error(capsys.readouterr().err)
    assert line.startswith("portagrpo: error: warmstart --out ") and expected in line
    assert snapshot(tmp_path) == before


def test_an_empty_out_is_refused(tmp_path, capsys, no_training, monkeypatch):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "mine.txt").write_text("mine")
    assert main(["warmstart", "--out", "", *FAST]) == 2
    assert "warmstart --out is empty; name the model directory to write" in one_error(capsys.readouterr().err)
    assert snapshot(tmp_path) == {"mine.txt": b"mine"}


@pytest.mark.parametrize("args,expected", [
    (["--lr", "nan"], "warmstart --lr nan must be a finite number above 0"),
    (["--lr", "inf"], "warmstart --lr inf must be a finite number above 0"),
    (["--lr", "-1"], "warmstart --lr -1.0 must be a finite number above 0"),
    (["--lr", "0"], "warmstart --lr 0.0 must be a finite number above 0"),
    (["--steps", "0"], "warmstart --steps 0 and --batch-size 64 must be at least 1"),
    (["--batch-size", "-3"], "--batch-size -3 must be at least 1"),
    (["--call-share", "nan"], "warmstart --call-share nan must be within [0, 1]"),
    (["--call-share", "1.5"], "warmstart --call-share 1.5 must be within [0, 1]"),
    (["--seed", "-1"], "warmstart --seed -1 must be within [0, 2**63)"),
    (["--seed", str(2**64)], "must be within [0, 2**63)"),
])
def test_arguments_out_of_range_are_one_sentence_before_training(tmp_path, capsys, no_training, args, expected):
    assert main(["warmstart", "--out", str(tmp_path / "w"), *args]) == 2
    assert expected in one_error(capsys.readouterr().err)
    assert not (tmp_path / "w").exists()


def test_every_bad_argument_is_named_at_once(tmp_path, capsys, no_training):
    assert main(["warmstart", "--out", "", "--lr", "nan", "--seed", "-1"]) == 2
    err = capsys.readouterr().err
    assert "--out is empty" in err and "--lr nan" in err and "--seed -1" in err and "Traceback" not in err


def test_a_new_an_empty_and_an_earlier_warm_start_are_written(tmp_path, capsys):
    empty = tmp_path / "empty"
    empty.mkdir()
    for out in (tmp_path / "new" / "policy", empty):
        assert main(["warmstart", "--out", str(out), *FAST]) == 0
        assert {"config.json", "model.safetensors", "warmstart.json"} <= {p.name for p in out.iterdir()}
    first = json.loads((empty / "warmstart.json").read_text())
    assert first["steps"] == 1 and math.isfinite(first["final_loss"])
    assert main(["warmstart", "--out", str(empty), "--steps", "2", "--batch-size", "2"]) == 0  # replaces its own
    assert json.loads((empty / "warmstart.json").read_text())["steps"] == 2
    assert sorted(p.name for p in tmp_path.iterdir()) == ["empty", "new"]  # no temporary left beside it


def test_a_directory_filled_while_training_is_not_replaced(tmp_path):
    out = tmp_path / "w"

    def user_writes_meanwhile(message):
        out.mkdir(exist_ok=True)
        (out / "mine.txt").write_text("mine")

    settings = warmstart.WarmStart(steps=1, batch_size=2)
    with pytest.raises(UserError, match="is not an earlier portagrpo warmstart output"):
        warmstart.warm_start(settings, out, log=user_writes_meanwhile)
    assert snapshot(tmp_path) == {"w/mine.txt": b"mine"}
