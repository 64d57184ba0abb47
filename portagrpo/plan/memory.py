"""The memory plan of a run, before it starts: what each rank holds on its device, phase by phase, and what each node
holds in host memory, from the model's config.json (an empty model on the meta device: no weights read) and the run's
config. Pure arithmetic over a `ModelShape` and a `RunShape`; `portagrpo plan` (tools/plan.py) prints it.

The terms, per rank (F: the ranks one FSDP2 shard group spans, 1 without FSDP2; bm: the master dtype's bytes, 4;
bc: the compute dtype's, model.dtype):
- states: the policy's parameters bm*P/F, AdamW's two moments 2*bm*P_train/F, the reference bc*P/F (none with LoRA,
  whose reference is the base under the adapter), gradients bm*P_train/F during the update (bm*P_train whole with
  actor.use_no_sync_for_gradient_accumulation, the unsharded gradients FSDP2 accumulates). actor.offload moves the
  policy's three to host memory, actor.ref_offload the reference's.
- FSDP2's gathers: a forward holds the root unit (final norm; tied embeddings and LM head) and about three decoder
  layers unsharded in the compute dtype (the layer running, the next one prefetched, the all-gather's output buffer),
  or one rank's block of an untied head or embedding (units of their own, model/parallel.py split_root, read by rows:
  StreamedRows); a backward also holds the root's unsharded gradient, a layer's unsharded gradients and the
  reduce-scatter's fp32 input, or the head's block with its fp32 gradient and this rank's own.
- activations of one micro-batch: per token and layer, what a Llama-style layer saves for backward
  (ACT_H_COMPUTE compute-dtype and ACT_H_FP32 fp32 tensors of the hidden size, ACT_I tensors of the MLP width, and,
  where the backend's attention keeps its scores, heads x sequence length); with gradient checkpointing only each
  layer's input (GC_H tensors of the hidden size), plus one layer recomputed in full; the log-prob kernel's chunk of
  logits (kernels/chunked.py) and its gradient.
- the rollout: the hf engine samples with the training model, gathered whole (bc*P plus one layer's gather buffer)
  with its KV cache; vLLM takes rollout.vllm_gpu_memory_utilization of the device while it samples and, where the
  backend has sleep mode, nothing while it sleeps; its weights (bc*P / tensor-parallel size) are awake for the push.

The constants were fitted to the emulated device's byte counts (tests/emulated/test_memory_plan.py keeps the plan
within 15% of what 2 and 4 emulated ranks measure, phase by phase, on six model shapes); docs/memory.md has the
model, the figures and what each knob costs.
"""
from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

GIB = 2**30
PINNED = " (page-locked)"  # marks a host-memory item that is pinned
DTYPE_BYTES = {"fp32": 4, "bf16": 2, "fp16": 2, "fp64": 8}

# per token and decoder layer, what training saves for backward (fitted on the emulated device, Llama layers)
ACT_H_COMPUTE = 4.5  # tensors of the hidden size in the compute dtype (inputs of the projections, q/k/v, outputs)
ACT_H_FP32 = 7.5  # fp32 tensors of the hidden size (RMSNorm computes in fp32 and keeps its normalised input)
ACT_I = 4.0  # tensors of the MLP width (gate, up, the activation, their product)
FWD_I, FWD_H = 2.0, 2.0  # a forward without gradients: a layer's working set, MLP-width and hidden-size tensors
GC_H = 2.0  # with gradient checkpointing: a layer's saved input (and its rotary inputs), hidden-size tensors
FWD_GATHER_UNITS = 3.0  # FSDP2 forward: layers unsharded at once (running, prefetched, all-gather output)
BWD_GATHER_UNITS = 2.4  # FSDP2 backward: layer-sized compute-dtype tensors at once (parameters, their gradients)
BWD_GRAD_UNITS = 1.1  # ... and layer-sized fp32 ones (the reduce-scatter's input and output)
GEN_GATHER_UNITS = 0.5  # the hf engine's whole-model gather: an all-gather buffer on top, on average half a layer
# (an untied head's whole: the largest unit)
ADAM_TEMP = 1.0  # AdamW's foreach step: one temporary the size of the parameters it updates (fp32); fused: none
# trainer.parallel=ep (model/expert_parallel.py): tensors of top-k x hidden per token that one MoE layer keeps in flight
# beside what a layer saves: the dispatched tokens and the experts' output (2, saved for the backward), and in the
# forward the sorted copy, the received copy, the output before and after the return exchange (4, transient).
A2A_SAVED = 2.0
A2A_WORK = 4.0
# A rank's experts receive up to this many times their even share of the routed tokens: an allowance, not a
# measurement (a router under training is not balanced, and the dispatcher drops no token: no capacity factor).
EP_IMBALANCE = 2.0
LOGITS_CHUNK_ELEMENTS = 2**25  # kernels/chunked.py's chunk of logits (fp32), and its gradient in the backward
HOST_BUFFER_GB = 4.0  # a rank's host-side working set besides offloaded states (Python, CUDA context, loaders)


@dataclass(frozen=True)
class ModelShape:
    """What the plan needs of a model, counted from its config.json on the meta device."""

    name: str
    params: int  # parameters, each tied tensor once
    unit_params: int  # the largest FSDP2 unit: a decoder layer or a vision block
    root_params: int  # parameters in the root unit (final norm, the vision merger; tied embeddings and LM head)
    vision_params: int  # the vision tower's
    layers: int
    hidden: int
    mlp_width: int  # MLP width a token goes through (an MoE: experts per token x expert width, + shared experts)
    heads: int
    kv_heads: int
    head_dim: int
    vocab: int
    experts: int = 0  # routed experts per MoE layer (0: dense)
    experts_per_token: int = 0
    active_params: int = 0  # parameters one token uses (an MoE's routed experts counted top-k of E)
    vision_hidden: int = 0  # a vision tower's block width, MLP width, depth, and patches merged into one token
    vision_mlp: int = 0
    vision_depth: int = 0
    vision_merge: int = 1
    vision_patch: int = 0  # pixel values per patch (channels x temporal patch x patch side squared)
    head_params: int = 0  # an untied LM head's parameters, and its input embedding's: two units of their own
    embedding_streams: bool = True  # the input embedding is torch's own lookup (model/parallel.py streams_lookup)
    head_streams: bool = True  # the LM head is a linear layer without a bias (model/parallel.py streams_head)
    # the largest tensor the push holds at once (elements): it gathers one tensor at a time, and a packed expert tensor
    # one expert at a time (model/weight_push.py push_pairs)
    largest_tensor: int = 0
    expert_params: int = 0  # every MoE layer's routed experts (what trainer.parallel=ep splits over the ranks)
    layer_experts: int = 0  # one MoE layer's routed experts

    @property
    def is_moe(self) -> bool:
        return self.experts > 0


@dataclass(frozen=True)
class Cluster:
    nodes: int
    devices_per_node: int
    device_memory_gb: float  # nominal, as the device's name says (80 for an H100 80GB)
    host_memory_gb: float  # per node
    usable_fraction: float = 1.0  # of the nominal figure, what torch can allocate (the backend row's)

    @property
    def world(self) -> int:
        return self.nodes * self.devices_per_node

    @property
    def capacity(self) -> float:
        """Bytes of one device that torch can allocate: the nominal figure times the backend row's usable share."""
        return self.device_memory_gb * self.usable_fraction * GIB


@dataclass(frozen=True)
class RunShape:
    """The settings of a run that decide its memory, read from its config (`from_config`)."""

    strategy: str  # fsdp2 | ddp | none
    shard_group: int  # ranks one FSDP2 shard group spans (F)
    master_bytes: int
    compute_bytes: int
    trainable_params: int
    has_ref: bool
    offload: bool
    ref_offload: bool
    no_sync: bool  # unsharded gradients kept across a mini-batch's micro-batches
    accumulation: int  # micro-batches per optimizer step on a rank
    update_tokens: int  # tokens of one update micro-batch (rows x padded width, or the dynamic token budget)
    update_rows: int
    scoring_tokens: int
    scoring_rows: int
    seq_len: int  # prompt + response, padded
    gradient_checkpointing: bool
    activation_offload: bool
    engine: str  # hf | vllm | other
    rollout_rows: int  # responses one rank samples in a step (the hf engine's KV cache)
    vllm_fraction: float
    vllm_sleeps: bool
    tensor_parallel: int
    attention_keeps_scores: bool  # the backend's attention saves heads x length x length (a math/eager path)
    sequence_parallel: int = 1
    runtime_reserve: float = 0.0  # bytes the device runtime and collective library keep (the backend row's allowance)
    image_tokens: int = 0  # image tokens a row may carry (a vision-language run: its prompt length bounds them)
    routes: float = 0.0  # router replay: the global batch's recorded experts (int16), held on every rank
    prompts: int = 0  # prompts in a step's global batch (a vision-language run holds each one's pixel values)
    fused_adamw: bool = False  # the backend row's fused AdamW: it updates in place, no temporaries
    token_budget: bool = False  # actor.use_dynamic_bsz: micro-batches are cut by ppo_max_token_len_per_gpu
    pinned_offload: bool = False  # offloaded shards page-locked (backend row pinned_offload and actor.pin_offload)
    pinned_activations: bool = False  # offloaded activations page-locked (the backend row's pinned_offload)
    # the schedule samples in a process of its own (rollout.mode=one_step_off), on an accelerator a device of its own
    # (rollout.devices, after the trainers'): the engine is planned there, and the trainer's devices only gather
    sampler_apart: bool = False
    sampler_param_bytes: int = 4  # an hf sampler's copy of the policy, per parameter (rollout.precision)
    # an untied head and embedding read by rows (model/parallel.py StreamedRows, actor.stream_head_rows); gathered
    # units with actor.offload, and the head with LoRA on it
    head_streams: bool = True
    embedding_streams: bool = True
    ep: int = 1  # trainer.parallel=ep: ranks one expert-parallel group spans (trainer.ep_size), 1 otherwise
    world: int = 1  # training ranks (an expert tensor is split over all of them under ep: efsdp x ep)
    vllm_ep: int = 1  # rollout.expert_parallel_size: vLLM holds 1/vllm_ep of the routed experts a rank (1: off)
    vllm_ep_allowed: bool = True  # the backend row's vLLM can split the experts (BackendSpec.vllm_expert_parallel)


@dataclass
class PhasePlan:
    name: str
    items: dict[str, float] = field(default_factory=dict)  # bytes per rank

    @property
    def total(self) -> float:
        return sum(self.items.values())


@dataclass
class Plan:
    model: ModelShape
    cluster: Cluster
    run: RunShape
    phases: list[PhasePlan]
    host_per_node: dict[str, float]
    advice: list[str]

    @property
    def peak(self) -> PhasePlan:
        return max(self.phases, key=lambda p: p.total)

    @property
    def vllm_weights(self) -> float:
        """Bytes of the policy's weights in one colocated vLLM engine's share of a device (0 without one)."""
        r = self.run
        if r.engine != "vllm" or r.sampler_apart:
            return 0.0
        return vllm_weight_bytes(self.model, r)

    @property
    def vllm_short(self) -> bool:
        """vLLM's weights alone exceed its rollout.vllm_gpu_memory_utilization share (vLLM then stops at start, with
        no memory left for its KV cache)."""
        return self.vllm_weights > self.run.vllm_fraction * self.cluster.capacity

    @property
    def fits_device(self) -> bool:
        return self.peak.total <= self.cluster.capacity and not self.vllm_short

    @property
    def pinned_per_node(self) -> float:
        """Of the host memory per node, the bytes that are page-locked (the kernel cannot swap or reclaim them)."""
        return sum(v for k, v in self.host_per_node.items() if k.endswith(PINNED))

    @property
    def fits_host(self) -> bool:
        return sum(self.host_per_node.values()) <= self.cluster.host_memory_gb * GIB

    @property
    def fits(self) -> bool:
        return self.fits_device and self.fits_host

    def as_json(self) -> dict[str, Any]:
        return {
            "model": asdict(self.model), "cluster": asdict(self.cluster), "run": asdict(self.run),
            "phases": {p.name: {"peak_gib": p.total / GIB, "items_gib": {k: v / GIB for k, v in p.items.items()}}
                       for p in self.phases},
            "peak_phase": self.peak.name, "peak_gib": self.peak.total / GIB,
            "host_per_node_gib": {k: v / GIB for k, v in self.host_per_node.items()},
            "pinned_host_per_node_gib": self.pinned_per_node / GIB,
            "fits_device": self.fits_device, "fits_host": self.fits_host, "fits": self.fits, "advice": self.advice,
        }


def layer_activation_bytes(m: ModelShape, r: RunShape, tokens: int, seq_len: int) -> float:
    """What one decoder layer saves for backward over `tokens` tokens of rows `seq_len` long (no checkpointing)."""
    per_token = (ACT_H_COMPUTE * r.compute_bytes * m.hidden + ACT_H_FP32 * 4 * m.hidden
                 + ACT_I * r.compute_bytes * m.mlp_width)
    if r.attention_keeps_scores:
        per_token += m.heads * seq_len * r.compute_bytes
    if m.is_moe:
        per_token += 2 * 4 * m.experts  # router logits and probabilities, fp32
    if r.ep > 1:
        per_token += A2A_SAVED * EP_IMBALANCE * m.experts_per_token * m.hidden * r.compute_bytes
    return per_token * tokens / max(r.sequence_parallel, 1)


def exchange_bytes(m: ModelShape, r: RunShape, tokens: int) -> dict[str, float]:
    """Under expert parallelism, one MoE layer's all-to-all copies in flight (not saved) over `tokens` tokens."""
    if r.ep <= 1:
        return {}
    copies = A2A_WORK * EP_IMBALANCE * m.experts_per_token * m.hidden * r.compute_bytes * tokens
    return {"expert all-to-all copies in flight (one layer)": copies / max(r.sequence_parallel, 1)}


def activations(m: ModelShape, r: RunShape, tokens: int, rows: int, training: bool) -> dict[str, float]:
    """One micro-batch's activations on a rank: saved for backward (training), or a forward's working set."""
    seq = r.seq_len
    one_layer = layer_activation_bytes(m, r, tokens, seq)
    logits = min(LOGITS_CHUNK_ELEMENTS, max(tokens, 1) * m.vocab) * 4
    hidden_out = tokens * m.hidden * 4 / max(r.sequence_parallel, 1)  # final hidden states, upcast for the kernel
    if not training:  # nothing saved: a layer's working set, its MLP's two widest tensors and two of the hidden size
        per_token = r.compute_bytes * (FWD_I * m.mlp_width + FWD_H * m.hidden)
        if r.attention_keeps_scores:
            per_token += m.heads * seq * r.compute_bytes
        working = per_token * tokens / max(r.sequence_parallel, 1)
        return {"one layer's working set (forward only)": working, "logits chunk": logits,
                "final hidden states": hidden_out, **exchange_bytes(m, r, tokens)}
    if r.gradient_checkpointing:
        saved = m.layers * GC_H * r.compute_bytes * m.hidden * tokens / max(r.sequence_parallel, 1)
        recompute = one_layer
    else:
        saved, recompute = m.layers * one_layer, 0.0
    if r.activation_offload:
        saved = saved / m.layers  # each layer's saved tensors go to host memory; one layer's on the device
    out = {"saved activations": saved, "logits chunk and its gradient": 2 * logits, "final hidden states": hidden_out,
           **exchange_bytes(m, r, tokens)}
    if recompute:
        out["one layer recomputed"] = recompute
    if m.vision_depth and r.image_tokens:
        out["vision tower's saved activations"] = vision_activation_bytes(m, r, rows)
    return out


def vision_activation_bytes(m: ModelShape, r: RunShape, rows: int) -> float:
    """A vision-language micro-batch's tower: each image token is `vision_merge` patches, each block saves per patch
    what a decoder layer saves per token (checkpointed: its input only, plus one block recomputed)."""
    patches = rows * r.image_tokens * m.vision_merge
    block = (ACT_H_COMPUTE * r.compute_bytes * m.vision_hidden + ACT_H_FP32 * 4 * m.vision_hidden
             + ACT_I * r.compute_bytes * m.vision_mlp) * patches
    if r.gradient_checkpointing:
        return m.vision_depth * GC_H * r.compute_bytes * m.vision_hidden * patches + block
    return m.vision_depth * block


def plan(m: ModelShape, cluster: Cluster, r: RunShape) -> Plan:
    """The plan of `r` on `cluster`, with the settings that would make it fit when it does not."""
    phases, host = _phases(m, cluster, r)
    out = Plan(m, cluster, r, phases, host, [])
    out.advice = advise(out)
    return out


@dataclass(frozen=True)
class _Terms:
    """The bytes every phase builds on, per rank."""

    fsdp: bool
    shards: int  # F: ranks one FSDP2 group spans, 1 without FSDP2
    spread: float  # the share of the parameters one rank holds (1 / F; under ep the experts over every rank)
    states: dict[str, float]  # what is resident from the load on (parameters, reference, the runtime's allowance)
    steady: dict[str, float]  # ... and AdamW's state, from the first update on
    grads: float
    fwd_gather: float
    bwd_gather: float


def _terms(m: ModelShape, r: RunShape) -> _Terms:
    fsdp = r.strategy in ("fsdp2", "ep")
    F = r.shard_group if fsdp else 1
    bm, bc, P, Ptr = r.master_bytes, r.compute_bytes, m.params, r.trainable_params
    # the share of the parameters a rank holds: 1/F under FSDP2; under ep the dense part over F and the routed
    # experts over every rank (efsdp x ep)
    experts = m.expert_params if r.strategy == "ep" else 0
    spread = ((P - experts) / F + experts / max(r.world, 1)) / P if P and experts else 1.0 / F
    grads = 0.0 if r.offload else bm * Ptr * spread
    if r.no_sync and r.accumulation > 1 and fsdp:
        grads = bm * Ptr  # unsharded, kept across the micro-batches (on the device even with offload)
    states = {"policy parameters": 0.0 if r.offload else bm * P * spread,
              "reference parameters": (0.0 if r.ref_offload else bc * P * spread) if r.has_ref else 0.0}
    if r.runtime_reserve:
        states["device runtime and collective buffers (allowance)"] = r.runtime_reserve
    steady = {**states, "optimizer state (AdamW)": 0.0 if r.offload else 2 * bm * Ptr * spread}
    # under ep a layer's experts are gathered over efsdp only: this rank's ep block, never the layer's whole experts
    unit, root, head = expert_parallel_unit(m, r), m.root_params, m.head_params
    # The root stays gathered from the forward's start to the backward's end, and holds its unsharded gradient from
    # the head's backward on (the LM head's, where tied). Gradients and their reduce-scatter buffers exist for
    # trained parameters only (LoRA: its adapters' share).
    trained = min(Ptr / P, 1.0) if P else 1.0
    # The untied head and embedding (units of their own) are read one rank's rows at a time (model/parallel.py
    # StreamedRows): a block of head / F rows in the compute dtype; in the backward the head's block again with the
    # block's fp32 gradient and this rank's own, the embedding's the two gradients alone. A gathered one (LoRA on the
    # head; an embedding of another kind) holds its whole weight beside its all-gather's output in the forward, and
    # its unsharded gradient as well in its backward (measured on the emulated device: test_memory_plan_measured).
    block = head / F
    head_fwd, head_bwd = (block * bc, block * (bc + 8 * trained)) if m.head_streams and r.head_streams else (
        2 * head * bc, (2 + trained) * head * bc)
    embed_fwd, embed_bwd = (block * bc, block * 8 * trained) if m.embedding_streams and r.embedding_streams else (
        2 * head * bc, (2 + trained) * head * bc)
    fwd = (root + FWD_GATHER_UNITS * unit) * bc if fsdp else 0.0
    fwd = max(fwd, (root + unit) * bc + max(head_fwd, embed_fwd)) if fsdp else 0.0
    layers_bwd = BWD_GATHER_UNITS * unit * bc + BWD_GRAD_UNITS * trained * unit * 4
    bwd = ((1 + trained) * root * bc + max(layers_bwd, head_bwd, embed_bwd)) if fsdp else 0.0
    return _Terms(fsdp, F, spread, states, steady, grads, fwd, bwd)


def vllm_weight_bytes(m: ModelShape, r: RunShape) -> float:
    """One colocated vLLM rank's weights: the model over its tensor-parallel group, or under vLLM's expert parallelism
    (rollout.expert_parallel_size) the routed experts over the expert-parallel ranks (whole experts a rank) and the
    rest over the tensor-parallel group."""
    experts = m.expert_params if r.vllm_ep > 1 else 0
    return r.compute_bytes * ((m.params - experts) / max(r.tensor_parallel, 1) + experts / max(r.vllm_ep, 1))


def expert_parallel_unit(m: ModelShape, r: RunShape) -> float:
    """The largest decoder layer as a rank gathers it: whole under FSDP2; under ep its routed experts are the rank's
    ep block (1/ep of them)."""
    if r.strategy != "ep":
        return m.unit_params
    return m.unit_params - m.layer_experts * (1 - 1 / max(r.ep, 1))


def _load(m: ModelShape, r: RunShape, t: _Terms) -> PhasePlan:
    load = dict(t.states)
    if not t.fsdp:
        load["policy parameters"] = r.master_bytes * m.params  # whole on every rank
    return PhasePlan("load", load)


def _push(m: ModelShape, r: RunShape, t: _Terms) -> PhasePlan:
    push = _held(m, r, t)
    if r.engine == "vllm" and not r.sampler_apart:
        push["vLLM weights (awake for the push)"] = vllm_weight_bytes(m, r)
    if t.fsdp and (r.engine == "vllm" or r.sampler_apart):
        # gathered in the master dtype (model/weight_push.py push_pairs: packed experts one expert at a time), a layer's
        # held until vLLM's layerwise reload has all of it (or it is sent to the sampler process): of its experts,
        # those this rank's engine keeps (every one, but 1/vllm_ep under vLLM's expert parallelism)
        layer = m.unit_params - m.layer_experts + m.layer_experts / max(r.vllm_ep, 1)
        push["whole tensors gathered for the push (a layer's, or the largest)"] = (
            max(layer, m.largest_tensor) * r.master_bytes)
    return PhasePlan("push", push)


def _sampler(m: ModelShape, cluster: Cluster, r: RunShape) -> PhasePlan:
    """A sampler process's own device (rollout.mode=one_step_off): its engine alone, vLLM's share of the device or
    an hf copy of the policy in rollout.precision with its KV cache."""
    if r.engine == "vllm":
        return PhasePlan("sampler", {"vLLM (weights, KV cache, its activations)": r.vllm_fraction
                                            * cluster.capacity})
    kv = 2 * m.layers * m.kv_heads * m.head_dim * r.sampler_param_bytes * r.rollout_rows * r.seq_len
    return PhasePlan("sampler", {"the sampler's copy of the policy": r.sampler_param_bytes * m.params,
                                        "KV cache": kv})


def _held(m: ModelShape, r: RunShape, t: _Terms) -> dict[str, float]:
    """What every phase from the rollout to the push holds: the states, and the step's global batch where its
    images make it count (every rank keeps the gathered batch; the rows of a prompt share its fp32 pixel values,
    `image_tokens` x `vision_merge` patches of `vision_patch` values each)."""
    held = dict(t.steady)
    if m.vision_patch and r.image_tokens and r.prompts:
        held["the step's images (every prompt's pixel values)"] = (4.0 * r.prompts * r.image_tokens * m.vision_merge
                                                                   * m.vision_patch)
    return held


def _rollout(m: ModelShape, cluster: Cluster, r: RunShape, t: _Terms) -> PhasePlan:
    rollout, bc = _held(m, r, t), r.compute_bytes
    if r.sampler_apart:  # sampling happens on the sampler's device (`_sampler`) while this one updates
        return PhasePlan("rollout", rollout)
    if r.engine == "vllm":
        rollout["vLLM (weights, KV cache, its activations)"] = r.vllm_fraction * cluster.capacity
    elif r.engine == "hf":
        if t.fsdp:  # under ep every unit but the experts' (gathered over efsdp: the rank's ep block)
            gathered = m.params - (m.expert_params * (1 - 1 / r.ep) if r.strategy == "ep" else 0)
            rollout["the policy gathered whole for sampling"] = bc * (gathered + max(
                GEN_GATHER_UNITS * expert_parallel_unit(m, r), m.head_params))
        rollout["KV cache"] = 2 * m.layers * m.kv_heads * m.head_dim * bc * r.rollout_rows * r.seq_len
    return PhasePlan("rollout", rollout)


def _scoring(m: ModelShape, r: RunShape, t: _Terms) -> PhasePlan:
    scoring = _held(m, r, t)
    scoring["FSDP2 gathered units"] = t.fwd_gather
    if r.routes:  # gathered over the ranks as their bytes: every rank's part, then the concatenation (held, int16)
        scoring["the batch's routes (router replay), gathered"] = 2 * r.routes
    scoring.update(activations(m, r, r.scoring_tokens, r.scoring_rows, training=False))
    return PhasePlan("scoring", scoring)


def _update(m: ModelShape, r: RunShape, t: _Terms) -> PhasePlan:
    """The largest of a micro-batch's forward (its activations saved so far and the layers gathered) or backward
    (all of them saved, a layer's parameters and gradients unsharded), with the gradients of the mini-batch's earlier
    micro-batches held; and AdamW's step (gradients and its temporaries, no activations)."""
    update = _held(m, r, t)
    if r.accumulation > 1 or (r.no_sync and t.fsdp):
        update["gradients of the earlier micro-batches"] = t.grads
    update.update(activations(m, r, r.update_tokens, r.update_rows, training=True))
    if r.routes:
        update["the batch's routes (router replay)"] = r.routes
    update["FSDP2 gathered units and unsharded gradients"] = max(t.fwd_gather, t.bwd_gather)
    if r.strategy == "ddp":
        update["gradient all-reduce buffers"] = 2 * r.master_bytes * r.trainable_params  # flat buffer, summed copies
    step = _held(m, r, t)
    step["gradients"] = t.grads
    step["AdamW's step temporaries"] = (0.0 if r.offload or r.fused_adamw
                                        else ADAM_TEMP * r.master_bytes * r.trainable_params * t.spread)
    return PhasePlan("update", step if sum(step.values()) > sum(update.values()) else update)


def _host(m: ModelShape, cluster: Cluster, r: RunShape, t: _Terms) -> dict[str, float]:
    per_node, bm, P, Ptr = cluster.devices_per_node, r.master_bytes, m.params, r.trainable_params
    host = {"working set of each rank": HOST_BUFFER_GB * GIB * per_node}
    shards = PINNED if r.pinned_offload else ""
    if r.offload:
        host["offloaded policy, gradients and AdamW state" + shards] = 4 * bm * P * t.spread * per_node
    if r.ref_offload and r.has_ref:
        host["offloaded reference" + shards] = r.compute_bytes * P * t.spread * per_node
    if r.activation_offload:  # each layer's saved tensors (its input, with checkpointing) wait in host memory
        tokens = r.update_tokens / max(r.sequence_parallel, 1)
        per_layer = (GC_H * r.compute_bytes * m.hidden * tokens if r.gradient_checkpointing
                     else layer_activation_bytes(m, r, r.update_tokens, r.seq_len))
        host["offloaded activations" + (PINNED if r.pinned_activations else "")] = m.layers * per_layer * per_node
    staging = bm * P + 2 * bm * Ptr
    if r.offload and t.fsdp:
        # the sharded checkpoint writes the offloaded states where they already are (host memory, counted above):
        # no second copy (issue 51: 72B on one node planned 2063 GiB against about 1.25 TiB)
        return host
    host["checkpoint staging (one rank's shards at a time)"] = staging * t.spread * per_node if t.fsdp else staging
    return host


def _phases(m: ModelShape, cluster: Cluster, r: RunShape) -> tuple[list[PhasePlan], dict[str, float]]:
    t = _terms(m, r)
    phases = [_load(m, r, t), _push(m, r, t), _rollout(m, cluster, r, t), _scoring(m, r, t), _update(m, r, t),
              PhasePlan("checkpoint", dict(t.steady))]  # after the step: its batch is gone
    if r.sampler_apart:
        phases.append(_sampler(m, cluster, r))
    return phases, _host(m, cluster, r, t)


def advise(p: Plan) -> list[str]:
    """Settings that would make a plan that does not fit fit, cheapest first, each checked by planning it."""
    if p.fits:
        return []
    from dataclasses import replace

    cap = p.cluster.capacity
    r = p.run
    if p.vllm_short:
        return _vllm_advice(p)
    if p.fits_device:  # the host overflows: only settings that take host memory back can fix it
        return _host_advice(p) or ["none of the single settings tried fits the host: more nodes (trainer.nnodes) "
                                   "spread the offloaded shards, or plan for more host memory (trainer.host_memory_gb)"]
    tries: list[tuple[str, RunShape]] = []
    if r.no_sync:
        tries.append(("actor.use_no_sync_for_gradient_accumulation=false", replace(r, no_sync=False)))
    if not r.gradient_checkpointing:
        tries.append(("model.gradient_checkpointing=true", replace(r, gradient_checkpointing=True)))
    if r.has_ref and not r.ref_offload and r.strategy in ("fsdp2", "ep"):
        tries.append(("actor.ref_offload=true", replace(r, ref_offload=True)))
    if r.engine == "vllm" and r.vllm_fraction > 0.3:
        tries.append(("rollout.vllm_gpu_memory_utilization=0.3", replace(r, vllm_fraction=0.3)))
    if r.update_rows > 1:
        half = max(1, r.update_rows // 2)
        tokens = r.update_tokens * half // r.update_rows
        # under a token budget micro_batch_size changes nothing: the budget is the knob (per rank, an SP group's
        # micro-batch holds sp x budget tokens)
        knob = (f"actor.ppo_max_token_len_per_gpu={tokens // max(r.sequence_parallel, 1)}" if r.token_budget
                else f"actor.micro_batch_size={half}")
        tries.append((knob, replace(r, update_rows=half, update_tokens=tokens)))
    if not r.offload and r.strategy in ("fsdp2", "ep"):
        tries.append(("actor.offload=true", replace(r, offload=True)))
    if p.model.is_moe and r.strategy == "fsdp2":
        tries.append(("trainer.parallel=ep", replace(r, strategy="ep", ep=r.world, shard_group=r.world)))
    out = []
    for setting, run in tries:
        trial = plan_fits(p.model, p.cluster, run)
        if trial is not None:
            out.append(f"{setting} (peak {trial / GIB:.1f} GiB of {cap / GIB:.0f})")
    if not out:
        out.append("none of the single settings tried fits: more devices (trainer.nnodes), offload with a shorter "
                   "response length, or a smaller model")
    return out


def _vllm_advice(p: Plan) -> list[str]:
    """A plan whose vLLM weights outgrow vLLM's share: a larger share, vLLM's expert parallelism over every rank (where
    the row's vLLM can split the experts and planning it fits the device and the host), or one sentence."""
    from dataclasses import replace

    cap, r = p.cluster.capacity, p.run
    share = p.vllm_weights / cap
    if share < 0.9:
        return [f"rollout.vllm_gpu_memory_utilization={min(share + 0.1, 0.9):.2f} (vLLM's weights alone are "
                f"{p.vllm_weights / GIB:.0f} GiB a device at rollout.tensor_model_parallel_size="
                f"{r.tensor_parallel}; check the plan again with it)"]
    ep = r.world
    if (p.model.is_moe and r.vllm_ep == 1 and r.vllm_ep_allowed and p.model.experts % ep == 0
            and ep % max(r.tensor_parallel, 1) == 0):
        split = replace(r, vllm_ep=ep)
        weights = vllm_weight_bytes(p.model, split)
        if plan(p.model, p.cluster, split).fits:  # the device (vLLM's share included) and the host
            dp = ep // max(r.tensor_parallel, 1)
            return [f"rollout.expert_parallel_size={ep} rollout.data_parallel_size={dp} (vLLM's expert "
                    f"parallelism: its weights {weights / GIB:.0f} GiB a device, where the whole "
                    f"experts at rollout.tensor_model_parallel_size={r.tensor_parallel} are "
                    f"{p.vllm_weights / GIB:.0f})"]
    return [f"vLLM's weights alone are {p.vllm_weights / GIB:.0f} GiB a device at rollout."
            f"tensor_model_parallel_size={r.tensor_parallel}"
            + (f" and rollout.expert_parallel_size={r.vllm_ep}" if r.vllm_ep > 1 else "")
            + f", more than its rollout.vllm_gpu_memory_utilization={r.vllm_fraction:g} share; this model needs "
            f"a larger tensor-parallel group" + (", vLLM's expert parallelism over more ranks" if p.model.is_moe
                                                 else "") + " or a smaller model"]


def _host_advice(p: Plan) -> list[str]:
    """Host-side settings, each kept where the whole plan (device and host) then fits."""
    from dataclasses import replace

    r, out = p.run, []
    tries = []
    if r.ref_offload and r.has_ref:
        tries.append(("actor.ref_offload=false", replace(r, ref_offload=False)))
    if r.offload:
        tries.append(("actor.offload=false", replace(r, offload=False)))
    if r.activation_offload:
        tries.append(("model.enable_activation_offload=false", replace(r, activation_offload=False)))
    for setting, run in tries:
        trial = plan(p.model, p.cluster, run)
        if trial.fits:
            host = sum(trial.host_per_node.values())
            out.append(f"{setting} (host {host / GIB:.0f} of {p.cluster.host_memory_gb:g} GiB per node, device "
                       f"peak {trial.peak.total / GIB:.1f} GiB)")
    return out


def plan_fits(m: ModelShape, cluster: Cluster, r: RunShape) -> float | None:
    """The device peak of `r` when it fits `cluster`, else None."""
    peak = max(ph.total for ph in _phases(m, cluster, r)[0])
    return peak if peak <= cluster.capacity else None


def ceil_div(a: int, b: int) -> int:
    return -(-a // b)


def gib(x: float) -> str:
    return f"{x / GIB:.2f}" if x < 10 * GIB else f"{x / GIB:.1f}"


