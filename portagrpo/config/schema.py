"""The config schema: frozen, typed dataclasses; YAML files are instances of it.

`load.py` builds one from YAML and `key=value` overrides, `rules.py` checks it, `verl.py` maps
verl's keys onto it. Every problem is one sentence naming the field and the fix.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any, Literal, Optional

from portagrpo.errors import UserError


class ConfigError(UserError, ValueError):
    """Invalid configuration. `problems` holds one sentence per problem."""

    def __init__(self, problems: list[str]) -> None:
        self.problems = problems
        super().__init__("\n".join(problems))


@dataclass(frozen=True)
class TinyModelConfig:
    """Architecture of the built-in random-init policy (used when `model.path` is null)."""

    hidden_size: int = 64
    num_layers: int = 2
    # 2 heads of 32: the smallest head size vLLM's CPU attention runs (cpu_attn.py, get_supported_head_sizes), which
    # FlashAttention, Triton and Ascend's fused attention also take; 16 (4 heads) was refused by the CPU build.
    num_heads: int = 2
    intermediate_size: int = 128
    tie_word_embeddings: bool = True
    # A vision-language policy (Qwen2.5-VL architecture: this text part plus a small vision tower) with a
    # processor built locally, for rows with images (model/vision.py).
    vision: bool = False
    # A mixture-of-experts policy instead of the dense Llama: "qwen3_moe", "qwen2_moe" or "deepseek_v3"
    # (model/loading.py), every layer's MLP `num_experts` experts of `moe_intermediate_size`, each token routed to
    # `num_experts_per_tok`. DeepSeek-V3's shape: multi-head latent attention, the first layer dense, a shared expert,
    # a sigmoid router choosing within the best of 2 expert groups, its weights scaled by 2.5.
    moe: Optional[Literal["qwen3_moe", "qwen2_moe", "deepseek_v3"]] = None
    num_experts: int = 4
    num_experts_per_tok: int = 2
    moe_intermediate_size: int = 64


@dataclass(frozen=True)
class LoraSettings:
    """LoRA adapters through peft; rank 0 trains the full model."""

    rank: int = 0
    alpha: float = 16.0
    dropout: float = 0.0
    target_modules: list[str] = field(default_factory=lambda: ["q_proj", "k_proj", "v_proj", "o_proj"])


@dataclass(frozen=True)
class ModelConfig:
    path: Optional[str] = None
    ref_path: Optional[str] = None
    tokenizer_path: Optional[str] = None
    dtype: Literal["fp32", "bf16", "fp64"] = "fp32"
    attn_implementation: str = "auto"
    gradient_checkpointing: bool = False
    # A training forward's saved activations live in host memory until its backward (model/activation_offload.py); with
    # gradient checkpointing that is each decoder layer's input. Same numbers, one copy out and back per layer.
    enable_activation_offload: bool = False
    # Pack each micro-batch's rows into one row without padding (model/ulysses.py's attention keeps to each
    # sequence: the backend's variable-length kernel, else one SDPA call per sequence; no length cap). false: every
    # forward runs the padded grid. Sequence parallelism needs it.
    use_remove_padding: bool = True
    # FSDP2 on several ranks: build the model on the meta device, shard it, and read each rank's shards alone from
    # the safetensors checkpoint (model/sharded_load.py), so no rank holds it whole; false: every rank loads it
    # whole first
    sharded_load: bool = True
    tiny: TinyModelConfig = field(default_factory=TinyModelConfig)
    lora: LoraSettings = field(default_factory=LoraSettings)


@dataclass(frozen=True)
class DataConfig:
    task: Optional[str] = "repeat"
    train_files: list[str] = field(default_factory=list)
    val_files: list[str] = field(default_factory=list)
    train_size: int = 4096
    val_size: int = 64
    train_batch_size: int = 16
    max_prompt_length: int = 32
    max_response_length: int = 10
    shuffle: bool = True
    # A prompt longer than max_prompt_length is dropped (true), or else kept under `truncation`:
    # error (stop, naming it), left (keep its last tokens) or right (keep its first ones), as verl.
    filter_overlong_prompts: bool = True
    truncation: Literal["error", "left", "right"] = "error"
    prompt_key: str = "prompt"  # the data files' column holding the prompt
    reward_fn_key: str = "data_source"  # the column that picks the reward function
    image_key: str = "images"  # the column of a row's encoded images (verl's key), one per <image> in its prompt
    # A row with a larger image is refused at load. null: the model's own limit (its processor's max_pixels), so an
    # image its processor would shrink is refused; a number lets in images up to it, and the processor shrinks those
    # over its own limit (the run says how many). data/images.py.
    max_image_pixels: Optional[int] = None


@dataclass(frozen=True)
class MultiTurnConfig:
    """Multi-turn, tool-using rollouts (verl's actor_rollout_ref.rollout.multi_turn): the model calls tools
    mid-answer, the tools run in sandboxed worker processes, and only the model's own tokens are trained."""

    enable: bool = False
    max_assistant_turns: int = 5  # model turns per sample at most
    tool_config_path: Optional[str] = None  # YAML in verl's tool_config_path layout (portagrpo/agent/tools.py)
    max_tool_response_length: int = 256  # tokens of one tool result at most (longer: cut, and the model told so)
    format: str = "hermes"  # how tool calls are written: <tool_call>{"name": ..., "arguments": {...}}</tool_call>
    tool_timeout_s: float = 10.0  # wall clock per tool call; the CPU-time limit is the same number of seconds
    tool_memory_mb: int = 1024  # address-space limit of a tool's process
    tool_workers: int = 2  # sandbox worker processes
    # How tool calls are isolated: namespaces (own PID, mount, network, user namespaces; refused where the host
    # forbids them), process (own process and limits only), or auto (namespaces where the host allows them, else
    # process, refusing tools that run model-written code). docs/config.md says what each level guarantees.
    sandbox: str = "auto"


@dataclass(frozen=True)
class CodeConfig:
    """The `code` generator (rollout/generators/code.py): each answer's Python program is run in the tool sandbox,
    and what it prints is the row's outcome (reward.function=execution grades it against the ground truth)."""

    timeout_s: float = 5.0  # wall clock per program; the CPU-time limit is the same number of seconds
    memory_mb: int = 512  # address-space limit of a program's process
    max_output_bytes: int = 4096  # stdout and stderr together; more is cut and the program counted as an error
    workers: int = 2  # sandbox worker processes per rank
    sandbox: str = "auto"  # as rollout.multi_turn.sandbox; auto refuses the process level (model-written code)


@dataclass(frozen=True)
class RolloutConfig:
    engine: str = "hf"
    n: int = 8
    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    min_p: float = 0.0
    repetition_penalty: float = 1.0
    val_temperature: float = 0.0
    val_n: int = 1
    vllm_gpu_memory_utilization: float = 0.5
    vllm_weight_bucket_mb: int = 512
    vllm_max_model_len: Optional[int] = None
    # vLLM only: ranks per engine. Consecutive training ranks of one node form a tensor-parallel group
    # that runs one engine under vLLM's external launcher (verl's rollout.tensor_model_parallel_size).
    tensor_model_parallel_size: int = 1
    # vLLM only, for a mixture-of-experts policy: the ranks vLLM splits each MoE layer's experts over
    # (`enable_expert_parallel`; verl's rollout.expert_parallel_size): 1 (off), or tensor_model_parallel_size x
    # data_parallel_size. data_parallel_size engines (one per tensor-parallel group) then run as one vLLM instance
    # whose experts are split over all their ranks (verl's rollout.data_parallel_size); vLLM's external launcher
    # makes that instance the whole world, so tensor x data parallel must equal the ranks.
    expert_parallel_size: int = 1
    data_parallel_size: int = 1
    # The sampler's copy of the weights: auto samples with the training model itself (its dtype under
    # autocast); fp32/bf16/int8 keep a separate copy in that precision, refreshed after every update
    # (int8: PyTorch's dynamic int8 linear layers, CPU only). The training weights are never touched.
    # With rollout.engine=vllm: auto is model.dtype, fp32/bf16 the dtype vLLM holds and samples in (each push
    # cast in the copy), fp8 vLLM's block-FP8.
    precision: Literal["auto", "fp32", "bf16", "int8", "fp8"] = "auto"
    # sync: sample, then update, in the trainer's process. one_step_off: a sampler process of its own
    # samples batch k+1 (with the weights before update k) while the trainer updates on batch k.
    mode: Literal["sync", "one_step_off"] = "sync"
    devices: int = 0  # one_step_off on an accelerator: sampler devices per node (one per rank), after the trainers'
    # How a round's rows are made (rollout/generators/): auto (conversation with multi_turn, vision for a
    # vision-language policy, else text), or a registered generator's name (text, vision, conversation, echo, code)
    generator: str = "auto"
    multi_turn: MultiTurnConfig = field(default_factory=MultiTurnConfig)
    code: CodeConfig = field(default_factory=CodeConfig)


@dataclass(frozen=True)
class OverlongBufferConfig:
    """DAPO's overlong reward shaping: over the last `len` tokens before data.max_response_length the
    reward falls linearly, by up to `penalty_factor` at the limit."""

    enable: bool = False
    len: int = 0
    penalty_factor: float = 1.0


@dataclass(frozen=True)
class RewardConfig:
    function: str = "auto"
    max_error_frac: float = 0.0
    num_workers: int = 1
    timeout_s: float = 10.0
    overlong_buffer: OverlongBufferConfig = field(default_factory=OverlongBufferConfig)


@dataclass(frozen=True)
class RolloutCorrectionConfig:
    """verl's `algorithm.rollout_correction` (see portagrpo/algo/rollout_correction.py)."""

    rollout_is: Optional[Literal["token", "sequence"]] = None  # importance weights on the policy loss
    rollout_is_threshold: Optional[str] = "2.0"  # a number: truncate above (TIS); "L_U": zero outside (IcePop)
    rollout_is_batch_normalize: bool = False  # weights divided by their batch mean
    rollout_rs: Optional[str] = None  # rejection: comma-separated token_k1..seq_max_k3
    rollout_rs_threshold: Optional[str] = None  # one bound for all options, or one per option
    bypass_mode: bool = False  # the sampler's log-probs are the old ones (no scoring pass before the update)
    loss_type: Literal["ppo_clip"] = "ppo_clip"


@dataclass(frozen=True)
class FilterGroupsConfig:
    """DAPO's dynamic sampling: groups whose `metric` (acc, score, seq_reward, seq_final_reward) is the same
    for every response carry no advantage; they are dropped and more prompts sampled until the batch is
    full, at most `max_num_gen_batches` rounds (0: no limit)."""

    enable: bool = False
    metric: Literal["acc", "score", "seq_reward", "seq_final_reward"] = "acc"
    max_num_gen_batches: int = 10


@dataclass(frozen=True)
class AlgorithmConfig:
    name: Literal["grpo", "drgrpo"] = "grpo"
    adv_estimator: str = "grpo"
    norm_adv_by_std_in_grpo: bool = True
    reward_clip: Optional[float] = None
    reward_norm: Literal["none", "batch"] = "none"
    reward_shift: bool = False
    reward_scale: bool = False
    use_kl_in_reward: bool = False
    kl_coef: float = 0.001
    whiten_advantages: bool = False
    advantage_clip: Optional[float] = None
    rollout_correction: RolloutCorrectionConfig = field(default_factory=RolloutCorrectionConfig)
    filter_groups: FilterGroupsConfig = field(default_factory=FilterGroupsConfig)


@dataclass(frozen=True)
class ActorConfig:
    lr: float = 2e-3
    weight_decay: float = 0.0
    betas: list[float] = field(default_factory=lambda: [0.9, 0.99])
    warmup_steps: int = 5
    lr_schedule: Literal["constant", "cosine"] = "constant"
    grad_clip: float = 1.0
    ppo_epochs: int = 1
    ppo_mini_batch_size: int = 64
    # Responses per forward/backward on one rank (verl's ppo_micro_batch_size_per_gpu). It never changes
    # the update: the loss is normalised over the whole mini-batch. None: the largest divisor of the
    # per-rank mini-batch up to 32; a size that does not divide it leaves a shorter last micro-batch.
    micro_batch_size: Optional[int] = None
    # Responses per scoring forward (old and reference log-probs; verl's log_prob_micro_batch_size_per_gpu).
    # None: actor.micro_batch_size.
    logprob_micro_batch_size: Optional[int] = None
    # Token-budget micro-batches (verl's use_dynamic_bsz): responses grouped, balanced, so each group's
    # prompt + response tokens stay under the budget per rank; the gradient is the same (the loss is
    # normalised over the mini-batch), only the memory and the number of forwards change.
    use_dynamic_bsz: bool = False
    ppo_max_token_len_per_gpu: int = 16384
    log_prob_max_token_len_per_gpu: Optional[int] = None  # scoring; None: ppo_max_token_len_per_gpu
    # Ulysses sequence parallelism (model/ulysses.py): groups of this many consecutive ranks split each packed
    # micro-batch along its length, all-to-all over heads around attention. Data parallelism is world / size;
    # the token budgets above are per rank, so an SP group's micro-batch holds size x budget tokens (as verl).
    ulysses_sequence_parallel_size: int = 1
    # FSDP2 gradient accumulation (verl's fsdp_config.use_no_sync_for_gradient_accumulation): false reduce-scatters
    # after every micro-batch, so a rank holds only its gradient shard; true keeps the whole model's unsharded fp32
    # gradients over a mini-batch and reduce-scatters once (fewer collectives, when memory allows).
    use_no_sync_for_gradient_accumulation: bool = False
    # FSDP2 offload (FSDP2's CPUOffloadPolicy): `offload` keeps the policy's parameter shards, their gradients and the
    # optimizer state in host memory (each unit copied to the device for its forward and backward; AdamW steps on
    # the CPU): verl's param_offload, optimizer_offload and grad_offload, which go together here. `ref_offload`: the
    # reference's shards in host memory, copied in per unit for its forward (verl's ref param_offload).
    offload: bool = False
    ref_offload: bool = False
    # the offloaded shards in page-locked host memory where the backend row pins them (CUDA, ROCm, Ascend: faster
    # copies, but pinned memory is memory the OS cannot page out; 72B on one node pins about 1.1 TB). false: pageable
    pin_offload: bool = True
    # FSDP2 with an untied LM head and input embedding: read them one rank's rows at a time to score and train, never
    # gathered whole (model/parallel.py StreamedRows). false: gather each as an FSDP2 unit (verl's layout), which
    # holds the whole head and its gradient on every rank; the streamed collectives run in sequence, unprefetched
    stream_head_rows: bool = True
    clip_ratio: float = 0.2
    clip_ratio_low: Optional[float] = None
    clip_ratio_high: Optional[float] = None
    clip_ratio_c: float = 3.0
    loss_agg_mode: str = "token-mean"
    loss_scale_factor: Optional[float] = None
    use_kl_loss: bool = True
    kl_loss_coef: float = 0.001
    kl_loss_type: str = "low_var_kl"
    entropy_coeff: float = 0.0
    # A vision-language policy's vision tower gets no gradient and stays out of the optimizer (verl's key).
    freeze_vision_tower: bool = False
    # Mixture-of-experts router replay (verl's actor.router_replay.mode names; model/router_replay.py): null routes
    # live; R2: the update replays the experts the old policy's scoring pass chose; R3: the scoring and update
    # forwards replay the experts the rollout engine chose. Replayed experts are weighed by the live router (its
    # gradient flows).
    router_replay: Optional[Literal["R2", "R3"]] = None


@dataclass(frozen=True)
class KernelsConfig:
    logprob: str = "auto"


@dataclass(frozen=True)
class TrainerConfig:
    device: str = "auto"
    seed: int = 1
    total_steps: Optional[int] = 300
    total_epochs: int = 1
    save_freq: int = 100
    test_freq: int = 40
    max_ckpt_to_keep: int = 2
    output_dir: Optional[str] = None
    deterministic: bool = False
    num_threads: Optional[int] = None
    progress_bar: bool = True
    tensorboard: bool = True
    plot: bool = True
    record_rollouts: bool = False
    nproc_per_node: int = 1
    nnodes: int = 1
    devices_per_node: int = 1
    parallel: Literal["auto", "fsdp2", "ddp", "ep"] = "auto"
    # FSDP2: ranks one shard group spans (verl's fsdp_size). -1: every rank (one group). A divisor k of the world
    # size shards within groups of k consecutive ranks (a node) and replicates across groups (HSDP), so the per-layer
    # all-gathers stay inside a node and only gradients cross nodes.
    fsdp_size: int = -1
    # trainer.parallel=ep: ranks one expert-parallel group spans (verl's expert_model_parallel_size); each holds
    # num_experts / ep_size of every MoE layer's experts, and tokens travel to their expert's rank by all-to-all.
    # -1: every rank. The world / ep_size ranks holding the same experts shard them with FSDP2 (model/parallel.py).
    ep_size: int = -1
    # The cluster a run is planned for (portagrpo plan, --dry-run): one device's memory in GiB (None: ask the device)
    # and one node's host memory in GiB (None: 1024).
    device_memory_gb: Optional[float] = None
    host_memory_gb: Optional[float] = None
    dist_timeout_s: float = 600.0
    val_before_train: bool = True  # validate before the first step (with test_freq > 0)
    # console (the progress bar and lines), tensorboard (with trainer.tensorboard), wandb, mlflow
    logger: list[str] = field(default_factory=lambda: ["console", "tensorboard"])
    # runs/<project_name>/<experiment_name> when no output_dir is given (verl's names)
    project_name: Optional[str] = None
    experiment_name: Optional[str] = None
    # disable: a new run unless --resume; auto: continue the output directory's latest whole checkpoint if
    # there is one; resume_path: continue trainer.resume_from_path (verl's trainer.resume_mode)
    resume_mode: Literal["disable", "auto", "resume_path"] = "disable"
    resume_from_path: Optional[str] = None


@dataclass(frozen=True)
class Config:
    model: ModelConfig = field(default_factory=ModelConfig)
    data: DataConfig = field(default_factory=DataConfig)
    rollout: RolloutConfig = field(default_factory=RolloutConfig)
    reward: RewardConfig = field(default_factory=RewardConfig)
    algorithm: AlgorithmConfig = field(default_factory=AlgorithmConfig)
    actor: ActorConfig = field(default_factory=ActorConfig)
    kernels: KernelsConfig = field(default_factory=KernelsConfig)
    trainer: TrainerConfig = field(default_factory=TrainerConfig)

    @property
    def clip_low(self) -> float:
        a = self.actor
        return a.clip_ratio if a.clip_ratio_low is None else a.clip_ratio_low

    @property
    def clip_high(self) -> float:
        a = self.actor
        return a.clip_ratio if a.clip_ratio_high is None else a.clip_ratio_high

    @property
    def loss_scale_factor(self) -> float:
        a = self.actor
        return float(self.data.max_response_length if a.loss_scale_factor is None else a.loss_scale_factor)

    @property
    def tensorboard(self) -> bool:
        """TensorBoard scalars: trainer.tensorboard, and "tensorboard" among trainer.logger."""
        return self.trainer.tensorboard and "tensorboard" in self.trainer.logger

    @property
    def progress_bar(self) -> bool:
        """The progress bar: trainer.progress_bar, and "console" among trainer.logger."""
        return self.trainer.progress_bar and "console" in self.trainer.logger

    @property
    def rollout_batch_size(self) -> int:
        return self.data.train_batch_size * self.rollout.n

    def micro_batch(self, world_size: int) -> int:
        """Responses per forward/backward on one rank (see ActorConfig.micro_batch_size)."""
        per_rank = max(self.actor.ppo_mini_batch_size // world_size, 1)
        if self.actor.micro_batch_size is not None:
            return min(self.actor.micro_batch_size, per_rank)
        return max(d for d in range(1, min(per_rank, DEFAULT_MICRO_BATCH) + 1) if per_rank % d == 0)

    def logprob_micro_batch(self, world_size: int) -> int:
        """Responses per scoring forward on one rank."""
        return self.actor.logprob_micro_batch_size or self.micro_batch(world_size)


DEFAULT_MICRO_BATCH = 32  # the largest micro-batch chosen when none is set

# Values the `algorithm.name` preset sets unless the user set them explicitly.
PRESETS: dict[str, dict[str, dict[str, Any]]] = {
    "grpo": {},
    "drgrpo": {
        "algorithm": {"norm_adv_by_std_in_grpo": False},
        "actor": {"loss_agg_mode": "seq-mean-token-sum-norm", "use_kl_loss": False},
    },
}
