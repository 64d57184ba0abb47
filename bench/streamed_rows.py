"""What reading the untied LM head and embedding by rows (model/parallel.py StreamedRows, actor.stream_head_rows)
costs in time against FSDP2's gathered units, on this machine's ranks: `python bench/streamed_rows.py [--ranks 2]
[--vocab 32768 --hidden 256 --layers 2] [--tokens 512] [--iters 6] [--seeds 0,1,2] [--json out.json]`.

Each rank builds the same Llama-shaped model with an untied head twice under FSDP2, once per setting, and times a
scoring forward and backward (the update's micro-batch: log-probs and entropy of `--tokens` response tokens) with
each, interleaved A, B, A, B, ... in one process so that the machine's load falls on both alike. It reports, per
seed, the median seconds of each and their ratio (streamed / gathered), and the spread of the ratio over the seeds.

On the CPU over gloo this measures the collectives' host cost and the kernels' arithmetic, not NCCL, RCCL or HCCL
on a GPU or NPU, where the gathered units also overlap their all-gathers with compute (FSDP2's prefetch) and the
streamed blocks do not.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch


def _model(vocab: int, hidden: int, layers: int):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    return LlamaForCausalLM(LlamaConfig(vocab_size=vocab, hidden_size=hidden, intermediate_size=2 * hidden,
                                        num_hidden_layers=layers, num_attention_heads=4, num_key_value_heads=4,
                                        tie_word_embeddings=False, max_position_embeddings=4096))


def rank_main(args) -> None:
    import torch.distributed as dist

    from portagrpo.backends import get_backend
    from portagrpo.backends.dist import Collectives, init_collectives
    from portagrpo.kernels import logprob_impl
    from portagrpo.model.parallel import FSDP2
    from portagrpo.model.scorer import ResponseScorer

    torch.set_num_threads(1)
    init_collectives(get_backend("cpu"), 600)
    rank = dist.get_rank()
    scorers = {name: FSDP2(Collectives(), stream_rows=name == "streamed").wrap(
        ResponseScorer(_model(args.vocab, args.hidden, args.layers), logprob_impl("chunked")), trainable=True)
        for name in ("gathered", "streamed")}
    rows, width = 4, args.tokens // 4 + 16
    g = torch.Generator().manual_seed(args.seed * 1000 + rank)
    ids = torch.randint(0, args.vocab, (rows, width), generator=g)
    mask, rmask = torch.ones_like(ids), torch.ones(rows, args.tokens // 4, dtype=torch.bool)
    times: dict[str, list[float]] = {name: [] for name in scorers}
    for i in range(args.iters + 1):  # the first round warms both up and is not counted
        for name, scorer in scorers.items():
            dist.barrier()
            start = time.perf_counter()
            logp, ent, _, _ = scorer(ids, mask, ids[:, width - rmask.shape[1]:], rmask, 1.0, True, False)
            (logp.sum() + ent.sum()).backward()
            dist.barrier()
            if i:
                times[name].append(time.perf_counter() - start)
            scorer.zero_grad(set_to_none=True)
    if rank == 0:
        Path(args.out).write_text(json.dumps({name: statistics.median(t) for name, t in times.items()}))
    dist.destroy_process_group()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--ranks", type=int, default=2)
    p.add_argument("--vocab", type=int, default=32768)
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=2)
    p.add_argument("--tokens", type=int, default=512)
    p.add_argument("--iters", type=int, default=6)
    p.add_argument("--seeds", default="0,1,2")
    p.add_argument("--json")
    p.add_argument("--rank-main", action="store_true", help=argparse.SUPPRESS)
    p.add_argument("--seed", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--out", help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.rank_main:
        rank_main(args)
        return 0
    results = []
    for seed in [int(s) for s in args.seeds.split(",")]:
        with tempfile.TemporaryDirectory() as tmp:
            out = Path(tmp) / "result.json"
            cmd = [sys.executable, "-m", "portagrpo.launcher", "--nproc", str(args.ranks), __file__, "--rank-main",
                   "--seed", str(seed), "--out", str(out), "--vocab", str(args.vocab), "--hidden", str(args.hidden),
                   "--layers", str(args.layers), "--tokens", str(args.tokens), "--iters", str(args.iters)]
            subprocess.run(cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"})
            medians = json.loads(out.read_text())
        ratio = medians["streamed"] / medians["gathered"]
        results.append({"seed": seed, **medians, "ratio": ratio})
        print(f"seed {seed}: gathered {medians['gathered'] * 1e3:.1f} ms, streamed {medians['streamed'] * 1e3:.1f} ms, "
              f"streamed / gathered x{ratio:.2f}")
    ratios = [r["ratio"] for r in results]
    print(f"streamed / gathered over {len(ratios)} seeds: x{statistics.median(ratios):.2f} "
          f"(min x{min(ratios):.2f}, max x{max(ratios):.2f}); {args.ranks} gloo CPU ranks, vocab {args.vocab}, "
          f"hidden {args.hidden}, {args.tokens} response tokens a rank")
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": results, "args": vars(args)}, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
