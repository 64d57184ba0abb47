"""One rank of the tensor-parallel request gather check (run by portagrpo.launcher with 4 ranks, TP=2).

Each rank's requests carry a vision-language prompt's raw image (bytes that name the rank); `TensorParallel.requests`
over the gather the engine builds (`TensorParallel.of_ranks`) gives the rank its group's requests. Writes
`rank<R>.json`: whose images reached the rank (before issue 45 the engine gathered over the world: every rank's),
and its slice. Usage: tp_gather_worker.py OUT."""
import json
import os
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from portagrpo.rollout.vllm_images import RawImage, VisionPrompt
from portagrpo.rollout.vllm_parallel import TensorParallel


def main() -> None:
    from portagrpo.backends import get_backend
    from portagrpo.backends.dist import init_collectives

    out = Path(sys.argv[1])
    comm = init_collectives(get_backend("cpu"), 120)  # as the trainer forms its group
    rank, world = comm.rank, comm.world_size
    torch.manual_seed(rank)
    image = RawImage(1, 1, bytes([rank]) * 3)
    local = [VisionPrompt((5, 9, 6), (image,), 9, (1,)), [7, rank]]
    tp = TensorParallel.of_ranks(2, rank // 2, rank % 2, comm)  # as the engine's from_run builds it
    gather, arrived = tp.gather, []
    tp.gather = lambda obj: arrived.extend(gather(obj)) or arrived  # what reached this rank
    requests, mine, seed = tp.requests(local)
    senders = sorted({r.images[0].rgb[0] for part, _ in arrived for r in part if isinstance(r, VisionPrompt)})
    (out / f"rank{rank}.json").write_text(json.dumps({
        "senders": senders, "mine_is_local": requests[mine] == local, "count": len(requests), "seed": seed,
        "world": world, "local_rank": int(os.environ.get("LOCAL_RANK", "0"))}))
    dist.barrier()
    dist.destroy_process_group()


if __name__ == "__main__":
    main()
