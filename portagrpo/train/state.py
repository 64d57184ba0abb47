"""Run state: checkpoints (save and resume), RNG streams, parameter fingerprints, rollout records."""
from __future__ import annotations

import random
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from portagrpo.checkpoint import (
    CheckpointError,
    check_checkpoint_fits,
    latest_valid_checkpoint,
    load_checkpoint_state,
    save_checkpoint,
)
from portagrpo.fileio import WriteError, atomic_path

if TYPE_CHECKING:
    from portagrpo.train.loop import StepOutput


class RunState:
    """Save/resume methods of the Trainer (see loop.py)."""

    def save(self) -> Path:
        # Gathering full state dicts is a collective: every rank takes part, rank 0 writes.
        model_state = self.strategy.model_state(self.scorer)
        optimizer_state = self.strategy.optimizer_state(self.scorer, self.optimizer)
        path = None
        if self.comm.is_main:
            path = self._save_checkpoint(model_state, optimizer_state)
            self.log(f"saved checkpoint {path}")
        self.comm.barrier()
        return path

    def _save_checkpoint(self, model_state, optimizer_state) -> Path:
        try:
            return save_checkpoint(
                self.run_dir, self.step_done, model=self.policy, tokenizer=self.tokenizer, model_state=model_state,
                optimizer_state=optimizer_state, scheduler=self.scheduler,
                state={"loader": self.loader.state_dict(), "world_size": self.comm.world_size},
                rng=self.rng_state(), keep=self.cfg.trainer.max_ckpt_to_keep,
            )
        except WriteError as err:  # the temporary is gone; say what is still there to resume from
            last = latest_valid_checkpoint(self.run_dir, warn=lambda message: None)
            after = (f"The last whole checkpoint, {last.name}, is untouched: free space, then continue with --resume "
                     f"{self.run_dir}." if last else "No earlier checkpoint exists, so the run cannot be resumed.")
            raise WriteError(f"{err} {after}") from None

    def _maybe_resume(self) -> int:
        if self.resume_from is None:
            return 0
        target = Path(self.resume_from)
        if (target / "manifest.json").exists() or target.name.startswith("step_"):
            ckpt = target
        else:
            ckpt = latest_valid_checkpoint(target, warn=self.log)
            if ckpt is None:
                raise CheckpointError(
                    f"--resume {str(target)!r}: no whole checkpoint found under {target}/checkpoints."
                )
        check_checkpoint_fits(ckpt, self.policy.config, self.cfg.model.lora.rank)
        parts = load_checkpoint_state(ckpt)
        from safetensors.torch import load_file

        state = {}
        for f in sorted(Path(parts["model_dir"]).glob("*.safetensors")):
            state.update(load_file(f))
        if self.is_lora:
            self._load_adapter(ckpt, state)
        else:
            self._load_full(ckpt, state)
        self.strategy.load_optimizer_state(self.scorer, self.optimizer, parts["optimizer"])
        self.scheduler.load_state_dict(parts["scheduler"])
        self.loader.load_state_dict(parts["state"]["loader"])
        self.set_rng_state(parts["rng"])
        self.step_done = int(parts["state"]["step"])
        self.log(f"resumed from {ckpt} at step {self.step_done}")
        return self.step_done

    def _load_adapter(self, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
        from peft import set_peft_model_state_dict

        result = set_peft_model_state_dict(self.policy, state)
        unexpected = [k for k in getattr(result, "unexpected_keys", []) if "lora_" in k]
        if not state or unexpected:
            raise CheckpointError(
                f"checkpoint {ckpt} does not hold this run's LoRA adapter (unexpected {unexpected[:3]})."
            )

    def _load_full(self, ckpt: Path, state: dict[str, torch.Tensor]) -> None:
        expected = set(self.policy.state_dict())  # parameter names (sharded or not)
        tied = {"lm_head.weight"} if getattr(self.policy.config, "tie_word_embeddings", False) else set()
        missing = sorted(expected - set(state) - tied)
        unexpected = sorted(set(state) - expected - {"lm_head.weight"})
        if missing or unexpected:
            raise CheckpointError(
                f"checkpoint {ckpt} does not fit the model (missing {missing[:3]}, unexpected {unexpected[:3]})."
            )
        self.strategy.load_model_state(self.scorer, state)

    def rng_state(self) -> dict[str, Any]:
        return {"python": random.getstate(), "numpy": np.random.get_state(), "torch": torch.get_rng_state(),
                "backend": self.backend.rng_state()}

    def set_rng_state(self, rng: dict[str, Any]) -> None:
        random.setstate(rng["python"])
        np.random.set_state(rng["numpy"])
        torch.set_rng_state(rng["torch"])
        self.backend.set_rng_state(rng.get("backend", {}))

    def record(self, out: StepOutput) -> None:
        """Save this step's rollout, metrics and parameter fingerprint (rank 0 writes)."""
        fingerprint = self.param_fingerprint()
        if not self.comm.is_main:
            return
        rb = out.experience.batch.rollout
        folder = self.run_dir / "rollouts"
        folder.mkdir(exist_ok=True)
        record = {k: v.detach().cpu() for k, v in rb.tensors().items() if torch.is_tensor(v)}
        record.update(scores=out.experience.raw_scores.cpu(), correct=out.experience.correct.cpu(),
                      metrics=out.metrics, fingerprint=fingerprint,
                      setting={"device": self.backend.name, "dtype": self.cfg.model.dtype, "kernel": self.kernel_name})
        with atomic_path(folder / f"step_{out.metrics['step']:08d}.pt", what="recording the rollout to") as tmp:
            torch.save(record, tmp)

    def param_fingerprint(self) -> dict[str, list[float]]:
        """Per parameter tensor: (sum, sum of squares) in fp64. Both add up over shards, so the
        fingerprint is exact under FSDP2 too; replay compares it to measure parameter drift."""
        names, values = [], []
        for name, p in self.scorer.named_parameters():
            local = p.to_local() if hasattr(p, "to_local") else p
            x = local.detach().double()
            names.append(name.removeprefix("lm."))
            values.append(torch.stack([x.sum(), (x * x).sum()]))
        sharded = any(hasattr(p, "to_local") for p in self.scorer.parameters())
        if not values:
            total = torch.zeros(0, 2, dtype=torch.float64)
        elif sharded:  # FSDP2 shards add up to the whole tensor
            total = self.comm.sum_on_host(torch.stack(values))
        else:  # every rank holds the whole model: summing over ranks would count it world_size times
            total = torch.stack(values).cpu()
        return {n: v.tolist() for n, v in zip(names, total)}
