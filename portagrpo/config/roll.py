"""Accept a ROLL (alibaba/ROLL) RLVR/GRPO YAML as written: its flat top-level keys and the
`actor_train` / `actor_infer` / `validation` sections map key by key onto portagrpo's, each with a
one-line notice; keys that only place work on a cluster are named as having no effect here; any
other key is rejected with a sentence. Semantics read from ROLL's `roll/configs/base_config.py`,
`roll/pipeline/rlvr/rlvr_config.py` and `roll/utils/functionals.py`; documented in docs/config.md.
"""
from __future__ import annotations

from typing import Any

from portagrpo.fileio import shorten

# A file is a ROLL config when it has none of portagrpo's sections and one of these.
MARKERS = {"rollout_batch_size", "num_return_sequences_in_group", "actor_train", "actor_infer", "pretrain"}
SECTIONS = {"model", "data", "rollout", "reward", "algorithm", "actor", "kernels", "trainer"}

TOP = {
    "rollout_batch_size": "data.train_batch_size",  # prompts per step in both
    "num_return_sequences_in_group": "rollout.n",
    "prompt_length": "data.max_prompt_length",  # longer prompts are dropped in both
    "response_length": "data.max_response_length",
    "ppo_epochs": "actor.ppo_epochs",
    "use_kl_loss": "actor.use_kl_loss",
    "kl_loss_coef": "actor.kl_loss_coef",
    "loss_agg_mode": "actor.loss_agg_mode",
    "whiten_advantages": "algorithm.whiten_advantages",
    "advantage_clip": "algorithm.advantage_clip",
    "reward_clip": "algorithm.reward_clip",
    "reward_shift": "algorithm.reward_shift",
    "reward_scale": "algorithm.reward_scale",
    "pg_clip": "actor.clip_ratio",
    "max_steps": "trainer.total_steps",
    "save_steps": "trainer.save_freq",
    "eval_steps": "trainer.test_freq",
    "seed": "trainer.seed",
    "exp_name": "trainer.experiment_name",
    "output_dir": "trainer.output_dir",
    "pretrain": "model.path",
    "max_grad_norm": "actor.grad_clip",
    "init_kl_coef": "algorithm.kl_coef",
    "entropy_loss_coef": "actor.entropy_coeff",
}
TRAINING_ARGS = {"learning_rate": "actor.lr", "weight_decay": "actor.weight_decay",
                 "warmup_steps": "actor.warmup_steps"}
GENERATING_ARGS = {"temperature": "rollout.temperature", "top_p": "rollout.top_p", "top_k": "rollout.top_k",
                   "repetition_penalty": "rollout.repetition_penalty"}
# Where ROLL places work on its cluster, or values it overwrites itself: no effect on what is computed.
NO_EFFECT = {"hydra", "system_envs", "logging_steps", "logging_dir", "tracker_kwargs", "checkpoint_config",
             "device_mapping", "strategy_args", "infer_batch_size", "template", "model_type", "dataset_dir",
             "interleave_probs", "preprocessing_num_workers", "domain_interleave_probs", "reward_pretrain",
             "num_train_epochs", "max_new_tokens", "num_return_sequences", "num_beams", "do_sample", "reference",
             "rewards", "use_pg_clip_range", "kl_penalty", "disable_gradient_checkpointing"}


def is_roll(raw: dict) -> bool:
    return bool(MARKERS & set(raw)) and not (SECTIONS & set(raw))


def translate(raw: dict[str, Any]) -> tuple[dict[str, Any], list[str], list[str]]:
    """A ROLL mapping -> (portagrpo `key: value` pairs as dotted keys, notices, problems)."""
    out: dict[str, Any] = {}
    notices: list[str] = []
    problems: list[str] = []

    def put(roll_key: str, key: str, value: Any, why: str = "") -> None:
        out[key] = value
        notices.append(f"ROLL key {roll_key} -> portagrpo {key}" + (f" ({why})" if why else ""))

    for key, value in raw.items():
        if key in TOP:
            put(key, TOP[key], value)
        elif key in ("actor_train", "actor_infer", "validation"):
            if value is not None and not isinstance(value, dict):
                problems.append(_not_a_section(key, value))
            else:
                _section(key, value or {}, put, notices, problems)
        elif key == "reference" and isinstance(value, dict) and _offloaded(value.get("strategy_args")):
            put("reference.strategy_args.strategy_config.zero_optimization.offload_param", "actor.ref_offload", True,
                "FSDP2's CPUOffloadPolicy on the reference")
        elif key in NO_EFFECT or key == "num_gpus_per_node":
            pass  # below, with the keys that need the whole file
        elif key not in _SPECIAL:
            problems.append(f"ROLL key {key} has no portagrpo equivalent; remove it (docs/config.md, 'Coming from "
                            f"ROLL', lists the keys portagrpo accepts).")
    _special(raw, put, notices, problems)
    return out, notices, problems


_SPECIAL = {"adv_estimator", "reward_norm", "dual_clip_loss", "add_token_level_kl", "track_with", "pg_clip_low",
            "pg_clip_high", "resume_from_checkpoint", "num_gpus_per_node"}


def _special(raw: dict, put, notices: list[str], problems: list[str]) -> None:
    est = raw.get("adv_estimator")
    if est is not None:
        if est == "grpo":
            put("adv_estimator", "algorithm.adv_estimator", "grpo", "group (x - mean) / (std + 1e-6), as ROLL forces")
        else:
            problems.append(f"ROLL key adv_estimator={est!r} has no portagrpo equivalent; portagrpo trains GRPO "
                            f"(adv_estimator: grpo).")
    norm = raw.get("reward_norm")
    if norm in ("batch",):
        put("reward_norm", "algorithm.reward_norm", "batch")
    elif norm not in (None, "group", "none"):
        problems.append(f"ROLL key reward_norm={norm!r} has no portagrpo equivalent; use null, group or batch.")
    eps = raw.get("pg_clip", 0.2)
    if "dual_clip_loss" in raw and _number(eps, "pg_clip", []):  # a pg_clip that is no number: actor.clip_ratio says so
        # ROLL bounds the negative-advantage loss at (1 + 2 pg_clip) A; off: a bound that never binds
        put("dual_clip_loss", "actor.clip_ratio_c", 1.0 + 2.0 * eps if raw["dual_clip_loss"] else 1e9,
            "ROLL's bound 1 + 2 x pg_clip" if raw["dual_clip_loss"] else "off: a bound that never binds")
    if raw.get("use_pg_clip_range"):
        for key in ("pg_clip_low", "pg_clip_high"):
            if _number(raw.get(key, 0.2), key, problems):
                put(key, f"actor.clip_ratio_{key.rsplit('_', 1)[1]}", float(raw.get(key, 0.2)))
    if raw.get("add_token_level_kl"):
        put("add_token_level_kl", "algorithm.use_kl_in_reward", True,
            f"k1 KL to the reference, coefficient init_kl_coef={raw.get('init_kl_coef', 0.2)}, summed over the "
            f"response before the group advantage (verl's order; ROLL subtracts it per token after normalising)")
        if "init_kl_coef" not in raw:
            put("init_kl_coef", "algorithm.kl_coef", 0.2, "ROLL's default")
    if raw.get("use_kl_loss"):
        put("use_kl_loss", "actor.kl_loss_type", "k3", "ROLL's KL loss is always k3")
    if "track_with" in raw:
        trackers = {"tensorboard": "tensorboard", "wandb": "wandb", "stdout": None}
        tracker = trackers.get(raw["track_with"], "?") if isinstance(raw["track_with"], str) else "?"
        if tracker == "?":
            problems.append(f"ROLL key track_with={raw['track_with']!r} has no portagrpo equivalent; use "
                            f"tensorboard, wandb or stdout.")
        else:
            put("track_with", "trainer.logger", ["console"] + ([tracker] if tracker else []))
    if raw.get("resume_from_checkpoint"):
        problems.append("ROLL key resume_from_checkpoint: continue a portagrpo run with --resume RUN_DIR (or "
                        "trainer.resume_mode=auto) instead.")
    if "num_gpus_per_node" in raw:
        put("num_gpus_per_node", "trainer.nproc_per_node", raw["num_gpus_per_node"])
    if "reward_clip" in raw:
        notices.append("ROLL key reward_clip: portagrpo clips the score before normalising it, ROLL after")
    ignored = sorted(k for k in raw if k in NO_EFFECT)
    if ignored:
        notices.append(f"ROLL keys with no effect here (cluster placement, logging, reward workers: portagrpo "
                       f"scores with reward.function): {', '.join(ignored)}")


PARTS = ("model_args", "training_args", "generating_args", "data_args")  # the sections inside a worker's section


def _number(value: Any, key: str, problems: list[str]) -> bool:
    """Whether `value` is a number; if not, a sentence naming the ROLL key is added to `problems`."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        return True
    problems.append(f"ROLL key {key}={value!r} must be a number.")
    return False


def _count(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value >= 1


def _not_a_section(where: str, value: Any) -> str:
    return (f"ROLL key {where} is {type(value).__name__} {shorten(repr(value))}, not a section of keys; write it as a "
            f"mapping (as in ROLL's example_grpo.yaml) or remove it.")


def _offloaded(strategy_args: Any) -> bool:
    """Whether a ROLL worker's DeepSpeed strategy offloads to the CPU (zero_optimization.offload_param or
    offload_optimizer with device cpu, as ROLL's deepspeed_zero3_cpuoffload config writes them)."""
    config = strategy_args.get("strategy_config") if isinstance(strategy_args, dict) else None
    zero = config.get("zero_optimization") if isinstance(config, dict) else None
    if not isinstance(zero, dict):
        return False
    return any(isinstance(zero.get(k), dict) and zero[k].get("device") == "cpu"
               for k in ("offload_param", "offload_optimizer"))


def _section(name: str, body: dict, put, notices: list[str], problems: list[str]) -> None:
    if name == "actor_train" and _offloaded(body.get("strategy_args")):
        put("actor_train.strategy_args.strategy_config.zero_optimization.offload_*", "actor.offload", True,
            "FSDP2's CPUOffloadPolicy: parameters, gradients and optimizer state together")
    for part, values in body.items():
        where = f"{name}.{part}"
        if not isinstance(values, dict):
            if part in PARTS and values is not None:
                problems.append(_not_a_section(where, values))
            elif part not in NO_EFFECT and part not in PARTS:
                problems.append(f"ROLL key {where} has no portagrpo equivalent; remove it.")
            continue
        for key, value in values.items():
            full = f"{where}.{key}"
            if part == "training_args" and key in TRAINING_ARGS:
                put(full, TRAINING_ARGS[key], value)
            elif part == "training_args" and key in ("adam_beta1", "adam_beta2"):
                betas = [values.get("adam_beta1", 0.9), values.get("adam_beta2", 0.999)]
                put(full, "actor.betas", betas)
            elif part == "training_args" and key == "lr_scheduler_type":
                if value in ("constant", "cosine"):
                    put(full, "actor.lr_schedule", value)
                else:
                    problems.append(f"ROLL key {full}={value!r}: portagrpo schedules are constant and cosine.")
            elif part == "training_args" and key == "per_device_train_batch_size":
                accumulate = values.get("gradient_accumulation_steps", 1)
                if not (_count(value) and _count(accumulate)):
                    problems.append(f"ROLL keys {where}.per_device_train_batch_size={value!r} and "
                                    f"gradient_accumulation_steps={accumulate!r} must be whole numbers of at least 1.")
                else:
                    put(full, "actor.micro_batch_size", value)
                    put(f"{where}.per_device_train_batch_size x gradient_accumulation_steps",
                        "__roll_mini_batch_per_rank", value * accumulate, "responses per optimizer step, x the ranks")
            elif part == "training_args" and key == "gradient_accumulation_steps":
                continue  # read with per_device_train_batch_size
            elif part == "generating_args" and key in GENERATING_ARGS and name == "actor_infer":
                put(full, GENERATING_ARGS[key], value)
            elif part == "generating_args" and key == "temperature" and name == "validation":
                put(full, "rollout.val_temperature", value)
            elif part == "data_args" and key == "file_name":
                files = value if isinstance(value, list) else [value]
                put(full, "data.train_files" if name == "actor_train" else "data.val_files", files)
            elif part == "data_args" and key == "messages":
                put(full, "data.prompt_key", value)
            elif part == "model_args" and key == "dtype":
                names = {"bf16": "bf16", "fp32": "fp32", "float32": "fp32", "bfloat16": "bf16"}
                put(full, "model.dtype", names.get(value, value) if isinstance(value, str) else value)
            elif key in NO_EFFECT or part == "strategy_args" or (part == "generating_args" and name == "validation"):
                continue
            else:
                problems.append(f"ROLL key {full} has no portagrpo equivalent; remove it.")
