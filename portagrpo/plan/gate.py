"""The gate before a run starts: the run's memory plan on its cluster (the layout `train` resolves, train/layout.py,
and the model's shape), as strict as `train` (a layout `train` refuses is refused here with the same sentence, from
the same rule; nonsense cluster numbers are one sentence), and the one sentence that stops a run whose plan does not
fit. `portagrpo plan` (tools/plan.py) prints it; `train` and `--dry-run` (cli.py) stop on it."""
from __future__ import annotations

import argparse
import math

from portagrpo.errors import UserError
from portagrpo.plan.memory import DTYPE_BYTES, GIB, Cluster, ModelShape, Plan, RunShape, plan
from portagrpo.plan.shapes import lora_params, model_shape


def cluster_of(cfg, args: argparse.Namespace | None = None) -> Cluster:
    """The cluster from the flags, else from the config; each number checked in one sentence naming where it came
    from."""
    t = cfg.trainer
    fields = {
        "nodes": ("--nodes", "trainer.nnodes", t.nnodes),
        "devices_per_node": ("--devices-per-node", "trainer.devices_per_node" if t.nnodes > 1
                             else "trainer.nproc_per_node", t.devices_per_node if t.nnodes > 1 else t.nproc_per_node),
        "device_memory_gb": ("--device-memory-gb", "trainer.device_memory_gb", t.device_memory_gb),
        "host_memory_gb": ("--host-memory-gb", "trainer.host_memory_gb", t.host_memory_gb),
    }
    values = {}
    for name, (flag, key, default) in fields.items():
        given = getattr(args, name, None)
        value, where = (default, key) if given is None else (given, flag)
        if value is None and name == "host_memory_gb":
            value = 1024.0
        elif value is None:
            raise UserError("the plan needs the memory of one device: give --device-memory-gb (e.g. 80 for an H100, "
                            "64 for an Ascend 910B), or set trainer.device_memory_gb in the config.")
        elif name.endswith("_gb") and not (isinstance(value, (int, float)) and math.isfinite(value) and value > 0):
            raise UserError(f"{where} {value} must be a positive, finite number of GiB (80 for an H100, 64 for an "
                            f"Ascend 910B).")
        elif not name.endswith("_gb") and not (isinstance(value, int) and value >= 1):
            raise UserError(f"{where} {value} must be a whole number of at least 1.")
        values[name] = value
    from portagrpo.backends import backend_spec

    usable = backend_spec(_device(cfg)).usable_memory_fraction  # `plan --device` is applied as trainer.device
    return Cluster(nodes=values["nodes"], devices_per_node=values["devices_per_node"],
                   device_memory_gb=float(values["device_memory_gb"]),
                   host_memory_gb=float(values["host_memory_gb"]), usable_fraction=usable)


def strategy_of(cfg, world: int, device: str | None = None) -> str:
    """The training strategy `train` would take on `world` ranks of `device` (default trainer.device, auto planned
    as cuda): the run layout's (train/layout.py), from the backend row's answer to trainer.parallel."""
    return layout_of(cfg, world, device).strategy


def layout_of(cfg, world: int, device: str | None = None):
    """The run layout `train` resolves on `world` ranks of `device` (train/layout.py), without the device."""
    from portagrpo.backends import unstarted_backend
    from portagrpo.train.layout import resolve_layout
    from portagrpo.train.schedule import schedule_of

    return resolve_layout(cfg, world, unstarted_backend(device or _device(cfg)).parallel_strategy,
                          apart=schedule_of(cfg.rollout.mode).apart)


def _device(cfg) -> str:
    return cfg.trainer.device if cfg.trainer.device not in ("auto", None) else "cuda"


def layout_problems(cfg, world: int, shape: ModelShape, per_node: int | None = None) -> list[str]:
    """What `train` would refuse about this layout on `world` ranks, in its own sentences (the same rules)."""
    from portagrpo.config import strategy_problems, validate_world
    from portagrpo.model.ulysses import sequence_parallel_problem

    problems = validate_world(cfg, world)
    if problems:
        return problems
    problems = strategy_problems(cfg, world, strategy_of(cfg, world))
    per_node = per_node or world
    sp = cfg.actor.ulysses_sequence_parallel_size
    if sp > 1:
        problem = sequence_parallel_problem(sp, shape.heads, shape.kv_heads, shape.is_moe)
        problems += [problem] if problem else []
    problem = engine_layout_problem(cfg, world, per_node, shape)
    return problems + ([problem] if problem else [])


def engine_layout_problem(cfg, world: int, per_node: int, shape: ModelShape) -> str | None:
    """vLLM's tensor-parallel layout as the engine would refuse it at build (rollout/vllm_parallel.py `tp_layout`:
    a group within one node, dividing the ranks and the heads), with the largest size it takes here."""
    from portagrpo.rollout.vllm_parallel import tp_layout

    size = cfg.rollout.tensor_model_parallel_size
    if cfg.rollout.engine != "vllm" or size <= 1:
        return None
    try:
        tp_layout(size, 0, world, per_node, shape.heads, shape.kv_heads)
    except UserError as err:
        fits = [t for t in range(1, per_node + 1) if _tp_fits(t, world, per_node, shape)]
        return (f"{err} The largest rollout.tensor_model_parallel_size vLLM takes here is {max(fits)} (vLLM does not "
                f"span a tensor-parallel group over nodes in portagrpo's colocated engine).")
    return None


def _tp_fits(size: int, world: int, per_node: int, shape: ModelShape) -> bool:
    from portagrpo.rollout.vllm_parallel import tp_layout

    try:
        tp_layout(size, 0, world, per_node, shape.heads, shape.kv_heads)
    except UserError:
        return False
    return True


SAMPLER_BYTES = {"fp32": 4, "bf16": 2, "int8": 1, "fp8": 1}  # a sampler copy's bytes per parameter (rollout.precision)


def run_shape(cfg, cluster: Cluster, shape: ModelShape, model) -> RunShape:
    from portagrpo.backends import backend_spec

    world = cluster.world
    spec = backend_spec(_device(cfg))
    layout = layout_of(cfg, world)  # the decisions `train` makes, made once (train/layout.py)
    a, d, r = cfg.actor, cfg.data, cfg.rollout
    if layout.lora:
        trainable = lora_params(model, cfg.model.lora)
    else:
        trainable = shape.params - (shape.vision_params if layout.frozen_vision else 0)
    seq = d.max_prompt_length + d.max_response_length
    sp, dp, b = layout.sequence_parallel, layout.data_parallel, layout.batches
    mb, lp_mb = b.update_micro_batch, b.scoring_micro_batch  # scoring: each rank's own rows (an SP group's union)
    per_rank = max(a.ppo_mini_batch_size // dp, 1)
    if b.update_token_budget is not None:  # an update micro-batch holds its group's budget; a scoring one sp ranks'
        update_tokens, scoring_tokens = b.update_token_budget, b.scoring_token_budget * sp
        update_rows, scoring_rows = max(update_tokens // seq, 1), max(scoring_tokens // seq, 1)
    else:
        update_rows, scoring_rows = mb, lp_mb * sp
        update_tokens, scoring_tokens = mb * seq, lp_mb * sp * seq
    attention = spec.default_attention if cfg.model.attn_implementation == "auto" else cfg.model.attn_implementation
    return RunShape(
        strategy=layout.strategy, shard_group=layout.shard_group if layout.strategy in ("fsdp2", "ep") else world,
        ep=(cfg.trainer.ep_size if cfg.trainer.ep_size > 0 else world) if layout.strategy == "ep" else 1, world=world,
        master_bytes=DTYPE_BYTES[layout.master_dtype], compute_bytes=DTYPE_BYTES[layout.compute_dtype],
        trainable_params=trainable, has_ref=layout.reference == "model",
        offload=a.offload, ref_offload=a.ref_offload, no_sync=a.use_no_sync_for_gradient_accumulation,
        accumulation=max(per_rank // max(mb, 1), 1), update_tokens=update_tokens, update_rows=update_rows,
        scoring_tokens=scoring_tokens, scoring_rows=scoring_rows, seq_len=seq,
        gradient_checkpointing=cfg.model.gradient_checkpointing,
        activation_offload=cfg.model.enable_activation_offload,
        engine=layout.engine, rollout_rows=max(cfg.rollout_batch_size // world, 1),
        vllm_fraction=r.vllm_gpu_memory_utilization, vllm_sleeps=spec.vllm_sleep_mode,
        tensor_parallel=r.tensor_model_parallel_size,
        vllm_ep=r.expert_parallel_size if layout.engine == "vllm" else 1, vllm_ep_allowed=spec.vllm_expert_parallel,
        attention_keeps_scores=attention == "eager" or (attention == "sdpa" and spec.attention_saves_scores),
        sequence_parallel=sp, runtime_reserve=spec.runtime_reserve_gb * GIB,
        image_tokens=d.max_prompt_length if shape.vision_depth else 0, prompts=d.train_batch_size,
        routes=(cfg.rollout_batch_size * seq * shape.layers * shape.experts_per_token * 2
                if shape.is_moe and layout.routes else 0.0),
        fused_adamw=spec.fused_adamw, token_budget=a.use_dynamic_bsz,
        pinned_offload=spec.pinned_offload and a.pin_offload, pinned_activations=spec.pinned_offload,
        sampler_apart=layout.engine_apart,
        sampler_param_bytes=SAMPLER_BYTES.get(r.precision, DTYPE_BYTES[cfg.model.dtype]),
        head_streams=a.stream_head_rows and not a.offload and not (
            layout.lora and any(t.rsplit(".", 1)[-1] == "lm_head" for t in cfg.model.lora.target_modules)),
        embedding_streams=a.stream_head_rows and not a.offload)


def plan_config(cfg, args: argparse.Namespace | None = None) -> tuple[Plan, str]:
    """The plan of `cfg` on its cluster (or the one `args` gives), and where the model's shape came from."""
    from portagrpo.config import ConfigError

    cluster = cluster_of(cfg, args)
    shape, model, source = model_shape(cfg)
    problems = layout_problems(cfg, cluster.world, shape, cluster.devices_per_node)
    if problems:
        raise ConfigError(problems)
    return plan(shape, cluster, run_shape(cfg, cluster, shape, model)), source


def refusal(p: Plan) -> str | None:
    """One sentence for a run whose plan does not fit its cluster (None when it fits)."""
    if p.fits:
        return None
    c = p.cluster
    where = (f"vLLM's weights, {p.vllm_weights / GIB:.0f} GiB a device, exceed its rollout.vllm_gpu_memory_utilization="
             f"{p.run.vllm_fraction:g} share of {c.capacity / GIB:.1f} usable GiB" if p.vllm_short else
             f"peak {p.peak.total / GIB:.1f} GiB in {p.peak.name} per device of trainer.device_memory_gb="
             f"{c.device_memory_gb:g}{usable(c)}" if not p.fits_device else
             f"{sum(p.host_per_node.values()) / GIB:.0f} GiB of host memory per node of trainer.host_memory_gb="
             f"{c.host_memory_gb:g}")
    fix = p.advice[0] if p.advice else "plan for a larger cluster"
    return (f"the memory plan does not fit ({where}); {fix} (portagrpo plan lists what each phase holds; "
            f"trainer.device_memory_gb=null skips the plan).")


def usable(c: Cluster) -> str:
    return f" ({c.capacity / GIB:.1f} usable)" if c.usable_fraction != 1.0 else ""
