"""What a run is made of, built from its config as typed parts: where it runs (`Runtime`), its data
and reward (`Data`), its models (`Models`), optimizer and schedule (`Optimization`), the rollout
engine and the objective. `build` makes them; nothing here trains. The experience maker, the
updater and the checkpointer each take the parts they use from these, by name.
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch

from portagrpo.algo.objective import Objective, Shaping
from portagrpo.algo.schedule import lr_multiplier
from portagrpo.backends import Backend, get_backend
from portagrpo.backends.dist import Collectives, init_collectives
from portagrpo.config import Config, ConfigError, strategy_problems, validate_world
from portagrpo.data.images import image_limits, shrink_notice
from portagrpo.data.records import (
    PromptLoader,
    PromptRecord,
    filter_long_prompts,
    load_records,
    task_records,
    truncate_long_prompts,
)
from portagrpo.fileio import atomic_path
from portagrpo.kernels import logprob_impl
from portagrpo.model.activation_offload import HostActivations, checkpoint_kwargs
from portagrpo.model.loading import (
    apply_lora,
    build_tiny_model,
    check_tiny_matches,
    load_model,
    load_tokenizer,
    seed_adapters,
)
from portagrpo.model.moe import configure_experts
from portagrpo.model.parallel import ParallelStrategy, make_strategy, sequence_parallel_group
from portagrpo.model.router_replay import RouterHooks, refuse_r3_engine
from portagrpo.model.scorer import AdaptersOff, ResponseScorer
from portagrpo.model.sharded_load import buffers_to, empty_model, materialize, missing_tensors, sharded_load_problem
from portagrpo.model.vision import (
    build_tiny_processor,
    build_tiny_vl_model,
    check_rows,
    freeze_vision_tower,
    is_vision_language,
    processor_for,
)
from portagrpo.model.vision_attention import set_vision_attention
from portagrpo.rewards.functions import RewardResolver
from portagrpo.rewards.pool import RewardPool
from portagrpo.rollout.engines import ROLLOUT_ENGINES, EngineInputs, RolloutEngine
from portagrpo.rollout.generators import generator_spec
from portagrpo.rollout.process import AheadSampler
from portagrpo.rollout.settings import EngineSettings
from portagrpo.tolerances import DTYPES
from portagrpo.train.layout import RunLayout, resolve_layout
from portagrpo.train.memory import PhaseMemory


@dataclass
class Runtime:
    """Where this process runs: the backend, its collectives, its device and the compute dtype."""

    backend: Backend
    comm: Collectives
    device: torch.device
    dtype: torch.dtype  # model.dtype: what the forward computes in
    memory: PhaseMemory = field(init=False)  # this rank's peak memory per phase (train/memory.py)

    def __post_init__(self) -> None:
        self.memory = PhaseMemory(self.backend)

    def phase(self, label: str):
        """A named stretch of the run (the backend's region) with its own peak memory: rollout, logprobs, update,
        push weights, load, checkpoint."""
        return self.memory.phase(label)

    @property
    def master_dtype(self) -> torch.dtype:
        """Weights and optimizer state: fp64 for the fp64 reference, else fp32 (bf16 is compute only)."""
        return torch.float64 if self.dtype == torch.float64 else torch.float32

    def autocast(self):
        return self.backend.autocast(self.dtype)


@dataclass
class Data:
    tokenizer: Any
    loader: PromptLoader
    val_records: list[PromptRecord]
    reward: RewardResolver
    reward_pool: RewardPool | None  # reward.num_workers > 0: scoring in worker processes
    processor: Any = None  # a vision-language policy's processor (its tokenizer is `tokenizer`); None: text only


@dataclass
class Models:
    policy: torch.nn.Module  # the Hugging Face model (with its LoRA adapter)
    scorer: torch.nn.Module  # the policy's scorer, wrapped by the parallel strategy
    ref: torch.nn.Module | None  # a separate reference model (KL without LoRA)
    ref_scorer: torch.nn.Module | None  # None: no KL anywhere
    strategy: ParallelStrategy  # how the scorers are parallelised
    kernel_name: str  # the log-prob kernel
    is_lora: bool


@dataclass
class Optimization:
    params: list[torch.nn.Parameter]
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    # how this run's AdamW steps (its `fused` and `foreach`): a loaded checkpoint's parameter groups carry the saving
    # run's, which another device may not have (`keep_step_form`)
    step_form: dict[str, Any] = field(default_factory=dict)


@dataclass
class Parts:
    data: Data
    models: Models
    optim: Optimization
    engine: RolloutEngine
    shaping: Shaping
    objective: Objective
    total_steps: int
    layout: RunLayout  # what the run decided before any device existed (train/layout.py), the plan's too
    sampler: AheadSampler | None = None  # a schedule that samples apart (one_step_off): rollout/process.py

    def close(self) -> None:
        if self.data.reward_pool is not None:
            self.data.reward_pool.close()
        if self.sampler is not None:
            self.sampler.close()


def make_runtime(cfg: Config, processes: int = 1) -> Runtime:
    """The backend, the process group (one process: none) and this rank's device, checked against the config.
    `processes`: per rank, with a sampler process of its own (the schedule's `apart`) 2."""
    backend = get_backend(cfg.trainer.device)
    alone = chosen_strategy(cfg, backend, 1) == "fsdp2"  # FSDP2 on one process: a group of one (model/parallel.py)
    comm = init_collectives(backend, cfg.trainer.dist_timeout_s, group_of_one=alone)
    try:
        problems = validate_world(cfg, comm.world_size)
        if problems:
            raise ConfigError(problems)
        dtype = DTYPES[cfg.model.dtype]
        if not backend.supports_dtype(dtype):
            raise ConfigError(
                [f"model.dtype={cfg.model.dtype} is not supported on --device {backend.name}; use fp32."]
            )
        set_threads(cfg.trainer.num_threads, comm, backend, processes=processes)
        backend.set_deterministic(cfg.trainer.deterministic)
        backend.seed(cfg.trainer.seed)
        return Runtime(backend, comm, backend.device(comm.env.local_rank), dtype)
    except BaseException:
        comm.close(abandon=True)  # a rank refused alone must not wait at a barrier for peers that went on
        raise


def chosen_strategy(cfg: Config, backend: Backend, world: int) -> str:
    """none, ddp or fsdp2: the backend's answer to trainer.parallel on `world` ranks (the run layout's)."""
    return resolve_layout(cfg, world, backend.parallel_strategy, apart=False).strategy


def set_threads(threads: int | None, comm: Collectives, backend: Backend, processes: int = 1) -> None:
    """`processes`: per rank, with its sampler process 2."""
    if threads is None and comm.world_size * processes > 1 and backend.device_type == "cpu":
        # Processes sharing the cores must not each start a thread per core (many-fold slowdown).
        threads = max(1, (os.cpu_count() or 1) // (comm.env.local_world_size * processes))
    if threads:
        torch.set_num_threads(threads)


def build(cfg: Config, runtime: Runtime, run_dir: Path, log: Callable[[str], None], apart: bool = False) -> Parts:
    """Every part of a run, in the order each needs the one before. `apart`: the run's schedule samples in a sampler
    process of its own (train/schedule.py), which is built here; the trainer's engine then only validates."""
    layout = resolve_layout(cfg, runtime.comm.world_size, runtime.backend.parallel_strategy, apart)
    chosen = layout.strategy
    problems = strategy_problems(cfg, runtime.comm.world_size, chosen)
    if problems:
        raise ConfigError(problems)
    strategy = make_strategy(chosen, runtime.comm, cfg.trainer.fsdp_size,
                             runtime.backend.spec.pinned_offload and cfg.actor.pin_offload, cfg.actor.stream_head_rows,
                             cfg.trainer.ep_size)
    data = build_data(cfg, log)
    try:
        models = build_models(cfg, runtime, strategy, layout, data.tokenizer, run_dir, log)
        total = total_steps(cfg, data.loader)
        trainable = [p for p in models.scorer.parameters() if p.requires_grad]
        optim = build_optimization(cfg, models, total, fused=runtime.backend.fused_adamw_for(trainable))
        engine = build_engine(cfg, runtime, models, data.tokenizer, run_dir, log if runtime.comm.is_main else None,
                              apart=apart)
        sampler = build_sampler_process(cfg, runtime, models, data.tokenizer, run_dir) if apart else None
    except BaseException:
        if data.reward_pool is not None:
            data.reward_pool.close()
        raise
    return Parts(data, models, optim, engine, shaping_from(cfg), objective_from(cfg), total, layout, sampler)


def total_steps(cfg: Config, loader: PromptLoader) -> int:
    t = cfg.trainer
    return t.total_steps if t.total_steps is not None else t.total_epochs * loader.batches_per_epoch


def build_data(cfg: Config, log: Callable[[str], None]) -> Data:
    processor = processor_for(cfg.model)
    field = "model.tokenizer_path" if cfg.model.tokenizer_path else "model.path"
    tokenizer = (processor.tokenizer if processor is not None
                 else load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, field))
    if cfg.data.task:
        train = task_records(cfg.data.task, cfg.data.train_size, cfg.trainer.seed)
        val = task_records(cfg.data.task, cfg.data.val_size, cfg.trainer.seed + 10_007)
    else:
        keys = dict(prompt_key=cfg.data.prompt_key, source_key=cfg.data.reward_fn_key, image_key=cfg.data.image_key,
                    max_image_pixels=cfg.data.max_image_pixels, processor=processor)
        train = load_records(cfg.data.train_files, **keys)
        val = load_records(cfg.data.val_files, **keys) if cfg.data.val_files else []
        shrunk = shrink_notice(train + val, image_limits(cfg.data.max_image_pixels, processor))
        if shrunk:
            log(shrunk)
    train, val = _fit_prompts(cfg, tokenizer, train, val, log)
    check_rows(processor, train + val)
    reward = RewardResolver(cfg.reward.function)
    reward.check_sources({r.data_source for r in train + val})
    pool = (RewardPool(cfg.reward.function, cfg.reward.num_workers, cfg.reward.timeout_s)
            if cfg.reward.num_workers > 0 else None)
    return Data(tokenizer, PromptLoader(train, cfg.data.train_batch_size, cfg.trainer.seed, cfg.data.shuffle), val,
                reward, pool, processor)


def _fit_prompts(cfg: Config, tokenizer, train: list[PromptRecord], val: list[PromptRecord],
                 log: Callable[[str], None]) -> tuple[list[PromptRecord], list[PromptRecord]]:
    """Prompts over data.max_prompt_length: dropped (data.filter_overlong_prompts) or cut (data.truncation),
    measured as the model sees them (a multi-turn run's chat prompts with their tools' schemas)."""
    d, tools = cfg.data, _tool_schemas(cfg)
    if d.filter_overlong_prompts:
        train, dropped = filter_long_prompts(tokenizer, train, d.max_prompt_length, tools)
        val, dropped_val = filter_long_prompts(tokenizer, val, d.max_prompt_length, tools)
        verb = "dropped"
    else:
        train, dropped = truncate_long_prompts(tokenizer, train, d.max_prompt_length, d.truncation, "train", tools)
        val, dropped_val = truncate_long_prompts(tokenizer, val, d.max_prompt_length, d.truncation, "val", tools)
        verb = f"cut ({d.truncation})"
    if dropped or dropped_val:
        log(f"{verb} {dropped} train and {dropped_val} val prompts longer than data.max_prompt_length="
            f"{d.max_prompt_length} tokens")
    return train, val


def _tool_schemas(cfg: Config) -> list[dict] | None:
    """The tools' schemas a multi-turn run renders its chat prompts with (rollout.multi_turn.tool_config_path)."""
    mt = cfg.rollout.multi_turn
    if not mt.enable:
        return None
    from portagrpo.config.tool_file import load_tool_config

    return [spec.schema for spec in load_tool_config(mt.tool_config_path).values()]


def build_models(cfg: Config, runtime: Runtime, strategy, layout: RunLayout, tokenizer, run_dir: Path,
                 log: Callable[[str], None] = lambda m: None) -> Models:
    kernel_name = runtime.backend.kernel_implementation(cfg.kernels.logprob)
    kernel = logprob_impl(kernel_name)
    attn = runtime.backend.attention_implementation(cfg.model.attn_implementation, runtime.dtype)
    policy_path, ref_path = _model_paths(cfg, runtime, tokenizer, run_dir)
    is_lora = cfg.model.lora.rank > 0
    policy, sharded = _language_model(cfg, runtime, strategy, policy_path, attn, runtime.master_dtype, log)
    _tower_attention(policy, cfg, runtime)
    if cfg.actor.freeze_vision_tower:
        freeze_vision_tower(policy)
    if is_lora:  # on an empty model too (peft adds its adapters on the meta device), which materialize fills
        policy = apply_lora(policy, cfg.model.lora).to(dtype=runtime.master_dtype)
        if not sharded:
            seed_adapters(policy.to(device=runtime.device), cfg.trainer.seed)
    offload_activations = cfg.model.enable_activation_offload
    # a MoE policy's router replay (refused where its routers cannot replay) and its backend's expert ops; its router
    # hooks are installed once, here (model/router_replay.py), before checkpointing learns to recompute with them
    configure_experts(policy, cfg.actor.router_replay, runtime.backend.spec.moe_experts)
    routers = RouterHooks.install(policy, runtime.backend.moe_topk())
    if cfg.model.gradient_checkpointing:
        policy.gradient_checkpointing_enable(gradient_checkpointing_kwargs=checkpoint_kwargs(
            offload_activations, None if routers is None else routers.checkpoint_context))
        if offload_activations:  # a reentrant checkpoint passes gradients only to inputs that ask for them (LoRA)
            policy.enable_input_require_grads()
    policy.config.use_cache = True
    activations = HostActivations(runtime.backend.spec.pinned_offload) if offload_activations else None
    packing = packing_settings(cfg, runtime, attn)  # model.use_remove_padding, actor.ulysses_sequence_parallel_size
    scorer = strategy.wrap(ResponseScorer(policy, kernel, activations, routers=routers, **packing), trainable=True,
                           compute_dtype=runtime.dtype, offload=cfg.actor.offload)
    if sharded:  # offloaded shards live in host memory
        materialize(scorer, runtime.device, policy_path, shards_on=_host_if(cfg.actor.offload),
                    adapter_seed=cfg.trainer.seed)
    ref = ref_scorer = None
    if layout.reference == "adapters_off":
        ref_scorer = AdaptersOff(scorer)  # the reference is the base model under the adapter
    elif layout.reference == "model":
        # forward-only: the compute dtype (model.dtype), never an fp32 master copy
        ref, ref_sharded = _language_model(cfg, runtime, strategy, ref_path, attn, runtime.dtype, log,
                                           "model.ref_path" if cfg.model.ref_path else "model.path")
        ref.eval().requires_grad_(False)
        configure_experts(ref, None, runtime.backend.spec.moe_experts)
        _tower_attention(ref, cfg, runtime)
        ref_routers = RouterHooks.install(ref, runtime.backend.moe_topk())  # the backend's top-k op, nothing replayed
        ref_scorer = strategy.wrap(ResponseScorer(ref, kernel, routers=ref_routers, **packing), trainable=False,
                                   compute_dtype=runtime.dtype, offload=cfg.actor.ref_offload)
        if ref_sharded:
            materialize(ref_scorer, runtime.device, ref_path, shards_on=_host_if(cfg.actor.ref_offload))
    return Models(policy, scorer, ref, ref_scorer, strategy, kernel_name, is_lora)


def packing_settings(cfg: Config, runtime: Runtime, attn: str) -> dict:
    """The scorers' packing: padding removed or not, the backend's variable-length attention, and this rank's
    sequence-parallel group (model/parallel.py), made once so the policy and the reference share it."""
    sp = sequence_parallel_group(runtime.comm, cfg.actor.ulysses_sequence_parallel_size)
    return {"remove_padding": cfg.model.use_remove_padding, "varlen": runtime.backend.varlen_attention(attn),
            "sequence_parallel": sp}


def _host_if(offload: bool) -> torch.device | None:
    """Where FSDP2 keeps an offloaded model's shards: host memory."""
    return torch.device("cpu") if offload else None


def _language_model(cfg: Config, runtime: Runtime, strategy, path, attn: str, dtype: torch.dtype,
                    log: Callable[[str], None], field_name: str = "model.path"):
    """(the model, whether it is built empty to be filled by shards after wrapping): FSDP2 (on one rank too) builds it
    on the meta device when its checkpoint allows (model/sharded_load.py), so no rank ever holds it whole; otherwise
    it is loaded whole onto this rank's device."""
    whole = (not cfg.model.sharded_load
             or sharded_load_problem(path, strategy=strategy.name, world_size=runtime.comm.world_size))
    if not whole:
        model = empty_model(path, attn, dtype)
        missing = missing_tensors(model, path)
        if not missing:
            buffers_to(model, runtime.device)
            return model, True
        log(f"{field_name}: loaded whole on every rank, not by shards: its checkpoint names tensors otherwise than "
            f"the model does ({missing[0]!r} is not there), a layout transformers converts while loading.")
    return load_model(path, attn, field_name).to(device=runtime.device, dtype=dtype), False


def _tower_attention(model, cfg: Config, runtime: Runtime) -> None:
    """A vision-language model's tower attends over its variable-length windows with what the backend answers for
    `model.attn_implementation` (backends/: `vision_attention_implementation`); asked only of such a model, so a
    backend without a windowed form never refuses a text policy."""
    if is_vision_language(model):
        set_vision_attention(model, runtime.backend.vision_attention_implementation(cfg.model.attn_implementation,
                                                                                    runtime.dtype))


def _model_paths(cfg: Config, runtime: Runtime, tokenizer, run_dir: Path) -> tuple[Path | str, Path | str]:
    """(policy, reference) checkpoints: model.path, or the run's own tiny initial model, written once."""
    if cfg.model.path:
        return cfg.model.path, cfg.model.ref_path or cfg.model.path
    init_dir = Path(run_dir) / "init_model"
    if runtime.comm.is_main and not (init_dir / "config.json").is_file():
        # written whole or not at all: a kill here must leave a run that can start again
        model = (build_tiny_vl_model(cfg.model.tiny, tokenizer, cfg.trainer.seed) if cfg.model.tiny.vision
                 else build_tiny_model(cfg.model, tokenizer, cfg.trainer.seed))
        with atomic_path(init_dir, directory=True, what="writing the initial model to") as tmp:
            model.save_pretrained(tmp, safe_serialization=True)
            tokenizer.save_pretrained(tmp)
            if cfg.model.tiny.vision:  # AutoProcessor loads the run's model directory
                build_tiny_processor(tokenizer).save_pretrained(tmp)
    runtime.comm.barrier()
    check_tiny_matches(cfg.model.tiny, init_dir)
    return init_dir, cfg.model.ref_path or init_dir


def build_optimization(cfg: Config, models: Models, total: int, fused: bool = False) -> Optimization:
    """AdamW over the trainable parameters, in its fused form where the backend says so for where they live
    (`Backend.fused_adamw_for`), and the learning-rate schedule."""
    a = cfg.actor
    params = [p for p in models.scorer.parameters() if p.requires_grad]
    optimizer = torch.optim.AdamW(params, lr=a.lr, betas=tuple(a.betas), weight_decay=a.weight_decay,
                                  **({"fused": True} if fused else {}))
    form = {k: optimizer.defaults[k] for k in STEP_FORM}
    schedule = functools.partial(lr_multiplier, warmup_steps=a.warmup_steps, total_steps=total, kind=a.lr_schedule)
    return Optimization(params, optimizer, torch.optim.lr_scheduler.LambdaLR(optimizer, schedule), form)


STEP_FORM = ("fused", "foreach")


def keep_step_form(optimizer: torch.optim.Optimizer, form: dict[str, Any]) -> None:
    """After `load_state_dict`, which takes every parameter group's settings from the checkpoint: the step form this
    run built (a CPU checkpoint's fused step on a device torch has no fused kernel for would fail there)."""
    for group in optimizer.param_groups:
        group.update(form)


def build_engine(cfg: Config, runtime: Runtime, models: Models, tokenizer, run_dir: Path,
                 log: Callable[[str], None] | None = None, apart: bool = False):
    """The trainer's engine. `apart`: a sampler process samples the steps (with vLLM or a copy of its own), and this
    engine, the training model's, validates."""
    name = "hf" if apart else runtime.backend.rollout_engine(cfg.rollout.engine)
    if cfg.rollout.tensor_model_parallel_size > 1 and name != "vllm" and log is not None:
        log(f"note: rollout.tensor_model_parallel_size={cfg.rollout.tensor_model_parallel_size} has no effect with "
            f"rollout.engine={name}, which samples on every rank with the training model")
    engine = ROLLOUT_ENGINES.get(name, field="rollout.engine")
    refuse_r3_engine(cfg.actor.router_replay, name)
    if name == "hf" and cfg.rollout.precision != "auto" and not apart:
        # the hf engine on a copy in that precision (with a sampler process the copy lives there, and this engine,
        # on the training model, only validates)
        from portagrpo.rollout.sampler_copy import SamplerCopy

        engine = SamplerCopy
    return engine.from_run(EngineInputs(
        settings=EngineSettings.from_config(cfg), scorer=models.scorer, policy=models.policy, tokenizer=tokenizer,
        autocast=runtime.autocast,
        generate_kwargs=models.strategy.generate_kwargs, backend=runtime.backend, rank=runtime.comm.rank,
        world_size=runtime.comm.world_size, init_model_dir=Path(run_dir) / "init_model", comm=runtime.comm))


def build_sampler_process(cfg: Config, runtime: Runtime, models: Models, tokenizer, run_dir: Path):
    """This rank's sampler process (a schedule that samples apart), holding a copy of the initial policy (the hf
    engine) or a vLLM engine built from it (rollout.engine=vllm), and the run's generator."""
    from portagrpo.paths import resolve_model_path
    from portagrpo.rollout.engines import stop_token_ids
    from portagrpo.rollout.process import SamplerProcess, SamplerSpec, vllm_engine_kwargs
    from portagrpo.rollout.sampler_copy import CopySource, int8_refusal

    backend, threads = runtime.backend, torch.get_num_threads()
    env = runtime.comm.env
    device = backend.sampler_process_device(env.local_rank, env.local_world_size, cfg.rollout.devices)
    settings = EngineSettings.from_config(cfg)
    eos = stop_token_ids(tokenizer, models.policy)
    init_model = Path(run_dir) / "init_model"
    generation = dict(generator=generator_spec(cfg), rank=runtime.comm.rank, local_world_size=env.local_world_size)
    if backend.rollout_engine(cfg.rollout.engine) == "vllm":
        path = str(resolve_model_path(settings.model_path) if settings.model_path else init_model)
        vllm = vllm_engine_kwargs(settings, backend, models.policy, eos, path, runtime.comm.rank)
        spec = SamplerSpec(path, "eager", tokenizer, settings.copy_precision, vllm["tied_embeddings"], threads, device,
                           backend.name, engine="vllm", vllm=vllm, **generation)
        return SamplerProcess(spec)
    precision = settings.copy_precision
    if precision == "int8" and not backend.supports_dynamic_quantization():
        raise int8_refusal(backend.name)
    source = CopySource.of(settings, backend, models.policy, init_model)
    spec = SamplerSpec(str(source.path), source.attn, tokenizer, precision, source.tied, threads, device, backend.name,
                       **generation)
    return SamplerProcess(spec)


def push_weights(engine, models: Models) -> None:
    """Engines that keep their own copy of the weights (vLLM) get the updated policy, with any
    LoRA adapter merged in; gathering a sharded policy is a collective on every rank."""
    if not engine.holds_weights:
        return
    if models.is_lora:
        models.policy.merge_adapter()
    try:  # one parameter gathered at a time, loaded bucket by bucket and freed (never the whole model at once)
        # an engine that takes per-expert names (vLLM): packed experts by the expert, each only to the ranks whose
        # engine keeps it (vLLM's expert parallelism)
        engine.update_weights(models.strategy.full_tensors(models.scorer, getattr(engine, "experts_wanted", None),
                                                           per_expert=getattr(engine, "takes_expert_names", False)))
    finally:
        if models.is_lora:
            models.policy.unmerge_adapter()


def shaping_from(cfg: Config) -> Shaping:
    alg = cfg.algorithm
    return Shaping(adv_estimator=alg.adv_estimator, norm_by_std=alg.norm_adv_by_std_in_grpo,
                   reward_clip=alg.reward_clip, shift=alg.reward_norm == "batch" or alg.reward_shift,
                   scale=alg.reward_norm == "batch" or alg.reward_scale,
                   kl_in_reward_coef=alg.kl_coef if alg.use_kl_in_reward else None,
                   whiten=alg.whiten_advantages, advantage_clip=alg.advantage_clip)


def objective_from(cfg: Config) -> Objective:
    a = cfg.actor
    return Objective(clip_low=cfg.clip_low, clip_high=cfg.clip_high, clip_c=a.clip_ratio_c,
                     loss_agg_mode=a.loss_agg_mode, loss_scale_factor=cfg.loss_scale_factor,
                     kl_loss_type=a.kl_loss_type if a.use_kl_loss else None, kl_loss_coef=a.kl_loss_coef,
                     entropy_coeff=a.entropy_coeff)
