"""`portagrpo bench kernels`: forward+backward time and peak memory of the token log-prob paths.

Each (shape, variant) runs in a fresh subprocess so that peak memory is that variant's alone:
`torch.*.max_memory_allocated` on GPU/NPU, the resident-set high-water mark on the CPU, both
minus the memory in use once the inputs exist. Times are the median of `repeats` runs after
one warm-up. Ratios are against `naive` measured in the same invocation.
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import time
from typing import Any

DEFAULT_SHAPES = ["4096x896x151936", "4096x2048x151936"]
VARIANTS = ["naive", "chunked", "triton"]
BENCH_DTYPES = ("fp32", "bf16")


def naive_logprobs(hidden, weight, targets, *, compute_entropy=False, **_):
    """Full logits, log_softmax, gather: what an unfused trainer does."""
    import torch

    logits = (hidden @ weight.t()).float()
    logp_vocab = torch.log_softmax(logits, dim=-1)
    logp = logp_vocab.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    ent = -(logp_vocab.exp() * logp_vocab).sum(-1) if compute_entropy else None
    return logp, ent


def _variant_fn(name: str):
    from portagrpo.kernels import logprob_impl

    return naive_logprobs if name == "naive" else logprob_impl(name)


def measure_one(shape: str, variant: str, dtype: str, device: str, repeats: int, entropy: bool) -> dict[str, Any]:
    """Runs inside the subprocess."""
    import torch

    from portagrpo.backends import get_backend
    from portagrpo.tolerances import DTYPES

    backend = get_backend(device)
    n, h, v = (int(x) for x in shape.split("x"))
    dt = DTYPES[dtype]
    dev = backend.device(0)
    need = (n * v * 4 * 3 + v * h * 4 * 2) / 2**30 if variant == "naive" else (v * h * 4 * 3) / 2**30
    if need > backend.free_memory_gb() * 0.9:
        return {"status": f"skipped: needs about {need:.1f} GiB, {backend.free_memory_gb():.1f} GiB free"}
    g = torch.Generator().manual_seed(0)
    hidden = torch.randn(n, h, generator=g).to(device=dev, dtype=dt).requires_grad_(True)
    weight = (torch.randn(v, h, generator=g) * h ** -0.5).to(device=dev, dtype=dt).requires_grad_(True)
    targets = torch.randint(0, v, (n,), generator=g).to(dev)
    fn = _variant_fn(variant)

    def run_once():
        logp, ent = fn(hidden, weight, targets, compute_entropy=entropy)
        loss = logp.sum() + (ent.sum() if entropy else 0.0)
        loss.backward()
        hidden.grad = weight.grad = None
        backend.synchronize()

    # The baseline is taken before the first run: on the CPU the peak is the process's
    # resident-set high-water mark, which cannot be reset and would otherwise absorb the warm-up.
    backend.synchronize()
    base = backend.current_memory_gb()
    backend.reset_peak_memory()
    run_once()  # warm-up (kernel compilation, allocator)
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        run_once()
        times.append(time.perf_counter() - t0)
    peak = backend.peak_memory_gb() - base
    return {"status": "ok", "time_s": statistics.median(times), "peak_gb": max(peak, 0.0), "device": backend.name}


def run_subprocess(shape, variant, dtype, device, repeats, entropy, threads) -> dict[str, Any]:
    env = {**os.environ}
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "portagrpo.tools.bench", "--one", shape, variant, dtype, device, str(repeats),
           "1" if entropy else "0"]
    res = subprocess.run(cmd, capture_output=True, text=True, env=env)
    if res.returncode != 0:
        last = (res.stderr.strip().splitlines() or ["no output"])[-1]
        return {"status": f"failed: {last}"}
    return json.loads(res.stdout.strip().splitlines()[-1])


def bench_kernels(shapes, variants, dtype, device, repeats, entropy, threads=None, log=print) -> list[dict[str, Any]]:
    rows = []
    for shape in shapes:
        baseline = None
        for variant in variants:
            if variant == "triton" and device == "cpu":
                rows.append({"shape": shape, "variant": variant, "dtype": dtype,
                             "status": "skipped: Triton runs on the CPU only through its interpreter"})
                log(format_row(rows[-1]))
                continue
            r = {"shape": shape, "variant": variant, "dtype": dtype,
                 **run_subprocess(shape, variant, dtype, device, repeats, entropy, threads)}
            if variant == "naive" and r["status"] == "ok":
                baseline = r
            if r["status"] == "ok" and baseline is not None:
                r["time_vs_naive"] = r["time_s"] / baseline["time_s"]
                r["mem_vs_naive"] = r["peak_gb"] / baseline["peak_gb"] if baseline["peak_gb"] else None
            rows.append(r)
            log(format_row(r))
    return rows


def format_row(r: dict[str, Any]) -> str:
    if r["status"] != "ok":
        return f"{r['shape']:18} {r['variant']:8} {r['dtype']:5} {r['status']}"
    ratio = ""
    if "time_vs_naive" in r:
        ratio = f"  time x{r['time_vs_naive']:.2f}  memory x{r['mem_vs_naive']:.3f}"
    return f"{r['shape']:18} {r['variant']:8} {r['dtype']:5} {r['time_s']:8.2f} s  peak {r['peak_gb']:7.3f} GiB{ratio}"


def main_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="portagrpo bench kernels")
    p.add_argument("--shapes", default=",".join(DEFAULT_SHAPES), help="N x H x V, comma separated")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--dtype", default="fp32", choices=list(BENCH_DTYPES))
    p.add_argument("--device", default="auto")
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--entropy", action="store_true", help="also compute (and differentiate) the entropy")
    p.add_argument("--threads", type=int, default=None, help="torch threads in each measuring process")
    p.add_argument("--json", dest="json_path", help="write the rows to this file")
    args = p.parse_args(argv)
    from portagrpo.backends import get_backend
    from portagrpo.fileio import check_report_destination, write_report

    if args.json_path:  # before any work
        check_report_destination(args.json_path, "--json", "bench-kernels")
    device = get_backend(args.device).name
    print(f"{'shape (NxHxV)':18} {'variant':8} {'dtype':5} {'fwd+bwd':>10}  {'peak':>12}  (device {device})")
    rows = bench_kernels(args.shapes.split(","), args.variants.split(","), args.dtype, device, args.repeats,
                         args.entropy, args.threads)
    if args.json_path:
        write_report(args.json_path, {"device": device, "rows": rows, "argv": argv}, "bench-kernels")
    return 0


if __name__ == "__main__":
    if len(sys.argv) > 1 and sys.argv[1] == "--one":
        shape, variant, dtype, device, repeats, entropy = sys.argv[2:8]
        print(json.dumps(measure_one(shape, variant, dtype, device, int(repeats), entropy == "1")))
    else:
        sys.exit(main_cli(sys.argv[1:]))
