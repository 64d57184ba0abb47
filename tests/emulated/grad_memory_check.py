"""Run by portagrpo.launcher on two emu ranks: one FSDP2 training step of a hidden-256, 4-layer tiny Llama, 4
micro-batches per rank per optimizer step. Prints JSON (rank 0): the gradient bytes each rank held between
micro-batches (device bytes before a micro-batch less those before the mini-batch's first), the update's
reduce-scatters, the update's peak, and the trainable parameters. Usage: grad_memory_check.py OUT [key=value ...]."""
import json
import os
import sys
from pathlib import Path

from portagrpo.config import load_config
from portagrpo.train import Trainer

SHAPE = ["model.tiny.hidden_size=256", "model.tiny.intermediate_size=512", "model.tiny.num_layers=4",
         "model.tiny.num_heads=8"]
STEP = ["trainer.device=emu", "trainer.parallel=fsdp2", "trainer.total_steps=1", "trainer.test_freq=0",
        "trainer.save_freq=0", "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.plot=false",
        "data.train_batch_size=4", "rollout.n=4", "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=1",
        "actor.ppo_epochs=1", "reward.num_workers=0", "rollout.engine=fixed", "data.train_size=16"]
MICRO_PER_STEP = 4  # a rank's 4 of each mini-batch's 8 responses, one at a time


def main() -> None:
    out, extra = Path(sys.argv[1]), sys.argv[2:]
    trainer = Trainer(load_config(None, [*STEP, *SHAPE, *extra]), run_dir=out, log=lambda m: None).setup()
    device, strategy = trainer.runtime.backend.module, trainer.models.strategy
    readings = []  # device bytes as each micro-batch starts: the gradients its predecessors left, and the base
    real_sync = strategy.gradient_sync

    def gradient_sync(scorer, enabled):
        readings.append(device.memory_allocated())
        return real_sync(scorer, enabled)

    strategy.gradient_sync = gradient_sync
    from portagrpo_emu.counters import COUNTERS

    first = len(COUNTERS.spans)
    metrics = trainer.step().metrics
    updates = [s for s in COUNTERS.spans[first:] if s["label"] == "update"]  # the backend's regions mark spans
    held = [max(r - mini[0] for r in mini) for mini in (readings[i:i + MICRO_PER_STEP]
                                                         for i in range(0, len(readings), MICRO_PER_STEP))]
    if trainer.runtime.comm.is_main:
        print(json.dumps({"held_grad_bytes": held, "micro_batches": len(readings),
                          "reduce_scatters": sum(s["collectives"].get("reduce_scatter", 0) for s in updates),
                          "update_peak_mib": metrics["mem/update_peak_gb"] * 1024,
                          "parameters": sum(p.numel() for p in trainer.parts.optim.params),
                          "layers": trainer.cfg.model.tiny.num_layers}))
    trainer.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
