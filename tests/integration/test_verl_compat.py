"""A verl-style GRPO command line trains exactly like its portagrpo form."""
import pytest

from portagrpo.cli import main
from portagrpo.config import ConfigError, load_config
from portagrpo.data.records import write_jsonl
from portagrpo.data.tasks import gsm8k_style_rows
from portagrpo.metrics import MEASURED_KEYS, read_metrics


def test_verl_command_line_trains_like_portagrpo(tmp_path, tiny_model_dir, capsys):
    train = write_jsonl(gsm8k_style_rows(64, seed=2), tmp_path / "train.jsonl")
    val = write_jsonl(gsm8k_style_rows(8, seed=3), tmp_path / "val.jsonl")
    common = ["trainer.progress_bar=false", "trainer.total_steps=2", "reward.function=gsm8k"]
    verl = [  # as in verl's GRPO documentation
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files={val}",
        "data.train_batch_size=4", "data.max_prompt_length=200", "data.max_response_length=12",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.actor.optim.lr=1e-3",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.temperature=1.0",
        "algorithm.use_kl_in_reward=False", "trainer.save_freq=0", "trainer.test_freq=2",
    ]
    native = [
        "algorithm.adv_estimator=grpo", f"data.train_files=[{train}]", f"data.val_files=[{val}]", "data.task=null",
        "data.train_batch_size=4", "data.max_prompt_length=200", "data.max_response_length=12",
        f"model.path={tiny_model_dir}", "actor.lr=1e-3", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=4",
        "actor.use_kl_loss=true", "actor.kl_loss_coef=0.001", "actor.kl_loss_type=low_var_kl",
        "actor.entropy_coeff=0", "rollout.n=4", "rollout.temperature=1.0", "algorithm.use_kl_in_reward=false",
        "trainer.save_freq=0", "trainer.test_freq=2",
    ]
    assert load_config(None, [*verl, *common]) == load_config(None, [*native, *common])
    assert main(["train", "--output-dir", str(tmp_path / "verl"), *verl, *common]) == 0
    out = capsys.readouterr().out
    assert "verl key actor_rollout_ref.actor.optim.lr -> portagrpo actor.lr" in out
    assert "ppo_mini_batch_size (x rollout.n" in out
    assert main(["train", "--output-dir", str(tmp_path / "native"), *native, *common]) == 0
    a, b = read_metrics(tmp_path / "verl" / "metrics.jsonl"), read_metrics(tmp_path / "native" / "metrics.jsonl")
    assert len(a) == 2 and "val/acc" in a[-1]
    for ra, rb in zip(a, b):
        same = lambda row: {k: v for k, v in row.items() if k not in MEASURED_KEYS}  # noqa: E731
        assert same(ra) == same(rb)


def test_unknown_verl_keys_are_listed_and_rejected():
    with pytest.raises(ConfigError) as info:
        load_config(
            None,
            [
                "trainer.logger=[console,wandb]",
                "trainer.project_name=x",
                "actor_rollout_ref.actor.fsdp_config.param_offload=True",
                "actor_rollout_ref.actor.optim.lr=1e-6",
            ],
        )
    problems = info.value.problems
    assert len(problems) == 3 and all("has no portagrpo equivalent" in p for p in problems)
    assert any("fsdp_config.param_offload" in p for p in problems)


def test_gpus_per_node_and_epochs():
    cfg = load_config(None, ["trainer.n_gpus_per_node=2", "trainer.total_epochs=3"])
    assert cfg.trainer.nproc_per_node == 2 and cfg.trainer.devices_per_node == 2
    assert cfg.trainer.total_steps is None and cfg.trainer.total_epochs == 3


def test_verl_two_gpu_quick_start_without_a_micro_batch_trains(tmp_path, tiny_model_dir, capsys):
    """verl's quick start sets no micro-batch size; on two ranks it used to stop with "actor.micro_batch_size=32
    does not divide the per-rank mini-batch", a size the user never wrote."""
    train = write_jsonl(gsm8k_style_rows(8, seed=2), tmp_path / "train.jsonl")
    val = write_jsonl(gsm8k_style_rows(4, seed=3), tmp_path / "val.jsonl")
    command = [  # verl's quick start, with local paths and small sizes
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files={val}",
        "data.train_batch_size=4", "data.max_prompt_length=200", "data.max_response_length=8",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.actor.optim.lr=1e-6",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.use_kl_loss=True",
        "actor_rollout_ref.actor.kl_loss_coef=0.001", "actor_rollout_ref.rollout.n=4",
        "trainer.n_gpus_per_node=2", "trainer.total_epochs=1",
    ]
    cfg = load_config(None, command)
    assert cfg.actor.micro_batch_size is None and cfg.micro_batch(2) == 4  # 2 prompts x 4 responses / 2 ranks
    run = tmp_path / "run"
    assert main(["train", "--device", "cpu", "--output-dir", str(run), "trainer.progress_bar=false",
                 "reward.function=gsm8k", *command]) == 0
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2] and all(r["world_size"] == 2 for r in rows)
