"""The vLLM rollout engine (`rollout.engine: vllm`; on Ascend through the vllm-ascend plugin).

vLLM runs colocated with training: it sleeps (weights offloaded, KV cache dropped) while the
trainer updates the policy, wakes before generation, and receives the updated weights after
every optimizer step, gathered from the (possibly sharded) policy and streamed in buckets
without touching the disk. vLLM is imported only when this engine is chosen.

Written against vLLM's documented public API (`LLM`, `SamplingParams`, `TokensPrompt`,
`LLM.sleep`/`wake_up`, `LLM.apply_model`); the pure parts (sampling-parameter mapping,
weight-name mapping, bucketing) are tested without vLLM.
"""
from __future__ import annotations

from typing import Any, Iterable, Iterator

import torch

from .errors import UserError
from .rollout import ROLLOUT_ENGINES, SamplingParams, response_mask_from_tokens

PEFT_PREFIX = "base_model.model."


def sampling_kwargs(params: SamplingParams, *, seed: int | None, stop_token_ids: list[int], n: int = 1) -> dict[str, Any]:
    """portagrpo sampling settings as `vllm.SamplingParams` keyword arguments."""
    greedy = params.temperature <= 0
    return {
        "n": n,
        "temperature": 0.0 if greedy else float(params.temperature),
        "top_p": 1.0 if greedy else float(params.top_p),
        "top_k": -1 if greedy or params.top_k <= 0 else int(params.top_k),
        "max_tokens": int(params.max_tokens),
        "seed": seed,
        "stop_token_ids": list(stop_token_ids),
        "detokenize": False,
    }


def vllm_weight_names(state: dict[str, torch.Tensor], *, tied_embeddings: bool) -> Iterator[tuple[str, torch.Tensor]]:
    """Hugging Face parameter names as vLLM's `load_weights` expects them.

    vLLM loads checkpoints by their Hugging Face names (it fuses q/k/v and gate/up itself), so
    names pass through, except: peft's wrapper prefix is removed (adapters are merged before
    this), LoRA factors are never sent, and a tied LM head is skipped (vLLM ties it itself).
    """
    for name, tensor in state.items():
        if "lora_" in name:
            continue
        name = name.removeprefix("lm.").removeprefix(PEFT_PREFIX).replace(".base_layer.", ".")
        if tied_embeddings and name == "lm_head.weight":
            continue
        yield name, tensor


def bucket_tensors(named: Iterable[tuple[str, torch.Tensor]], bucket_bytes: int) -> Iterator[list[tuple[str, torch.Tensor]]]:
    """Group tensors into buckets of at most `bucket_bytes` (a larger tensor travels alone)."""
    bucket: list[tuple[str, torch.Tensor]] = []
    size = 0
    for name, tensor in named:
        nbytes = tensor.numel() * tensor.element_size()
        if bucket and size + nbytes > bucket_bytes:
            yield bucket
            bucket, size = [], 0
        bucket.append((name, tensor))
        size += nbytes
    if bucket:
        yield bucket


def _import_vllm():
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise UserError("rollout.engine=vllm needs vLLM, which is not installed: `pip install portagrpo[vllm]` on "
                        "CUDA/ROCm, plus vllm-ascend on Ascend NPUs; or use rollout.engine=hf.") from err
    return vllm, TokensPrompt


@ROLLOUT_ENGINES.register("vllm")
class VLLMRollout:
    def __init__(self, model, tokenizer, autocast, generate_kwargs: dict | None = None, *, model_path: str,
                 dtype: str = "bfloat16", seed: int = 0, gpu_memory_utilization: float = 0.5,
                 bucket_mb: int = 512, max_model_len: int | None = None, tied_embeddings: bool = False) -> None:
        vllm, self._tokens_prompt = _import_vllm()
        self._sampling_cls = vllm.SamplingParams
        eos = tokenizer.eos_token_id
        self.eos_ids = [eos] if isinstance(eos, int) else list(eos)
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.seed, self.bucket_bytes, self.tied = seed, bucket_mb * 2**20, tied_embeddings
        self.calls = 0
        self.llm = vllm.LLM(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                            gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=True,
                            max_model_len=max_model_len)
        self.llm.sleep(level=1)  # hand the memory to training until the first rollout
        self.awake = False

    def _wake(self, tags: list[str] | None = None) -> None:
        self.llm.wake_up(tags=tags) if tags else self.llm.wake_up()

    def update_weights(self, state: dict[str, torch.Tensor]) -> int:
        """Push a full state dict into the sleeping engine, bucket by bucket. Returns the bucket count."""
        self._wake(["weights"])  # weights only: no KV cache while training memory is in use
        count = 0
        for bucket in bucket_tensors(vllm_weight_names(state, tied_embeddings=self.tied), self.bucket_bytes):
            self.llm.apply_model(lambda model, b=bucket: model.load_weights(weights=b))
            count += 1
        self.llm.sleep(level=1)
        return count

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams):
        self._wake()
        try:
            prompts = [self._tokens_prompt(prompt_token_ids=[t for t, m in zip(ids, mask) if m])
                       for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist())]
            # a distinct seed per call keeps sampling reproducible without repeating itself
            kwargs = sampling_kwargs(params, seed=self.seed + self.calls, stop_token_ids=self.eos_ids)
            self.calls += 1
            outputs = self.llm.generate(prompts, self._sampling_cls(**kwargs), use_tqdm=False)
        finally:
            self.llm.sleep(level=1)
        rows = []
        for out in outputs:
            tokens = list(out.outputs[0].token_ids)[: params.max_tokens]
            rows.append(tokens + [self.pad_id] * (params.max_tokens - len(tokens)))
        responses = torch.tensor(rows, dtype=torch.long, device=prompt_ids.device)
        mask = response_mask_from_tokens(responses, self.eos_ids)
        lengths = torch.tensor([len(o.outputs[0].token_ids) for o in outputs], device=prompt_ids.device)
        mask = mask * (torch.arange(params.max_tokens, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)).float()
        return torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id)), mask
