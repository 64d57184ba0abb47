"""Bad input of every kind ends in one sentence naming the field: never a traceback, never silent."""
import json
import shutil

import pytest
import torch

from portagrpo.cli import main
from portagrpo.errors import UserError


def dry_run(capsys, *overrides, config=None):
    argv = ["train", "--dry-run", *overrides, *(["--config", str(config)] if config else [])]
    code = main(argv)
    return code, capsys.readouterr().err


@pytest.mark.parametrize("override,expected", [
    ("actor.grad_clip=0", "actor.grad_clip=0.0 must be positive"),
    ("actor.grad_clip=-1", "actor.grad_clip=-1.0 must be positive"),
    ("actor.clip_ratio=.nan", "actor.clip_ratio=nan must be a finite number"),
    ("actor.kl_loss_coef=-0.1", "actor.kl_loss_coef=-0.1 must be 0 or positive"),
    ("trainer.total_epochs=0", "trainer.total_epochs=0 must be at least 1"),
    ("actor.lr=-1e-3", "actor.lr=-0.001 must be positive"),
    ("actor.lr=.nan", "actor.lr=nan must be a finite number"),
    ("actor.lr=.inf", "actor.lr=inf must be a finite number"),
    ("actor.betas=[0.9]", "actor.betas=[0.9] must be two numbers in [0, 1)"),
    ("actor.betas=[0.9,1.5]", "must be two numbers in [0, 1)"),
    ("actor.weight_decay=-0.01", "actor.weight_decay=-0.01 must be 0 or positive"),
    ("rollout.temperature=.nan", "rollout.temperature=nan must be a finite number"),
    ("rollout.val_n=0", "rollout.val_n=0 must be at least 1 while validation is on"),
    ("model.tiny.num_heads=3", "model.tiny.num_heads=3 does not divide model.tiny.hidden_size=64"),
    ("model.tiny.hidden_size=0", "model.tiny.hidden_size=0 must be at least 1"),
])
def test_impossible_values_are_refused_with_the_field(capsys, override, expected):
    overrides = [override] + (["trainer.total_steps=null"] if "total_epochs" in override else [])
    code, err = dry_run(capsys, *overrides)
    assert code == 2 and expected in err and "Traceback" not in err


def test_grad_clip_infinity_means_no_clipping(capsys):
    assert dry_run(capsys, "actor.grad_clip=.inf")[0] == 0


def test_duplicate_yaml_keys_and_sections_are_refused(tmp_path, capsys):
    f = tmp_path / "dup.yaml"
    f.write_text("actor:\n  lr: 1.0e-3\nrollout:\n  n: 4\nactor:\n  ppo_epochs: 2\n")
    code, err = dry_run(capsys, config=f)
    assert code == 2 and "key 'actor' appears twice (lines 1 and 5)" in err
    f.write_text("actor:\n  lr: 1.0e-3\n  lr: 2.0e-3\n")
    code, err = dry_run(capsys, config=f)
    assert code == 2 and "key 'lr' appears twice (lines 2 and 3)" in err


def _row(**fields):
    row = {"prompt": "2+2=", "reward_model": {"ground_truth": "4"}, "data_source": "x"}
    row.update(fields)
    return row


@pytest.mark.parametrize("content,expected", [
    ([_row(reward_model={"ground_truth": None})], "'reward_model.ground_truth' is null"),
    ([_row(prompt="")], "'prompt' is empty"),
    ([_row(prompt="   ")], "'prompt' is empty"),
    ([_row(prompt=[])], "'prompt' is empty"),
])
def test_bad_rows_are_refused(tmp_path, content, expected):
    from portagrpo.data.records import load_records

    f = tmp_path / "d.jsonl"
    f.write_text("".join(json.dumps(r) + "\n" for r in content))
    with pytest.raises(UserError, match=expected):
        load_records([str(f)])


def test_bad_data_files_are_refused(tmp_path):
    from portagrpo.data.records import load_records

    fake = tmp_path / "train.parquet"
    fake.write_text(json.dumps(_row()) + "\n")
    with pytest.raises(UserError, match="is not a readable Parquet file"):
        load_records([str(fake)])
    latin = tmp_path / "latin.jsonl"
    latin.write_bytes(json.dumps(_row()).encode() + b"\n" + '{"prompt": "caf\xe9"}'.encode("latin-1") + b"\n")
    with pytest.raises(UserError, match=r"latin.jsonl:2: not UTF-8"):
        load_records([str(latin)])


def test_reward_files_that_fail_to_load_are_one_sentence(tmp_path):
    from portagrpo.rewards.functions import RewardResolver

    (tmp_path / "syntax.py").write_text("def score(ds, s, gt, extra=None)\n    return 1.0\n")
    with pytest.raises(UserError, match=r"fails to load \(line 1\): SyntaxError"):
        RewardResolver(f"{tmp_path / 'syntax.py'}:score")
    (tmp_path / "imports.py").write_text("import not_a_module_anywhere\n")
    with pytest.raises(UserError, match="fails to load: ModuleNotFoundError"):
        RewardResolver(f"{tmp_path / 'imports.py'}:score")


@pytest.mark.parametrize("damage", ["empty", "no_weights", "truncated", "bad_config", "fake_gguf", "a_text_file"])
def test_broken_model_paths_are_one_sentence(tmp_path, tiny_model_dir, damage):
    from portagrpo.model.loading import load_model

    target = tmp_path / "model"
    if damage == "empty":
        target.mkdir()
    elif damage in ("fake_gguf", "a_text_file"):
        target = tmp_path / ("model.gguf" if damage == "fake_gguf" else "notes.txt")
        target.write_text("this is not a model")
    else:
        shutil.copytree(tiny_model_dir, target)
        weights = target / "model.safetensors"
        if damage == "no_weights":
            weights.unlink()
        elif damage == "truncated":
            weights.write_bytes(weights.read_bytes()[: weights.stat().st_size // 2])
        else:
            (target / "config.json").write_text("{not json")
    expected = {"empty": "has no config.json", "no_weights": "has a config.json but no weight files",
                "truncated": "cannot be loaded", "bad_config": "its config.json is not valid JSON",
                "fake_gguf": "is not a GGUF file", "a_text_file": "is a file, not a model directory"}[damage]
    with pytest.raises(UserError, match=rf"model.path='{target}'.* {expected}"):
        load_model(target, "sdpa")


def test_lora_targets_matching_nothing_name_the_real_layers(tiny_model_dir):
    from portagrpo.config import LoraSettings
    from portagrpo.model.loading import apply_lora, load_model

    model = load_model(tiny_model_dir, "sdpa")
    with pytest.raises(UserError, match=r"model.lora.target_modules=\['qkv'\] cannot be adapted.*q_proj"):
        apply_lora(model, LoraSettings(rank=4, target_modules=["qkv"]))


def test_huge_rewards_give_finite_advantages_and_metrics():
    from portagrpo.algo.advantages import batch_normalize_scores, group_advantages

    scores64 = torch.tensor([1e30, -1e30, 0.0, 5e29, 3.0, 1.0], dtype=torch.float64)
    uid = torch.tensor([0, 0, 0, 0, 1, 1])
    mask = torch.ones(6, 2)
    want = group_advantages(scores64, uid, mask.double())
    got = group_advantages(scores64.float(), uid, mask)  # before: the squares overflowed fp32 (inf std, adv 0)
    assert torch.isfinite(got).all() and torch.allclose(got.double(), want, rtol=1e-5)
    assert got[0, 0] > 0.5
    normed = batch_normalize_scores(scores64.float(), shift=True, scale=True)
    assert torch.isfinite(normed).all() and normed.abs().max() > 0.1


# ---------------------------------------------------------------- eval


def test_eval_checks_its_arguments_before_working(tmp_path, capsys):
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_row()) + "\n")
    cases = [
        (["--batch-size", "0"], "--batch-size=0 must be at least 1"),
        (["--n", "0"], "--n=0 must be at least 1"),
        (["--output", str(tmp_path / "missing" / "eval.json")], "does not exist; create it first"),
    ]
    for extra, expected in cases:
        assert main(["eval", "--model", str(tmp_path / "nowhere"), "--data", str(data), *extra]) == 2
        assert expected in capsys.readouterr().err
    empty = tmp_path / "empty.jsonl"
    empty.write_text("")
    assert main(["eval", "--model", str(tmp_path), "--data", str(empty), "--output", str(tmp_path / "e.json")]) == 2
    assert "holds no prompts" in capsys.readouterr().err
    (tmp_path / "notes.txt").write_text("hello")
    assert main(["eval", "--model", str(tmp_path / "notes.txt"), "--data", str(data),
                 "--output", str(tmp_path / "e.json")]) == 2
    assert "is a file, not a model directory" in capsys.readouterr().err


def test_eval_of_a_run_without_checkpoint_is_refused_unless_asked(tmp_path, capsys):
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "trainer.total_steps=1", "trainer.save_freq=0",
                 "trainer.test_freq=0", "trainer.progress_bar=false", "data.train_batch_size=2", "rollout.n=2",
                 "actor.ppo_mini_batch_size=4", "actor.micro_batch_size=4", "data.max_response_length=4"]) == 0
    data = tmp_path / "d.jsonl"
    data.write_text(json.dumps(_row(data_source="repeat")) + "\n")
    args = ["eval", "--model", str(run), "--data", str(data), "--output", str(tmp_path / "e.json"),
            "--max-new-tokens", "4", "--reward", "repeat"]
    assert main(args) == 2
    assert "would measure the untrained initial model; pass --untrained" in capsys.readouterr().err
    assert main([*args, "--untrained"]) == 0
    assert "(no checkpoint)" in json.loads((tmp_path / "e.json").read_text())["model"]
