"""Checkpoints of a run: save (every rank takes part; rank 0 writes, or under FSDP2 every rank its own shards) and
resume, with the RNG streams."""
from __future__ import annotations

import random
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable

import numpy as np
import torch

from portagrpo.backends import Backend
from portagrpo.checkpoint import (
    CheckpointError,
    check_checkpoint_fits,
    latest_valid_checkpoint,
    load_checkpoint_state,
    load_shards,
    save_checkpoint,
    save_sharded_checkpoint,
    verify_checkpoint,
)
from portagrpo.data.records import PromptLoader
from portagrpo.fileio import WriteError
from portagrpo.train.build import Models, Optimization, Runtime, keep_step_form
from portagrpo.train.schedule import ScheduleState


@dataclass(frozen=True)
class Resumed:
    """What a resume found: the step the checkpoint holds and the schedule's batch in flight, if any."""

    step: int
    inflight: ScheduleState | None


class Checkpointer:
    """Saves and restores everything a resumed run needs to continue exactly: weights, optimizer,
    schedule, the data loader's position, the RNG streams and the step."""

    def __init__(self, run_dir: Path, runtime: Runtime, models: Models, optim: Optimization, loader: PromptLoader,
                 tokenizer: Any, *, keep: int, lora_rank: int, log: Callable[[str], None]) -> None:
        self.run_dir, self.runtime, self.models, self.optim = Path(run_dir), runtime, models, optim
        self.loader, self.tokenizer, self.keep, self.lora_rank, self.log = loader, tokenizer, keep, lora_rank, log

    def save(self, step: int, inflight: ScheduleState | None) -> Path | None:
        """The checkpoint of `step` (a collective: every rank calls it), with the schedule's batch in flight
        (`Schedule.state()`); its path on rank 0."""
        m, comm = self.models, self.runtime.comm
        if m.strategy.shards_checkpoints and not m.is_lora:  # a LoRA adapter is small: gathered, as one process saves
            return self._saving(step, lambda: save_sharded_checkpoint(
                self.run_dir, step, comm=comm, model=m.policy, tokenizer=self.tokenizer,
                shards=m.strategy.sharded_state(m.scorer, self.optim.optimizer), **self._run_state(inflight)))
        model_state = m.strategy.model_state(m.scorer, trainable_only=m.is_lora)  # LoRA: the adapters alone
        optimizer_state = m.strategy.optimizer_state(m.scorer, self.optim.optimizer)
        run_state = self._run_state(inflight)
        path = None
        if comm.is_main:
            path = self._saving(step, lambda: save_checkpoint(
                self.run_dir, step, model=m.policy, tokenizer=self.tokenizer, model_state=model_state,
                optimizer_state=optimizer_state, **run_state))
        comm.barrier()
        return path

    def _run_state(self, inflight: ScheduleState | None) -> dict[str, Any]:
        """Everything but the model and optimizer state."""
        return {"scheduler": self.optim.scheduler, "keep": self.keep, "rng": rng_state(self.runtime.backend),
                "state": {"loader": self.loader.state_dict(), "world_size": self.runtime.comm.world_size},
                "inflight": None if inflight is None else inflight.to_saved()}

    def _saving(self, step: int, write: Callable[[], Path | None]) -> Path | None:
        try:
            path = write()
        except WriteError as err:  # the temporary is gone; say what is still there to resume from
            last = latest_valid_checkpoint(self.run_dir, warn=lambda message: None)
            after = (f"The last whole checkpoint, {last.name}, is untouched: free space, then continue with --resume "
                     f"{self.run_dir}." if last else "No earlier checkpoint exists, so the run cannot be resumed.")
            raise WriteError(f"{err} {after}") from None
        if path is not None:
            self.log(f"saved checkpoint {path}")
        return path

    def resume(self, target: str | Path) -> Resumed:
        """Load `target` (a checkpoint, or a run directory: its latest whole one); the step it holds and the batch
        that was in flight."""
        ckpt = self._choose(Path(target))
        m = self.models
        check_checkpoint_fits(ckpt, m.policy.config, self.lora_rank)
        parts = load_checkpoint_state(ckpt, verified=True)
        if parts.shards is not None:
            shards = m.strategy.sharded_state(m.scorer, self.optim.optimizer)
            load_shards(ckpt, shards)  # each rank reads only the slices it holds
            m.strategy.load_sharded_state(m.scorer, self.optim.optimizer, shards)
        else:
            self._load_whole(ckpt, parts.model_dir)
            m.strategy.load_optimizer_state(m.scorer, self.optim.optimizer, parts.optimizer)
        keep_step_form(self.optim.optimizer, self.optim.step_form)
        self.optim.scheduler.load_state_dict(parts.scheduler)
        self.loader.load_state_dict(parts.loader)
        set_rng_state(self.runtime.backend, parts.rng)
        self.log(f"resumed from {ckpt} at step {parts.step}")
        return Resumed(parts.step, ScheduleState.from_saved(parts.inflight))

    def _choose(self, target: Path) -> Path:
        """The checkpoint to load, verified on rank 0 alone (hashing reads every byte) and named to the other ranks,
        so they load the one rank 0 checked; a refusal is the same sentence on every rank."""
        comm = self.runtime.comm
        found = None
        if comm.is_main:
            try:
                found = (str(self._verified(target)), None)
            except CheckpointError as err:
                found = (None, str(err))
        path, refusal = comm.broadcast_object(found)
        if refusal is not None:
            raise CheckpointError(refusal)
        return Path(path)

    def _verified(self, target: Path) -> Path:
        if (target / "manifest.json").exists() or target.name.startswith("step_"):
            problems = verify_checkpoint(target)
            if problems:
                raise CheckpointError(f"checkpoint {target} is corrupt and was not loaded: {problems[0]}.")
            return target
        ckpt = latest_valid_checkpoint(target, warn=self.log)
        if ckpt is None:
            raise CheckpointError(f"--resume {str(target)!r}: no whole checkpoint found under {target}/checkpoints.")
        return ckpt

    def _load_whole(self, ckpt: Path, model_dir: Path) -> None:
        from safetensors.torch import load_file

        state = {}
        for f in sorted(model_dir.glob("*.safetensors")):
            state.update(load_file(f))
        if self.models.is_lora:
            self._load_adapter(ckpt, state)
        else:
            self._load_full(ckpt, state)

    def _load_adapter(self, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.models.policy, state)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if not state or unexpected:
            raise CheckpointError(
                f"checkpoint {ckpt} does not hold this run's LoRA adapter (unexpected {unexpected[:3]})."
            )

    def _load_full(self, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
        from portagrpo.model.expert_packing import packed_experts

        policy = self.models.policy
        state = packed_experts(state, policy)  # a MoE checkpoint's per-expert tensors, packed as the policy holds them
        expected = set(policy.state_dict())  # parameter names (sharded or not)
        tied = {"lm_head.weight"} if getattr(policy.config, "tie_word_embeddings", False) else set()
        missing = sorted(expected - set(state) - tied)
        unexpected = sorted(set(state) - expected - {"lm_head.weight"})
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {ckpt} does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})."
            )
        self.models.strategy.load_model_state(self.models.scorer, state)


def rng_state(backend: Backend) -> dict[str, Any]:
    return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
            "backend": backend.rng_state()}


def set_rng_state(backend: Backend, rng: dict[str, Any]) -> None:
    random.setstate(rng["python"])
    np.random.set_state(rng["numpy"])
    torch.set_rng_state(rng["torch"])
    backend.set_rng_state(rng.get("backend", {}))
