"""Accept the GRPO keys of verl's documentation as `key=value` overrides.

Each verl key maps onto one portagrpo key (with a one-line notice naming it); verl keys with
no equivalent are listed and rejected, never silently ignored. Documented in docs/config.md.
"""
from __future__ import annotations

from typing import Any

AR = "actor_rollout_ref."

# verl key -> portagrpo key
DIRECT = {
    "algorithm.adv_estimator": "algorithm.adv_estimator",
    "algorithm.norm_adv_by_std_in_grpo": "algorithm.norm_adv_by_std_in_grpo",
    "algorithm.use_kl_in_reward": "algorithm.use_kl_in_reward",
    "algorithm.kl_ctrl.kl_coef": "algorithm.kl_coef",
    "data.train_files": "data.train_files",
    "data.val_files": "data.val_files",
    "data.train_batch_size": "data.train_batch_size",
    "data.max_prompt_length": "data.max_prompt_length",
    "data.max_response_length": "data.max_response_length",
    AR + "model.path": "model.path",
    AR + "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    AR + "model.lora_rank": "model.lora.rank",
    AR + "model.lora_alpha": "model.lora.alpha",
    AR + "model.target_modules": "model.lora.target_modules",
    AR + "rollout.n": "rollout.n",
    AR + "rollout.temperature": "rollout.temperature",
    AR + "rollout.top_p": "rollout.top_p",
    AR + "rollout.top_k": "rollout.top_k",
    AR + "rollout.name": "rollout.engine",
    AR + "rollout.gpu_memory_utilization": "rollout.vllm_gpu_memory_utilization",
    AR + "actor.optim.lr": "actor.lr",
    AR + "actor.optim.weight_decay": "actor.weight_decay",
    AR + "actor.optim.betas": "actor.betas",
    AR + "actor.ppo_micro_batch_size_per_gpu": "actor.micro_batch_size",
    AR + "rollout.log_prob_micro_batch_size_per_gpu": "actor.logprob_micro_batch_size",
    AR + "ref.log_prob_micro_batch_size_per_gpu": "actor.logprob_micro_batch_size",
    AR + "actor.use_dynamic_bsz": "actor.use_dynamic_bsz",
    AR + "actor.ppo_max_token_len_per_gpu": "actor.ppo_max_token_len_per_gpu",
    AR + "rollout.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
    AR + "ref.log_prob_use_dynamic_bsz": "actor.use_dynamic_bsz",
    AR + "rollout.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    AR + "ref.log_prob_max_token_len_per_gpu": "actor.log_prob_max_token_len_per_gpu",
    AR + "actor.ppo_epochs": "actor.ppo_epochs",
    AR + "actor.clip_ratio": "actor.clip_ratio",
    AR + "actor.clip_ratio_low": "actor.clip_ratio_low",
    AR + "actor.clip_ratio_high": "actor.clip_ratio_high",
    AR + "actor.clip_ratio_c": "actor.clip_ratio_c",
    AR + "actor.loss_agg_mode": "actor.loss_agg_mode",
    AR + "actor.loss_scale_factor": "actor.loss_scale_factor",
    AR + "actor.use_kl_loss": "actor.use_kl_loss",
    AR + "actor.kl_loss_coef": "actor.kl_loss_coef",
    AR + "actor.kl_loss_type": "actor.kl_loss_type",
    AR + "actor.entropy_coeff": "actor.entropy_coeff",
    AR + "actor.grad_clip": "actor.grad_clip",
    AR + "actor.lora.rank": "model.lora.rank",
    AR + "actor.lora.alpha": "model.lora.alpha",
    AR + "actor.lora.dropout": "model.lora.dropout",
    AR + "actor.lora.target_modules": "model.lora.target_modules",
    "trainer.total_epochs": "trainer.total_epochs",
    "trainer.total_training_steps": "trainer.total_steps",
    "trainer.save_freq": "trainer.save_freq",
    "trainer.test_freq": "trainer.test_freq",
    "trainer.nnodes": "trainer.nnodes",
    "trainer.default_local_dir": "trainer.output_dir",
    AR + "actor.lora.r": "model.lora.rank",
}
LORA_ENABLE = AR + "actor.lora.enable"
REWARD_PATH, REWARD_NAME = "custom_reward_function.path", "custom_reward_function.name"

# verl counts the mini-batch in prompts; portagrpo counts responses (prompts x rollout.n)
MINI_BATCH = AR + "actor.ppo_mini_batch_size"
GPUS_PER_NODE = "trainer.n_gpus_per_node"
WARMUP = AR + "actor.optim.lr_warmup_steps"
WARMUP_RATIO = AR + "actor.optim.lr_warmup_steps_ratio"  # only 0 maps: a ratio needs the step count first
SCHEDULE = AR + "actor.optim.warmup_style"  # verl's name for the schedule after warmup
VERL_ONLY_PREFIXES = (AR, "critic.", "reward_model.", "custom_reward_function.", "ray_init.", "ray_kwargs.")
VERL_ONLY_KEYS = {
    "trainer.critic_warmup",
    "data.shuffle_seed",
    GPUS_PER_NODE,
}


def is_verl_key(key: str) -> bool:
    return key in DIRECT or key in VERL_ONLY_KEYS or key.startswith(VERL_ONLY_PREFIXES)


def translate(pairs: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list[str], list[str]]:
    """verl (key, value) pairs -> portagrpo pairs, notices, and rejected keys. Non-verl pairs pass through."""
    out, notices, rejected = [], [], []
    mini_prompts, reward_path, reward_name, lora_enable = None, None, "compute_score", None
    for key, value in pairs:
        if not is_verl_key(key) or (key in DIRECT and DIRECT[key] == key):
            out.append((key, value))
            continue
        if key in DIRECT:
            out.append((DIRECT[key], value))
            notices.append(f"verl key {key} -> portagrpo {DIRECT[key]}")
        elif key == MINI_BATCH:
            mini_prompts = value
        elif key == WARMUP:
            steps = int(value)
            out.append(("actor.warmup_steps", max(steps, 0)))  # verl: -1 means "from the ratio", default 0
            notices.append(f"verl key {key}={value} -> portagrpo actor.warmup_steps={max(steps, 0)}")
        elif key == WARMUP_RATIO and float(value) == 0.0:
            notices.append(f"verl key {key}=0 -> no warmup (the default)")
        elif key == SCHEDULE and value in ("constant", "cosine"):
            out.append(("actor.lr_schedule", value))
            notices.append(f"verl key {key} -> portagrpo actor.lr_schedule")
        elif key == REWARD_PATH:
            reward_path = value
        elif key == REWARD_NAME:
            reward_name = value or "compute_score"
        elif key == LORA_ENABLE:
            lora_enable = str(value).lower() == "true"
        elif key == GPUS_PER_NODE:
            out += [("trainer.nproc_per_node", value), ("trainer.devices_per_node", value)]
            notices.append(f"verl key {key} -> portagrpo trainer.nproc_per_node (one machine) and "
                           f"trainer.devices_per_node (with --ray)")
        else:
            rejected.append(key)
    if reward_path:
        out.append(("reward.function", f"{reward_path}:{reward_name}"))
        notices.append(f"verl keys {REWARD_PATH}/{REWARD_NAME} -> portagrpo "
                       f"reward.function={reward_path}:{reward_name}")
    if lora_enable is False:
        out.append(("model.lora.rank", 0))
        notices.append(f"verl key {LORA_ENABLE}=false -> portagrpo model.lora.rank=0")
    elif lora_enable:
        notices.append(f"verl key {LORA_ENABLE}=true: LoRA is on when model.lora.rank > 0 (verl's actor.lora.r)")
    if mini_prompts is not None:
        out.append(("__verl_mini_batch_prompts", mini_prompts))
        notices.append(f"verl key {MINI_BATCH} -> portagrpo actor.ppo_mini_batch_size (x rollout.n: verl counts "
                       f"prompts, portagrpo counts responses)")
    return out, notices, rejected
