"""A run's layout: what it decides before any device exists, from its config and its backend's answers. `build()`
and the memory plan (`portagrpo plan`, the gate before a run starts) read the same `RunLayout`, so a decision is
made once (issue 52: the planner had kept a second copy, and one copy was wrong: a one_step_off run's vLLM was
charged to the trainers' devices)."""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from portagrpo.config import Config
from portagrpo.model.parallel import strategy_name


@dataclass(frozen=True)
class BatchPlan:
    """How a rank cuts its rows into forwards (read by the update's and the scoring pass's settings too)."""

    update_micro_batch: int  # responses per update forward on a rank
    scoring_micro_batch: int  # responses per scoring forward on a rank
    update_token_budget: int | None  # actor.use_dynamic_bsz: prompt + response tokens per update micro-batch
    scoring_token_budget: int | None  # ... per scoring micro-batch of a rank

    @classmethod
    def of(cls, cfg: Config, world: int) -> "BatchPlan":
        a = cfg.actor
        sp = max(a.ulysses_sequence_parallel_size, 1)
        # a sequence-parallel group runs each update micro-batch together: its budget is sp ranks'; a scoring pass
        # plans each rank's own share (a group scores its ranks' micro-batches as one)
        return cls(update_micro_batch=cfg.micro_batch(max(world // sp, 1)),
                   scoring_micro_batch=cfg.logprob_micro_batch(world),
                   update_token_budget=a.ppo_max_token_len_per_gpu * sp if a.use_dynamic_bsz else None,
                   scoring_token_budget=(a.log_prob_max_token_len_per_gpu or a.ppo_max_token_len_per_gpu)
                   if a.use_dynamic_bsz else None)


@dataclass(frozen=True)
class RunLayout:
    world: int  # training ranks
    strategy: str  # none | ddp | fsdp2: the backend's answer to trainer.parallel on `world` ranks
    shard_group: int  # ranks one FSDP2 shard group spans (trainer.fsdp_size, else every rank)
    sequence_parallel: int  # actor.ulysses_sequence_parallel_size: ranks that split each row
    data_parallel: int  # world / sequence_parallel: the groups that take different rows
    master_dtype: str  # the parameters' and optimizer's dtype: fp32 (fp64 for an fp64 model)
    compute_dtype: str  # model.dtype: what the forward computes in
    lora: bool
    reference: str | None  # "model" (a frozen copy in the compute dtype), "adapters_off" (LoRA's base), None (no KL)
    frozen_vision: bool  # actor.freeze_vision_tower: the tower is not trained
    engine: str  # rollout.engine
    engine_apart: bool  # the schedule (rollout.mode) samples in a sampler process of its own
    batches: BatchPlan
    routes: bool  # actor.router_replay: a MoE policy's routes travel with the batch

    @property
    def has_reference(self) -> bool:
        return self.reference is not None


def resolve_layout(cfg: Config, world: int, parallel: Callable[[str], str], apart: bool) -> RunLayout:
    """The layout of `cfg` on `world` training ranks; `parallel`: the backend's answer to trainer.parallel (its
    default, and FSDP2's fallback on a torch without it: `Backend.parallel_strategy`, which needs no device);
    `apart`: what the run's schedule declares (train/schedule.py `schedule_of(rollout.mode).apart`)."""
    a, t = cfg.actor, cfg.trainer
    strategy = strategy_name(t.parallel, parallel(t.parallel), world, a.offload or a.ref_offload)
    sp = max(a.ulysses_sequence_parallel_size, 1)
    lora = cfg.model.lora.rank > 0
    kl = a.use_kl_loss or cfg.algorithm.use_kl_in_reward
    return RunLayout(
        world=world, strategy=strategy,
        shard_group=(t.fsdp_size if t.fsdp_size > 0 else world) if strategy in ("fsdp2", "ep") else 1,
        sequence_parallel=sp, data_parallel=max(world // sp, 1),
        master_dtype="fp64" if cfg.model.dtype == "fp64" else "fp32", compute_dtype=cfg.model.dtype, lora=lora,
        reference=("adapters_off" if lora else "model") if kl else None, frozen_vision=a.freeze_vision_tower,
        engine=cfg.rollout.engine, engine_apart=apart,
        batches=BatchPlan.of(cfg, world), routes=a.router_replay is not None)
