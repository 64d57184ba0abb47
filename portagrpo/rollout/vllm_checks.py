"""What vLLM would get wrong with this run, refused in one sentence before or right after the engine is built: a head
size the backend's vLLM attention lacks, an engine that would keep a vision tower's stale outputs; and the sleep
pools' bookkeeping that keeps vLLM's executor from ignoring or faulting a sleep or a wake."""
from __future__ import annotations

from portagrpo.errors import UserError


def check_head_size(backend, config, settings) -> None:
    """One sentence, before vLLM is built, for a head size the backend's vLLM attention lacks (vLLM's CPU attention
    fails inside its first forward otherwise, after the engine was built)."""
    sizes = backend.spec.vllm_head_sizes
    heads = getattr(config, "num_attention_heads", None)
    head = getattr(config, "head_dim", None) or (config.hidden_size // heads if heads else None)
    if not sizes or head is None or head in sizes:
        return
    path = settings.model_path
    where = (f"model.path={path} has {head}-wide attention heads" if path else
             f"the built-in model's attention heads are {head} wide (model.tiny.hidden_size="
             f"{settings.tiny_hidden_size} / model.tiny.num_heads={settings.tiny_num_heads})")
    fix = ("use a model with heads of those sizes" if path else
           f"set model.tiny.hidden_size to one of those times model.tiny.num_heads (e.g. "
           f"model.tiny.hidden_size={min(s for s in sizes if s > 0) * settings.tiny_num_heads})")
    raise UserError(f"rollout.engine=vllm on --device {backend.name}: {where}, and vLLM's attention there runs head "
                    f"sizes {', '.join(map(str, sizes))}; {fix}, or use rollout.engine=hf.")


def check_encoder_cache_reset(llm, vision, sleep_mode: bool) -> None:
    """One sentence where an engine that never sleeps would keep serving a vision tower's outputs computed with old
    weights: vLLM keeps them by image across requests (its encoder cache), and only a sleep or
    `LLMEngine.reset_encoder_cache` (vLLM 0.23.0 and 0.33.0 have it, 0.11.0 none) drops them."""
    if vision is None or sleep_mode or hasattr(llm.llm_engine, "reset_encoder_cache"):
        return
    raise UserError("rollout.engine=vllm with a vision-language policy on a platform without sleep mode needs vLLM's "
                    "reset_encoder_cache after every push, which this vLLM lacks (its encoder cache would serve image "
                    "features computed with old weights); install vLLM 0.23 or newer, or use rollout.engine=hf.")


class SleepState:
    """Which of vLLM's memory pools are asleep. vLLM's executor ignores `sleep` while any pool still
    sleeps, and a tag-less `wake_up` remaps every pool, mapped or not; so every call here names exactly
    the pools that are asleep, and `sleep` is only called when all of them are awake."""

    POOLS = ("weights", "kv_cache")

    def __init__(self) -> None:
        self.asleep: set[str] = set()

    def to_wake(self, wanted: tuple[str, ...]) -> list[str]:
        return [p for p in wanted if p in self.asleep]
