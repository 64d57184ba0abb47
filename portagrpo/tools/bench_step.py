"""`portagrpo bench step`: the end-to-end GRPO step, phase by phase, against a FLOP floor.

Each variant (a set of config overrides) runs in a fresh subprocess with a pinned thread count:
it trains `--warmup` steps that are not counted, then `--steps` measured ones, and reports the
median time of each phase (generate, reward, log-probs, update), response tokens/s, tokens/s per
device counted as verl does ((prompt + response) / (step time x devices)), MFU (the step's model FLOPs per device
and second over the device's datasheet peak, backends/peaks.py; none for a device without a row), peak memory, and each
phase's floor: the phase's model FLOPs divided by the matmul rate this process measured on this
device in the same run, and for generation the larger of that and the time to read every weight once
per generated token at the copy bandwidth measured the same way (so "x floor" is a ratio on the same
hardware, not a datasheet figure).
"""
from __future__ import annotations

import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from portagrpo.backends.peaks import peak_flops

PHASES = ("generate", "reward", "logprobs", "update")


def matmul_flops_per_s(device, dtype, size: int = 1024, repeats: int = 5) -> float:
    """Achieved dense matmul throughput on `device` (the floor's hardware rate)."""
    import torch

    a = torch.randn(size, size, device=device, dtype=dtype)
    b = torch.randn(size, size, device=device, dtype=dtype)
    (a @ b).sum().item()
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        (a @ b).sum().item()
        times.append(time.perf_counter() - t)
    return 2 * size**3 / min(times)


def copy_bytes_per_s(device, megabytes: int = 256, repeats: int = 3) -> float:
    """Achieved memory bandwidth on `device`: bytes read plus written by a large copy."""
    import torch

    src = torch.empty(megabytes * 2**20 // 4, device=device)
    dst = torch.empty_like(src)
    dst.copy_(src)
    times = []
    for _ in range(repeats):
        t = time.perf_counter()
        dst.copy_(src)
        dst[:1].sum().item()
        times.append(time.perf_counter() - t)
    return 2 * src.numel() * src.element_size() / min(times)


def phase_flops(params: int, prompt_tokens: float, response_tokens: float, *, scoring_passes: int,
                ppo_epochs: int) -> dict[str, float]:
    """Model FLOPs of one step (2 x params per token forward, 6 x params forward+backward):
    generation = prefill of the prompts + one forward per generated token (KV cache);
    log-probs = `scoring_passes` forwards over prompt + response (old and/or reference);
    update = ppo_epochs forward+backward passes over prompt + response. Reward: none."""
    tokens = prompt_tokens + response_tokens
    return {"generate": 2.0 * params * tokens, "reward": 0.0,
            "logprobs": 2.0 * params * tokens * scoring_passes, "update": 6.0 * params * tokens * ppo_epochs}


def run_variant(config: str | None, overrides: list[str], steps: int, warmup: int) -> dict[str, Any]:
    """Inside the subprocess: train warmup + steps, return the medians and floors."""
    import torch

    from portagrpo.config import load_config
    from portagrpo.train import Trainer

    fixed = [f"trainer.total_steps={steps + warmup}", "trainer.save_freq=0", "trainer.test_freq=0",
             "trainer.progress_bar=false", "trainer.tensorboard=false", "trainer.plot=false"]
    cfg = load_config(config, [*overrides, *fixed])
    with tempfile.TemporaryDirectory() as tmp:
        trainer = Trainer(cfg, run_dir=Path(tmp) / "run", log=lambda message: None).setup()
        try:
            rows = [trainer.step().metrics for _ in range(steps + warmup)][warmup:]
            models, rt = trainer.models, trainer.runtime
            scoring_passes = int(trainer.experience.settings.scoring_pass) + (models.ref_scorer is not None)
            params = sum(p.numel() for p in models.policy.parameters())
            rate = matmul_flops_per_s(rt.device, rt.dtype if rt.dtype != torch.float64 else torch.float32)
            bandwidth = copy_bytes_per_s(trainer.runtime.device)
            param_bytes = sum(p.numel() * p.element_size() for p in trainer.models.policy.parameters())
            world = trainer.runtime.comm.world_size
            names = rt.backend.is_available().details.get("device_names") or [str(rt.device)]
            peak, peak_source = peak_flops(names[0], rt.dtype)
        finally:
            trainer.close()
    med = {k: statistics.median(r[k] for r in rows) for k in rows[0] if isinstance(rows[0][k], (int, float))}
    times = {"generate": med["time_gen_s"], "reward": med["time_reward_s"], "logprobs": med["time_logprob_s"],
             "update": med["time_update_s"]}
    batch = cfg.rollout_batch_size
    response_tokens = med["response_len_mean"] * batch
    prompt_tokens = med["prompt_len_mean"] * batch
    flops = phase_flops(params, prompt_tokens, response_tokens, scoring_passes=scoring_passes,
                        ppo_epochs=cfg.actor.ppo_epochs)
    floors = {k: flops[k] / rate for k in PHASES}
    model_flops_per_s = sum(flops.values()) / med["time_step_s"] / world  # per device
    # Every decode step reads every weight at least once, and a response of L tokens needs L steps: at
    # small batches this, not the FLOPs, is what generation cannot beat.
    read_floor = med["response_len_mean"] * param_bytes / bandwidth
    floors["generate"] = max(floors["generate"], read_floor)
    return {
        "overrides": overrides, "threads": torch.get_num_threads(), "device": str(trainer.runtime.device),
        "params": params, "steps": steps, "warmup": warmup, "world_size": world,
        "time_step_s": med["time_step_s"], "phases_s": times,
        "floor_s": floors, "x_floor": {k: (times[k] / floors[k] if floors[k] else None) for k in PHASES},
        "matmul_flops_per_s": rate, "copy_bytes_per_s": bandwidth, "generate_weight_read_floor_s": read_floor,
        "response_tokens_per_s": med["response_tokens_per_s"],
        "tokens_per_s_per_device": med["tokens_per_s_per_device"], "mem_peak_gb": med["mem_peak_gb"],
        "response_len_mean": med["response_len_mean"],
        # MFU: the step's model FLOPs per device and second over the datasheet peak (None where the table has no
        # row: backends/peaks.py); and the same over the matmul rate measured here, which needs no table
        "model_flops_per_s_per_device": model_flops_per_s, "mfu": model_flops_per_s / peak if peak else None,
        "mfu_peak_source": peak_source, "matmul_utilization": model_flops_per_s / rate,
    }


def _spawn(name: str, config: str | None, overrides: list[str], steps: int, warmup: int, threads: int) -> dict:
    env = {**os.environ, "OMP_NUM_THREADS": str(threads), "MKL_NUM_THREADS": str(threads)}
    spec = json.dumps({"config": config, "overrides": [*overrides, f"trainer.num_threads={threads}"],
                       "steps": steps, "warmup": warmup})
    res = subprocess.run([sys.executable, "-m", "portagrpo.tools.bench_step", "--worker", spec], env=env,
                         capture_output=True, text=True)
    if res.returncode != 0:
        from portagrpo.errors import UserError

        tail = (res.stderr.strip().splitlines() or ["no output"])[-1]
        raise UserError(f"bench step variant {name!r} failed: {tail}")
    return {"variant": name, **json.loads(res.stdout.strip().splitlines()[-1])}


def parse_variants(items: list[str]) -> list[tuple[str, list[str]]]:
    """`NAME=key=value,key=value` -> (NAME, [key=value, ...]) (`NAME=` is the baseline with no extra
    overrides); none given: one variant `default`."""
    out = []
    for item in items:
        name, sep, rest = item.partition("=")
        if not name or not sep:
            from portagrpo.errors import UserError

            raise UserError(
                f"--variant {item!r} must look like NAME=key=value[,key=value...] (or NAME= for no overrides)."
            )
        out.append((name, [kv for kv in rest.split(",") if kv]))
    return out or [("default", [])]


def render(results: list[dict]) -> str:
    head = f"{'variant':<14}{'step s':>8}" + "".join(f"{p + ' s (xfloor)':>22}" for p in PHASES) + f"{'resp tok/s':>12}"
    lines = [head]
    for r in results:
        cells = "".join(
            f"{r['phases_s'][p]:>12.3f} " + (f"({r['x_floor'][p]:>6.1f}x)" if r["x_floor"][p] else "(     -)")
            for p in PHASES
        )
        lines.append(f"{r['variant']:<14}{r['time_step_s']:>8.3f}{cells}{r['response_tokens_per_s']:>12.1f}")
    for r in results:
        mfu = f"MFU {r['mfu']:.1%}" if r["mfu"] is not None else "MFU -"
        mfu += f" ({r['mfu_peak_source']})"
        lines.append(f"{r['variant']}: {r['model_flops_per_s_per_device'] / 1e12:.3g} model TFLOP/s per device, {mfu}, "
                     f"{r['matmul_utilization']:.1%} of the matmul rate measured here")
    base = results[0]["time_step_s"]
    lines += [f"{r['variant']}: step time {r['time_step_s'] / base:.2f}x {results[0]['variant']}" for r in results[1:]]
    return "\n".join(lines)


def main_cli(argv: list[str]) -> int:
    import argparse

    from tqdm.auto import tqdm

    p = argparse.ArgumentParser(prog="portagrpo bench step", description=__doc__.split("\n\n")[0])
    p.add_argument("--config", default=None, help="recipe (default: the embedded default)")
    p.add_argument("--steps", type=int, default=3, help="measured steps per variant")
    p.add_argument("--warmup", type=int, default=1, help="steps run first and not counted")
    p.add_argument("--threads", type=int, default=1, help="torch threads of each variant's process")
    p.add_argument("--variant", action="append", default=[], metavar="NAME=key=value,...",
                   help="a named set of overrides (repeatable); each runs in its own process")
    p.add_argument("--json", default=None, help="write the results here")
    p.add_argument("overrides", nargs="*", help="key=value overrides applied to every variant")
    args = p.parse_args(argv)
    from portagrpo.fileio import check_report_destination, write_report

    if args.steps < 1 or args.warmup < 0 or args.threads < 1:
        from portagrpo.errors import UserError

        raise UserError("--steps and --threads must be at least 1 and --warmup at least 0.")
    if args.json:  # before any work
        check_report_destination(args.json, "--json", "bench-step")
    results = []
    for name, extra in tqdm(parse_variants(args.variant), desc="bench step", unit="variant"):
        results.append(_spawn(name, args.config, [*args.overrides, *extra], args.steps, args.warmup, args.threads))
    report = {"command": "portagrpo bench step " + " ".join(argv), "results": results}
    print(render(results))
    if args.json:
        write_report(args.json, report, "bench-step")
    return 0


if __name__ == "__main__":
    if len(sys.argv) == 3 and sys.argv[1] == "--worker":
        spec = json.loads(sys.argv[2])
        print(json.dumps(run_variant(spec["config"], spec["overrides"], spec["steps"], spec["warmup"])))
    else:
        sys.exit(main_cli(sys.argv[1:]))
