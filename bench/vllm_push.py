"""What one weight push into vLLM's CPU build costs against its floor, one copy of the policy's weights:
`python bench/vllm_push.py [--sizes 3m,24m] [--rounds 3] [--pushes 10] [--generate 8,32,128] [--json out.json]`
(vLLM's CPU build installed).

The engine is portagrpo's (`VLLMRollout`, fp32, in process, as `rollout.engine=vllm` builds it on the CPU) on the
random Qwen2 models of bench/vs_trl.py, and the policy an HF model of the same checkpoint. The pushes compared:
- `in-place` (now, rollout/vllm_cpu_push.py: CpuGemmWeights): each tensor copied straight into the views vLLM's loader
  copied it into on the first push; layers of at most PLAIN_GEMM_MAX_BYTES compute with F.linear on their weight
  (nothing to prepare), larger ones' oneDNN GEMMs prepared again;
- `all-prepared`: the same, with every GEMM prepared again (PLAIN_GEMM_MAX_BYTES = 0);
- `loader` (issue 33's first in-place push): every push through the model's `load_weights`, every GEMM prepared again;
- `reload` (before that): vLLM's layerwise reload of every layer, then the tied LM head processed again.
Each (size, push) runs in a fresh process; the rounds interleave them (the order rotates every round), and inside a
process every push alternates with a floor measurement (`{name: tensor.clone()}` of the policy's state_dict, the
floor bench/vs_trl.py reports), so that load from other processes falls on both. Reported per (size, push): the
medians over rounds of the process's median push, floor and push/floor ratio, and the parts of an in-place push
(writing the tensors; preparing the GEMMs again, which is oneDNN's reorder of each weight into its blocked layout).
With `--generate 8,32,128` two more runs per size time vLLM's generation (that many sequences, 8 per prompt, 32
tokens each) in the engine as portagrpo builds it (compiled), with small layers on F.linear (`generate-now`)
against every layer on its prepared GEMM (`generate-prepared`). One torch thread.
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

PUSHES = ("in-place", "all-prepared", "loader", "reload")
GENERATE = ("generate-now", "generate-prepared")


def _engine(spec: dict):
    import torch

    import portagrpo.rollout.vllm as engine_module
    import portagrpo.rollout.vllm_cpu_push as parts
    from portagrpo.model.loading import build_char_tokenizer

    push = spec["push"]
    if spec.get("plain_max_kib") is not None:
        parts.PLAIN_GEMM_MAX_BYTES = int(spec["plain_max_kib"] * 1024)
    if push in ("all-prepared", "loader", "generate-prepared"):
        parts.PLAIN_GEMM_MAX_BYTES = 0
    if push == "reload":  # the layerwise reload, the engine built as vLLM builds it
        engine_module.CpuGemmWeights.of = staticmethod(lambda get_model: None)
        engine_module.CpuGemmWeights.building = staticmethod(lambda plain_max_bytes=None: _null())
    torch.set_num_threads(1)
    engine = engine_module.VLLMRollout(None, build_char_tokenizer(), None, model_path=spec["model"], dtype="float32",
                                       max_model_len=128, tied_embeddings=True, sleep_mode=False)
    torch.set_num_threads(1)
    if push == "loader" and engine.in_place is not None:
        engine.in_place.recorded = True  # no recording: every push through load_weights
    return engine


def _null():
    import contextlib

    return contextlib.nullcontext()


def worker(spec: dict) -> dict:
    if spec["push"] in GENERATE:
        return generate_worker(spec)
    import torch
    from transformers import AutoModelForCausalLM

    engine = _engine(spec)
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    engine.update_weights(policy.state_dict().items())  # the first push (built with dummy weights; records the views)
    pushes, floors, writes, gemms = [], [], [], []
    named = lambda: ((n, t) for n, t in policy.state_dict().items() if n != "lm_head.weight")  # noqa: E731
    for _ in range(spec["pushes"]):
        t0 = time.perf_counter()
        copy = {k: v.detach().clone() for k, v in policy.state_dict().items()}
        floors.append(time.perf_counter() - t0)
        del copy
        t0 = time.perf_counter()
        engine.update_weights(policy.state_dict().items())
        pushes.append(time.perf_counter() - t0)
        if engine.in_place is not None:  # its two parts, timed apart
            t0 = time.perf_counter()
            engine.in_place.write(named())
            writes.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            engine.in_place.prepare()
            gemms.append(time.perf_counter() - t0)
    med = statistics.median
    out = {"push_s": med(pushes), "floor_s": med(floors), "ratio": med(p / f for p, f in zip(pushes, floors)),
           "fp32_model_mib": sum(v.numel() * 4 for v in policy.state_dict().values()) / 2**20}
    if writes:
        ip = engine.in_place
        out.update(load_s=med(writes), gemm_prepare_s=med(gemms), direct=ip.plan is not None,
                   prepared_layers=len(ip.gemm_layers), plain_layers=len(ip.plain_layers))
    return out


def generate_worker(spec: dict) -> dict:
    """vLLM's generation in the engine as portagrpo builds it (compiled), its small layers on F.linear or every layer
    on its prepared GEMM, loaded with the policy through the push."""
    import torch
    from transformers import AutoModelForCausalLM

    from portagrpo.rollout.settings import SamplingParams

    engine = _engine(spec)
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    engine.update_weights(policy.state_dict().items())
    out = {}
    for sequences in spec["generate"]:
        prompts = torch.tensor([[5 + i % 50, 6, 7, 8, 9, 10, 11, 12] for i in range(sequences)])
        params = SamplingParams(32, 1.0)
        times = []
        engine.generate(prompts, torch.ones_like(prompts), params)  # warm-up
        for i in range(spec["reps"]):
            torch.manual_seed(i)
            t0 = time.perf_counter()
            engine.generate(prompts, torch.ones_like(prompts), params)
            times.append(time.perf_counter() - t0)
        out[str(sequences)] = statistics.median(times)
    return {"generate_s": out}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/vllm_push.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="3m,24m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "portagrpo-vllm-push"))
    p.add_argument("--generate", default="", help="sequences per generation to time with small layers on F.linear "
                                                     "and with every GEMM prepared, e.g. 8,32,128")
    p.add_argument("--plain-max-kib", type=float, default=None,
                   help="PLAIN_GEMM_MAX_BYTES for the `in-place` and `generate-now` runs, in KiB (default: the code's)")
    p.add_argument("--pushes-only", default=None, help="comma-separated subset of the pushes to run, e.g. in-place")
    p.add_argument("--json", default=None)
    p.add_argument("--worker", default=None, help=argparse.SUPPRESS)
    args = p.parse_args(argv)
    if args.worker:
        print(json.dumps(worker(json.loads(args.worker))))
        return 0
    sys.path.insert(0, str(Path(__file__).resolve().parent))
    from vs_trl import build_workdir

    sizes = [s.strip() for s in args.sizes.split(",") if s.strip()]
    generate = [int(b) for b in args.generate.split(",") if b.strip()]
    pushes = tuple(x.strip() for x in args.pushes_only.split(",")) if args.pushes_only else PUSHES
    runs = [(size, push) for size in sizes for push in pushes + (GENERATE if generate else ())]
    results: dict = {f"{size} {push}": [] for size, push in runs}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    models = {size: build_workdir(Path(args.workdir) / size, size, 1, 1)["model"] for size in sizes}
    for i in range(args.rounds):
        for size, push in runs[i % len(runs):] + runs[:i % len(runs)]:
            spec = {"model": models[size], "push": push, "pushes": args.pushes, "generate": generate, "reps": 4,
                    "plain_max_kib": args.plain_max_kib}
            res = subprocess.run([sys.executable, __file__, "--worker", json.dumps(spec)], env=env,
                                 capture_output=True, text=True)
            if res.returncode != 0:
                raise SystemExit(f"vllm_push: the {size} {push} run failed:\n{res.stderr[-3000:]}")
            results[f"{size} {push}"].append(json.loads(res.stdout.strip().splitlines()[-1]))
    report = {"command": "python bench/vllm_push.py " + " ".join(argv), "rounds": args.rounds,
              "pushes_per_run": args.pushes, "runs": results,
              "median": {key: {k: statistics.median(r[k] for r in rows) for k in rows[0] if k != "generate_s"}
                         for key, rows in results.items()}}
    for key, rows in results.items():
        if "generate_s" in rows[0]:
            report["median"][key]["generate_s"] = {
                b: statistics.median(r["generate_s"][b] for r in rows) for b in rows[0]["generate_s"]}
    for key, m in report["median"].items():
        if "push_s" not in m:
            size = key.split()[0]
            if key.endswith("generate-now"):
                base = report["median"][f"{size} generate-prepared"]["generate_s"]
                for b, t in m["generate_s"].items():
                    print(f"{size:4} generate {b:>3} x 32 tokens: {t:.3f} s now (small layers on F.linear), "
                          f"{base[b]:.3f} s with every GEMM prepared ({t / base[b]:.2f}x)")
            continue
        parts = (f", of which writing {m['load_s'] * 1e3:.1f} ms ({'direct' if m['direct'] else 'loader'}) and "
                 f"preparing {m['prepared_layers']:.0f} GEMMs {m['gemm_prepare_s'] * 1e3:.1f} ms "
                 f"({m['plain_layers']:.0f} on F.linear)" if "load_s" in m else "")
        print(f"{key:17} ({m['fp32_model_mib']:.1f} MiB): push {m['push_s'] * 1e3:7.1f} ms, floor "
              f"{m['floor_s'] * 1e3:6.1f} ms, push/floor {m['ratio']:.2f}x{parts}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
