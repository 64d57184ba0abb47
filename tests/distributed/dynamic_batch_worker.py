"""One rank of the dynamic-batch check (run by portagrpo.launcher): dp_worker.py's two steps, with extra overrides,
recording every optimizer step's full gradients (rank 0), each rank's micro-batch plans for the update and the
scoring passes, and the state after the steps.
Usage: dynamic_batch_worker.py OUT PARALLEL DTYPE [key=value ...]. Writes result.pt (rank 0) and plans_rank<r>.pt.
"""
import os
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))
from dp_worker import OVERRIDES  # noqa: E402

from portagrpo.batch import token_budget_groups  # noqa: E402
from portagrpo.config import load_config  # noqa: E402
from portagrpo.train import Trainer  # noqa: E402


def full(t: torch.Tensor) -> torch.Tensor:
    return (t.full_tensor() if hasattr(t, "full_tensor") else t).detach().cpu().clone()


def main() -> None:
    out, parallel, dtype, extra = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4:]
    cfg = load_config(None, [*OVERRIDES, f"trainer.parallel={parallel}", f"model.dtype={dtype}", *extra])
    trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
    grads, plans = [], {"update": [], "scoring": [], "own_update": [], "own_scoring": []}
    updater, sampling = trainer.updater, trainer.pipeline.logprobs  # the scoring passes
    names = [n for n, p in trainer.models.scorer.named_parameters() if p.requires_grad]

    def clip_and_step(step, real=updater._clip_and_step):
        grads.append({n: full(p.grad) for n, p in zip(names, updater.params)})  # a collective on every rank
        return real(step)

    def accumulate(mine, sums, rows, seen, count=None, routing=None, real=updater._accumulate_gradients):
        budget = updater.settings.token_budget
        plans["update"].append(count)  # how many every rank runs
        if budget is not None:  # how many this rank's own share needs
            own = token_budget_groups([p + r for p, r in mine.rollout.host_lengths()], budget)
            plans["own_update"].append(len(own))
        return real(mine, sums, rows, seen, count, routing)

    def micro_plan(batch, real=sampling.micro_plan):
        plan = real(batch)
        plans["scoring"].append([int(g.numel()) for g in plan])  # the rows of each micro-batch every rank runs
        budget = sampling.settings.token_budget
        if budget is not None:
            plans["own_scoring"].append(len(token_budget_groups([p + r for p, r in batch.host_lengths()], budget)))
        return plan

    updater._clip_and_step, updater._accumulate_gradients, sampling.micro_plan = clip_and_step, accumulate, micro_plan
    metrics = [trainer.step().metrics for _ in range(2)]
    state = {k: v.cpu() for k, v in trainer.models.strategy.model_state(trainer.models.scorer).items()}
    rank = trainer.runtime.comm.rank
    torch.save(plans, out / f"plans_rank{rank}.pt")
    if trainer.runtime.comm.is_main:
        torch.save({"metrics": metrics, "state": state, "grads": grads, "world": trainer.runtime.comm.world_size},
                   out / "result.pt")
    trainer.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
