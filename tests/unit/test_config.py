"""Config schema: overrides, presets, and one clear sentence per problem."""
from pathlib import Path

import pytest

from portagrpo.config import Config, ConfigError, load_config, to_yaml

ROOT = Path(__file__).resolve().parents[2]


def errors_of(overrides, path=None):
    with pytest.raises(ConfigError) as info:
        load_config(path, overrides)
    return info.value.problems


def test_defaults_are_valid_and_match_configs_default():
    assert load_config() == Config()
    assert load_config(ROOT / "configs" / "default.yaml") == Config()


def test_typed_dotted_overrides():
    cfg = load_config(None, ["actor.lr=1e-4", "rollout.n=4", "actor.clip_ratio_high=0.28", "trainer.total_steps=null",
                             "data.train_batch_size=8", "actor.ppo_mini_batch_size=32", "actor.micro_batch_size=8",
                             "model.dtype=bf16", "trainer.deterministic=true", "actor.betas=[0.9,0.95]"])
    assert cfg.actor.lr == 1e-4 and isinstance(cfg.actor.lr, float)
    assert cfg.rollout.n == 4 and cfg.trainer.total_steps is None and cfg.model.dtype == "bf16"
    assert cfg.clip_low == 0.2 and cfg.clip_high == 0.28
    assert cfg.trainer.deterministic is True and cfg.actor.betas == [0.9, 0.95]


def test_unknown_key_suggests_nearest():
    (msg,) = errors_of(["actor.clip_ration=0.3"])
    assert "actor.clip_ration is not a config key" in msg and "actor.clip_ratio" in msg


def test_key_in_wrong_section_points_to_right_one():
    (msg,) = errors_of(["trainer.lr=0.1"])
    assert "did you mean actor.lr" in msg


def test_wrong_type():
    (msg,) = errors_of(["rollout.n=many"])
    assert msg == "rollout.n must be int, got str 'many'."


def test_literal_choice():
    (msg,) = errors_of(["model.dtype=fp8"])
    assert "model.dtype='fp8' is not allowed" in msg and "'bf16'" in msg


def test_n_below_two_with_grpo():
    (msg,) = errors_of(["rollout.n=1", "actor.ppo_mini_batch_size=16", "actor.micro_batch_size=16"])
    assert "rollout.n=1" in msg and "2 or more" in msg


def test_mini_batch_must_divide_rollout_batch():
    (msg,) = errors_of(["actor.ppo_mini_batch_size=48", "actor.micro_batch_size=16"])
    assert "actor.ppo_mini_batch_size=48 does not divide" in msg and "128" in msg


def test_micro_batch_defaults_from_the_mini_batch_and_any_size_is_accepted():
    """verl's quick start sets no micro-batch: the default comes from the per-rank mini-batch (its
    largest divisor up to 32); a size that does not divide it is accepted (a shorter last micro-batch)."""
    cfg = load_config(None, [])
    assert cfg.actor.micro_batch_size is None
    assert [load_config(None, [f"actor.ppo_mini_batch_size={m}"]).micro_batch(w)
            for m, w in ((64, 1), (64, 4), (32, 2), (128, 2), (16, 2), (8, 1))] == [32, 16, 16, 32, 8, 8]
    odd = load_config(None, ["data.train_batch_size=18", "rollout.n=4", "actor.ppo_mini_batch_size=72"])
    assert odd.micro_batch(1) == 24
    assert load_config(None, ["actor.micro_batch_size=24"]).micro_batch(1) == 24  # no "does not divide" any more
    assert load_config(None, ["actor.micro_batch_size=48"]).micro_batch(2) == 32  # never more than a rank's share
    assert load_config(None, ["actor.logprob_micro_batch_size=5"]).logprob_micro_batch(1) == 5
    (msg,) = errors_of(["actor.micro_batch_size=0"])
    assert "actor.micro_batch_size=0 must be at least 1" in msg


def test_several_problems_reported_together():
    problems = errors_of(["actor.clip_ration=0.3", "rollout.n=x"])
    assert len(problems) == 2


def test_missing_files_are_named(tmp_path):
    problems = errors_of(["model.path=/no/such/model", "data.task=null", "data.train_files=[/no/such.jsonl]"])
    assert any("model.path='/no/such/model' does not exist" in p for p in problems)
    assert any("data.train_files[0]='/no/such.jsonl' does not exist" in p for p in problems)


def test_missing_config_file():
    (msg,) = errors_of([], path="/no/such/recipe.yaml")
    assert "--config '/no/such/recipe.yaml' does not exist" in msg


def test_missing_reward_file():
    (msg,) = errors_of(["reward.function=/no/reward.py:score"])
    assert "reward.function" in msg and "does not exist" in msg


def test_dual_clip_bound():
    (msg,) = errors_of(["actor.clip_ratio_c=1.0"])
    assert "actor.clip_ratio_c=1.0 must be greater than 1" in msg


def test_unknown_loss_mode_and_kl_type():
    problems = errors_of(["actor.loss_agg_mode=token_mean", "actor.kl_loss_type=k9"])
    assert any("did you mean 'token-mean'" in p for p in problems)
    assert any("actor.kl_loss_type='k9'" in p for p in problems)


def test_drgrpo_preset_and_explicit_override_wins():
    cfg = load_config(None, ["algorithm.name=drgrpo"])
    assert cfg.algorithm.norm_adv_by_std_in_grpo is False
    assert cfg.actor.loss_agg_mode == "seq-mean-token-sum-norm" and cfg.actor.use_kl_loss is False
    cfg = load_config(None, ["algorithm.name=drgrpo", "actor.loss_agg_mode=token-mean"])
    assert cfg.actor.loss_agg_mode == "token-mean"


def test_loss_scale_factor_defaults_to_max_response_length():
    assert load_config(None, ["data.max_response_length=17"]).loss_scale_factor == 17.0
    assert load_config(None, ["actor.loss_scale_factor=4"]).loss_scale_factor == 4.0


def test_every_recipe_in_configs_loads():
    for path in sorted((ROOT / "configs").glob("*.yaml")):
        load_config(path, check_files=False)


def test_yaml_round_trip(tmp_path):
    cfg = load_config(None, ["actor.lr=3e-4", "algorithm.name=drgrpo"])
    p = tmp_path / "c.yaml"
    p.write_text(to_yaml(cfg))
    assert load_config(p) == cfg


def test_print_config_cli(capsys):
    from portagrpo.cli import main

    assert main(["train", "--print-config", "actor.lr=0.25"]) == 0
    assert "lr: 0.25" in capsys.readouterr().out


def test_cli_reports_config_error_without_traceback(capsys):
    from portagrpo.cli import main

    assert main(["train", "rollout.n=1"]) == 2
    err = capsys.readouterr().err
    assert err.startswith("portagrpo: error: rollout.n=1") and "Traceback" not in err


def test_every_key_is_documented():
    from portagrpo.config import all_keys

    doc = (ROOT / "docs" / "config.md").read_text()
    undocumented = [k for k in all_keys() if f"`{k}`" not in doc]
    assert not undocumented, undocumented
