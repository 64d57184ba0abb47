"""`portagrpo plan`: the memory plan of a run before it starts (portagrpo/model/memory_plan.py has the model).

    portagrpo plan --config C [overrides] [--device D] [--nodes N --devices-per-node D --device-memory-gb M
                   --host-memory-gb H] [--json F]

The model is read from its config.json alone (a directory without weights is enough); where model.path has none
on this machine, the shape of a well-known model of the same name shipped with portagrpo (tools/model_shapes/) is
used, and the plan says so. The cluster comes from the flags, else from the config (trainer.nnodes,
trainer.devices_per_node or trainer.nproc_per_node, trainer.device_memory_gb, trainer.host_memory_gb).

It is as strict as `train`: a layout `train` refuses (batch divisions, shard groups, sequence-parallel groups) is
refused here with the same sentence, from the same rule; nonsense cluster numbers and a config.json transformers
cannot read are one sentence; `--json` writes a new file or replaces an earlier plan report, never another file.
"""
from __future__ import annotations

import argparse
import json
import math
from dataclasses import replace
from pathlib import Path
from typing import Any

from portagrpo.errors import UserError
from portagrpo.model.memory_plan import DTYPE_BYTES, GIB, Cluster, ModelShape, Plan, RunShape, plan

SHAPES = Path(__file__).resolve().parent / "model_shapes"


def shipped_shape_names() -> list[str]:
    return sorted(p.stem for p in SHAPES.glob("*.json"))


def _config_source(cfg) -> tuple[Any, str]:
    """(a transformers config, where it came from) of the run's policy."""
    from transformers import AutoConfig

    path = cfg.model.path
    if path is None:
        return None, "the built-in tiny model (model.tiny)"
    local = Path(path)
    if (local / "config.json").is_file():
        return _read_config(local / "config.json"), f"{local / 'config.json'}"
    shipped = SHAPES / f"{local.name}.json"
    if shipped.is_file():
        data = json.loads(shipped.read_text())
        data.pop("_comment", None)
        return AutoConfig.for_model(data.pop("model_type"), **data), \
            f"the shipped shape of {local.name} ({path} has no config.json here)"
    raise UserError(f"model.path={path!r} has no config.json on this machine and {local.name!r} is not a shape "
                    f"portagrpo ships ({', '.join(shipped_shape_names())}); copy the model's config.json (no weights "
                    f"needed) into {path}, or plan on a machine that has it.")


def _read_config(path: Path):
    """A model's config.json as transformers reads it, or one sentence naming the file and what is wrong."""
    from transformers import AutoConfig

    from portagrpo.fileio import shorten

    try:
        data = json.loads(path.read_text())
    except (OSError, UnicodeDecodeError, ValueError) as err:
        raise UserError(f"{path} is not a JSON file ({shorten(str(err))}); give model.path a model directory whose "
                        f"config.json transformers wrote.") from None
    if not isinstance(data, dict):
        raise UserError(f"{path} holds a JSON {type(data).__name__}, not an object of model settings; give "
                        f"model.path a model directory whose config.json transformers wrote.")
    text = data.get("text_config") if isinstance(data.get("text_config"), dict) else data
    for name in SHAPE_FIELDS:  # before transformers, which may divide by them while it builds the config
        if name in text:
            _check_field(name, text[name], str(path))
    try:
        return AutoConfig.from_pretrained(str(path.parent), local_files_only=True)
    except Exception as err:  # noqa: BLE001 - transformers' many ways of refusing a config: one sentence here
        said = shorten(" ".join(str(err).split()), 200)
        raise UserError(f"{path}: transformers cannot read it ({type(err).__name__}: {said}); check "
                        f"its model_type and the types of its fields.") from None


SHAPE_FIELDS = ("hidden_size", "num_attention_heads", "num_hidden_layers", "vocab_size")


def _check_field(name: str, value, source: str) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise UserError(f"{source}: {name}={value!r} must be a positive integer; fix the model's config.json.")


def _check_text_config(text, source: str) -> None:
    for name in SHAPE_FIELDS:
        _check_field(name, getattr(text, name, None), source)


def _empty(config):
    """The model on the meta device, as training builds it (the vision-language class for a config with a vision
    tower)."""
    import torch
    from transformers import AutoModelForCausalLM

    if "vision_config" in config.to_dict():
        from transformers import AutoModelForImageTextToText as auto
    else:
        auto = AutoModelForCausalLM
    with torch.device("meta"):
        return auto.from_config(config)


def _tiny_model(cfg):
    from portagrpo.model.loading import build_tiny_model, load_tokenizer
    from portagrpo.model.vision import build_tiny_vl_model

    tokenizer = load_tokenizer(cfg.model.tokenizer_path or cfg.model.path, "model.path")
    if cfg.model.tiny.vision:
        return build_tiny_vl_model(cfg.model.tiny, tokenizer, cfg.trainer.seed)
    return build_tiny_model(cfg.model, tokenizer, cfg.trainer.seed)


def model_shape(cfg) -> tuple[ModelShape, Any, str]:
    """(the shape, the empty model, where its config came from)."""
    from portagrpo.model.loading import decoder_of
    from portagrpo.model.vision import is_vision_language, vision_blocks, vision_tower

    config, source = _config_source(cfg)
    if config is not None:
        _check_text_config(config.get_text_config(), source)
        try:
            model = _empty(config)
        except Exception as err:  # noqa: BLE001 - a field of the wrong type or size: one sentence, not a traceback
            said = " ".join(str(err).split())[:200]
            raise UserError(f"{source}: transformers cannot build the model it describes ({type(err).__name__}: "
                            f"{said}); check the types and sizes of its fields.") from None
    else:
        model = _tiny_model(cfg)
    params = sum(p.numel() for p in model.parameters())  # a tied tensor once
    units = [*vision_blocks(model), *getattr(decoder_of(model), "layers", [])]
    unit_sizes = [sum(p.numel() for p in u.parameters()) for u in units]
    embed, lm_head = model.get_input_embeddings(), model.get_output_embeddings()
    untied = embed is not None and lm_head is not None and lm_head.weight is not embed.weight
    head = lm_head.weight.numel() if untied else 0  # model/parallel.py split_root: the head and embedding as units
    vision = sum(p.numel() for p in vision_tower(model).parameters()) if is_vision_language(model) else 0
    text = model.config.get_text_config()
    heads = text.num_attention_heads
    head_dim = getattr(text, "head_dim", None) or text.hidden_size // heads
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith(".experts"))
    if experts:
        shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0)
        mlp = top_k * int(text.moe_intermediate_size) + shared
        active = params - expert_params + expert_params * top_k // experts
    else:
        mlp, active = int(text.intermediate_size), params
    layers = text.num_hidden_layers
    vc = getattr(model.config, "vision_config", None) if vision else None
    vision_fields = dict(vision_hidden=vc.hidden_size, vision_mlp=vc.intermediate_size, vision_depth=vc.depth,
                         vision_merge=vc.spatial_merge_size ** 2,
                         vision_patch=_patch_values(vc)) if vc is not None else {}
    shape = ModelShape(
        name=Path(cfg.model.path).name if cfg.model.path else "tiny", params=params,
        unit_params=max(unit_sizes, default=0), vision_params=vision,
        root_params=params - sum(unit_sizes) - (head + embed.weight.numel() if untied else 0), head_params=head,
        largest_tensor=max(p.numel() for p in model.parameters()),
        layers=layers, hidden=text.hidden_size, mlp_width=mlp, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=text.vocab_size,
        experts=experts, experts_per_token=top_k, active_params=active, **vision_fields)
    return shape, model, source


def _patch_values(vision_config) -> int:
    """Pixel values in one patch of a Qwen2-VL-style tower (its patch embedding's input width)."""
    channels = getattr(vision_config, "in_chans", None) or getattr(vision_config, "in_channels", 3)
    return int(channels * vision_config.temporal_patch_size * vision_config.patch_size ** 2)


def _lora_params(model, lora) -> int:
    """Parameters LoRA adds (and trains): rank x (in + out) for every linear layer its target modules name."""
    import torch

    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in set(lora.target_modules):
            total += lora.rank * (module.in_features + module.out_features)
    return total


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
        trainable = _lora_params(model, cfg.model.lora)
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
        strategy=layout.strategy, shard_group=layout.shard_group if layout.strategy == "fsdp2" else world,
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
        attention_keeps_scores=attention == "eager" or (attention == "sdpa" and spec.attention_saves_scores),
        sequence_parallel=sp, runtime_reserve=spec.runtime_reserve_gb * GIB,
        image_tokens=d.max_prompt_length if shape.vision_depth else 0, prompts=d.train_batch_size,
        routes=(cfg.rollout_batch_size * seq * shape.layers * shape.experts_per_token * 2
                if shape.is_moe and layout.routes else 0.0),
        fused_adamw=spec.fused_adamw, token_budget=a.use_dynamic_bsz,
        pinned_offload=spec.pinned_offload and a.pin_offload, pinned_activations=spec.pinned_offload,
        sampler_apart=layout.engine_apart,
        sampler_param_bytes=SAMPLER_BYTES.get(r.precision, DTYPE_BYTES[cfg.model.dtype]))


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
    where = (f"peak {p.peak.total / GIB:.1f} GiB in {p.peak.name} per device of trainer.device_memory_gb="
             f"{c.device_memory_gb:g}{_usable(c)}" if not p.fits_device else
             f"{sum(p.host_per_node.values()) / GIB:.0f} GiB of host memory per node of trainer.host_memory_gb="
             f"{c.host_memory_gb:g}")
    fix = p.advice[0] if p.advice else "plan for a larger cluster"
    return (f"the memory plan does not fit ({where}); {fix} (portagrpo plan lists what each phase holds; "
            f"trainer.device_memory_gb=null skips the plan).")


def _usable(c: Cluster) -> str:
    return f" ({c.capacity / GIB:.1f} usable)" if c.usable_fraction != 1.0 else ""


def describe(p: Plan, source: str) -> list[str]:
    """The plan as lines of text: the model, each phase's per-rank peak and what it holds, host memory, the verdict."""
    m, c, r = p.model, p.cluster, p.run
    moe = (f", MoE {m.experts} experts (top {m.experts_per_token}): {m.active_params / 1e9:.2f}B active"
           if m.is_moe else "")
    lines = [f"memory plan: {m.name}, {m.params / 1e9:.2f}B parameters{moe} (shape from {source})",
             f"  cluster: {c.nodes} node(s) x {c.devices_per_node} device(s) of {c.device_memory_gb:g} GiB"
             f"{_usable(c)}, {c.host_memory_gb:g} GiB host memory per node; {r.strategy}"
             + (f" (shard groups of {r.shard_group})" if r.strategy == "fsdp2" else "")
             + f"; rollout engine {r.engine}"
             + ("; each rank's sampler process on a device of its own (rollout.mode=one_step_off, the phase "
                "'sampler')" if r.sampler_apart else ""),
             "  per device, each phase's peak (GiB):"]
    for phase in p.phases:
        held = ", ".join(f"{k} {v / GIB:.2f}" for k, v in phase.items.items() if v > 0)
        lines.append(f"    {phase.name:<10} {phase.total / GIB:8.2f}   {held}")
    other = replace(r, gradient_checkpointing=not r.gradient_checkpointing)
    update_other = next(ph.total for ph in plan(m, c, other).phases if ph.name == "update")
    update_now = next(ph.total for ph in p.phases if ph.name == "update")
    on, off = (update_now, update_other) if r.gradient_checkpointing else (update_other, update_now)
    lines.append(f"  update with gradient checkpointing: {on / GIB:.2f} GiB; without: {off / GIB:.2f} GiB "
                 f"(model.gradient_checkpointing={str(r.gradient_checkpointing).lower()} here)")
    host = sum(p.host_per_node.values())
    lines.append(f"  host memory per node: {host / GIB:.1f} GiB ("
                 + ", ".join(f"{k} {v / GIB:.1f}" for k, v in p.host_per_node.items() if v > 0) + ")")
    if p.pinned_per_node:
        lines.append(f"  of which page-locked: {p.pinned_per_node / GIB:.1f} GiB per node (actor.pin_offload=false "
                     f"keeps the offloaded shards pageable)")
    verdict = "fits" if p.fits else "does NOT fit"
    lines.append(f"  {verdict}: peak {p.peak.total / GIB:.2f} GiB in {p.peak.name} of {c.capacity / GIB:.1f} usable "
                 f"GiB per device; host {host / GIB:.1f} of {c.host_memory_gb:g} GiB per node")
    for advice in p.advice:
        lines.append(f"  would fit with: {advice}")
    return lines


def add_parser(sub) -> None:
    p = sub.add_parser("plan", help="the memory plan of a run: each device's peak per phase, whether it fits")
    p.add_argument("--config", help="YAML recipe (see configs/)")
    p.add_argument("--device", help="the device kind to plan for, as `train --device` takes it (default "
                   "trainer.device; auto plans for cuda)")
    p.add_argument("--nodes", type=int, help="nodes (default trainer.nnodes)")
    p.add_argument("--devices-per-node", type=int, help="devices per node (default trainer.devices_per_node, or "
                   "trainer.nproc_per_node on one node)")
    p.add_argument("--device-memory-gb", type=float, help="memory of one device in GiB (default "
                   "trainer.device_memory_gb)")
    p.add_argument("--host-memory-gb", type=float, help="host memory of one node in GiB (default "
                   "trainer.host_memory_gb, else 1024)")
    p.add_argument("--json", help="write the plan as JSON to this file")
    p.add_argument("overrides", nargs="*", help="key=value overrides with dotted keys")


def cmd_plan(args) -> int:
    from portagrpo.config import load_config
    from portagrpo.fileio import check_report_destination, write_report

    if args.json:
        check_report_destination(args.json, "plan --json", "plan")
    notices: list[str] = []
    overrides = list(args.overrides) + ([f"trainer.device={args.device}"] if args.device else [])
    cfg = load_config(args.config, overrides, check_files=False, notices=notices)
    for line in notices:
        print(f"portagrpo: {line}")
    p, source = plan_config(cfg, args)
    for line in describe(p, source):
        print(line)
    if args.json:
        write_report(args.json, {**p.as_json(), "shape_source": source}, "plan")
    return 0 if p.fits else 1
