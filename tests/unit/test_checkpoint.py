"""Atomic checkpoints: manifest verification, corruption detection, pruning."""
import pytest
import torch

from portagrpo.checkpoint import (
    CheckpointError,
    latest_valid_checkpoint,
    list_checkpoints,
    load_checkpoint_state,
    save_checkpoint,
    verify_checkpoint,
)


@pytest.fixture()
def parts(tiny_model_dir, tokenizer):
    from transformers import AutoModelForCausalLM

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir, local_files_only=True)
    opt = torch.optim.AdamW(model.parameters(), lr=1e-3)
    sched = torch.optim.lr_scheduler.LambdaLR(opt, lambda s: 1.0)
    return dict(model=model, tokenizer=tokenizer, model_state=model.state_dict(), optimizer_state=opt.state_dict(),
                scheduler=sched)


def _save(run, step, parts, keep=3):
    return save_checkpoint(
        run,
        step,
        state={"loader": {"epoch": 0, "cursor": step}},
        rng={"torch": torch.get_rng_state()},
        keep=keep,
        **parts,
    )


def test_save_is_whole_and_loadable_by_transformers(tmp_path, parts):
    from transformers import AutoModelForCausalLM

    path = _save(tmp_path, 3, parts)
    assert verify_checkpoint(path) == []
    assert (path / "model" / "model.safetensors").is_file()
    reloaded = AutoModelForCausalLM.from_pretrained(path / "model", local_files_only=True)
    for (name, a), b in zip(parts["model"].state_dict().items(), reloaded.state_dict().values()):
        assert torch.equal(a, b), name
    state = load_checkpoint_state(path)
    assert state.step == 3 and state.loader["cursor"] == 3
    assert not any(p.name.startswith(".tmp") for p in (tmp_path / "checkpoints").iterdir())


def test_keeps_only_newest(tmp_path, parts):
    for step in (1, 2, 3, 4):
        _save(tmp_path, step, parts, keep=2)
    assert [p.name for p in list_checkpoints(tmp_path)] == ["step_00000003", "step_00000004"]


def test_corrupted_file_detected_and_never_loaded(tmp_path, parts):
    _save(tmp_path, 1, parts)
    bad = _save(tmp_path, 2, parts)
    with (bad / "optimizer.pt").open("r+b") as fh:
        fh.seek(10)
        fh.write(b"\x00\x01\x02")
    problems = verify_checkpoint(bad)
    assert problems and "SHA-256" in problems[0]
    with pytest.raises(CheckpointError, match="corrupt"):
        load_checkpoint_state(bad)
    warnings = []
    assert latest_valid_checkpoint(tmp_path, warn=warnings.append).name == "step_00000001"
    assert "step_00000002" in warnings[0]


def test_half_written_checkpoint_detected(tmp_path, parts):
    path = _save(tmp_path, 5, parts)
    (path / "manifest.json").unlink()  # as if the process died before the manifest was written
    assert "no manifest.json" in verify_checkpoint(path)[0]
    truncated = _save(tmp_path, 6, parts)
    data = (truncated / "model" / "model.safetensors").read_bytes()
    (truncated / "model" / "model.safetensors").write_bytes(data[: len(data) // 2])
    assert "bytes, expected" in verify_checkpoint(truncated)[0]
    assert latest_valid_checkpoint(tmp_path, warn=lambda m: None) is None
