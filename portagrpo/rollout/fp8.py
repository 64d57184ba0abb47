"""FP8 rollout under vLLM (`rollout.precision=fp8`): the trainer's weights as a block-FP8 checkpoint.

vLLM samples from a model built with a checkpoint-serialized block-FP8 quantization config (e4m3
weights in 128 x 128 blocks, one float32 `weight_scale_inv` per block, activations quantized per token
group at run time: DeepSeek-V3's format, which verl's FP8 rollout also uses) and dummy initial weights.
After every update the trainer quantizes each linear layer's weight here and the engine reloads the
whole set through vLLM's layerwise reload (`Worker.reload_weights`, vLLM >= 0.16), which restores the
checkpoint layout, loads, and reruns vLLM's post-load processing per layer. The other tensors
(embeddings, norms, biases, the LM head) travel unquantized. Training weights are never touched.
"""
from __future__ import annotations

from typing import Iterable, Iterator

import torch

BLOCK = 128
FP8 = torch.float8_e4m3fn
FP8_MAX = 448.0  # the largest finite e4m3fn value
QUANTIZATION_CONFIG = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                       "weight_block_size": [BLOCK, BLOCK]}
# The linear layers of a decoder block that vLLM's FP8 method quantizes (Llama/Qwen/Mistral naming);
# everything else stays in the model dtype.
LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def _linear(name: str) -> bool:
    parts = name.split(".")
    return len(parts) >= 2 and parts[-1] == "weight" and parts[-2] in LINEARS  # exact: qkv_proj is not v_proj


def is_quantized(name: str, tensor: torch.Tensor) -> bool:
    return tensor.dim() == 2 and ".layers." in f".{name}" and _linear(name)


# How vLLM splits each of them over a tensor-parallel group (vllm/model_executor/layers/linear.py): the
# column-parallel layers (q/k/v in QKVParallelLinear, gate/up in MergedColumnParallelLinear) split their output
# rows, the row-parallel ones (RowParallelLinear) their input columns.
COLUMN_PARALLEL = ("q_proj", "k_proj", "v_proj", "gate_proj", "up_proj")
ROW_PARALLEL = ("o_proj", "down_proj")


def shard_shape(name: str, shape: tuple[int, int], tp: int, kv_heads: int | None = None) -> tuple[int, int] | None:
    """[out, in] of one TP rank's part of a decoder linear weight, or None where vLLM cannot split it evenly.
    With more ranks than key/value heads vLLM gives every rank one whole head (replicated), not a slice."""
    out_dim, in_dim = shape
    if tp == 1:
        return out_dim, in_dim
    layer = name.split(".")[-2]
    if layer in ROW_PARALLEL:
        return (out_dim, in_dim // tp) if in_dim % tp == 0 else None
    parts = kv_heads if layer in ("k_proj", "v_proj") and kv_heads and tp >= kv_heads else tp
    return (out_dim // parts, in_dim) if out_dim % parts == 0 else None


def layer_problem(named: Iterable[tuple[str, torch.Tensor]], tp: int = 1, kv_heads: int | None = None,
                  fits: Iterable[int] = ()) -> str | None:
    """One sentence when the model has decoder weights this path would not quantize as vLLM's FP8 method
    expects (another architecture's layer names), or a quantized dimension vLLM's block kernels refuse: with
    tensor parallelism, vLLM checks every rank's shard against the block (validate_fp8_block_shape in
    quantization/utils/fp8_utils.py; its ValueError comes only once the engine is being built). `fits`: the
    group sizes to suggest instead."""
    for name, tensor in named:
        if tensor.dim() != 2 or ".layers." not in f".{name}":
            continue
        if not _linear(name):
            return (f"rollout.precision=fp8 quantizes the Llama/Qwen/Mistral layer names ({', '.join(LINEARS)}); "
                    f"this model has {name}; use rollout.precision=auto.")
        full = tuple(tensor.shape)
        if full[0] % BLOCK or full[1] % BLOCK:
            return (f"rollout.precision=fp8 uses {BLOCK} x {BLOCK} blocks, and {name} is {list(full)}: vLLM's "
                    f"block-FP8 kernels need both dimensions to be multiples of {BLOCK}; use rollout.precision=auto.")
        shard = shard_shape(name, full, tp, kv_heads)
        if shard is None or shard[0] % BLOCK or shard[1] % BLOCK:
            what = "cannot be split evenly" if shard is None else f"leaves each rank a {list(shard)} shard"
            sizes = " or ".join(str(t) for t in fits)
            instead = f"rollout.tensor_model_parallel_size={sizes}, or " if sizes else ""
            return (f"rollout.precision=fp8 with rollout.tensor_model_parallel_size={tp}: {name} ({list(full)}) "
                    f"{what}, and vLLM's block-FP8 kernels need both dimensions of every rank's shard to be "
                    f"multiples of {BLOCK}; use {instead}rollout.precision=auto.")
    return None


def block_quantize(weight: torch.Tensor, block: int = BLOCK) -> tuple[torch.Tensor, torch.Tensor]:
    """[out, in] weight -> (e4m3 weight [out, in], float32 scale_inv [ceil(out/block), ceil(in/block)]):
    each block's largest magnitude maps to 448, and weight ~= q * scale_inv blockwise."""
    out_dim, in_dim = weight.shape
    rows, cols = -(-out_dim // block), -(-in_dim // block)
    w = weight.detach().float()
    padded = torch.zeros(rows * block, cols * block, dtype=torch.float32, device=w.device)
    padded[:out_dim, :in_dim] = w
    blocks = padded.view(rows, block, cols, block)
    amax = blocks.abs().amax(dim=(1, 3))
    scale_inv = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
    q = (blocks / scale_inv[:, None, :, None]).clamp(-FP8_MAX, FP8_MAX).to(FP8)
    return q.view(rows * block, cols * block)[:out_dim, :in_dim].contiguous(), scale_inv


def block_dequantize(q: torch.Tensor, scale_inv: torch.Tensor, block: int = BLOCK) -> torch.Tensor:
    """The float32 weight an FP8 block checkpoint stands for (the reference for block_quantize)."""
    scale = scale_inv.repeat_interleave(block, dim=0).repeat_interleave(block, dim=1)
    return q.float() * scale[: q.shape[0], : q.shape[1]]


def fp8_checkpoint(named: Iterable[tuple[str, torch.Tensor]], dtype: torch.dtype) -> Iterator[tuple[str, torch.Tensor]]:
    """The pushed weights as vLLM reads a block-FP8 checkpoint: a linear layer's weight as its e4m3 tensor
    and `<name>_scale_inv`; every other tensor in the engine's dtype. One tensor quantized at a time."""
    for name, tensor in named:
        if is_quantized(name, tensor):
            q, scale_inv = block_quantize(tensor)
            yield name, q
            yield name + "_scale_inv", scale_inv
        else:
            yield name, tensor.to(dtype)
