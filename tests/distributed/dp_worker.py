"""One rank of the data-parallel equivalence check (run directly for 1 process, or by portagrpo.launcher).

Every rank uses the `fixed` rollout engine, whose responses depend only on the prompt and the
sample's index in its group, so 1 process and K processes train on identical rollouts.
Writes `result.pt` (metrics and the full state dict after the step) from rank 0.
Usage: dp_worker.py OUT PARALLEL DTYPE [DEVICE [key=value ...]] (DEVICE: cpu by default, emu, npu).
"""
import os
import sys
from pathlib import Path

import torch

from portagrpo.config import load_config
from portagrpo.train import Trainer

# Shared with tests/distributed/test_ray.py, so Ray, torchrun and one process train the same thing.
OVERRIDES = [
    "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.tensorboard=false",
    "trainer.plot=false", "data.train_size=64", "data.train_batch_size=4", "rollout.n=4",
    "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.ppo_epochs=2",
    "actor.loss_agg_mode=seq-mean-token-mean", "actor.kl_loss_coef=0.1", "actor.warmup_steps=0",
    "model.tiny.hidden_size=32", "model.tiny.intermediate_size=64", "rollout.engine=fixed",
]


def use_hccl_rules() -> None:
    """The CPU backend with HCCL's collective rules (Atlas A2/A3 refuse float64), so gloo runs fail
    exactly where a multi-NPU run would."""
    from dataclasses import replace

    from portagrpo.backends import cpu, npu, register_backend

    def build():
        backend = cpu.CPUBackend()
        backend.spec = replace(backend.spec, collective_dtypes=npu.SPEC.collective_dtypes)
        return backend

    register_backend("cpu", build)


def main() -> None:
    out, parallel, dtype = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    device = sys.argv[4] if len(sys.argv) > 4 else "cpu"  # emu, or npu on the simulated Ascend
    hccl = os.environ.get("PORTAGRPO_TEST_HCCL_RULES") == "1"
    if hccl:
        use_hccl_rules()
    extra = ["data.val_size=6", "rollout.val_n=2", "rollout.val_temperature=1.0"] if hccl else []
    extra += sys.argv[5:]
    cfg = load_config(None, [*OVERRIDES, *extra, f"trainer.parallel={parallel}", f"model.dtype={dtype}",
                             f"trainer.device={device}"])
    trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
    metrics = [trainer.step().metrics for _ in range(2)]
    if hccl:  # every reduction a step, validation and a rollout recording make
        metrics.append(trainer.validate())
        metrics.append({"fingerprint": trainer.fingerprint()})
    state = {k: v.cpu() for k, v in trainer.models.strategy.model_state(trainer.models.scorer).items()}
    if trainer.runtime.comm.is_main:
        torch.save({"metrics": metrics, "state": state, "world": trainer.runtime.comm.world_size}, out / "result.pt")
    trainer.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
