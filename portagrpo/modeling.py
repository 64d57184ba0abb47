"""Policy and tokenizer construction: the built-in tiny model, or a local Hugging Face directory.

Nothing here reaches a model hub: every load is `local_files_only`.
"""
from __future__ import annotations

import string
from pathlib import Path

import torch

from .config import ModelConfig

PAD, BOS, EOS, UNK = "<pad>", "<bos>", "<eos>", "<unk>"
CHAT_TEMPLATE = (
    "{% for m in messages %}{{ m['role'][0] }}:{{ m['content'] }}\n{% endfor %}"
    "{% if add_generation_prompt %}a:{% endif %}"
)
CHARS = string.digits + string.ascii_lowercase + string.ascii_uppercase + " \n.,:;!?+-*/=#()<>'\"$%_\\{}^[]|&@~`"


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


def load_tokenizer(path: str | None):
    if path is None:
        return build_char_tokenizer()
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
    tok.padding_side = "left"
    if tok.pad_token is None:
        tok.pad_token = tok.eos_token
    return tok


def build_tiny_model(cfg: ModelConfig, tokenizer, seed: int):
    """A small random-init Llama-architecture policy sized by `model.tiny`."""
    from transformers import LlamaConfig, LlamaForCausalLM

    t = cfg.tiny
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


def load_model(path: str | Path, attn_implementation: str):
    """Load a causal LM from a local directory in fp32 master weights."""
    from transformers import AutoModelForCausalLM

    path = Path(path)
    if not path.exists():
        raise FileNotFoundError(f"model path {str(path)!r} does not exist; give a local Hugging Face model directory.")
    model = AutoModelForCausalLM.from_pretrained(
        str(path), local_files_only=True, attn_implementation=attn_implementation
    )
    return model.float()


def set_attention(model, attn_implementation: str) -> None:
    model.config._attn_implementation = attn_implementation


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


def position_ids_from_mask(attention_mask: torch.Tensor) -> torch.Tensor:
    """Positions for left-padded rows, as transformers' generate computes them."""
    pos = attention_mask.long().cumsum(-1) - 1
    return pos.masked_fill(attention_mask == 0, 1)


def apply_lora(model, lora):
    """Wrap `model` with peft LoRA adapters; only adapter weights stay trainable."""
    try:
        from peft import LoraConfig, get_peft_model
    except ImportError as err:
        from .errors import UserError

        raise UserError("model.lora.rank > 0 needs peft; `pip install portagrpo[lora]`.") from err
    config = LoraConfig(r=lora.rank, lora_alpha=lora.alpha, lora_dropout=lora.dropout,
                        target_modules=list(lora.target_modules), task_type="CAUSAL_LM")
    return get_peft_model(model, config)


def is_peft(model) -> bool:
    return hasattr(model, "peft_config") and hasattr(model, "disable_adapter")
