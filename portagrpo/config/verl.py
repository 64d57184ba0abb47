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
    "data.image_key": "data.image_key",
    AR + "model.path": "model.path",
    AR + "model.enable_gradient_checkpointing": "model.gradient_checkpointing",
    AR + "model.enable_activation_offload": "model.enable_activation_offload",
    AR + "model.use_remove_padding": "model.use_remove_padding",
    AR + "actor.ulysses_sequence_parallel_size": "actor.ulysses_sequence_parallel_size",
    AR + "ref.ulysses_sequence_parallel_size": "actor.ulysses_sequence_parallel_size",
    AR + "model.lora_rank": "model.lora.rank",
    AR + "model.lora_alpha": "model.lora.alpha",
    AR + "model.target_modules": "model.lora.target_modules",
    AR + "rollout.n": "rollout.n",
    AR + "rollout.tensor_model_parallel_size": "rollout.tensor_model_parallel_size",
    AR + "rollout.expert_parallel_size": "rollout.expert_parallel_size",
    AR + "rollout.data_parallel_size": "rollout.data_parallel_size",
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
    AR + "actor.freeze_vision_tower": "actor.freeze_vision_tower",
    AR + "actor.fsdp_config.use_no_sync_for_gradient_accumulation": "actor.use_no_sync_for_gradient_accumulation",
    AR + "actor.fsdp_config.fsdp_size": "trainer.fsdp_size",
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
    "reward_model.overlong_buffer.enable": "reward.overlong_buffer.enable",
    "reward_model.overlong_buffer.len": "reward.overlong_buffer.len",
    "reward_model.overlong_buffer.penalty_factor": "reward.overlong_buffer.penalty_factor",
    AR + "rollout.multi_turn.enable": "rollout.multi_turn.enable",
    AR + "rollout.multi_turn.max_assistant_turns": "rollout.multi_turn.max_assistant_turns",
    AR + "rollout.multi_turn.tool_config_path": "rollout.multi_turn.tool_config_path",
    AR + "rollout.multi_turn.format": "rollout.multi_turn.format",
}
# verl cuts a tool's response to this many characters; portagrpo cuts it to as many tokens
TOOL_RESPONSE_LENGTH = AR + "rollout.multi_turn.max_tool_response_length"
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
    "data.val_batch_size",
    "data.gen_batch_size",
    GPUS_PER_NODE,
}


# verl's router replay for MoE policies (disabled | R2 | R3) -> actor.router_replay (null | R2 | R3)
ROUTER_REPLAY = AR + "actor.router_replay.mode"


def is_verl_key(key: str) -> bool:
    return key in DIRECT or key in VERL_ONLY_KEYS or key.startswith(VERL_ONLY_PREFIXES) or key == ROUTER_REPLAY


# Placement and speed settings of verl's workers: what they change is where and how fast, never the numbers.
NO_EFFECT = {
    AR + "model.use_shm": "portagrpo loads models from the local path as they are",
    AR + "rollout.load_format": "the engine loads the run's own weights",
    AR + "rollout.layered_summon": "portagrpo gathers one tensor at a time for the weight push",
    AR + "rollout.enable_chunked_prefill": "vLLM's scheduling",
    AR + "rollout.enforce_eager": "vLLM's CUDA graphs",
    AR + "rollout.free_cache_engine": "the engine sleeps between rollouts",
    AR + "rollout.multi_turn.max_user_turns": "no simulated user speaks here; each tool turn follows a model "
                                              "turn, so rollout.multi_turn.max_assistant_turns bounds both",
    AR + "rollout.multi_turn.max_parallel_calls": "every tool call of a turn runs, in the sandbox's workers",
    AR + "rollout.multi_turn.tool_response_truncate_side": "a long tool result keeps its start and says it was cut",
    AR + "rollout.multi_turn.use_inference_chat_template": "tool turns are rendered with the tokenizer's template",
    AR + "rollout.multi_turn.tokenization_sanity_check_mode": "the model's own token ids are kept, never "
                                                              "re-tokenized",
    "data.val_batch_size": "validation runs in batches of data.train_batch_size prompts",
    "data.gen_batch_size": "each DAPO sampling round takes data.train_batch_size prompts",
    "reward_model.reward_manager": "reward.overlong_buffer is DAPO's reward manager here",
    "reward_model.overlong_buffer.log": "metrics.jsonl logs every step",
}
# verl's offload switches -> portagrpo's: the actor's three go together here (FSDP2's CPUOffloadPolicy offloads a
# shard's parameters, gradients and optimizer state as one), the reference's alone
ACTOR_OFFLOAD = tuple(AR + f"actor.fsdp_config.{k}_offload" for k in ("param", "optimizer", "grad"))
REF_OFFLOAD = AR + "ref.fsdp_config.param_offload"
# verl's global (all-GPU) micro-batches, deprecated by verl for the *_per_gpu keys
GLOBAL_MICRO = {AR + "actor.ppo_micro_batch_size": "actor.micro_batch_size",
                AR + "rollout.log_prob_micro_batch_size": "actor.logprob_micro_batch_size",
                AR + "ref.log_prob_micro_batch_size": "actor.logprob_micro_batch_size"}


EXPERT_PARALLEL = AR + "actor.megatron.expert_model_parallel_size"  # -> trainer.parallel=ep, trainer.ep_size


def expert_parallel_refusal(key: str) -> str | None:
    """verl's expert-parallel keys that portagrpo does not take (expert tensor parallelism; vLLM's keys other than the
    rollout's expert_parallel_size and data_parallel_size, which translate), refused in one sentence that says why;
    None for another key."""
    if not any(part in key for part in ("expert_model_parallel", "expert_parallel", "expert_tensor_parallel")):
        return None
    return (f"verl key {key}: portagrpo splits the experts by whole experts, in training (trainer.parallel=ep, "
            f"trainer.ep_size) and in vLLM (rollout.expert_parallel_size, rollout.data_parallel_size), never within an "
            f"expert; remove it, and `portagrpo plan` says whether the model fits without it.")


def translate(pairs: list[tuple[str, Any]]) -> tuple[list[tuple[str, Any]], list[str], list[str]]:
    """verl (key, value) pairs -> portagrpo pairs, notices, and rejected keys. Non-verl pairs pass through."""
    out, notices, rejected = [], [], []
    held: dict[str, Any] = {}  # keys whose meaning needs the whole command
    for key, value in pairs:
        if key in ("trainer.save_freq", "trainer.test_freq") and str(value).strip() == "-1":
            out.append((key, 0))  # verl's -1 is portagrpo's 0: never
            notices.append(f"verl key {key}=-1 -> portagrpo {key}=0 (never)")
        elif not is_verl_key(key) or (key in DIRECT and DIRECT[key] == key):
            out.append((key, value))
        elif key == EXPERT_PARALLEL and str(value).strip().lstrip("-").isdigit():
            size = int(value)
            out += [("trainer.parallel", "ep"), ("trainer.ep_size", size)] if size > 1 else []
            notices.append(f"verl key {key}={value} -> portagrpo " + (
                f"trainer.parallel=ep trainer.ep_size={size}" if size > 1 else "nothing (one rank's experts: no EP)"))
        elif key == ROUTER_REPLAY:
            mode = None if str(value).strip().lower() in ("disabled", "none", "null") else value
            out.append(("actor.router_replay", mode))
            notices.append(f"verl key {key}={value} -> portagrpo actor.router_replay={mode or 'null'}")
        elif key in DIRECT:
            out.append((DIRECT[key], value))
            notices.append(f"verl key {key} -> portagrpo {DIRECT[key]}")
        elif key == TOOL_RESPONSE_LENGTH:
            out.append(("rollout.multi_turn.max_tool_response_length", value))
            notices.append(f"verl key {key} -> portagrpo rollout.multi_turn.max_tool_response_length (counted in "
                           f"tokens here; verl counts characters)")
        elif key in NO_EFFECT or key in GLOBAL_MICRO or key in (MINI_BATCH, REWARD_PATH, REWARD_NAME, LORA_ENABLE,
                                                                  GPUS_PER_NODE, "trainer.critic_warmup",
                                                                  REF_OFFLOAD, *ACTOR_OFFLOAD):
            held[key] = value
        else:
            _schedule_key(key, value, out, notices, rejected)
    _held(held, out, notices, rejected)
    return out, notices, rejected


def _schedule_key(key: str, value: Any, out: list, notices: list[str], rejected: list[str]) -> None:
    if key == WARMUP:
        steps = int(value)
        out.append(("actor.warmup_steps", max(steps, 0)))  # verl: -1 means "from the ratio", default 0
        notices.append(f"verl key {key}={value} -> portagrpo actor.warmup_steps={max(steps, 0)}")
    elif key == WARMUP_RATIO and float(value) == 0.0:
        notices.append(f"verl key {key}=0 -> no warmup (the default)")
    elif key == SCHEDULE and value in ("constant", "cosine"):
        out.append(("actor.lr_schedule", value))
        notices.append(f"verl key {key} -> portagrpo actor.lr_schedule")
    else:
        rejected.append(key)


def _offload(held: dict[str, Any], out: list, notices: list[str]) -> None:
    """verl's offload keys, honoured: any of the actor's three on offloads all three (actor.offload); the
    reference's is actor.ref_offload."""
    on = [k for k in ACTOR_OFFLOAD if str(held.get(k, "false")).lower() == "true"]
    if on:
        out.append(("actor.offload", True))
        notices.append(f"verl key(s) {', '.join(on)} -> portagrpo actor.offload=true (FSDP2's CPUOffloadPolicy keeps "
                       f"a shard's parameters, gradients and optimizer state in host memory together)")
    elif any(k in held for k in ACTOR_OFFLOAD):
        out.append(("actor.offload", False))
    if REF_OFFLOAD in held:
        value = str(held[REF_OFFLOAD]).lower() == "true"
        out.append(("actor.ref_offload", value))
        notices.append(f"verl key {REF_OFFLOAD} -> portagrpo actor.ref_offload={str(value).lower()}")


def _held(held: dict[str, Any], out: list, notices: list[str], rejected: list[str]) -> None:
    _offload(held, out, notices)
    gpus = held.get(GPUS_PER_NODE)
    if gpus is not None:
        out += [("trainer.nproc_per_node", gpus), ("trainer.devices_per_node", gpus)]
        notices.append(f"verl key {GPUS_PER_NODE} -> portagrpo trainer.nproc_per_node (one machine) and "
                       f"trainer.devices_per_node (with --ray)")
    for key, why in NO_EFFECT.items():
        if key in held:
            notices.append(f"verl key {key}={held[key]}: no effect here ({why})")
    for key, target in GLOBAL_MICRO.items():
        if key in held:  # verl divides these by the GPU count
            per_gpu = max(int(held[key]) // int(gpus or 1), 1)
            out.append((target, per_gpu))
            notices.append(f"verl key {key} -> portagrpo {target}={per_gpu} (per rank: / trainer.n_gpus_per_node)")
    if int(held.get("trainer.critic_warmup", 0) or 0) > 0:
        rejected.append("trainer.critic_warmup")  # GRPO has no critic to warm up
    if held.get(REWARD_PATH):
        name = held.get(REWARD_NAME) or "compute_score"
        out.append(("reward.function", f"{held[REWARD_PATH]}:{name}"))
        notices.append(f"verl keys {REWARD_PATH}/{REWARD_NAME} -> portagrpo reward.function={held[REWARD_PATH]}:{name}")
    if LORA_ENABLE in held:
        if str(held[LORA_ENABLE]).lower() == "true":
            notices.append(f"verl key {LORA_ENABLE}=true: LoRA is on when model.lora.rank > 0 (verl's actor.lora.r)")
        else:
            out.append(("model.lora.rank", 0))
            notices.append(f"verl key {LORA_ENABLE}=false -> portagrpo model.lora.rank=0")
    if MINI_BATCH in held:
        out.append(("__verl_mini_batch_prompts", held[MINI_BATCH]))
        notices.append(f"verl key {MINI_BATCH} -> portagrpo actor.ppo_mini_batch_size (x rollout.n: verl counts "
                       f"prompts, portagrpo counts responses)")
