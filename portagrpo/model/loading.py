"""Policy and tokenizer construction: the built-in tiny model, or a local Hugging Face directory.

Nothing here reaches a model hub: every load is `local_files_only`.
"""
from __future__ import annotations

import string
from pathlib import Path
from typing import TYPE_CHECKING

import torch

from portagrpo.errors import UserError
from portagrpo.paths import model_source_problem, resolve_model_path

if TYPE_CHECKING:  # the config imports this module (model files), never the other way
    from portagrpo.config import ModelConfig

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n.,:;!?+-*/=#()<>'\"$%_\\{}^[]|&@~`"


def quiet_transformers() -> None:
    """No per-file progress bars or info logs from transformers in CLI runs and workers."""
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()
    hf_logging.set_verbosity_error()


def build_char_tokenizer():
    """A character-level tokenizer built locally (no download), with a chat template."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    vocab = {tok: i for i, tok in enumerate([PAD, BOS, EOS, UNK] + list(CHARS))}
    tok = Tokenizer(models.WordLevel(vocab=vocab, unk_token=UNK))
    tok.pre_tokenizer = pre_tokenizers.Split(Regex("."), behavior="isolated")
    tok.decoder = decoders.Fuse()
    hf = PreTrainedTokenizerFast(
        tokenizer_object=tok, bos_token=BOS, eos_token=EOS, pad_token=PAD, unk_token=UNK, padding_side="left"
    )
    hf.chat_template = CHAT_TEMPLATE
    return hf


def _hf_location(path: str | Path) -> tuple[str, dict]:
    """(directory, extra from_pretrained kwargs): a .gguf file loads through transformers' GGUF
    support (weights dequantized), anything else is a Hugging Face directory."""
    p = resolve_model_path(path)
    if p.suffix == ".gguf":
        return str(p.parent), {"gguf_file": p.name}
    return str(p), {}


def load_tokenizer(path: str | None, field: str = "model.tokenizer_path"):
    if path is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    problem = model_source_problem(path, field, tokenizer=True)
    if problem:
        raise ModelLoadError(problem)
    where, extra = _hf_location(path)
    try:
        tok = AutoTokenizer.from_pretrained(where, local_files_only=True, **extra)
    except Exception as err:  # noqa: BLE001 - transformers, tokenizers and gguf raise many types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:200]
        raise ModelLoadError(f"{field}={str(path)!r}: its tokenizer cannot be loaded ({type(err).__name__}: {first}); "
                             f"give the directory the model's tokenizer was saved to.") from None
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tiny_model(cfg: "ModelConfig", tokenizer, seed: int):
    """A small random-init Llama-architecture policy sized by `model.tiny` (`model.tiny.vision`: model/vision.py's
    `build_tiny_vl_model`)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
    if getattr(t, "moe", None):
        return build_tiny_moe_model(t, tokenizer, seed)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=t.hidden_size,
        intermediate_size=t.intermediate_size,
        num_hidden_layers=t.num_layers,
        num_attention_heads=t.num_heads,
        num_key_value_heads=t.num_heads,
        max_position_embeddings=512,
        tie_word_embeddings=t.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id,
    )
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = LlamaForCausalLM(config)
    return model.float()


MOE_FAMILIES = {"qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM"),
                "qwen2_moe": ("Qwen2MoeConfig", "Qwen2MoeForCausalLM"),
                "deepseek_v3": ("DeepseekV3Config", "DeepseekV3ForCausalLM")}


def _family_settings(t) -> dict:
    """A tiny model's settings that only its family has."""
    qwen = {"num_experts": t.num_experts, "decoder_sparse_step": 1}
    if t.moe == "qwen2_moe":
        return {**qwen, "shared_expert_intermediate_size": t.moe_intermediate_size}
    if t.moe == "deepseek_v3":  # DeepSeek-V3's shape, small: latent attention, a dense first layer, grouped routing
        head = t.hidden_size // t.num_heads
        return {"n_routed_experts": t.num_experts, "n_shared_experts": 1, "first_k_dense_replace": 1,
                "n_group": 2, "topk_group": 1, "routed_scaling_factor": 2.5, "kv_lora_rank": head,
                "q_lora_rank": 2 * head, "qk_rope_head_dim": head // 2, "qk_nope_head_dim": head // 2,
                "v_head_dim": head}
    return qwen


def build_tiny_moe_model(t, tokenizer, seed: int):
    """A small random-init mixture-of-experts policy (`model.tiny.moe`: Qwen3-MoE, or Qwen2-MoE with its shared
    expert): every layer sparse, `num_experts` experts of `moe_intermediate_size`, top-`num_experts_per_tok`, the
    top-k weights renormalised (as Qwen3-30B-A3B's config sets). transformers 5 keeps each layer's experts as packed
    3-D tensors (`mlp.experts.gate_up_proj` [E, 2I, H], `mlp.experts.down_proj` [E, H, I]), 4.x as one module each."""
    import transformers

    if t.moe == "deepseek_v3" and int(transformers.__version__.split(".")[0]) < 5:
        raise ModelLoadError(f"model.tiny.moe=deepseek_v3 needs transformers 5 (its router returns the logits, weights "
                             f"and experts portagrpo replays), and this is transformers {transformers.__version__}; "
                             f"upgrade transformers, or use model.tiny.moe=qwen3_moe.")
    config_name, model_name = MOE_FAMILIES[t.moe]
    extra = _family_settings(t)
    config = getattr(transformers, config_name)(
        vocab_size=len(tokenizer), hidden_size=t.hidden_size, intermediate_size=t.intermediate_size,
        moe_intermediate_size=t.moe_intermediate_size,
        num_experts_per_tok=t.num_experts_per_tok, norm_topk_prob=True,
        num_hidden_layers=t.num_layers, num_attention_heads=t.num_heads, num_key_value_heads=t.num_heads,
        max_position_embeddings=512, tie_word_embeddings=t.tie_word_embeddings,
        bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
        pad_token_id=tokenizer.pad_token_id, **extra)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(seed)
        model = getattr(transformers, model_name)(config)
        # transformers initialises a router at zero (every expert tied): a random one routes as a trained model does
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                torch.nn.init.normal_(p, std=0.5)
    return model.float()


class ModelLoadError(UserError, RuntimeError):
    """A model directory or file that cannot become a policy."""


def check_tiny_matches(tiny, init_dir: Path) -> None:
    """A resumed run loads its own init_model; `model.tiny` must still describe it."""
    import json

    saved = json.loads((Path(init_dir) / "config.json").read_text())
    if ("vision_config" in saved) != bool(getattr(tiny, "vision", False)):
        raise ModelLoadError(
            f"model.tiny.vision={getattr(tiny, 'vision', False)} but this run's init_model is "
            f"{'a vision-language' if 'vision_config' in saved else 'a text-only'} model; resume with the run's own "
            f"model settings (its config.yaml) or start a new run.")
    saved = saved.get("text_config", saved)
    pairs = {"hidden_size": "hidden_size", "num_layers": "num_hidden_layers", "num_heads": "num_attention_heads",
             "intermediate_size": "intermediate_size", "tie_word_embeddings": "tie_word_embeddings"}
    moe = getattr(tiny, "moe", None)
    if moe != saved.get("model_type") and (moe or saved.get("model_type") in MOE_FAMILIES):
        raise ModelLoadError(
            f"model.tiny.moe={moe} but this run's init_model is a {saved.get('model_type')} model; resume with the "
            f"run's own model settings (its config.yaml) or start a new run.")
    if moe:
        pairs.update(num_experts="num_experts", num_experts_per_tok="num_experts_per_tok",
                     moe_intermediate_size="moe_intermediate_size")
    for ours, theirs in pairs.items():
        if theirs in saved and saved[theirs] != getattr(tiny, ours):
            raise ModelLoadError(
                f"model.tiny.{ours}={getattr(tiny, ours)} but this run's init_model has {saved[theirs]}; "
                f"resume with the run's own model settings (its config.yaml) or start a new run."
            )


def load_model(path: str | Path, attn_implementation: str, field: str = "model.path",
               vision_attention: str | None = None):
    """Load a causal LM from a local directory (or a GGUF file, dequantized) in fp32 master weights. A
    vision-language model's tower attends with `vision_attention` (the backend's
    `vision_attention_implementation`) where given, else with `attn_implementation` as transformers sets it."""
    from transformers import AutoModelForCausalLM

    problem = model_source_problem(path, field)  # the same check config validation runs for `train`
    if problem:
        raise ModelLoadError(problem)
    where, extra = _hf_location(path)
    if extra:  # GGUF: transformers dequantizes into the dtype asked for
        extra["dtype"] = torch.float32
    auto = AutoModelForCausalLM
    if not extra and _is_vision_language_dir(where):
        from transformers import AutoModelForImageTextToText as auto  # Qwen2.5-VL is no causal-LM class
    try:
        model = auto.from_pretrained(where, local_files_only=True, attn_implementation=attn_implementation, **extra)
    except Exception as err:  # noqa: BLE001 - transformers, safetensors and gguf raise many types
        first = (str(err).strip().splitlines() or [type(err).__name__])[0][:300]
        raise ModelLoadError(f"{field}={str(path)!r} cannot be loaded ({type(err).__name__}: {first}); check that it "
                             f"holds a whole Hugging Face model (config.json and complete weight files) or a real "
                             f".gguf file.") from None
    if extra:
        _forget_gguf_origin(model)
    if auto is not AutoModelForCausalLM:
        # save (checkpoints) under the names the model has in memory, not transformers' older hub layout, so a
        # resume loads a checkpoint's tensors by the policy's own names (from_pretrained reads both layouts)
        model._weight_conversions = []
        if vision_attention is not None:
            from portagrpo.model.vision_attention import set_vision_attention

            set_vision_attention(model, vision_attention)
    return model.float()


def _is_vision_language_dir(where: str) -> bool:
    import json

    try:
        return "vision_config" in json.loads((Path(where) / "config.json").read_text())
    except (OSError, ValueError):
        return False


def _forget_gguf_origin(model) -> None:
    """A GGUF checkpoint arrives dequantized to ordinary fp32 tensors but still marked as
    quantized; drop the marks so it trains, casts and saves as the plain model it now is."""
    for attr in ("hf_quantizer", "quantization_method"):
        if hasattr(model, attr):
            setattr(model, attr, None)
    if "is_quantized" in vars(model):
        model.is_quantized = False
    if hasattr(model.config, "quantization_config"):
        del model.config.quantization_config




def decoder_of(model):
    """The transformer body of a causal LM (returns final hidden states, not logits)."""
    getter = getattr(model, "get_decoder", None)
    body = getter() if callable(getter) else None
    if body is None:
        body = getattr(model, model.base_model_prefix)
    return body


def lm_head_of(model) -> tuple[torch.Tensor, torch.Tensor | None]:
    """The LM head as (weight [V, H], bias [V] or None), differentiable.

    A peft LoRA-wrapped head gives its effective weight `W0 + sum scaling * B @ A` over the
    active adapters (LoRA dropout is not applied on this path), so every kernel sees the
    adapted head and its gradient reaches the adapter matrices.
    """
    head = model.get_output_embeddings()
    base = getattr(head, "base_layer", None)
    if base is None or not hasattr(head, "lora_A"):
        return head.weight, getattr(head, "bias", None)
    weight = base.weight
    if not getattr(head, "disable_adapters", False) and not getattr(head, "merged", False):
        for name in getattr(head, "active_adapters", []):
            if name in head.lora_A:
                delta = head.lora_B[name].weight @ head.lora_A[name].weight
                weight = weight + head.scaling[name] * delta.to(weight.dtype)
    return weight, getattr(base, "bias", None)


def run_in_head(fn, *args):
    """The scorer's head computation `fn(*args)`; as `through_head` of an FSDP2 head unit it runs between the unit's
    gather and reshard, and its backward reduce-scatters the head's gradient."""
    return fn(*args)


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions for left-padded rows, as transformers' generate computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def language_only_targets(targets: list[str]) -> str:
    """LoRA target modules of a vision-language model as a peft regular expression that matches the named layers
    of the language model only (the vision tower's MLP shares names such as gate_proj)."""
    names = "|".join(sorted({t.rsplit(".", 1)[-1] for t in targets}))
    return rf"^(?!.*\bvisual\b).*\.({names})$"


def apply_lora(model, lora):
    """Wrap `model` with peft LoRA adapters; only adapter weights stay trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        from portagrpo.errors import UserError

        raise UserError("model.lora.rank > 0 needs peft; `pip install portagrpo[lora]`.") from err
    targets: list[str] | str = list(lora.target_modules)
    if getattr(model.config, "vision_config", None) is not None:
        targets = language_only_targets(targets)  # the language model's layers only, never the vision tower's
    refuse_expert_lora(model, lora.target_modules)
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=targets, task_type="CAUSAL_LM")
    try:
        return get_peft_model(model, config)
    except ValueError as err:
        names = sorted({n.rsplit(".", 1)[-1] for n, m in model.named_modules() if isinstance(m, torch.nn.Linear)})
        raise ModelLoadError(
            f"model.lora.target_modules={list(lora.target_modules)} cannot be adapted ({str(err)[:120]}); "
            f"this model's linear layers are named {names}."
        ) from None


# How peft initialises each adapter tensor (peft/tuners/lora/layer.py reset_lora_parameters, init_lora_weights=True):
# a linear layer's A as nn.Linear's default (Kaiming-uniform, a=sqrt(5)) and its B zero; an embedding's A zero and
# its B standard normal.
ADAPTER_INIT = {"lora_A": "kaiming", "lora_B": "zeros", "lora_embedding_A": "zeros", "lora_embedding_B": "normal"}


def adapter_values(shapes: dict[str, tuple[int, ...]], seed: int) -> dict[str, torch.Tensor]:
    """The initial value of every LoRA tensor among `shapes` (parameter name -> its whole shape), drawn in name order
    from one generator seeded with `seed`: the same values whether the model was loaded whole (`seed_adapters`) or
    built empty and filled by shards (model/sharded_load.py materialize, each rank taking its rows). A LoRA tensor of a
    kind peft initialises otherwise raises, naming it."""
    import math

    g = torch.Generator().manual_seed(seed)
    values = {}
    for name in sorted(shapes):
        if "lora_" not in name:
            continue
        kind = next((ADAPTER_INIT[part] for part in name.split(".") if part in ADAPTER_INIT), None)
        if kind is None:
            raise UserError(f"LoRA tensor {name!r} is none peft's default initialisation covers "
                            f"({sorted(ADAPTER_INIT)}); set model.sharded_load=false.")
        value = torch.zeros(shapes[name])
        if kind == "kaiming":
            torch.nn.init.kaiming_uniform_(value, a=math.sqrt(5), generator=g)
        elif kind == "normal":
            value.normal_(generator=g)
        values[name] = value
    return values


def seed_adapters(model: torch.nn.Module, seed: int) -> None:
    """Give a whole model's LoRA tensors their `adapter_values`."""
    params = dict(model.named_parameters())
    values = adapter_values({n: tuple(p.shape) for n, p in params.items()}, seed)
    with torch.no_grad():
        for name, value in values.items():
            params[name].copy_(value.to(params[name].dtype))


def refuse_expert_lora(model, targets) -> None:
    """LoRA adapts a mixture-of-experts policy's attention and dense layers; its experts' packed 3-D tensors and its
    routers are no linear layers peft adapts (and an adapted router would change routes under replay): refused."""
    if not any(name.endswith(".mlp.experts") for name, _ in model.named_modules()):  # no MoE block (model/moe.py)
        return
    wrong = sorted({t.rsplit(".", 1)[-1] for t in targets} & {"gate", "experts", "gate_up_proj", "down_proj",
                                                                 "up_proj", "gate_proj"})
    if wrong:
        raise ModelLoadError(
            f"model.lora.target_modules={list(targets)} names {wrong}, and on a mixture-of-experts policy LoRA adapts "
            f"attention only (q_proj, k_proj, v_proj, o_proj): the experts and routers train in full or not at all.")
