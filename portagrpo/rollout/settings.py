"""What a rollout engine reads from the run's config, read once (`EngineSettings.from_config`), as each phase of
the step has its own settings: an engine never sees the whole `Config`. `SamplingParams` is the part that shapes
the sampled distribution (re-exported by rollout/engines.py)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from portagrpo.config import Config

@dataclass(frozen=True)
class SamplingParams:
    """Every knob that shapes the sampled distribution. Engines apply exactly these and nothing
    from the model's own generation_config, so the log-probs describe what was sampled."""

    max_tokens: int
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = -1  # -1 or 0: off
    min_p: float = 0.0  # 0: off
    repetition_penalty: float = 1.0  # 1: off


DTYPE_NAMES = {"fp32": "float32", "bf16": "bfloat16", "fp64": "float32"}  # vLLM's names (no float64 there)


@dataclass(frozen=True)
class EngineSettings:
    n: int  # rollout.n: samples per prompt
    seed: int  # trainer.seed
    sampling: SamplingParams  # the training rollout's (max_tokens: data.max_response_length)
    max_prompt_length: int  # data.max_prompt_length
    model_path: str | None  # model.path (None: the built-in tiny policy, saved in the run's init_model)
    model_dtype: str  # model.dtype: fp32 | bf16 | fp64
    attn_implementation: str  # model.attn_implementation
    lora: bool  # model.lora.rank > 0: an adapter is merged before each push
    tiny_hidden_size: int  # model.tiny.hidden_size and num_heads, named when their head size does not suit vLLM
    tiny_num_heads: int
    precision: str  # rollout.precision: auto | fp32 | bf16 | int8 | fp8
    tensor_parallel_size: int  # rollout.tensor_model_parallel_size (vLLM)
    vllm_gpu_memory_utilization: float
    vllm_weight_bucket_mb: int
    vllm_max_model_len: int | None
    # the rollout-correction features on (rollout_is, rollout_rs, bypass_mode): they weigh the loss with the
    # sampler's own log-probs, so an engine that would report them wrongly refuses the run
    correction_uses: tuple[str, ...] = ()
    # actor.router_replay: R3 asks the engine for the experts it routed each token to
    router_replay: str | None = None
    # rollout.expert_parallel_size and data_parallel_size (vLLM's expert parallelism; 1: off)
    expert_parallel_size: int = 1
    data_parallel_size: int = 1

    @classmethod
    def from_config(cls, cfg: Config) -> "EngineSettings":
        r, m, rc = cfg.rollout, cfg.model, cfg.algorithm.rollout_correction
        uses = tuple(k for k, on in (("rollout_is", rc.rollout_is is not None),
                                     ("rollout_rs", rc.rollout_rs is not None), ("bypass_mode", rc.bypass_mode)) if on)
        return cls(n=r.n, seed=cfg.trainer.seed,
                   sampling=SamplingParams(cfg.data.max_response_length, r.temperature, r.top_p, r.top_k, r.min_p,
                                           r.repetition_penalty),
                   max_prompt_length=cfg.data.max_prompt_length, model_path=m.path, model_dtype=m.dtype,
                   attn_implementation=m.attn_implementation, lora=m.lora.rank > 0,
                   tiny_hidden_size=m.tiny.hidden_size, tiny_num_heads=m.tiny.num_heads, precision=r.precision,
                   tensor_parallel_size=r.tensor_model_parallel_size,
                   expert_parallel_size=r.expert_parallel_size, data_parallel_size=r.data_parallel_size,
                   vllm_gpu_memory_utilization=r.vllm_gpu_memory_utilization,
                   vllm_weight_bucket_mb=r.vllm_weight_bucket_mb, vllm_max_model_len=r.vllm_max_model_len,
                   correction_uses=uses, router_replay=cfg.actor.router_replay)

    @property
    def copy_precision(self) -> str:
        """The precision a sampler copy runs in: rollout.precision, or with `auto` (a sampler process's) the model's
        compute precision (bf16 under model.dtype=bf16, else fp32)."""
        if self.precision != "auto":
            return self.precision
        return "bf16" if self.model_dtype == "bf16" else "fp32"

    @property
    def vllm_dtype(self) -> str:
        """The dtype vLLM holds its weights and samples in: rollout.precision fp32 or bf16 (verl's rollout dtype: a
        bf16 sampler for an fp32 policy, each push cast in the copy), else model.dtype (fp8 builds on it)."""
        return DTYPE_NAMES[self.precision if self.precision in ("fp32", "bf16") else self.model_dtype]

    @property
    def max_model_len(self) -> int:
        """vLLM's context: rollout.vllm_max_model_len, else a prompt and a response at their limits."""
        return self.vllm_max_model_len or self.max_prompt_length + self.sampling.max_tokens
