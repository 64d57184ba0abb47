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
                "actor_rollout_ref.actor.megatron.tensor_model_parallel_size=2",
                "actor_rollout_ref.actor.optim.lr=1e-6",
            ],
        )
    problems = info.value.problems
    assert len(problems) == 1
    assert any("megatron.tensor_model_parallel_size" in p and "has no portagrpo equivalent" in p for p in problems)
    assert not any("trainer.logger" in p for p in problems)  # wandb is a logger portagrpo has


def test_verl_run_keys_map(tmp_path):
    """verl's run, data, reward and LoRA keys as its GRPO and LoRA examples write them."""
    cfg = load_config(None, [
        "trainer.project_name=verl_grpo_example_gsm8k", "trainer.experiment_name=qwen_tiny",
        "trainer.val_before_train=False", f"trainer.default_local_dir={tmp_path / 'ckpts'}",
        "trainer.resume_mode=auto", "trainer.logger=[console]", "data.filter_overlong_prompts=False",
        "data.truncation=left", "data.prompt_key=question", "data.reward_fn_key=source",
        f"custom_reward_function.path={tmp_path / 'r.py'}", "custom_reward_function.name=my_score",
        "actor_rollout_ref.actor.lora.enable=True", "actor_rollout_ref.actor.lora.r=8",
        "actor_rollout_ref.actor.lora.alpha=16", "actor_rollout_ref.actor.lora.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.actor.use_dynamic_bsz=True", "actor_rollout_ref.actor.ppo_max_token_len_per_gpu=4096",
    ], check_files=False)
    t, d, lora = cfg.trainer, cfg.data, cfg.model.lora
    assert (t.project_name, t.experiment_name, t.val_before_train, t.output_dir, t.resume_mode) == (
        "verl_grpo_example_gsm8k", "qwen_tiny", False, str(tmp_path / "ckpts"), "auto")
    assert t.logger == ["console"] and not cfg.tensorboard
    assert (d.filter_overlong_prompts, d.truncation, d.prompt_key, d.reward_fn_key) == (False, "left", "question",
                                                                                        "source")
    assert cfg.reward.function == f"{tmp_path / 'r.py'}:my_score"
    assert (lora.rank, lora.alpha, lora.target_modules) == (8, 16, ["q_proj", "v_proj"])
    assert cfg.actor.use_dynamic_bsz and cfg.actor.ppo_max_token_len_per_gpu == 4096
    off = load_config(None, ["actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.actor.lora.enable=False"])
    assert off.model.lora.rank == 0
    from portagrpo.train.loop import Cadence

    assert Cadence(3, 1, 0, val_before_train=True).validate_first(0)
    assert not Cadence(3, 1, 0, val_before_train=False).validate_first(0)


def test_verl_data_reward_and_resume_keys_train(tmp_path, tiny_model_dir, capsys):
    """A verl command naming its prompt column, reward column and function, cutting long prompts, and
    continuing its own checkpoint with trainer.resume_mode=auto."""
    rows = [{"question": "x" * (5 + 3 * i), "source": "mine", "reward_model": {"ground_truth": "1"}}
            for i in range(16)]
    train = write_jsonl(rows, tmp_path / "train.jsonl")
    reward = tmp_path / "r.py"
    reward.write_text("def my_score(data_source, solution_str, ground_truth, extra_info=None):\n"
                      "    assert data_source == 'mine'\n    return float(len(solution_str) % 3 == 0)\n")
    out = tmp_path / "ckpts"
    command = [
        f"data.train_files={train}", "data.train_batch_size=2", "data.max_prompt_length=20",
        "data.max_response_length=6", "data.filter_overlong_prompts=False", "data.truncation=left",
        "data.prompt_key=question", "data.reward_fn_key=source", f"custom_reward_function.path={reward}",
        "custom_reward_function.name=my_score", f"actor_rollout_ref.model.path={tiny_model_dir}",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=2",
        f"trainer.default_local_dir={out}", "trainer.save_freq=2", "trainer.test_freq=0",
        "trainer.resume_mode=auto", "trainer.progress_bar=false", "reward.num_workers=0",
    ]
    assert main(["train", *command, "trainer.total_training_steps=2"]) == 0
    assert "cut (left) " in capsys.readouterr().out  # prompts over 20 tokens were kept, cut from the left
    assert main(["train", *command, "trainer.total_training_steps=3"]) == 0
    assert "resumed from" in capsys.readouterr().out
    assert [r["step"] for r in read_metrics(out / "metrics.jsonl")] == [1, 2, 3]
    with pytest.raises(Exception, match="prompt 6 has 23 tokens, over data.max_prompt_length=20"):
        load_and_build_data = __import__("portagrpo.train.build", fromlist=["build_data"]).build_data
        load_and_build_data(load_config(None, [*command, "data.truncation=error"]), print)


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


def _gsm8k_files(tmp_path, prompt_key="prompt"):
    def rows(n, seed):
        out = gsm8k_style_rows(n, seed=seed)
        for r in out:
            r[prompt_key] = r.pop("prompt")
        return out

    return (write_jsonl(rows(16, 2), tmp_path / "train.jsonl"), write_jsonl(rows(4, 3), tmp_path / "test.jsonl"))


def test_verl_lora_example_trains(tmp_path, tiny_model_dir, monkeypatch, capsys):
    """verl's examples/grpo_trainer/run_qwen2_5-3b_gsm8k_grpo_lora.sh key for key, with the model and data paths
    and the sizes changed; rollout.name=vllm is left out (no vLLM on these CPU machines) and W&B runs offline."""
    monkeypatch.setenv("WANDB_MODE", "offline")
    monkeypatch.setenv("WANDB_SILENT", "true")
    train, test = _gsm8k_files(tmp_path, "messages")
    command = [
        "algorithm.adv_estimator=grpo", f"data.train_files={train}", f"data.val_files={test}",
        "data.train_batch_size=4", "data.max_prompt_length=200", "data.max_response_length=6",
        "data.filter_overlong_prompts=True", "data.truncation=error", "data.prompt_key=messages", "data.shuffle=False",
        f"actor_rollout_ref.model.path={tiny_model_dir}", "actor_rollout_ref.model.use_shm=True",
        "actor_rollout_ref.actor.optim.lr=3e-6", "actor_rollout_ref.model.use_remove_padding=True",
        "actor_rollout_ref.actor.ppo_mini_batch_size=2", "actor_rollout_ref.actor.ppo_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.actor.use_kl_loss=True", "actor_rollout_ref.actor.kl_loss_coef=0.001",
        "actor_rollout_ref.actor.kl_loss_type=low_var_kl", "actor_rollout_ref.actor.entropy_coeff=0",
        "actor_rollout_ref.model.lora_rank=8", "actor_rollout_ref.model.lora_alpha=16",
        "actor_rollout_ref.model.target_modules=[q_proj,v_proj]",
        "actor_rollout_ref.model.enable_gradient_checkpointing=True",
        "actor_rollout_ref.actor.fsdp_config.param_offload=False",
        "actor_rollout_ref.actor.fsdp_config.optimizer_offload=False",
        "actor_rollout_ref.rollout.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.rollout.tensor_model_parallel_size=2",
        "actor_rollout_ref.rollout.gpu_memory_utilization=0.6",
        "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.rollout.load_format=safetensors",
        "actor_rollout_ref.rollout.layered_summon=True", "actor_rollout_ref.ref.log_prob_micro_batch_size_per_gpu=4",
        "actor_rollout_ref.ref.fsdp_config.param_offload=True", "algorithm.use_kl_in_reward=False",
        "trainer.critic_warmup=0", "trainer.logger=['console','wandb']", "trainer.project_name=verl_grpo_example_gsm8k",
        "trainer.experiment_name=qwen2_7b_function_rm", "trainer.n_gpus_per_node=1", "trainer.nnodes=1",
        "trainer.save_freq=-1", "trainer.test_freq=5", "trainer.total_epochs=1",
    ]
    run = tmp_path / "run"
    assert main(["train", "--output-dir", str(run), "trainer.progress_bar=false", *command]) == 0
    out = capsys.readouterr().out
    assert "model.use_remove_padding -> portagrpo model.use_remove_padding" in out
    assert "tensor_model_parallel_size=2" in out
    rows = read_metrics(run / "metrics.jsonl")
    assert [r["step"] for r in rows] == [1, 2, 3, 4] and not (run / "checkpoints").exists()  # save_freq=-1: never
    assert (run / "wandb").is_dir()


def test_verl_drgrpo_command_trains_like_the_preset(tmp_path, tiny_model_dir):
    """verl's DrGRPO documentation: token-sum-norm aggregation, no std in the advantage, no KL."""
    train, test = _gsm8k_files(tmp_path)
    common = [f"data.train_files={train}", f"data.val_files={test}", "data.train_batch_size=4",
              "data.max_prompt_length=200", "data.max_response_length=6",
              f"actor_rollout_ref.model.path={tiny_model_dir}",
              "actor_rollout_ref.rollout.n=4", "actor_rollout_ref.actor.ppo_mini_batch_size=4",
              "trainer.total_training_steps=2", "trainer.test_freq=0", "trainer.save_freq=0"]
    verl = ["algorithm.adv_estimator=grpo", "actor_rollout_ref.actor.loss_agg_mode=seq-mean-token-sum-norm",
            "actor_rollout_ref.actor.use_kl_loss=False", "algorithm.norm_adv_by_std_in_grpo=False",
            "algorithm.use_kl_in_reward=False"]
    from dataclasses import replace

    cfg, preset = load_config(None, [*common, *verl]), load_config(None, [*common, "algorithm.name=drgrpo"])
    assert cfg.actor == preset.actor and replace(cfg.algorithm, name="drgrpo") == preset.algorithm
    assert main(["train", "--output-dir", str(tmp_path / "run"), "trainer.progress_bar=false", *common, *verl]) == 0
    assert [r["step"] for r in read_metrics(tmp_path / "run" / "metrics.jsonl")] == [1, 2]
