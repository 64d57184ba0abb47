"""The shape of a run's model, for its memory plan: read from its config.json alone (a directory without weights is
enough); where model.path has none on this machine, the shape of a well-known model of the same name shipped with
portagrpo (plan/model_shapes/) is used, and the plan says so. A config.json transformers cannot read is one
sentence."""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from portagrpo.errors import UserError
from portagrpo.plan.memory import ModelShape

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
    from portagrpo.model.moe import expert_modules
    from portagrpo.model.parallel import streams_head, streams_lookup
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
    if getattr(text, "kv_lora_rank", None):  # latent attention (DeepSeek-V3): transformers caches every head's key
        # (qk_nope + qk_rope wide) and value (v_head_dim wide), so the plan's 2 x heads x head_dim is their mean
        head_dim = (text.qk_nope_head_dim + text.qk_rope_head_dim + text.v_head_dim) // 2
    experts = int(getattr(text, "num_experts", 0) or getattr(text, "n_routed_experts", 0) or 0)
    top_k = int(getattr(text, "num_experts_per_tok", 0) or 0)
    expert_params = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n or n.endswith(".experts"))
    layer_experts = max((sum(p.numel() for p in m.parameters()) for m in expert_modules(model)), default=0)
    if experts:  # a shared expert: Qwen2-MoE's own width, or DeepSeek-V3's n_shared_experts of the experts' width
        shared = int(getattr(text, "shared_expert_intermediate_size", 0) or 0) or (
            int(getattr(text, "n_shared_experts", 0) or 0) * int(text.moe_intermediate_size))
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
        embedding_streams=embed is not None and streams_lookup(embed), head_streams=streams_head(lm_head),
        largest_tensor=max(_pushed_at_once(n, p) for n, p in model.named_parameters()),
        layers=layers, hidden=text.hidden_size, mlp_width=mlp, heads=heads,
        kv_heads=getattr(text, "num_key_value_heads", None) or heads, head_dim=head_dim, vocab=text.vocab_size,
        experts=experts, experts_per_token=top_k, active_params=active, expert_params=expert_params,
        layer_experts=layer_experts, **vision_fields)
    return shape, model, source


def _pushed_at_once(name: str, param) -> int:
    """Elements the weight push holds of a parameter at once: a packed expert tensor one expert's block
    (model/weight_push.py push_pairs), any other whole."""
    from portagrpo.model.expert_packing import packed_kind

    return param.numel() // param.shape[0] if packed_kind(name, param) else param.numel()


def _patch_values(vision_config) -> int:
    """Pixel values in one patch of a Qwen2-VL-style tower (its patch embedding's input width)."""
    channels = getattr(vision_config, "in_chans", None) or getattr(vision_config, "in_channels", 3)
    return int(channels * vision_config.temporal_patch_size * vision_config.patch_size ** 2)


def lora_params(model, lora) -> int:
    """Parameters LoRA adds (and trains): rank x (in + out) for every linear layer its target modules name."""
    import torch

    total = 0
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.Linear) and name.rsplit(".", 1)[-1] in set(lora.target_modules):
            total += lora.rank * (module.in_features + module.out_features)
    return total
