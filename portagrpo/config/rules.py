"""Rules a config must satisfy beyond its types: cross-field rules, value ranges (every number
finite and in range), the tiny model's shape, batch divisions for a world size, missing files.
One sentence per problem, naming the field."""
from __future__ import annotations

import dataclasses
import difflib
import math
import re
from pathlib import Path
from typing import Any

from portagrpo.config.bounds import rollout_correction_problems
from portagrpo.config.schema import Config
from portagrpo.errors import UnknownNameError
from portagrpo.paths import model_source_problem

# Float fields where infinity means something (no clipping).
INFINITY_ALLOWED = {"actor.grad_clip", "algorithm.reward_clip", "algorithm.advantage_clip"}


def _floats(obj: Any, prefix: str = ""):
    for f in dataclasses.fields(obj):
        value = getattr(obj, f.name)
        name = f"{prefix}{f.name}"
        if dataclasses.is_dataclass(value):
            yield from _floats(value, name + ".")
        elif isinstance(value, float):
            yield name, value
        elif isinstance(value, list) and value and all(isinstance(v, float) for v in value):
            for i, v in enumerate(value):
                yield f"{name}[{i}]", v


def value_problems(cfg) -> list[str]:
    bad = {name.split("[")[0]: f"{name}={value} must be a finite number." for name, value in _floats(cfg)
           if math.isnan(value) or (math.isinf(value) and name not in INFINITY_ALLOWED)}
    # a non-finite field gets that sentence only, not also its range's
    return list(bad.values()) + [line for line in _ranges(cfg) if line.split("=", 1)[0] not in bad]


def _ranges(cfg) -> list[str]:
    p: list[str] = []
    a, alg, r, t = cfg.actor, cfg.algorithm, cfg.rollout, cfg.trainer
    if not a.lr > 0:
        p.append(f"actor.lr={a.lr} must be positive.")
    if not a.grad_clip > 0:
        p.append(f"actor.grad_clip={a.grad_clip} must be positive (0 would zero every gradient and a negative value "
                 f"flip its sign); use .inf to turn clipping off.")
    if len(a.betas) != 2 or not all(0 <= b < 1 for b in a.betas):
        p.append(f"actor.betas={list(a.betas)} must be two numbers in [0, 1), e.g. [0.9, 0.999].")
    if a.weight_decay < 0:
        p.append(f"actor.weight_decay={a.weight_decay} must be 0 or positive.")
    if a.warmup_steps < 0:
        p.append(f"actor.warmup_steps={a.warmup_steps} must be 0 or positive.")
    for name, value in (("actor.kl_loss_coef", a.kl_loss_coef), ("algorithm.kl_coef", alg.kl_coef)):
        if value < 0:
            p.append(
                f"{name}={value} must be 0 or positive (a negative coefficient rewards drifting from the reference)."
            )
    if r.top_k < -1:
        p.append(f"rollout.top_k={r.top_k} must be -1 or 0 (off) or positive.")
    if not 0 <= r.min_p < 1:
        p.append(f"rollout.min_p={r.min_p} must be in [0, 1) (0 is off).")
    if not r.repetition_penalty > 0:
        p.append(f"rollout.repetition_penalty={r.repetition_penalty} must be positive (1 is off).")
    if r.val_temperature <= 0 and r.val_n > 1 and t.test_freq:
        p.append(
            f"rollout.val_n={r.val_n} with greedy validation (rollout.val_temperature=0) gives {r.val_n} identical "
            f"samples, so pass@{r.val_n} would equal accuracy; set val_temperature > 0 or val_n=1."
        )
    if r.val_temperature < 0:
        p.append(f"rollout.val_temperature={r.val_temperature} must be 0 (greedy) or positive.")
    if r.val_n < 1 and t.test_freq:
        p.append(
            f"rollout.val_n={r.val_n} must be at least 1 while validation is on (trainer.test_freq={t.test_freq})."
        )
    if t.total_steps is None and t.total_epochs < 1:
        p.append(f"trainer.total_epochs={t.total_epochs} must be at least 1 (or set trainer.total_steps).")
    for name, value in (("algorithm.reward_clip", alg.reward_clip), ("algorithm.advantage_clip", alg.advantage_clip)):
        if value is not None and not value > 0:
            p.append(f"{name}={value} must be positive (or null for no clipping).")
    if cfg.model.path is None:
        p.extend(tiny_problems(cfg.model.tiny))
    from portagrpo.data.images import max_pixels_problem

    pixels = max_pixels_problem(cfg.data.max_image_pixels)
    if pixels:
        p.append(pixels)
    return p


def tiny_problems(tiny) -> list[str]:
    p = [f"model.tiny.{name}={getattr(tiny, name)} must be at least 1."
         for name in ("hidden_size", "num_layers", "num_heads", "intermediate_size") if getattr(tiny, name) < 1]
    if not p and tiny.hidden_size % tiny.num_heads:
        p.append(f"model.tiny.num_heads={tiny.num_heads} does not divide model.tiny.hidden_size={tiny.hidden_size}; "
                 f"pick a divisor of it.")
    elif not p and (tiny.hidden_size // tiny.num_heads) % 2:
        p.append(f"model.tiny.hidden_size / num_heads = {tiny.hidden_size // tiny.num_heads} must be even (rotary "
                 f"embeddings rotate pairs); change one of them.")
    if getattr(tiny, "moe", None) and not 1 <= tiny.num_experts_per_tok <= tiny.num_experts:
        p.append(f"model.tiny.num_experts_per_tok={tiny.num_experts_per_tok} must be between 1 and model.tiny."
                 f"num_experts={tiny.num_experts}; route each token to fewer experts than there are.")
    return p




# ---------------------------------------------------------------- validation


def validate(cfg: Config, *, check_files: bool = True) -> list[str]:
    """Cross-field rules. Returns one sentence per problem (empty when valid)."""
    p = (_names_and_sizes(cfg) + _batch_and_loss(cfg) + _run_settings(cfg) + rollout_correction_problems(cfg)
         + rollout_precision_problems(cfg) + rollout_mode_problems(cfg) + multi_turn_problems(cfg) + code_problems(cfg)
         + logger_problems(cfg) + dapo_problems(cfg) + rollout_expert_problems(cfg)
         + value_problems(cfg))
    if check_files:
        p.extend(missing_files(cfg))
    return p


def _names_and_sizes(cfg: Config) -> list[str]:
    from portagrpo.algo import ADV_ESTIMATORS, AGG_MODES
    from portagrpo.algo.losses import parse_kl_type

    p: list[str] = []
    a, d, r, alg = cfg.actor, cfg.data, cfg.rollout, cfg.algorithm
    if alg.adv_estimator not in ADV_ESTIMATORS:
        p.append(f"algorithm.adv_estimator={alg.adv_estimator!r} is unknown; use one of {', '.join(ADV_ESTIMATORS)}.")
    if alg.adv_estimator == "grpo" and r.n == 1:
        p.append(f"rollout.n={r.n} gives groups of one, which carry no GRPO advantage; set rollout.n to 2 or more.")
    if a.loss_agg_mode not in AGG_MODES:
        close = difflib.get_close_matches(a.loss_agg_mode, AGG_MODES.names(), n=1)
        hint = f" (did you mean {close[0]!r}?)" if close else ""
        p.append(f"actor.loss_agg_mode={a.loss_agg_mode!r} is unknown{hint}; use one of {', '.join(AGG_MODES)}.")
    try:
        parse_kl_type(a.kl_loss_type)
    except UnknownNameError as err:
        p.append(str(err))
    unset_is_fine = {None: 1}
    for name, value in (("data.train_batch_size", d.train_batch_size), ("rollout.n", r.n),
                        ("actor.ppo_mini_batch_size", a.ppo_mini_batch_size),
                        ("actor.micro_batch_size", unset_is_fine.get(a.micro_batch_size, a.micro_batch_size)),
                        ("actor.logprob_micro_batch_size",
                         unset_is_fine.get(a.logprob_micro_batch_size, a.logprob_micro_batch_size)),
                        ("actor.ppo_epochs", a.ppo_epochs),
                        ("rollout.tensor_model_parallel_size", r.tensor_model_parallel_size),
                        ("rollout.expert_parallel_size", r.expert_parallel_size),
                        ("rollout.data_parallel_size", r.data_parallel_size),
                        ("data.max_response_length", d.max_response_length),
                        ("data.max_prompt_length", d.max_prompt_length)):
        if value < 1:
            p.append(f"{name}={value} must be at least 1.")
    return p


def _batch_and_loss(cfg: Config) -> list[str]:
    p: list[str] = []
    a, d, r = cfg.actor, cfg.data, cfg.rollout
    total = cfg.rollout_batch_size
    sizes = (
        min(d.train_batch_size, r.n, a.ppo_mini_batch_size) >= 1
    )  # else _names_and_sizes says so
    if sizes and total % a.ppo_mini_batch_size:
        p.append(
            f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} does not divide data.train_batch_size * rollout.n = "
            f"{d.train_batch_size} * {r.n} = {total} responses; pick a divisor of {total}."
        )
    longest = d.max_prompt_length + d.max_response_length
    for name, budget in (("actor.ppo_max_token_len_per_gpu", a.ppo_max_token_len_per_gpu),
                         ("actor.log_prob_max_token_len_per_gpu", a.log_prob_max_token_len_per_gpu)):
        if a.use_dynamic_bsz and budget is not None and budget < longest:
            p.append(f"{name}={budget} is below the longest possible sequence, data.max_prompt_length + "
                     f"data.max_response_length = {longest} tokens; raise it to at least {longest}.")
    if a.clip_ratio_c <= 1.0:
        p.append(
            f"actor.clip_ratio_c={a.clip_ratio_c} must be greater than 1 (dual clip bound); the usual value is 3.0."
        )
    for name, value in (("actor.clip_ratio", a.clip_ratio), ("actor.clip_ratio_low", cfg.clip_low),
                        ("actor.clip_ratio_high", cfg.clip_high)):
        if value < 0:
            p.append(f"{name}={value} must be non-negative.")
    if cfg.clip_low >= 1:
        p.append(f"actor.clip_ratio_low={cfg.clip_low} must be below 1 so that 1 - clip_ratio_low stays positive.")
    if a.loss_scale_factor is not None and a.loss_scale_factor <= 0:
        p.append(
            f"actor.loss_scale_factor={a.loss_scale_factor} must be positive (or null for the max response length)."
        )
    if r.temperature <= 0:
        p.append(f"rollout.temperature={r.temperature} must be positive; "
                 f"use rollout.val_temperature=0 for greedy validation.")
    if not 0 < r.top_p <= 1:
        p.append(f"rollout.top_p={r.top_p} must be in (0, 1].")
    if cfg.reward.num_workers < 0 or cfg.reward.timeout_s <= 0:
        p.append(f"reward.num_workers={cfg.reward.num_workers} must be >= 0 and reward.timeout_s="
                 f"{cfg.reward.timeout_s} positive.")
    if not 0 <= cfg.reward.max_error_frac <= 1:
        p.append(f"reward.max_error_frac={cfg.reward.max_error_frac} must be between 0 and 1.")
    return p


def _run_settings(cfg: Config) -> list[str]:
    p: list[str] = []
    a, d, alg, t = cfg.actor, cfg.data, cfg.algorithm, cfg.trainer
    if alg.use_kl_in_reward and a.use_kl_loss:
        p.append("algorithm.use_kl_in_reward and actor.use_kl_loss are both true; docs/design.md uses one or the "
                 "other, so set actor.use_kl_loss=false.")
    if t.total_steps is not None and t.total_steps < 1:
        p.append(f"trainer.total_steps={t.total_steps} must be at least 1 (or null to use trainer.total_epochs).")
    for name, value in (("trainer.save_freq", t.save_freq), ("trainer.test_freq", t.test_freq)):
        if value < 0:
            p.append(f"{name}={value} must be 0 (off) or positive.")
    lora = cfg.model.lora
    if lora.rank < 0:
        p.append(f"model.lora.rank={lora.rank} must be 0 (off) or positive.")
    if lora.rank > 0 and not 0 <= lora.dropout < 1:
        p.append(f"model.lora.dropout={lora.dropout} must be in [0, 1).")
    if lora.rank > 0 and cfg.model.ref_path:
        p.append("model.ref_path is set but with LoRA the reference is the base model with adapters disabled "
                 "(no second copy); remove model.ref_path or set model.lora.rank=0.")
    if lora.rank > 0 and not lora.target_modules:
        p.append("model.lora.target_modules is empty; name the modules to adapt, e.g. [q_proj, v_proj].")
    if t.nproc_per_node < 1:
        p.append(f"trainer.nproc_per_node={t.nproc_per_node} must be at least 1.")
    if t.nnodes < 1 or t.devices_per_node < 1:
        p.append(f"trainer.nnodes={t.nnodes} and trainer.devices_per_node={t.devices_per_node} must be at least 1.")
    for name in ("device_memory_gb", "host_memory_gb"):
        value = getattr(t, name)
        if value is not None and not value > 0:  # nan too
            p.append(f"trainer.{name}={value} must be a positive number of GiB, or null.")
    if t.dist_timeout_s <= 0:
        p.append(f"trainer.dist_timeout_s={t.dist_timeout_s} must be positive.")
    if t.max_ckpt_to_keep < 1:
        p.append(f"trainer.max_ckpt_to_keep={t.max_ckpt_to_keep} must be at least 1.")
    if not d.train_files and not d.task:
        p.append("data.train_files is empty and data.task is null; give a JSONL/Parquet file or a built-in task "
                 "such as data.task=repeat.")
    if d.train_files and d.task:
        p.append(f"data.train_files and data.task={d.task!r} are both set; set data.task=null to train on the files.")
    m = cfg.model
    if a.router_replay and m.gradient_checkpointing and m.enable_activation_offload:
        # activation offload checkpoints in torch's reentrant form, whose recomputation takes no context: its routers
        # would choose live where the forward replayed (model/router_replay.py `checkpoint_context`)
        p.append(f"actor.router_replay={a.router_replay} with model.gradient_checkpointing and "
                 f"model.enable_activation_offload would recompute each layer with live routes where its forward "
                 f"replayed others; set model.enable_activation_offload=false (or actor.router_replay=null).")
    return p


LOGGERS = ("console", "tensorboard", "wandb", "mlflow")


def logger_problems(cfg: Config) -> list[str]:
    import importlib.util

    p = []
    for name in cfg.trainer.logger:
        if name in ("wandb", "mlflow") and importlib.util.find_spec(name) is None:
            p.append(f"trainer.logger names {name}, which is not installed; pip install 'portagrpo[{name}]' (or "
                     f"drop {name} from trainer.logger).")
        elif name not in LOGGERS:
            p.append(f"trainer.logger names {name!r}, which is unknown; use {', '.join(LOGGERS)}.")
    return p


def dapo_problems(cfg: Config) -> list[str]:
    p = []
    ob, fg = cfg.reward.overlong_buffer, cfg.algorithm.filter_groups
    if ob.enable and not 0 < ob.len <= cfg.data.max_response_length:
        p.append(f"reward.overlong_buffer.len={ob.len} must be between 1 and data.max_response_length="
                 f"{cfg.data.max_response_length} (the last tokens before the limit that are penalised).")
    if fg.max_num_gen_batches < 0:
        p.append(f"algorithm.filter_groups.max_num_gen_batches={fg.max_num_gen_batches} must be 0 (no limit) or "
                 f"positive.")
    return p


def rollout_precision_problems(cfg: Config) -> list[str]:
    r = cfg.rollout
    if r.precision == "fp8":
        if r.engine != "vllm":
            return [f"rollout.precision=fp8 is vLLM's block-FP8 rollout (rollout.engine=vllm); with "
                    f"rollout.engine={r.engine} use bf16, or int8 on the CPU."]
        return []
    if r.precision == "int8" and r.engine != "hf":
        return [f"rollout.precision=int8 is PyTorch's dynamic int8 linear layers on a copy of the policy "
                f"(rollout.engine=hf, CPU); with rollout.engine={r.engine} use auto, fp32 or bf16."]
    if r.precision != "auto" and r.engine not in ("hf", "vllm"):
        return [f"rollout.precision={r.precision} is built for rollout.engine=hf or vllm; with rollout.engine="
                f"{r.engine} leave it at auto."]
    return []


def rollout_mode_problems(cfg: Config) -> list[str]:
    r = cfg.rollout
    if r.devices < 0:
        return [f"rollout.devices={r.devices} must be 0 or positive (sampler devices per node, one_step_off)."]
    p = []
    if r.mode == "one_step_off":  # the sampler process's own limits
        p += sampler_process_problems(cfg)
    return p


def rollout_expert_problems(cfg: Config) -> list[str]:
    """rollout.expert_parallel_size and rollout.data_parallel_size (vLLM's expert parallelism): applied or refused."""
    r = cfg.rollout
    ep, dp, tp = r.expert_parallel_size, r.data_parallel_size, r.tensor_model_parallel_size
    if ep == dp == 1 or min(ep, dp, tp) < 1:
        return []
    if r.engine != "vllm":
        key = "expert_parallel_size" if ep > 1 else "data_parallel_size"
        return [f"rollout.{key}={getattr(r, key)} splits a MoE policy's experts in vLLM's engines, and "
                f"rollout.engine={r.engine} has none; use rollout.engine=vllm, or rollout.{key}=1."]
    if ep == 1:
        return [f"rollout.data_parallel_size={dp} joins vLLM engines into one only for its expert parallelism (every "
                f"tensor-parallel group already runs an engine of its own); set rollout.expert_parallel_size="
                f"{tp * dp} (tensor x data parallel), or rollout.data_parallel_size=1."]
    if ep != tp * dp:
        return [f"rollout.expert_parallel_size={ep} must be rollout.tensor_model_parallel_size x "
                f"rollout.data_parallel_size = {tp} x {dp} = {tp * dp}: vLLM splits the experts over every rank of its "
                f"tensor- and data-parallel groups; set rollout.data_parallel_size={max(ep // tp, 1)}"
                + ("" if ep % tp == 0 else f" and an expert_parallel_size that is a multiple of {tp}") + "."]
    return []


def sampler_process_problems(cfg: Config) -> list[str]:
    """What each rank's sampler process (rollout.mode=one_step_off) is not built to hold."""
    r, p = cfg.rollout, []
    if r.engine not in ("hf", "vllm"):
        p.append(f"rollout.mode={r.mode} runs the hf engine in a sampler process of its own (or vLLM's), and "
                 f"portagrpo has not built it for rollout.engine={r.engine} (a limit of portagrpo, not of the "
                 f"{r.engine} engine); use rollout.mode=sync with rollout.engine={r.engine}, or rollout.engine=hf or "
                 f"vllm to overlap.")
    for key in ("tensor_model_parallel_size", "expert_parallel_size"):
        if r.engine == "vllm" and getattr(r, key) > 1:
            p.append(f"rollout.mode={r.mode} with rollout.{key}={getattr(r, key)} is not built: each rank's sampler "
                     f"process holds a whole vLLM engine of its own (a limit of portagrpo, not of vLLM); use "
                     f"rollout.{key}=1, or rollout.mode=sync.")
    return p


MT = "rollout.multi_turn"
TOOL_FORMATS = ("hermes",)
SANDBOX_LEVELS = ("auto", "namespaces", "process")


def code_problems(cfg: Config) -> list[str]:
    """rollout.code: the code generator's sandbox (its worker count's bound is the machine's, checked where the
    generator starts)."""
    c, f = cfg.rollout.code, "rollout.code"
    p = []
    if re.search(r"(^|[+\s])execution(\s*\*|\s*\+|$)", cfg.reward.function) and cfg.rollout.generator != "code":
        p.append(f"reward.function={cfg.reward.function!r} grades what each answer's program printed, which only "
                 f"rollout.generator=code runs; set rollout.generator=code, or choose another reward.")
    if c.sandbox not in SANDBOX_LEVELS:
        p.append(f"{f}.sandbox={c.sandbox!r} is unknown; use {', '.join(SANDBOX_LEVELS)}.")
    if c.timeout_s <= 0 or c.memory_mb < 16 or c.workers < 1 or c.max_output_bytes < 1:
        p.append(f"{f}.timeout_s={c.timeout_s} must be positive, memory_mb={c.memory_mb} at least 16, workers="
                 f"{c.workers} and max_output_bytes={c.max_output_bytes} at least 1.")
    return p


def multi_turn_problems(cfg: Config) -> list[str]:
    m = cfg.rollout.multi_turn
    p = []
    if m.max_assistant_turns < 1:
        p.append(f"{MT}.max_assistant_turns={m.max_assistant_turns} must be at least 1.")
    if m.max_tool_response_length < 1:
        p.append(f"{MT}.max_tool_response_length={m.max_tool_response_length} must be at least 1 (tokens).")
    if m.format not in TOOL_FORMATS:
        p.append(f"{MT}.format={m.format!r} is unknown; use {', '.join(TOOL_FORMATS)}.")
    if m.sandbox not in SANDBOX_LEVELS:
        p.append(f"{MT}.sandbox={m.sandbox!r} is unknown; use {', '.join(SANDBOX_LEVELS)}.")
    if m.tool_timeout_s <= 0 or m.tool_memory_mb < 16 or m.tool_workers < 1:
        p.append(f"{MT}.tool_timeout_s={m.tool_timeout_s} must be positive, tool_memory_mb={m.tool_memory_mb} at "
                 f"least 16 and tool_workers={m.tool_workers} at least 1.")
    from portagrpo.config.tool_file import tool_file_problems

    # tool_workers' bound is the machine's (agent/tools.py: tool_workers_problem): checked where the run starts, and
    # said by --dry-run, not here, so a recipe for a big node loads on a laptop
    if not m.enable:
        return p
    if cfg.actor.router_replay == "R3":  # a conversation's turns are several generates, not one route grid
        p.append(f"actor.router_replay=R3 replays the sampler's experts, which a multi-turn rollout does not carry "
                 f"yet; use actor.router_replay=R2 or null with {MT}.enable=true.")
    if not m.tool_config_path:
        p.append(f"{MT}.enable=true needs {MT}.tool_config_path, a YAML file that declares the tools.")
    elif Path(m.tool_config_path).exists():  # a missing one is missing_files' (a dry run lists it)
        p += tool_file_problems(m.tool_config_path)
    return p


def validate_world(cfg: Config, world_size: int) -> list[str]:
    """Batch divisions that depend on the number of data-parallel ranks."""
    k = cfg.trainer.fsdp_size
    if k == 0 or k < -1:
        return [f"trainer.fsdp_size={k} is not a group size; give -1 (every rank in one shard group) or a divisor of "
                f"the ranks."]
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp < 1 or world_size % sp:
        return [f"actor.ulysses_sequence_parallel_size={sp} must divide the {world_size} rank(s) (groups of that many "
                f"consecutive ranks split each micro-batch); give a divisor of {world_size}."]
    if sp > 1 and not cfg.model.use_remove_padding:
        return [f"actor.ulysses_sequence_parallel_size={sp} splits packed rows; set model.use_remove_padding=true."]
    r = cfg.rollout
    if r.engine == "vllm" and r.data_parallel_size > 1 and r.expert_parallel_size != world_size:
        tp = r.tensor_model_parallel_size
        return [f"rollout.data_parallel_size={r.data_parallel_size} on {world_size} rank(s): vLLM's data "
                f"parallelism under its external launcher makes the whole world one instance (data_parallel_rank = "
                f"RANK // tensor size, which must stay below data_parallel_size), so tensor x data parallel must be "
                f"every rank; set rollout.data_parallel_size={max(world_size // tp, 1)} and "
                f"rollout.expert_parallel_size={world_size}" + ("" if world_size % tp == 0 else
                                                                 f" with a tensor size that divides {world_size}")
                + "."]
    if world_size == 1:
        return []
    p = []
    if k > 0 and (world_size % k or cfg.trainer.parallel == "ddp"):
        p.append(f"trainer.fsdp_size={k} needs trainer.parallel=fsdp2 and must divide the {world_size} ranks (shard "
                 f"groups of k ranks, replicated across groups); give a divisor, or -1 for one group.")
    d, a = cfg.data, cfg.actor
    if d.train_batch_size % world_size:
        p.append(f"data.train_batch_size={d.train_batch_size} prompts cannot be split over {world_size} ranks; "
                 f"use a multiple of {world_size} (each rank keeps whole groups).")
    if a.ppo_mini_batch_size % world_size:
        p.append(f"actor.ppo_mini_batch_size={a.ppo_mini_batch_size} cannot be split over {world_size} ranks; "
                 f"use a multiple of {world_size}.")
    return p


def strategy_problems(cfg: Config, world_size: int, strategy: str) -> list[str]:
    """trainer.fsdp_size against the strategy the backend resolves trainer.parallel to (`strategy`: none, ddp or
    fsdp2): a shard group is applied or refused, never ignored. `train` and `portagrpo plan` ask the same."""
    p = expert_group_problems(cfg, world_size, strategy)
    k = cfg.trainer.fsdp_size
    if k <= 0 or k == world_size == 1:
        return p
    if world_size == 1:
        return [f"trainer.fsdp_size={k} asks for shard groups of {k} ranks, and this run has 1; use "
                f"trainer.fsdp_size=-1, or run on a multiple of {k} ranks."]
    if strategy not in ("fsdp2", "ep"):
        return [f"trainer.fsdp_size={k} sets FSDP2's shard groups, and trainer.parallel={cfg.trainer.parallel} runs "
                f"{strategy} here; set trainer.parallel=fsdp2, or trainer.fsdp_size=-1."]
    return p


def expert_group_problems(cfg: Config, world_size: int, strategy: str) -> list[str]:
    """trainer.ep_size against the world and the strategy: an expert-parallel group is applied or refused, never
    ignored."""
    e = cfg.trainer.ep_size
    if e == -1:
        return []
    if e < 1:
        return [f"trainer.ep_size={e} is not a group size; give -1 (every rank in one expert-parallel group) or a "
                f"divisor of the ranks."]
    if strategy != "ep" and e > 1:
        return [f"trainer.ep_size={e} splits the experts under trainer.parallel=ep, and this run takes {strategy}; "
                f"set trainer.parallel=ep, or trainer.ep_size=-1."]
    if world_size % e:
        return [f"trainer.ep_size={e} must divide the {world_size} ranks (groups of that many consecutive ranks "
                f"split the experts); give a divisor of {world_size}."]
    return []


def missing_files(cfg: Config) -> list[str]:
    p = []
    m = cfg.model
    sources = [("model.path", m.path, False), ("model.ref_path", m.ref_path, False),
               ("model.tokenizer_path" if m.tokenizer_path else "model.path", m.tokenizer_path or m.path, True)]
    for field, value, tokenizer in sources:
        problem = model_source_problem(value, field, tokenizer=tokenizer) if value else None
        if problem and problem not in p:
            p.append(problem)
    for name in ("train_files", "val_files"):
        for i, value in enumerate(getattr(cfg.data, name)):
            if Path(value).is_dir():
                p.append(f"data.{name}[{i}]={value!r} is a directory; give the path of a .jsonl or .parquet file.")
            elif not Path(value).is_file():
                p.append(f"data.{name}[{i}]={value!r} does not exist; give the path of a .jsonl or .parquet file.")
    tools = cfg.rollout.multi_turn.tool_config_path
    if cfg.rollout.multi_turn.enable and tools and not Path(tools).exists():
        p.append(f"{MT}.tool_config_path={tools!r} does not exist; give the path of a YAML tool file.")
    fn = cfg.reward.function
    if ":" in fn and fn.split(":", 1)[0].endswith(".py") and not Path(fn.split(":", 1)[0]).is_file():
        p.append(f"reward.function={fn!r}: the file {fn.split(':', 1)[0]!r} does not exist; "
                 f"use path/to/file.py:function_name.")
    return p
