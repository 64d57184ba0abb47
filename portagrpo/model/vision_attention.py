"""The attention of a vision-language policy's vision tower: the backend's answer for it
(`Backend.vision_attention_implementation`, asked like the decoder's) set on the vision config, so the tower's
blocks run their variable-length windows (Qwen2.5-VL's `cu_seqlens`: windowed and full-attention blocks)
through it, while the language model keeps the decoder's attention. (Imports nothing of portagrpo.model:
loading.py calls it.)"""
from __future__ import annotations

from portagrpo.errors import UserError


def registered_attention(name: str) -> bool:
    """Whether transformers knows `name` (else a forward would fall back to eager attention without a word)."""
    from transformers.modeling_utils import ALL_ATTENTION_FUNCTIONS

    return name == "eager" or name in ALL_ATTENTION_FUNCTIONS.valid_keys()


def set_vision_attention(model, implementation: str) -> None:
    """The vision tower of a transformers `model` attends with `implementation` (registered with transformers: the
    backend registers its own when it answers); a text-only model is left as it is. The tower reads its config
    (the model config's `vision_config`) at every forward."""
    config = getattr(model.config, "vision_config", None)
    if config is None:
        return
    if not registered_attention(implementation):
        raise UserError(f"the vision tower's attention {implementation!r} is not registered with transformers in "
                        f"this process; ask the backend for it (vision_attention_implementation) before loading.")
    config._attn_implementation = implementation
