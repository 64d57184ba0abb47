"""One rank of the mixture-of-experts equivalence check (run directly for 1 process, or by portagrpo.launcher).

A tiny Qwen3-MoE (4 experts, top-2, 2 layers, hidden 64). ENGINE=fixed: rollouts that depend only on the prompt, so 1
process and K processes train on identical rollouts; ENGINE=hf: sampled, with actor.router_replay=R3.
Writes `result.pt` from rank 0: metrics, the full state after 2 steps, and how FSDP2 placed the experts.
Usage: moe_worker.py OUT PARALLEL DTYPE ENGINE [DEVICE [KEY=VALUE ...]] (the pairs: more config overrides; steps=N
the number of steps, 2 by default; push=1 adds `push`: the weight push checked under three engine expert layouts)
"""
import os
import sys
from pathlib import Path

import torch

from portagrpo.config import load_config
from portagrpo.train import Trainer

OVERRIDES = [
    "trainer.progress_bar=false", "trainer.test_freq=0", "trainer.save_freq=0", "trainer.tensorboard=false",
    "trainer.plot=false", "data.train_size=64", "data.train_batch_size=4", "rollout.n=4",
    "actor.ppo_mini_batch_size=8", "actor.micro_batch_size=2", "actor.ppo_epochs=2", "actor.kl_loss_coef=0.1",
    "actor.warmup_steps=0", "model.tiny.moe=qwen3_moe", "data.max_response_length=12",
]


def expert_placement(scorer) -> dict:
    """Each packed expert tensor's global and local shape and FSDP2's placement of it; under `_rows`, whether the
    sharded load's index of this rank's block (model/sharded_load.py `local_rows`) is where its shard sits in the
    whole tensor (a collective: every rank calls it)."""
    from portagrpo.model.sharded_load import local_rows

    out, rows = {}, True
    for name, p in scorer.named_parameters():
        if ".experts." in name or name.endswith("mlp.gate.weight"):
            local = p.to_local() if hasattr(p, "to_local") else p
            out[name] = (tuple(p.shape), tuple(local.shape), str(getattr(p, "placements", None)))
            whole = p.full_tensor() if hasattr(p, "full_tensor") else p
            rows &= bool(torch.equal(whole.detach()[local_rows(p)], local.detach()))
    out["_rows"] = rows
    return out


def push_check(strategy, scorer, whole: dict) -> dict:
    """The weight push (`strategy.full_tensors`, model/weight_push.py push_pairs) under three layouts of the engines'
    experts: every engine keeps every expert, rank r's engine keeps the r-th block (vLLM's linear placement), and rank
    r's the (world-1-r)-th. Per layout: whether this rank received exactly the tensors its engine keeps, each equal to
    the gathered whole state's; how many broadcasts ran; how many whole packed expert tensors were gathered; the
    largest expert tensor received (numel)."""
    import torch.distributed as dist
    from torch.distributed.tensor import DTensor

    from portagrpo.model.expert_packing import per_expert_names

    rank, world = dist.get_rank(), dist.get_world_size()
    reference = dict(per_expert_names(whole.items()))
    layouts = {"every": None,
               "own": lambda r, n: range(r * n // world, (r + 1) * n // world),
               "other": lambda r, n: range((world - 1 - r) * n // world, (world - r) * n // world)}
    out = {}
    broadcast, full_tensor = dist.broadcast, DTensor.full_tensor
    for key, wanted in layouts.items():
        counts = {"broadcasts": 0, "whole": 0}

        def counted_broadcast(*args, counts=counts, **kwargs):
            counts["broadcasts"] += 1
            return broadcast(*args, **kwargs)

        def counted_full(self, *args, counts=counts, **kwargs):
            counts["whole"] += self.dim() == 3
            return full_tensor(self, *args, **kwargs)

        dist.broadcast, DTensor.full_tensor = counted_broadcast, counted_full
        try:
            got = {n: t.detach().cpu().clone() for n, t in strategy.full_tensors(scorer, wanted, per_expert=True)}
        finally:
            dist.broadcast, DTensor.full_tensor = broadcast, full_tensor
        expected = set()
        for name in reference:
            parts = name.split(".")
            if "experts" in parts and parts[parts.index("experts") + 1].isdigit():
                e = int(parts[parts.index("experts") + 1])
                if wanted is not None and e not in wanted(rank, 4):
                    continue
            expected.add(name)
        if "lm_head.weight" not in got:  # a tied head is sent once, as the embedding
            expected.discard("lm_head.weight")
        out[key] = dict(counts, equal=set(got) == expected and all(torch.equal(got[n], reference[n]) for n in got),
                        largest=max(t.numel() for n, t in got.items() if ".experts." in n),
                        names=len(got))
    return out


def main() -> None:
    out, parallel, dtype, engine = Path(sys.argv[1]), sys.argv[2], sys.argv[3], sys.argv[4]
    device = sys.argv[5] if len(sys.argv) > 5 else "cpu"
    replay = ["actor.router_replay=R3"] if engine == "hf" else []
    cfg = load_config(None, [*OVERRIDES, *replay, f"rollout.engine={engine}", f"trainer.parallel={parallel}",
                             f"model.dtype={dtype}", f"trainer.device={device}",
                             *[a for a in sys.argv[6:] if not a.startswith(("steps=", "push="))]])
    steps = int(next((a.split("=")[1] for a in sys.argv[6:] if a.startswith("steps=")), 2))
    trainer = Trainer(cfg, run_dir=out / "run", log=lambda m: None).setup()
    metrics = [trainer.step().metrics for _ in range(steps)]
    placement = expert_placement(trainer.models.scorer)
    state = {k: v.cpu() for k, v in trainer.models.strategy.model_state(trainer.models.scorer).items()}
    push = None
    if "push=1" in sys.argv[6:]:
        whole = [state]  # the full state is rank 0's (cpu_offload): every rank checks against it
        torch.distributed.broadcast_object_list(whole, src=0)
        push = push_check(trainer.models.strategy, trainer.models.scorer, whole[0])
        pushes = [None] * trainer.runtime.comm.world_size
        torch.distributed.all_gather_object(pushes, push)
        push = pushes
    if trainer.runtime.comm.is_main:
        torch.save({"metrics": [dict(m) for m in metrics], "state": state, "placement": placement,
                    "world": trainer.runtime.comm.world_size, "push": push}, out / "result.pt")
    trainer.close()


if __name__ == "__main__":
    os.environ.setdefault("OMP_NUM_THREADS", "1")
    main()
