"""The weight push into vLLM's CPU build, in place (`CpuGemmWeights`): vLLM's CPU GEMM dispatch wrapped while the
engine is built, the first push recorded through vLLM's loader and later pushes copied straight where it wrote.
vLLM's layer classes are imported when an engine is built or inspected, never at import."""
from __future__ import annotations

import contextlib
from typing import Iterable, Iterator

import torch

from portagrpo.rollout.vllm_weights import Counted

# On vLLM's CPU build a linear layer whose weight is at most this many bytes computes with `F.linear` on its own
# weight instead of a prepared oneDNN GEMM. Measured (bench/vllm_push.py, docs/benchmarks.md): at decode sizes such
# weights run as fast plain (0.8x to 1.2x oneDNN's time, single thread, weights streamed from memory) while preparing
# one costs ~0.2 ms of fixed oneDNN work per layer per push; larger ones run up to 1.65x slower plain, so they stay
# prepared and are prepared again after each push.
PLAIN_GEMM_MAX_BYTES = 2 * 2**20


def _plain_linear(x: torch.Tensor, weight: torch.Tensor, bias: torch.Tensor | None) -> torch.Tensor:
    return torch.nn.functional.linear(x, weight, bias)


class CpuGemmWeights:
    """The push on vLLM's CPU build, in place. There each unquantized linear layer and the LM head compute with a
    GEMM prepared when the weights are processed (vllm/model_executor/layers/utils.py:
    `dispatch_cpu_unquantized_gemm`): oneDNN's blocked copy of the weight, held inside an opaque oneDNN handle (or
    sgl's packed tensor, or zentorch's), after which vLLM drops the layer's own weight. vLLM's layerwise reload
    rebuilds every such layer to change its weights (4.7x to 15x a copy of the weights, docs/benchmarks.md).

    Here, while the engine is built (`building`), vLLM's dispatch is wrapped so that every linear layer keeps its
    weight in checkpoint layout, and a layer of at most `PLAIN_GEMM_MAX_BYTES` computes with `F.linear` on that
    weight (nothing to prepare: a push into it is all it needs; vLLM's compiled forward reads the weight as an
    input). A larger layer keeps vLLM's prepared GEMM, made again from the kept weight after each push.

    A push writes the tensors where vLLM's own loader writes them. The first push goes through the model's
    `load_weights` and records, for each tensor, the views of the model's weights it was copied into; where every
    tensor was copied whole into views of the model's weights and nothing changed them after (checked), later pushes
    copy each tensor straight into its views: one copy each, without the loader's per-tensor work. Otherwise (a
    loader that shards, transforms or splits a tensor: tensor parallel, some vision towers) every push goes through
    `load_weights`. The embedding's own GEMM (unused: it only looks tokens up) is never prepared again."""

    def __init__(self, model, gemm_layers: list, dispatch, plain_layers: list | None = None,
                 expert_layers: list | None = None) -> None:
        self.model, self.gemm_layers, self.dispatch = model, gemm_layers, dispatch
        self.plain_layers = plain_layers or []
        self.expert_layers = expert_layers or []  # (MoE layer, its CPU experts' isa): packed again after each push
        self.plan: dict[str, list[torch.Tensor]] | None = None  # name -> views it is copied into, once recorded
        self.recorded = False
        self._fill_map: dict[str, list] | None = None  # name -> prepared layers whose weight it writes into
        self._filled_by: dict = {}  # prepared layer -> the names that write into its weight

    @staticmethod
    @contextlib.contextmanager
    def building(plain_max_bytes: int | None = None) -> Iterator[None]:
        """While vLLM builds an engine in this process: its CPU GEMM dispatch keeps every layer's weight, and gives
        small layers `F.linear` (see the class). Without vLLM's CPU dispatch (another vLLM, no vLLM) it does nothing."""
        try:
            from vllm.model_executor.layers import utils as layer_utils
            from vllm.model_executor.layers.linear import LinearBase
            from vllm.model_executor.layers.vocab_parallel_embedding import ParallelLMHead
        except ImportError:
            yield
            return
        original = getattr(layer_utils, "dispatch_cpu_unquantized_gemm", None)
        if original is None:
            yield
            return
        limit = PLAIN_GEMM_MAX_BYTES if plain_max_bytes is None else plain_max_bytes

        def dispatch(layer, remove_weight: bool) -> None:
            weight = layer.weight
            small = (not weight.is_meta and weight.ndim == 2 and weight.numel() * weight.element_size() <= limit
                     and isinstance(layer, (LinearBase, ParallelLMHead)))
            if small:
                layer.cpu_linear = _plain_linear
            else:
                original(layer, remove_weight=False)

        layer_utils.dispatch_cpu_unquantized_gemm = dispatch
        try:
            yield
        finally:
            layer_utils.dispatch_cpu_unquantized_gemm = original

    @classmethod
    def of(cls, get_model) -> "CpuGemmWeights | None":
        """For the model (`get_model()`, asked once vLLM's parts are found) that vLLM's CPU build processed with
        unquantized GEMMs only, built under `building` (every such layer kept its weight); None elsewhere (another
        platform, a quantized layer, weights dropped), where the engine's other paths load the weights."""
        try:
            from vllm.model_executor.layers.linear import LinearBase, UnquantizedLinearMethod
            from vllm.model_executor.layers.utils import dispatch_cpu_unquantized_gemm
            from vllm.model_executor.layers.vocab_parallel_embedding import (
                ParallelLMHead,
                UnquantizedEmbeddingMethod,
                VocabParallelEmbedding,
            )
        except ImportError:
            return None
        model = get_model()
        plain = (UnquantizedLinearMethod, UnquantizedEmbeddingMethod)
        layers = [m for m in model.modules() if isinstance(m, (LinearBase, VocabParallelEmbedding))]
        dispatched = [m for m in layers if hasattr(m, "cpu_linear")]
        if not dispatched or not all(isinstance(getattr(m, "quant_method", None), plain) for m in layers):
            return None
        if any(m.weight.numel() == 0 for m in dispatched):  # built without `building`: vLLM dropped the weights
            return None
        # the GEMMs vLLM computes with: linear layers (except those it keeps on plain weights, e.g. MLA's kv_b_proj)
        # and the LM head; an embedding's own is never used
        gemm = [m for m in dispatched if isinstance(m, ParallelLMHead) or (
            isinstance(m.quant_method, UnquantizedLinearMethod) and not getattr(m, "_cpu_skip_gemm_dispatch", False))]
        return cls(model, [m for m in gemm if m.cpu_linear is not _plain_linear], dispatch_cpu_unquantized_gemm,
                   [m for m in gemm if m.cpu_linear is _plain_linear], cpu_expert_layers(model))

    @torch.no_grad()
    def load(self, named: Iterable[tuple[str, torch.Tensor]]) -> int:
        """Every tensor into the kept weights, and every prepared GEMM made again from them; returns the count. With
        the recorded views, a layer's GEMM is prepared as soon as its last tensor is written (its weight is then
        still in the cache), else all of them after the loader."""
        if self.plan is None:
            count = self.write(named)
            self.prepare()
        else:
            count = self.write(named, prepare=True)
        self.pack_experts()
        return count

    def pack_experts(self) -> None:
        """A mixture-of-experts layer's experts in vLLM's CPU kernel layout again. vLLM's CPU experts
        (CPUUnquantizedExperts) repack w13/w2 into their grouped-GEMM layout once, when the engine is built, and a
        weight update does not repack them; the push writes checkpoint layout into those very tensors (every expert,
        whole), so each is packed again here from a copy of what was written."""
        if not self.expert_layers:
            return
        import vllm._custom_ops  # noqa: F401 - registers torch.ops._C

        for layer, isa in self.expert_layers:
            for name in ("w13_weight", "w2_weight"):
                live = getattr(layer, name).data
                torch.ops._C.prepack_moe_weight(live.clone(), live, isa)

    @torch.no_grad()
    def write(self, named: Iterable[tuple[str, torch.Tensor]], prepare: bool = False) -> int:
        """Every tensor into the model's weights: straight into the recorded views, or through `load_weights` (the
        first push records the views). With `prepare` (recorded views only), each prepared GEMM is made again once
        every tensor of its weight is written."""
        if self.plan is None:
            return self._load_recording(named) if not self.recorded else self._load(named)
        fills = self._fills() if prepare else {}
        left = {layer: len(names) for layer, names in self._filled_by.items()} if prepare else {}
        count, seen = 0, set()
        for name, tensor in named:
            views = self.plan.get(name)
            if views is None:
                raise RuntimeError(f"the weight push sent {name}, which the first push into vLLM did not send")
            for view in views:
                view.copy_(tensor)
            seen.add(name)
            count += 1
            for layer in fills.get(name, ()):
                left[layer] -= 1
                if left[layer] == 0:
                    self.dispatch(layer, remove_weight=False)
        if len(seen) != len(self.plan):
            missing = sorted(set(self.plan) - seen)
            raise RuntimeError(f"the weight push did not send {', '.join(missing[:5])}, which vLLM's model holds: "
                               f"the engine would keep their old values")
        if prepare:  # a prepared layer that no pushed tensor fills (nothing changed it) is prepared all the same
            for layer in self.gemm_layers:
                if left.get(layer, 0) or layer not in left:
                    self.dispatch(layer, remove_weight=False)
        return count

    def _fills(self) -> dict[str, list]:
        """Which prepared layers each pushed tensor writes into (by the storage of the layer's weight), once."""
        if self._fill_map is None:
            by_storage = {layer.weight.untyped_storage().data_ptr(): layer for layer in self.gemm_layers}
            self._fill_map, self._filled_by = {}, {}
            for name, views in self.plan.items():
                layers = {by_storage[p] for p in (v.untyped_storage().data_ptr() for v in views) if p in by_storage}
                self._fill_map[name] = list(layers)
                for layer in layers:
                    self._filled_by.setdefault(layer, set()).add(name)
        return self._fill_map

    def prepare(self) -> None:
        """Each prepared GEMM made again from its layer's kept weight."""
        for layer in self.gemm_layers:
            self.dispatch(layer, remove_weight=False)

    def _load(self, named) -> int:
        counted = Counted(named)
        self.model.load_weights(iter(counted))
        return counted.count

    def _load_recording(self, named) -> int:
        """Through vLLM's loader, recording where each tensor was copied; the plan is kept only if every tensor went
        whole into views of the model's weights and holds there, unchanged, when the loader is done."""
        self.recorded = True
        sent: dict[tuple, str] = {}
        tensors: list[tuple[str, torch.Tensor]] = []

        def remembered():
            for name, tensor in named:
                sent[_identity(tensor)] = name
                tensors.append((name, tensor))
                yield name, tensor

        recorder = _CopyRecorder(sent)
        with recorder:
            count = self._load(remembered())
        owned = {t.untyped_storage().data_ptr() for t in (*self.model.parameters(), *self.model.buffers())}
        plan: dict[str, list[torch.Tensor]] = {}
        for name, view in recorder.copies:
            plan.setdefault(name, []).append(view)
        for name, tensor in tensors:
            views = plan.get(name)
            if not views or not all(v.untyped_storage().data_ptr() in owned and v.shape == tensor.shape
                                    and torch.equal(v, tensor.to(v.dtype)) for v in views):
                tensors.clear()  # release the pushed tensors before returning
                return count
        self.plan = plan
        tensors.clear()
        return count


def cpu_expert_layers(model) -> list:
    """(layer, isa) of each MoE layer whose experts run vLLM's CPU grouped-GEMM kernel on prepacked weights; a layer
    whose intermediate size vLLM pads for that kernel is refused (a push could not write its padded rows)."""
    try:
        from vllm.model_executor.layers.fused_moe.experts.cpu_moe import CPUUnquantizedExperts
    except ImportError:
        return []
    out = []
    for module in model.modules():
        kernel = getattr(getattr(module, "quant_method", None), "moe_kernel", None)
        experts = getattr(kernel, "fused_experts", None)
        if not isinstance(experts, CPUUnquantizedExperts) or getattr(experts, "_use_zentorch", False):
            continue
        config = module.moe_config
        if experts._padded_intermediate_size(config) != config.intermediate_size_per_partition:
            from portagrpo.errors import UserError

            raise UserError(f"vLLM's CPU build pads this model's expert intermediate size "
                            f"{config.intermediate_size_per_partition} to a multiple of "
                            f"{experts._intermediate_alignment()}, where a weight push cannot write; train it with "
                            f"rollout.engine=hf on the CPU.")
        out.append((module, experts.isa))
    return out


def _identity(tensor: torch.Tensor) -> tuple:
    return tensor.data_ptr(), tuple(tensor.shape), tuple(tensor.stride()), tensor.dtype


class _CopyRecorder(torch.overrides.TorchFunctionMode):
    """Which pushed tensors vLLM's loader copies whole, and into which tensors (`dst.copy_(pushed)`)."""

    def __init__(self, sent: dict[tuple, str]) -> None:
        super().__init__()
        self.sent, self.copies = sent, []

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", None) == "copy_" and len(args) >= 2 and isinstance(args[1], torch.Tensor):
            name = self.sent.get(_identity(args[1]))
            if name is not None:
                self.copies.append((name, args[0].data))
        return func(*args, **kwargs)
