"""The `hf` engine on a copy of the policy in a precision of its own (`rollout.precision` fp32, bf16,
int8), in the trainer's process (rollout.mode=sync) or in a sampler process (one_step_off)."""
from __future__ import annotations

import contextlib
from dataclasses import dataclass
from pathlib import Path

import torch

from portagrpo.rollout.engines import EngineInputs, HFRollout, hf_weight_names
from portagrpo.rollout.settings import EngineSettings


def copy_attention(settings: EngineSettings, backend) -> str:
    """The attention the copy runs with, asked of the backend at the dtype the copy computes in (the
    copy runs without autocast: a bf16 copy is bf16 throughout, an fp32 or int8 one fp32)."""
    from portagrpo.backends import BackendUnavailable

    precision = settings.copy_precision
    dtype, requested = SamplerCopy.PRECISIONS[precision], settings.attn_implementation
    try:
        return backend.attention_implementation(requested, dtype)
    except BackendUnavailable:
        if dtype == torch.bfloat16:
            raise
        backend.attention_implementation(requested, torch.bfloat16)  # refused there too: that reason stands
        from portagrpo.errors import UserError

        raise UserError(f"model.attn_implementation={requested} has no float32 kernels on --device {backend.name}, and "
                        f"the rollout copy computes in float32 (rollout.precision={precision}); use "
                        f"rollout.precision=bf16, or another model.attn_implementation.") from None


@dataclass(frozen=True)
class CopySource:
    """Where a sampler copy loads from: the run's model (or its saved initial one), its attention
    implementation at the copy's own dtype, and whether the LM head is tied."""

    path: Path
    attn: str
    tied: bool

    @classmethod
    def of(cls, settings: EngineSettings, backend, policy, init_model_dir: Path) -> "CopySource":
        from portagrpo.paths import resolve_model_path

        path = resolve_model_path(settings.model_path) if settings.model_path else Path(init_model_dir)
        return cls(path, copy_attention(settings, backend), bool(getattr(policy.config, "tie_word_embeddings", False)))


def int8_refusal(device: str):
    from portagrpo.errors import UserError

    return UserError(f"rollout.precision=int8 is PyTorch's dynamic int8 quantization, which runs on the CPU only; "
                     f"on --device {device} use rollout.precision=bf16.")


class SamplerCopy(HFRollout):
    """`rollout.precision` fp32 | bf16 | int8: the `hf` engine sampling from its own copy of the policy in
    that precision, loaded from the run's initial model and refreshed from the pushed weights after every
    update (as vLLM is). int8 is PyTorch's dynamic quantization of the linear layers (int8 weights, per
    token activation scales; CPU kernels only). The training weights are never touched; what the lower
    precision costs shows in the `rollout_corr/*` metrics, and `algorithm.rollout_correction` pays it."""

    holds_weights = True
    PRECISIONS = {"fp32": torch.float32, "bf16": torch.bfloat16, "int8": torch.float32}

    @classmethod
    def from_run(cls, inputs: EngineInputs) -> "SamplerCopy":
        from portagrpo.model.loading import load_model

        source = CopySource.of(inputs.settings, inputs.backend, inputs.policy, inputs.init_model_dir)
        device = next(inputs.policy.parameters()).device  # this rank's device
        return cls(load_model(source.path, source.attn).to(device), inputs.tokenizer, inputs.settings.precision,
                   int8_ok=inputs.backend.supports_dynamic_quantization(), device=inputs.backend.name,
                   tied_embeddings=source.tied)

    def __init__(self, model, tokenizer, precision: str, *, int8_ok: bool = True, device: str = "cpu",
                 tied_embeddings: bool = False) -> None:
        if precision == "int8" and not int8_ok:
            raise int8_refusal(device)
        self.precision, self.tied = precision, tied_embeddings
        self.master = model.to(self.PRECISIONS[precision]).eval().requires_grad_(False)
        super().__init__(self._sampler(), tokenizer, contextlib.nullcontext)  # the copy has its own dtype

    def _sampler(self):
        if self.precision != "int8":
            return self.master
        import copy
        import warnings

        from torch.ao.quantization import quantize_dynamic

        with warnings.catch_warnings():  # PyTorch announces the move of this API to torchao
            warnings.simplefilter("ignore")
            return quantize_dynamic(copy.deepcopy(self.master), {torch.nn.Linear}, dtype=torch.qint8)

    @torch.no_grad()
    def update_weights(self, named) -> int:
        """Copy the pushed (full, merged) weights into the copy, then requantize. Returns the tensor count."""
        params = dict(self.master.named_parameters())
        count = 0
        for name, tensor in hf_weight_names(named, tied_embeddings=self.tied):
            params[name].copy_(tensor)  # to the copy's device and dtype in the one copy
            count += 1
        if self.precision == "int8":
            requantize_in_place(self.model, self.master)
        return count


def requantize_in_place(quantized: torch.nn.Module, master: torch.nn.Module) -> None:
    """Refresh a `quantize_dynamic` copy of `master` from master's current weights without rebuilding it:
    each dynamic int8 linear layer gets its weight quantized as `quantize_dynamic` quantizes it (the
    default dynamic qconfig's per-tensor symmetric min/max observer), every other parameter is copied.
    Equal, bit for bit, to quantizing a fresh copy, at a fraction of its cost."""
    from torch.ao.nn.quantized.dynamic import Linear as DynamicInt8Linear
    from torch.ao.quantization import default_dynamic_qconfig

    floats = dict(master.named_modules())
    for name, module in quantized.named_modules():
        if isinstance(module, DynamicInt8Linear):
            linear = floats[name]
            observer = default_dynamic_qconfig.weight()
            observer(linear.weight)
            scale, zero_point = observer.calculate_qparams()
            weight = torch.quantize_per_tensor(linear.weight.float(), float(scale), int(zero_point), torch.qint8)
            module.set_weight_bias(weight, linear.bias)
    current = dict(master.named_parameters())
    for name, param in quantized.named_parameters():
        param.copy_(current[name])
