"""Run directories, exports and resume under misuse: nothing a user already has is ever lost."""
import json
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.metrics import read_metrics

TINY = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=4", "data.train_size=16", "data.val_size=4", "trainer.test_freq=0",
        "data.max_response_length=8", "trainer.plot=false", "trainer.tensorboard=false"]


def train(run_dir, *overrides, resume=None, extra=()):
    argv = ["train", *(["--output-dir", str(run_dir)] if run_dir else []), *TINY, *overrides, *extra]
    if resume:
        argv += ["--resume", str(resume)]
    return main(argv)


@pytest.fixture(scope="module")
def finished_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "done"
    assert train(run, "trainer.total_steps=2", "trainer.save_freq=1") == 0
    return run


def snapshot(folder: Path) -> dict[str, bytes]:
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(folder.rglob("*")) if p.is_file()}


# ---------------------------------------------------------------- export


def test_export_refuses_a_directory_that_is_not_an_earlier_export(finished_run, tmp_path, capsys):
    mine = tmp_path / "models"
    mine.mkdir()
    (mine / "precious.txt").write_text("do not delete")
    assert main(["export", str(finished_run), "--output", str(mine)]) == 2
    assert "is not empty and is not an earlier portagrpo export" in capsys.readouterr().err
    assert (mine / "precious.txt").read_text() == "do not delete" and len(list(mine.iterdir())) == 1
    (tmp_path / "a_file").write_text("x")
    assert main(["export", str(finished_run), "--output", str(tmp_path / "a_file")]) == 2
    assert "is a file" in capsys.readouterr().err


def test_export_replaces_an_earlier_export_whole(finished_run, tmp_path):
    out = tmp_path / "exp"
    assert main(["export", str(finished_run), "--output", str(out), "--step", "1"]) == 0
    first = snapshot(out)
    assert json.loads((out / ".portagrpo-export.json").read_text())["checkpoint"] == "step_00000001"
    (tmp_path / f".tmp_exp_{2**22 + 7}").mkdir()  # a killed export's temporary (dead pid)
    assert main(["export", str(finished_run), "--output", str(out)]) == 0
    second = snapshot(out)
    assert json.loads((out / ".portagrpo-export.json").read_text())["checkpoint"] == "step_00000002"
    assert first["model.safetensors"] != second["model.safetensors"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["exp"]  # no temporaries left beside it


# ---------------------------------------------------------------- train into an existing directory


def test_new_run_refuses_an_existing_run_and_leaves_it_untouched(finished_run, capsys):
    before = snapshot(finished_run)
    assert train(finished_run, "trainer.total_steps=2") == 2
    err = capsys.readouterr().err
    assert "already holds a run; continue it with --resume" in err
    after = snapshot(finished_run)
    after.pop(".lock", None), before.pop(".lock", None)
    assert after == before


def test_new_run_refuses_a_foreign_directory(tmp_path, capsys):
    (tmp_path / "notes.txt").write_text("mine")
    assert train(tmp_path, "trainer.total_steps=1") == 2
    assert "is not empty and not a portagrpo run" in capsys.readouterr().err
    assert sorted(p.name for p in tmp_path.iterdir()) == ["notes.txt"]


def test_run_directory_in_use_is_refused(tmp_path, capsys):
    from portagrpo.train.run_dir import RunDir

    holder = RunDir(tmp_path / "run")
    holder.lock()  # another writer (flock is per open file, so this process counts as another)
    try:
        assert train(tmp_path / "run", "trainer.total_steps=1") == 2
        import os

        assert f"is in use by pid {os.getpid()}" in capsys.readouterr().err
        assert sorted(p.name for p in (tmp_path / "run").iterdir()) == [".lock"]
    finally:
        holder.unlock()


def test_killed_init_model_write_leaves_a_run_that_starts_again(tmp_path, monkeypatch):
    import portagrpo.train.build as trainer_mod

    real = trainer_mod.build_tiny_model

    def dies_while_saving(*args, **kwargs):
        model = real(*args, **kwargs)

        def save_pretrained(path, **kw):
            Path(path).mkdir(parents=True, exist_ok=True)
            model.config.save_pretrained(path)  # config.json first, then the "kill"
            raise KeyboardInterrupt

        model.save_pretrained = save_pretrained
        return model

    monkeypatch.setattr(trainer_mod, "build_tiny_model", dies_while_saving)
    assert train(tmp_path, "trainer.total_steps=1") == 130
    assert not (tmp_path / "init_model").exists()  # never half there
    monkeypatch.setattr(trainer_mod, "build_tiny_model", real)
    assert train(tmp_path, "trainer.total_steps=1") == 0
    assert [r["step"] for r in read_metrics(tmp_path / "metrics.jsonl")] == [1]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".tmp_")]


# ---------------------------------------------------------------- resume


def test_resume_rejects_a_change_of_model_shape_or_lora(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    assert train(None, "trainer.total_steps=3", "model.lora.rank=4", resume=run) == 2
    assert "holds a full model but model.lora.rank=4 asks for a LoRA adapter" in capsys.readouterr().err
    assert train(None, "trainer.total_steps=3", "model.tiny.hidden_size=32", resume=run) == 2
    assert "model.tiny.hidden_size=32 but this run's init_model has 64" in capsys.readouterr().err


def test_resume_target_rules(finished_run, tmp_path, capsys):
    other = tmp_path / "other"
    assert train(other, "trainer.total_steps=3", resume=finished_run) == 2
    assert "continues" in capsys.readouterr().err and not other.exists()
    assert train(None, "trainer.total_steps=3", resume=finished_run / "config.yaml") == 2
    assert "is a file; pass a run directory" in capsys.readouterr().err
    # auto: a fresh directory starts fresh; a directory with steps but no checkpoint is refused, untouched
    fresh = tmp_path / "fresh"
    assert train(fresh, "trainer.total_steps=1", "trainer.save_freq=0", resume="auto") == 0
    before = snapshot(fresh)
    assert train(fresh, "trainer.total_steps=2", resume="auto") == 2
    assert "holds a run with no whole checkpoint" in capsys.readouterr().err
    assert {k: v for k, v in snapshot(fresh).items() if k != ".lock"} == {
        k: v for k, v in before.items() if k != ".lock"
    }


def test_resume_cleans_temporaries_survives_a_torn_metrics_line_and_says_when_done(finished_run, tmp_path, capsys):
    import shutil

    run = tmp_path / "run"
    shutil.copytree(finished_run, run)
    stale = run / "checkpoints" / ".tmp_step_00000003_999999"
    (stale / "model").mkdir(parents=True)
    (stale / "model" / "model.safetensors").write_bytes(b"\0" * 1000)
    with (run / "metrics.jsonl").open("a") as fh:
        fh.write('{"step": 3, "reward_me')  # killed mid-write
    assert train(None, "trainer.total_steps=3", "trainer.save_freq=1", resume=run) == 0
    out = capsys.readouterr().out
    assert "removed 1 half-written temporary entry" in out and "ignoring a torn last line" in out
    assert not stale.exists()
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]
    assert train(None, "trainer.total_steps=3", resume=run) == 0
    assert "nothing to do: the run is at step 3 of 3" in capsys.readouterr().out


def test_a_damaged_metrics_line_in_the_middle_is_an_error_naming_it(tmp_path):
    from portagrpo.errors import UserError

    (tmp_path / "metrics.jsonl").write_text('{"step": 1}\nnot json\n{"step": 2}\n')
    with pytest.raises(UserError, match="line 2 is not JSON"):
        read_metrics(tmp_path / "metrics.jsonl")
