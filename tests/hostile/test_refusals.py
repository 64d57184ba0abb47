"""A refused command changes nothing on disk, writes nothing it did not check first, and says one
sentence: resume, eval, parity, data, replay and export refusals; bad model sources; output paths
under a file, with over-long names, on a full disk; configs that are binary, huge or malformed."""
import errno
import json
import shutil
import subprocess
from pathlib import Path

import pytest

from portagrpo.cli import main
from portagrpo.metrics import read_metrics

TINY = ["trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=2", "actor.ppo_mini_batch_size=4",
        "actor.micro_batch_size=4", "data.train_size=16", "data.val_size=4", "trainer.test_freq=0",
        "data.max_response_length=8", "trainer.plot=false", "trainer.tensorboard=false"]


def train(run_dir, *overrides, resume=None):
    argv = ["train", *(["--output-dir", str(run_dir)] if run_dir else []), *TINY, *overrides]
    return main(argv + (["--resume", str(resume)] if resume else []))


def snapshot(folder: Path) -> dict[str, bytes]:
    """Every file under `folder` with its bytes; the lock file holds the last writer's pid, so it is left out."""
    return {str(p.relative_to(folder)): p.read_bytes() for p in sorted(Path(folder).rglob("*"))
            if p.is_file() and p.name != ".lock"}


def one_error(err: str) -> str:
    lines = [line for line in err.strip().splitlines() if line.strip()]
    assert "Traceback" not in err, err
    assert len(lines) == 1 and lines[0].startswith("portagrpo: error: "), err
    return lines[0]


@pytest.fixture(scope="module")
def recorded_run(tmp_path_factory):
    run = tmp_path_factory.mktemp("runs") / "rec"
    assert train(run, "trainer.total_steps=2", "trainer.save_freq=1", "trainer.record_rollouts=true") == 0
    return run


def _row():
    return {"prompt": "2+2=", "reward_model": {"ground_truth": "4"}, "data_source": "x"}


# ---------------------------------------------------------------- resume


@pytest.mark.parametrize("change,expected", [
    ("model.tiny.hidden_size=128", "model.tiny.hidden_size=128 but this run's init_model has 64"),
    ("model.lora.rank=8", "asks for a LoRA adapter"),
    ("data.train_files=[EMPTY]", "the training set has 0 prompts"),
])
def test_a_refused_resume_leaves_the_run_and_its_config_as_they_were(recorded_run, tmp_path, capsys, change,
                                                                     expected):
    run = tmp_path / "run"
    shutil.copytree(recorded_run, run)
    (tmp_path / "empty.jsonl").write_text("")
    before = snapshot(run)
    override = change.replace("EMPTY", str(tmp_path / "empty.jsonl"))
    assert train(None, "trainer.total_steps=3", override, resume=run) == 2
    assert expected in one_error(capsys.readouterr().err)
    assert snapshot(run) == before  # config.yaml above all: it used to hold the refused values
    assert train(None, "trainer.total_steps=3", resume=run) == 0  # so a plain resume still works
    assert [r["step"] for r in read_metrics(run / "metrics.jsonl")] == [1, 2, 3]


# ---------------------------------------------------------------- reports never replace a user's file


def test_eval_and_parity_reports_never_replace_a_users_file(tiny_model_dir, tmp_path, capsys, monkeypatch):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_row()) + "\n")
    mine = tmp_path / "mine.json"
    mine.write_text('{"my": "results"}')
    quick = ["--model", str(tiny_model_dir), "--data", str(data), "--max-new-tokens", "2", "--device", "cpu",
             "--reward", "gsm8k"]
    assert main(["eval", *quick, "--output", str(mine)]) == 2
    assert "is not an earlier portagrpo eval report" in one_error(capsys.readouterr().err)
    assert main(["parity", "--device", "cpu", "--json", str(mine)]) == 2
    assert "is not an earlier portagrpo parity report" in one_error(capsys.readouterr().err)
    assert mine.read_text() == '{"my": "results"}'
    # without --output, eval writes a new file and never touches an eval.json that is there
    monkeypatch.chdir(tmp_path)
    (tmp_path / "eval.json").write_text("precious")
    assert main(["eval", *quick]) == 0
    reports = sorted(tmp_path.glob("eval-*.json"))
    assert len(reports) == 1 and (tmp_path / "eval.json").read_text() == "precious"
    # an earlier report of the same command may be replaced when named
    assert main(["eval", *quick, "--output", str(reports[0])]) == 0
    assert json.loads(reports[0].read_text())["portagrpo_report"] == "eval"


# ---------------------------------------------------------------- model sources: one check for train and eval


def _bad_source(tmp_path: Path, kind: str) -> Path:
    if kind == "empty_dir":
        (tmp_path / "m").mkdir()
        return tmp_path / "m"
    if kind == "config_only":
        (tmp_path / "m").mkdir()
        (tmp_path / "m" / "config.json").write_text('{"model_type": "llama"}')
        return tmp_path / "m"
    if kind == "text_file":
        (tmp_path / "notes.txt").write_text("not a model")
        return tmp_path / "notes.txt"
    (tmp_path / "model.gguf").write_text("not a gguf")
    return tmp_path / "model.gguf"


@pytest.mark.parametrize("kind,expected", [
    ("empty_dir", "has no config.json"),
    ("config_only", "has a config.json but no weight files"),
    ("text_file", "is a file, not a model directory or a .gguf file"),
    ("fake_gguf", "is not a GGUF file"),
])
def test_bad_model_paths_are_one_sentence_in_train_and_eval(tmp_path, capsys, kind, expected):
    source = _bad_source(tmp_path, kind)
    out = tmp_path / "run"
    assert train(out, "trainer.total_steps=1", f"model.path={source}") == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and f"model.path='{source}' " in err and expected in err
    assert not out.exists()  # refused before anything was written
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_row()) + "\n")
    assert main(["eval", "--model", str(source), "--data", str(data), "--output", str(tmp_path / "e.json")]) == 2
    assert expected in one_error(capsys.readouterr().err)


def test_a_tokenizer_path_without_a_tokenizer_is_one_sentence(tmp_path, capsys):
    (tmp_path / "tok").mkdir()
    assert train(tmp_path / "run", "trainer.total_steps=1", f"model.tokenizer_path={tmp_path / 'tok'}") == 2
    assert "model.tokenizer_path=" in one_error(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()


def test_a_new_run_refused_during_setup_leaves_no_directory(tmp_path, capsys):
    (tmp_path / "empty.jsonl").write_text("")
    assert train(tmp_path / "run", "trainer.total_steps=1", f"data.train_files=[{tmp_path / 'empty.jsonl'}]") == 2
    one_error(capsys.readouterr().err)
    assert not (tmp_path / "run").exists()
    (tmp_path / "mine").mkdir()  # an empty directory of the user's stays, empty
    assert train(tmp_path / "mine", "trainer.total_steps=1", f"data.train_files=[{tmp_path / 'empty.jsonl'}]") == 2
    assert list((tmp_path / "mine").iterdir()) == []


# ---------------------------------------------------------------- output paths checked before any work


def test_output_dir_under_a_file_or_with_an_overlong_name_is_one_sentence(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    Path("afile").write_text("x")
    assert train("afile/run", "trainer.total_steps=1") == 2
    assert "afile is a file, so nothing can be created under it" in one_error(capsys.readouterr().err)
    assert train("d" * 300, "trainer.total_steps=1") == 2
    assert "over the 255-byte limit of a file name" in one_error(capsys.readouterr().err)
    assert sorted(p.name for p in tmp_path.iterdir()) == ["afile"]


def _mount_tmpfs(path: Path, size: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    try:
        done = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={size}", "tmpfs", str(path)],
                              capture_output=True, timeout=60)
    except (OSError, subprocess.TimeoutExpired):
        return False
    return done.returncode == 0


@pytest.fixture
def small_disk(tmp_path):
    """A real full disk: a size-limited tmpfs (needs the right to mount, as root in CI has)."""
    mounted = []

    def make(size: str) -> Path:
        where = tmp_path / f"disk{len(mounted)}"
        if not _mount_tmpfs(where, size):
            pytest.skip("cannot mount a size-limited tmpfs here (needs root or CAP_SYS_ADMIN)")
        mounted.append(where)
        return where

    yield make
    for where in mounted:
        subprocess.run(["umount", "-l", str(where)], capture_output=True, timeout=60)


def test_full_disk_at_init_model_is_one_sentence_and_leaves_nothing(small_disk, capsys):
    disk = small_disk("120k")  # the tiny model's init_model is about 360 KB
    assert train(disk / "run", "trainer.total_steps=2") == 2
    line = one_error(capsys.readouterr().err)
    assert "no space left on the device" in line and "init_model" in line
    assert list(disk.iterdir()) == []  # no run directory, no temporary


def test_full_disk_at_a_checkpoint_keeps_the_last_whole_one(small_disk, tmp_path, capsys):
    from portagrpo.checkpoint import latest_valid_checkpoint, verify_checkpoint

    disk = small_disk("1700k")  # init_model (~0.36 MB) and one checkpoint (~1.1 MB) fit; a second does not
    run = disk / "run"
    assert train(run, "trainer.total_steps=4", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=3") == 2
    line = one_error(capsys.readouterr().err)
    assert "no space left" in line and "The last whole checkpoint, step_00000001, is untouched" in line
    names = [p.name for p in (run / "checkpoints").iterdir()]
    assert names == ["step_00000001"]  # the half-written step_2 temporary is gone
    assert verify_checkpoint(run / "checkpoints" / "step_00000001") == []
    assert not [p for p in run.rglob(".tmp_*")]
    copy = tmp_path / "copy"  # the run resumes once there is space
    shutil.copytree(run, copy)
    assert latest_valid_checkpoint(copy).name == "step_00000001"
    assert train(None, "trainer.total_steps=2", resume=copy) == 0


def test_full_disk_at_a_sharded_checkpoint_on_two_ranks_is_one_sentence(small_disk, tmp_path):
    """torch.distributed.checkpoint raises every rank's failure (ENOSPC on one, torch's zip writer's "unexpected pos"
    on another) as a BaseException on every rank: the run says one sentence, names the last whole checkpoint, and
    leaves no temporary."""
    import os
    import sys

    disk = small_disk("2600k")  # init_model and one sharded checkpoint (~1.4 MB) fit; a second does not
    run = disk / "run"
    res = subprocess.run([sys.executable, "-m", "portagrpo", "train", "--output-dir", str(run), *TINY,
                          "actor.micro_batch_size=2", "trainer.total_steps=4", "trainer.save_freq=1",
                          "trainer.max_ckpt_to_keep=3", "trainer.nproc_per_node=2", "trainer.parallel=fsdp2"],
                         capture_output=True, text=True, timeout=900, cwd=tmp_path,
                         env={**os.environ, "OMP_NUM_THREADS": "1"})
    assert res.returncode != 0 and "Traceback" not in res.stderr and "CheckpointException" not in res.stderr, \
        res.stderr[-3000:]
    errors = [line for line in res.stderr.splitlines() if line.startswith("portagrpo: error:")]
    assert len(errors) == 1, res.stderr[-3000:]
    assert "no space left" in errors[0] and "The last whole checkpoint, step_00000001, is untouched" in errors[0]
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]
    assert not [p for p in run.rglob(".tmp_*")]


def test_torchs_short_write_is_read_as_a_full_disk(tmp_path, monkeypatch):
    from portagrpo.fileio import system_error_in

    monkeypatch.setattr(shutil, "disk_usage", lambda where: shutil._ntuple_diskusage(10 << 20, 10 << 20, 1 << 20))
    found = system_error_in(RuntimeError("[enforce fail at inline_container.cc:672] . unexpected pos 704 vs 598"),
                            tmp_path)
    assert found is not None and found.errno == errno.ENOSPC


def test_a_write_refused_by_the_system_mid_checkpoint_is_cleaned_up(tmp_path, capsys, monkeypatch):
    """The same as the tmpfs test where mounting is not allowed: the system says ENOSPC mid-checkpoint."""
    import portagrpo.checkpoint as ckpt_mod

    real, calls = ckpt_mod.torch.save, []

    def save(obj, path, *args, **kwargs):
        calls.append(path)
        if "step_00000002" in str(path):
            Path(path).write_bytes(b"partial")
            raise OSError(errno.ENOSPC, "No space left on device", str(path))
        return real(obj, path, *args, **kwargs)

    monkeypatch.setattr(ckpt_mod.torch, "save", save)
    run = tmp_path / "run"
    assert train(run, "trainer.total_steps=3", "trainer.save_freq=1") == 2
    line = one_error(capsys.readouterr().err)
    assert "no space left" in line and "step_00000001, is untouched" in line
    assert [p.name for p in (run / "checkpoints").iterdir()] == ["step_00000001"]


# ---------------------------------------------------------------- configs


@pytest.mark.parametrize(
    "make,expected",
    [
        (lambda d: (d / "bin.yaml").write_bytes(b"\x00\x01\xff\xfe"), "is not a text file"),
        (lambda d: (d / "bin.yaml").mkdir(), "is a directory"),
        (
            lambda d: (d / "bin.yaml").write_text("actor:\n  lr: 1" + "0" * 5000 + "\n"),
            "actor.lr=inf must be a finite number",
        ),
    ],
)
def test_unreadable_configs_are_one_sentence(tmp_path, capsys, make, expected):
    make(tmp_path)
    assert main(["train", "--dry-run", "--config", str(tmp_path / "bin.yaml")]) == 2
    assert expected in one_error(capsys.readouterr().err)


def test_a_huge_integer_override_is_a_number_problem_not_a_traceback(capsys):
    assert main(["train", "--dry-run", "actor.lr=1" + "0" * 5000]) == 2
    assert "actor.lr=inf must be a finite number" in one_error(capsys.readouterr().err)


def test_overrides_never_replace_a_section_the_file_gets_wrong(tmp_path, capsys):
    f = tmp_path / "a.yaml"
    f.write_text("actor: 5\n")
    assert main(["train", "--dry-run", "--config", str(f), "actor.lr=1e-3"]) == 2
    err = capsys.readouterr().err
    assert "actor is 5 in the config, not a section of keys" in err and "Traceback" not in err


def test_validation_reports_every_problem_at_once_and_never_echoes_a_huge_value(capsys):
    huge = "a" * 100_000
    assert main(["train", "--dry-run", f"actor.lr={huge}", "trainer.seed=x", "rollout.n=0", "actor.grad_clip=0",
                 "actor.lerning_rate=1", "bad override"]) == 2
    err = capsys.readouterr().err
    for expected in ("actor.lr must be float", "trainer.seed must be int", "rollout.n=0 must be at least 1",
                     "actor.grad_clip=0.0 must be positive", "actor.lerning_rate is not a config key",
                     "override 'bad override' must look like key=value"):
        assert expected in err
    assert len(err) < 2000 and "(100002 characters)" in err


def test_a_directory_as_a_data_file_says_so(tmp_path, capsys):
    assert main(["train", "--dry-run", f"data.train_files=[{tmp_path}]"]) == 0  # a dry run lists what is missing
    assert "is a directory; give the path of a .jsonl or .parquet file" in capsys.readouterr().out
    assert train(tmp_path / "run", f"data.train_files=[{tmp_path}]") == 2
    assert "is a directory" in one_error(capsys.readouterr().err)


def test_options_may_follow_overrides(capsys):
    assert main(["train", "actor.lr=1e-3", "--dry-run", "trainer.seed=3", "--device", "cpu"]) == 0
    assert "config OK" in capsys.readouterr().out


def test_bare_portagrpo_prints_help_and_trains_nothing(tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main([]) == 2
    assert "portagrpo train" in capsys.readouterr().out
    assert list(tmp_path.iterdir()) == []
    assert main(["bench", "--help"]) == 0
    assert "bench kernels|step" in capsys.readouterr().out


# ---------------------------------------------------------------- parity, data, replay, export


@pytest.mark.parametrize("dtype", ["fp8", "fp32,,bf16"])
def test_parity_bad_dtype_is_one_sentence(dtype, capsys):
    assert main(["parity", "--device", "cpu", "--dtype", dtype]) == 2
    assert "is not one of fp64, fp32, bf16" in one_error(capsys.readouterr().err)


def test_data_never_replaces_a_file_it_did_not_write(tmp_path, capsys):
    src = tmp_path / "g.jsonl"
    src.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    (tmp_path / "afile").write_text("x")
    assert main(["data", "gsm8k", "--input", str(src), "--output", str(tmp_path / "afile")]) == 2
    assert "is a file; pass a directory" in one_error(capsys.readouterr().err)
    out = tmp_path / "out"
    out.mkdir()
    (out / "g.jsonl").write_text("mine\n")
    assert main(["data", "gsm8k", "--input", str(src), "--output", str(out), "--format", "jsonl"]) == 2
    assert "was not written by `portagrpo data`" in one_error(capsys.readouterr().err)
    assert (out / "g.jsonl").read_text() == "mine\n"
    assert main(["data", "gsm8k", "--input", str(src), "--output", str(out)]) == 0
    assert main(["data", "gsm8k", "--input", str(src), "--output", str(out)]) == 0  # its own file: replaced
    assert sorted(p.name for p in out.iterdir()) == ["g.jsonl", "g.parquet"]


@pytest.mark.parametrize("split", ["../escaped", "a/b", "..", ".hidden", "", "tab\tname"])
def test_data_refuses_a_split_that_is_not_a_plain_name_and_writes_nothing(tmp_path, capsys, monkeypatch, split):
    src = tmp_path / "in" / "g.jsonl"
    src.parent.mkdir()
    src.write_text(json.dumps({"question": "1+1?", "answer": "#### 2"}) + "\n")
    work = tmp_path / "work"
    work.mkdir()
    monkeypatch.chdir(work)
    before = snapshot(tmp_path)
    assert main(["data", "gsm8k", "--input", str(src), "--output", "ex4", "--split", split]) == 2
    assert "is not a plain name" in one_error(capsys.readouterr().err)
    assert snapshot(tmp_path) == before and not (work / "ex4").exists()


@pytest.mark.parametrize("steps", ["0", "-1", "3"])
def test_replay_steps_out_of_range_are_refused_and_write_nothing(recorded_run, steps, capsys):
    before = snapshot(recorded_run)
    assert main(["replay", str(recorded_run), "--device", "cpu", "--steps", steps]) == 2
    assert "has 2 recorded step(s); give a number from 1 to 2" in one_error(capsys.readouterr().err)
    assert snapshot(recorded_run) == before


def test_every_refused_tool_invocation_leaves_the_disk_as_it_was(recorded_run, tmp_path, capsys):
    run = tmp_path / "run"
    shutil.copytree(recorded_run, run)
    (tmp_path / "user").mkdir()
    (tmp_path / "user" / "keep.txt").write_text("keep")
    (tmp_path / "report.json").write_text("{}")
    before_run, before_tmp = snapshot(run), snapshot(tmp_path)
    refusals = [
        ["export", str(run), "--output", str(tmp_path / "user")],  # a user's directory
        ["export", str(run), "--step", "7"],  # a step that is not there
        ["export", str(run), "--output", str(tmp_path / "report.json")],  # a file
        ["replay", str(run), "--device", "cpu", "--output-dir", str(tmp_path / "user")],
        ["replay", str(run), "--device", "nowhere"],
        ["parity", "--device", "cpu", "--json", str(tmp_path / "report.json")],
        ["parity", "--device", "cpu", "--dtype", "fp9", "--json", str(tmp_path / "new.json")],
        ["eval", "--model", str(run), "--data", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "user")],
        ["data", "gsm8k", "--input", str(tmp_path / "none.jsonl"), "--output", str(tmp_path / "report.json")],
        ["train", "--output-dir", str(run), *TINY],  # a new run into an existing one
        ["train", "--resume", str(run), "--output-dir", str(tmp_path / "other"), *TINY],
    ]
    for argv in refusals:
        assert main(argv) != 0, argv
        assert "Traceback" not in capsys.readouterr().err
        assert snapshot(run) == before_run, argv
        assert snapshot(tmp_path) == before_tmp, argv


def test_export_of_a_pruned_step_names_the_steps_that_are_kept(tmp_path, capsys):
    run = tmp_path / "run"
    assert train(run, "trainer.total_steps=3", "trainer.save_freq=1", "trainer.max_ckpt_to_keep=2") == 0
    assert main(["export", str(run), "--step", "1"]) == 2
    line = one_error(capsys.readouterr().err)
    assert "has no checkpoint of step 1 (it keeps steps: 2, 3" in line


# ---------------------------------------------------------------- rewards


def test_a_reward_returning_text_is_refused_even_when_it_looks_like_a_number(tmp_path):
    from portagrpo.rewards.functions import RewardFunctionError, RewardResolver, score_responses

    f = tmp_path / "r.py"
    f.write_text("def score(ds, s, gt, extra=None):\n    return '0.5'\n")
    with pytest.raises(RewardFunctionError, match="returned str '0.5', not a number"):
        score_responses(RewardResolver(f"{f}:score"), ["a"], ["b"], ["x"], [0])


def test_a_reward_worker_that_exits_is_reported_with_its_exit_code(tmp_path):
    from portagrpo.rewards.functions import RewardFunctionError, RewardResolver, score_responses
    from portagrpo.rewards.pool import RewardPool

    f = tmp_path / "r.py"
    f.write_text("import os\ndef score(ds, s, gt, extra=None):\n    os._exit(3)\n")
    pool = RewardPool(f"{f}:score", 1, 60.0)
    try:
        with pytest.raises(RewardFunctionError, match=r"exit code 3\)"):
            score_responses(RewardResolver(f"{f}:score"), ["a"], ["b"], ["x"], [0], pool=pool)
    finally:
        pool.close()

