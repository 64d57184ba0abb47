"""What one weight push into vLLM's CPU build costs against its floor, one copy of the policy's weights:
`python bench/vllm_push.py [--sizes 3m,24m] [--rounds 3] [--pushes 10] [--json out.json]` (vLLM's CPU build installed).

The engine is portagrpo's (`VLLMRollout`, fp32, in process, as `rollout.engine=vllm` builds it on the CPU) on the
random Qwen2 models of bench/vs_trl.py, and the policy an HF model of the same checkpoint. Two pushes are compared:
- `in-place` (now): the weights loaded into the ones vLLM's CPU GEMMs are prepared from, each GEMM prepared again
  (rollout/vllm_parts.py: CpuGemmWeights);
- `reload` (before): vLLM's layerwise reload of every layer, then the tied LM head processed again.
Each (size, push) runs in a fresh process; the rounds interleave them (the order rotates every round), and inside a
process every push alternates with a floor measurement (`{name: tensor.clone()}` of the policy's state_dict, the
floor bench/vs_trl.py reports), so that load from other processes falls on both. Reported per (size, push): the
medians over rounds of the process's median push, floor and push/floor ratio, and the parts of an in-place push
(loading the tensors; preparing the GEMMs again, which is oneDNN's reorder of each weight into its blocked layout).
With `--generate 8,32,128` a third run per size times vLLM's generation (that many sequences, 8 per prompt, 32
tokens each) with its prepared GEMMs against torch's `F.linear` on the kept plain weights (what a push that only
copied would leave vLLM computing with), alternating the two, in an eager engine. One torch thread.
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

PUSHES = ("in-place", "reload")


def worker(spec: dict) -> dict:
    if spec["push"] == "generate":
        return generate_worker(spec)
    import torch
    from transformers import AutoModelForCausalLM

    import portagrpo.rollout.vllm as engine_module
    from portagrpo.model.loading import build_char_tokenizer

    torch.set_num_threads(1)
    if spec["push"] == "reload":
        engine_module.CpuGemmWeights.of = staticmethod(lambda get_model: None)  # the layerwise reload instead
    engine = engine_module.VLLMRollout(None, build_char_tokenizer(), None, model_path=spec["model"], dtype="float32",
                                       max_model_len=128, tied_embeddings=True, sleep_mode=False)
    torch.set_num_threads(1)
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    engine.update_weights(policy.state_dict().items())  # the first push: built with dummy weights
    pushes, floors, loads, gemms = [], [], [], []
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
            engine.in_place.model.load_weights(
                (n, t) for n, t in policy.state_dict().items() if n != "lm_head.weight")
            loads.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            for layer in engine.in_place.gemm_layers:
                engine.in_place.dispatch(layer, remove_weight=False)
            gemms.append(time.perf_counter() - t0)
    med = statistics.median
    out = {"push_s": med(pushes), "floor_s": med(floors), "ratio": med(p / f for p, f in zip(pushes, floors)),
           "fp32_model_mib": sum(v.numel() * 4 for v in policy.state_dict().values()) / 2**20}
    if loads:
        out.update(load_s=med(loads), gemm_prepare_s=med(gemms))
    return out


def generate_worker(spec: dict) -> dict:
    """vLLM's generation with its prepared GEMMs against torch's F.linear on the kept plain weights: an engine of
    its own, eager (vLLM's compiled forward is traced with the prepared GEMMs' closures, so they cannot be swapped
    under it), loaded with the policy through the in-place push."""
    import torch
    import vllm
    from transformers import AutoModelForCausalLM
    from vllm.inputs import TokensPrompt

    from portagrpo.rollout.vllm_parts import CpuGemmWeights, _process_state_kept

    torch.set_num_threads(1)
    with _process_state_kept():
        llm = vllm.LLM(model=spec["model"], dtype="float32", max_model_len=128, load_format="dummy", seed=0,
                       enforce_eager=True, generation_config="vllm")
    model = llm.llm_engine.model_executor.driver_worker.worker.get_model()
    gemm = CpuGemmWeights.of(lambda: model)
    policy = AutoModelForCausalLM.from_pretrained(spec["model"], dtype=torch.float32)
    gemm.load((n, t) for n, t in policy.state_dict().items() if n != "lm_head.weight")
    prepared = {layer: layer.cpu_linear for layer in gemm.gemm_layers}
    out = {}
    for sequences in spec["generate"]:
        prompts = [TokensPrompt(prompt_token_ids=[5 + i % 50, 6, 7, 8, 9, 10, 11, 12])
                   for i in range(max(sequences // 8, 1))]
        params = vllm.SamplingParams(n=min(sequences, 8), temperature=1.0, max_tokens=32, ignore_eos=True,
                                     detokenize=False)
        times: dict[str, list[float]] = {"prepared": [], "plain": []}
        for i in range(spec["reps"]):
            for kind in (("prepared", "plain") if i % 2 else ("plain", "prepared")):
                for layer in gemm.gemm_layers:
                    layer.cpu_linear = prepared[layer] if kind == "prepared" else torch.nn.functional.linear
                torch.manual_seed(i)
                t0 = time.perf_counter()
                llm.generate(prompts, [params] * len(prompts), use_tqdm=False)
                times[kind].append(time.perf_counter() - t0)
        out[str(sequences)] = {kind: statistics.median(ts) for kind, ts in times.items()}
    return {"generate_s": out}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/vllm_push.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--sizes", default="3m,24m")
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--pushes", type=int, default=10)
    p.add_argument("--workdir", default=os.path.join(tempfile.gettempdir(), "portagrpo-vllm-push"))
    p.add_argument("--generate", default="", help="sequences per generation to time with and without vLLM's "
                                                     "prepared GEMMs (in-place runs), e.g. 8,32,128")
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
    runs = [(size, push) for size in sizes for push in PUSHES + (("generate",) if generate else ())]
    results: dict = {f"{size} {push}": [] for size, push in runs}
    env = {**os.environ, "OMP_NUM_THREADS": "1", "MKL_NUM_THREADS": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
           "VLLM_CPU_KVCACHE_SPACE": "1", "VLLM_NO_USAGE_STATS": "1", "VLLM_LOGGING_LEVEL": "WARNING",
           "TOKENIZERS_PARALLELISM": "false", "TRANSFORMERS_VERBOSITY": "error"}
    models = {size: build_workdir(Path(args.workdir) / size, size, 1, 1)["model"] for size in sizes}
    for i in range(args.rounds):
        for size, push in runs[i % len(runs):] + runs[:i % len(runs)]:
            spec = {"model": models[size], "push": push, "pushes": args.pushes, "generate": generate, "reps": 4}
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
                b: {kind: statistics.median(r["generate_s"][b][kind] for r in rows) for kind in ("prepared", "plain")}
                for b in rows[0]["generate_s"]}
    for key, m in report["median"].items():
        if "push_s" not in m:
            for b, g in m["generate_s"].items():
                print(f"{key:14} {b} x 32 tokens: {g['prepared']:.3f} s with vLLM's GEMMs, {g['plain']:.3f} s with "
                      f"F.linear on plain weights ({g['plain'] / g['prepared']:.2f}x)")
            continue
        parts = (f", of which loading {m['load_s'] * 1e3:.1f} ms and preparing the GEMMs "
                 f"{m['gemm_prepare_s'] * 1e3:.1f} ms" if "load_s" in m else "")
        print(f"{key:14} ({m['fp32_model_mib']:.1f} MiB): push {m['push_s'] * 1e3:7.1f} ms, floor "
              f"{m['floor_s'] * 1e3:6.1f} ms, push/floor {m['ratio']:.2f}x{parts}")
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
