"""One rank of the sharded-checkpoint resharding check (run directly for 1 process, or by portagrpo.launcher).

The `fixed` rollout engine (dp_worker.OVERRIDES) makes rollouts that do not depend on the number of ranks, so a run
resumed at another world size can be compared with the uninterrupted one.
Usage: ckpt_worker.py OUT PARALLEL train   -> 2 steps, a checkpoint, 1 more step
       ckpt_worker.py OUT PARALLEL CKPT    -> resume CKPT, 1 more step
Writes `result.pt` from rank 0: the full state after loading (or after step 2), the last step's metrics and the
full state after it.
"""
import os
import sys
from pathlib import Path

import torch
from dp_worker import OVERRIDES

from portagrpo.config import load_config
from portagrpo.train import Trainer


def full_state(trainer) -> dict[str, torch.Tensor]:
    """The model and optimizer state gathered whole (a collective; the test's reference, not the checkpoint's path)."""
    m = trainer.models
    model = {k: v.detach().cpu().clone() for k, v in m.strategy.model_state(m.scorer).items()}
    optimizer = m.strategy.optimizer_state(m.scorer, trainer.parts.optim.optimizer).get("state", {})  # rank 0 only
    moments = {f"{name}.{k}": v.detach().cpu().clone() for name, state in optimizer.items() for k, v in state.items()}
    return {**model, **moments}


def main() -> None:
    out, parallel, mode = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    cfg = load_config(None, [*OVERRIDES, f"trainer.parallel={parallel}", "model.dtype=fp64", "trainer.device=cpu"])
    resume = None if mode == "train" else mode
    trainer = Trainer(cfg, run_dir=out / "run", resume=resume, log=lambda m: None).setup()
    if resume is None:
        for _ in range(2):
            trainer.step()
        checkpoint = trainer.save()
    before = full_state(trainer)
    metrics = trainer.step().metrics
    after = full_state(trainer)
    if trainer.runtime.comm.is_main:
        torch.save({"before": before, "metrics": metrics, "after": after, "world": trainer.runtime.comm.world_size,
                    "checkpoint": None if resume else str(checkpoint)}, out / "result.pt")
    trainer.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
