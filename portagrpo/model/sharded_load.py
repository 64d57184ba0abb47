"""A model that never exists whole on any rank: built on the meta device, sharded by FSDP2, then each rank reads only
its own rows of each tensor from the checkpoint's safetensors files.

Today's simple path (model/loading.py) loads the whole model in fp32 on every rank's host and device before FSDP2
shards it: 4 bytes a parameter on every device at load (123 GiB for 32B). Here, per rank:
- the model is made with its parameters on the meta device (no memory; its buffers, such as rotary tables, real);
- FSDP2 shards it (`strategy.wrap`), still without memory;
- `to_empty` gives each rank storage for its shards alone (4 bytes / world size a parameter);
- each parameter's shard is read from the checkpoint (safetensors, memory-mapped) by its global rows, one tensor at
  a time: a rank's host holds at most one shard of one tensor beyond what it keeps.
Which runs take it: FSDP2 on several ranks, a Hugging Face directory with safetensors weights whose tensor names are
the model's own, or a mixture-of-experts checkpoint in the hub's per-expert layout (`experts.<e>.gate_proj.weight`,
`up_proj`, `down_proj`: what transformers 5 saves and the hub publishes, where the model in memory packs them as
`experts.gate_up_proj` [E, 2I, H] and `experts.down_proj` [E, H, I]; FSDP2 splits those over experts, so a rank reads
only its experts' tensors), or a vision-language checkpoint under Qwen2.5-VL's names (`model.*`, `visual.*` for the
model's `model.language_model.*`, `model.visual.*`); with LoRA too (peft wraps the empty model, its adapters take
seeded initial values, `loading.adapter_values`, on either path). Everything else loads whole, as before
(`model.sharded_load`, docs/config.md).
"""
from __future__ import annotations

import contextlib
import json
from pathlib import Path
from typing import Iterator

import torch

from portagrpo.errors import UserError
from portagrpo.model.loading import adapter_values
from portagrpo.paths import resolve_model_path

MIN_TORCH = (2, 8)  # FSDP2's meta-device build with to_empty as tested here; older torch loads whole, as before
INDEX = "model.safetensors.index.json"
SINGLE = "model.safetensors"


def weight_files(path: str | Path) -> dict[str, Path] | None:
    """Tensor name -> the safetensors file that holds it, for a Hugging Face directory; None where there is none
    (a GGUF file, .bin weights)."""
    where = resolve_model_path(path)
    if where.is_file():
        return None
    if (where / INDEX).is_file():
        weight_map = json.loads((where / INDEX).read_text())["weight_map"]
        return {name: where / file for name, file in weight_map.items()}
    if (where / SINGLE).is_file():
        from safetensors import safe_open

        with safe_open(str(where / SINGLE), framework="pt") as f:
            return {name: where / SINGLE for name in f.keys()}
    return None


def sharded_load_problem(path: str | Path, *, strategy: str, world_size: int) -> str | None:
    """Why a model loads whole instead (None: it loads by shards)."""
    if strategy not in ("fsdp2", "ep"):
        return "only FSDP2 shards a model (on one rank too: its shard is the whole, read straight to where it lives)"
    if tuple(int(x) for x in torch.__version__.split("+")[0].split(".")[:2]) < MIN_TORCH:
        return f"the sharded build is tested on torch {MIN_TORCH[0]}.{MIN_TORCH[1]} and newer, not {torch.__version__}"
    if weight_files(path) is None:
        return "the checkpoint has no safetensors weights"
    return None


@contextlib.contextmanager
def parameters_on_meta() -> Iterator[None]:
    """Every parameter a module registers goes to the meta device at once (its initialisation then costs nothing);
    buffers stay real, so tables computed at construction (rotary frequencies) keep their values."""
    register = torch.nn.Module.register_parameter

    def on_meta(module, name, param):
        register(module, name, param)
        if param is not None and param.device.type != "meta":
            kind = type(module._parameters[name])
            module._parameters[name] = kind(param.to("meta"), requires_grad=param.requires_grad)

    torch.nn.Module.register_parameter = on_meta
    try:
        yield
    finally:
        torch.nn.Module.register_parameter = register


def empty_model(path: str | Path, attn_implementation: str, dtype: torch.dtype):
    """The causal LM that `path` holds, with meta parameters in `dtype` and real buffers (nothing read but its
    config.json)."""
    from transformers import AutoConfig, AutoModelForCausalLM

    where = str(resolve_model_path(path))
    config = AutoConfig.from_pretrained(where, local_files_only=True)
    if "vision_config" in config.to_dict():
        from transformers import AutoModelForImageTextToText as auto
    else:
        auto = AutoModelForCausalLM
    with parameters_on_meta():
        model = auto.from_config(config, attn_implementation=attn_implementation, dtype=torch.float32)
    # made in fp32 as from_pretrained makes it, then cast as the whole path casts it: buffers computed at
    # construction (rotary frequencies) then hold the same values on either path
    return model.to(dtype)


def buffers_to(model: torch.nn.Module, device: torch.device) -> None:
    """An empty model's real buffers onto `device` before FSDP2 wraps it (it would move them with `.data =`, which a
    device whose tensors are a subclass, the emulated one, refuses)."""
    for module in model.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                module._buffers[name] = buffer.to(device)


def local_rows(param: torch.Tensor, coordinate: tuple[int, ...] | None = None) -> tuple[slice, ...]:
    """The global index of the shard this rank (or the rank at mesh `coordinate`) holds of an FSDP2 parameter (a
    DTensor sharded as torch.chunk splits, over one or more mesh dimensions); the whole tensor for a plain one. A
    strided shard (FSDP2 over a tensor already sharded on the same dim by a later mesh dimension: an expert-parallel
    expert tensor, `(efsdp, ep)` as `(_StridedShard(0), Shard(0))`) splits the later
    dimension's block, so it is applied after it."""
    from torch.distributed.tensor import DTensor, Shard
    from torch.distributed.tensor.placement_types import _StridedShard

    shape = list(param.shape)
    if not isinstance(param, DTensor):
        return tuple(slice(0, n) for n in shape)
    start, size = [0] * len(shape), list(shape)
    coordinate = param.device_mesh.get_coordinate() if coordinate is None else coordinate
    order = sorted(enumerate(param.placements), key=lambda item: isinstance(item[1], _StridedShard))
    for mesh_dim, placement in order:
        if isinstance(placement, (Shard, _StridedShard)):  # torch 2.13's _StridedShard is no Shard subclass
            d, parts, index = placement.dim, param.device_mesh.size(mesh_dim), coordinate[mesh_dim]
            chunk = -(-size[d] // parts)
            lo = min(index * chunk, size[d])
            start[d], size[d] = start[d] + lo, min(lo + chunk, size[d]) - lo
    return tuple(slice(s, s + n) for s, n in zip(start, size))


def materialize(scorer: torch.nn.Module, device: torch.device, path: str | Path, prefix: str = "lm.",
                shards_on: torch.device | None = None, adapter_seed: int = 0) -> int:
    """Give a sharded meta scorer storage and fill each rank's shards from the checkpoint at `path`: its parameter
    shards on `shards_on` (host memory when FSDP2 offloads them; by default `device`), its buffers on `device`.
    LoRA adapters on the base (peft's names: `base_model.model.<name>`, `<layer>.base_layer.weight`) take their
    rows of `adapter_values(..., adapter_seed)`, which a whole load gives them too. Returns the bytes this rank read.
    A tensor the model has and the checkpoint lacks (other than an LM head tied to the embedding) is one sentence."""
    from safetensors import safe_open
    from torch.distributed.tensor import DTensor

    files = weight_files(path) or {}
    buffers = {}
    for module in scorer.modules():
        for name, buffer in module._buffers.items():
            if buffer is not None and buffer.device.type != "meta":
                buffers[(module, name)] = buffer.detach().clone()
    scorer.to_empty(device=shards_on or device)
    for (module, name), buffer in buffers.items():
        module._buffers[name] = buffer.to(device)
    tied = _tied_names(scorer)
    adapters = adapter_values({n.removeprefix(prefix): tuple(p.shape) for n, p in scorer.named_parameters()},
                              adapter_seed)
    read = 0
    handles: dict[Path, object] = {}
    try:
        with torch.no_grad():
            for name, param in scorer.named_parameters():
                key = name.removeprefix(prefix)

                def handle(file: Path):
                    if file not in handles:
                        handles[file] = safe_open(str(file), framework="pt").__enter__()
                    return handles[file]

                local = param.to_local() if isinstance(param, DTensor) else param
                if key in adapters:
                    local.copy_(adapters[key][local_rows(param)].to(local.dtype))
                    continue
                own, key = key, checkpoint_key(key, files)
                experts = per_expert_keys(key, param.shape[0]) if key not in files else None
                if key not in files and not (experts and all(k in files for row in experts for k in row)):
                    if own in tied:
                        continue
                    raise UserError(f"model.path={str(path)!r} has no tensor {key!r}, which the model needs; give a "
                                    f"complete checkpoint, or set model.sharded_load=false to load it as "
                                    f"transformers does.")
                if key in files:
                    rows = handle(files[key]).get_slice(key)[local_rows(param)]
                else:
                    rows = _expert_rows(experts, local_rows(param), lambda k: handle(files[k]).get_slice(k)[:])
                if tuple(local.shape) != tuple(rows.shape):
                    raise UserError(f"model.path={str(path)!r}: tensor {key!r} has shape {tuple(rows.shape)} where "
                                    f"this rank's shard is {tuple(local.shape)}; the checkpoint does not match its "
                                    f"config.json.")
                local.copy_(rows.to(local.dtype))
                read += rows.numel() * rows.element_size()
    finally:
        for handle in handles.values():
            handle.__exit__(None, None, None)
    return read


# Qwen2-VL/Qwen2.5-VL in memory (transformers 5) against their checkpoints (what save_pretrained writes and the hub
# publishes): the language model under `model.language_model.` is saved under `model.`, the vision tower under
# `model.visual.` as `visual.` (the same renames vLLM's loader and tests/standins/fake_vllm.py's VisionModel make).
CHECKPOINT_PREFIXES = (("model.language_model.", "model."), ("model.visual.", "visual."))


PEFT_BASE = "base_model.model."  # peft's wrapper around the base model; an adapted layer's own is `base_layer`


def checkpoint_key(key: str, files: dict) -> str:
    """The name the checkpoint holds a model tensor under: its own (under LoRA, the base model's), else its
    vision-language checkpoint name."""
    if key.startswith(PEFT_BASE):
        key = key[len(PEFT_BASE):].replace(".base_layer.", ".")
    if key in files:
        return key
    for ours, theirs in CHECKPOINT_PREFIXES:
        if key.startswith(ours) and theirs + key[len(ours):] in files:
            return theirs + key[len(ours):]
    return key


EXPERT_PARTS = {"gate_up_proj": ("gate_proj", "up_proj"), "down_proj": ("down_proj",)}


def per_expert_keys(key: str, experts: int) -> list[list[str]] | None:
    """For a packed experts tensor (`<layer>.mlp.experts.gate_up_proj` or `.down_proj`), the per-expert checkpoint
    names that make it, expert by expert (`experts.<e>.gate_proj.weight`, `experts.<e>.up_proj.weight`, whose rows
    are stacked in that order); None for any other tensor. model/expert_packing.py's `packed_experts` is the same
    layout."""
    head, _, last = key.rpartition(".")
    if not head.endswith(".experts") or last not in EXPERT_PARTS:
        return None
    return [[f"{head}.{e}.{part}.weight" for part in EXPERT_PARTS[last]] for e in range(experts)]


def _expert_rows(experts: list[list[str]], rows: tuple[slice, ...], read) -> torch.Tensor:
    """This rank's block of a packed experts tensor from the per-expert tensors: only the experts in its slice of
    dim 0 are read (FSDP2 shards the packed tensor over experts), each expert's parts stacked, then cut to the
    slice's other dims."""
    blocks = [torch.cat([read(k) for k in experts[e]])[rows[1:]] for e in range(rows[0].start, rows[0].stop)]
    if blocks:
        return torch.stack(blocks)
    whole = torch.cat([read(k) for k in experts[0]])[rows[1:]]  # a rank with no expert: an empty block of that shape
    return whole.new_empty((0, *whole.shape))


def _tied_names(module: torch.nn.Module, prefix: str = "lm.") -> set[str]:
    """Parameter names (without `prefix`) that a checkpoint may leave out: aliases of another parameter, and an LM
    head tied to the embedding."""
    first = {n for n, _ in module.named_parameters()}
    every = {n for n, _ in module.named_parameters(remove_duplicate=False)}
    lm = getattr(module, "lm", module)
    tie = bool(getattr(getattr(lm, "config", None), "tie_word_embeddings", False))
    names = (every - first) | {n for n in first if tie and n.endswith("lm_head.weight")}
    return {n.removeprefix(prefix) for n in names}


def missing_tensors(model: torch.nn.Module, path: str | Path) -> list[str]:
    """The model's tensors (a bare LM's names) that the checkpoint does not hold by that name, nor as per-expert
    tensors: a layout transformers converts while loading, which this path does not, so such a model loads whole."""
    files = weight_files(path) or {}
    shapes = {n: p.shape for n, p in model.named_parameters()}
    needed = set(shapes) - _tied_names(model, prefix="")
    missing = []
    for name in sorted(needed - set(files)):
        if checkpoint_key(name, files) in files:
            continue
        experts = per_expert_keys(name, shapes[name][0]) if len(shapes[name]) == 3 else None
        if not experts or not all(k in files for row in experts for k in row):
            missing.append(name)
    return missing
