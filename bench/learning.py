"""Learning at equal settings: the embedded task's reward curve of each rollout variant, mean of seeds.

    python bench/learning.py [--steps 150] [--seeds 1,2,3] [--variants a,b,...] [--workdir DIR] [--json out.json]

Each (variant, seed) is one `portagrpo train` of the default recipe in a fresh process, one torch thread
per process (a one_step_off run's sampler process has its own). Variants are rollout settings with and
without verl's rollout correction (token-level truncated importance weights, threshold 2):

    sync-fp32                  the baseline: sample, then update, with the training weights
    one_step_off[+tis]         batch k+1 sampled with the weights before update k (rollout.mode)
    int8[+tis]                 the sampler's copy in dynamic int8 (rollout.precision)
    one_step_off+int8[+tis]    both
    one_step_off+int8+bypass   both, the sampler's log-probs as the old ones (verl's bypass mode)

Reported per variant: the mean over seeds of the training reward in the first and last 10% of steps,
of the held-out greedy reward at the last step, the seeds' spread (max - min) of the last-10% reward,
and the mean sampler/trainer gap (`rollout_corr/abs_logp_diff_mean`, `rollout_corr/kl`).
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TIS = ["algorithm.rollout_correction.rollout_is=token", "algorithm.rollout_correction.rollout_is_threshold=2.0"]
VARIANTS = {
    "sync-fp32": [],
    "one_step_off": ["rollout.mode=one_step_off"],
    "one_step_off+tis": ["rollout.mode=one_step_off", *TIS],
    "int8": ["rollout.precision=int8"],
    "int8+tis": ["rollout.precision=int8", *TIS],
    "one_step_off+int8": ["rollout.mode=one_step_off", "rollout.precision=int8"],
    "one_step_off+int8+tis": ["rollout.mode=one_step_off", "rollout.precision=int8", *TIS],
    "one_step_off+int8+bypass": ["rollout.mode=one_step_off", "rollout.precision=int8",
                                 "algorithm.rollout_correction.bypass_mode=true"],
}


def run(variant: str, seed: int, steps: int, workdir: Path) -> list[dict]:
    out = workdir / f"{variant}-s{seed}"
    env = {**os.environ, "OMP_NUM_THREADS": "1", "TOKENIZERS_PARALLELISM": "false"}
    cmd = [sys.executable, "-m", "portagrpo", "train", "--output-dir", str(out), "trainer.progress_bar=false",
           "trainer.num_threads=1", f"trainer.seed={seed}", f"trainer.total_steps={steps}",
           f"trainer.test_freq={steps}", f"trainer.save_freq={steps}", "trainer.plot=false",
           "trainer.tensorboard=false", *VARIANTS[variant]]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True)
    if res.returncode != 0:
        raise SystemExit(f"learning: {variant} seed {seed} failed:\n{res.stderr[-3000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines()]


def summary(runs: list[list[dict]]) -> dict:
    def mean_of(rows: list[dict], key: str) -> float:
        values = [r[key] for r in rows if key in r]
        return statistics.mean(values) if values else float("nan")

    first, last, val, gap, kl = [], [], [], [], []
    for rows in runs:
        steps = [r for r in rows if "reward_mean" in r]
        k = max(1, len(steps) // 10)
        first.append(mean_of(steps[:k], "reward_mean"))
        last.append(mean_of(steps[-k:], "reward_mean"))
        val.append([r["val/reward_mean"] for r in rows if "val/reward_mean" in r][-1])
        gap.append(mean_of(steps, "rollout_corr/abs_logp_diff_mean"))
        kl.append(mean_of(steps, "rollout_corr/kl"))
    return {"reward_first10": statistics.mean(first), "reward_last10": statistics.mean(last),
            "reward_last10_spread": max(last) - min(last), "reward_last10_per_seed": last,
            "val_reward_final": statistics.mean(val), "val_per_seed": val,
            "abs_logp_diff_mean": statistics.mean(gap), "kl": statistics.mean(kl)}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/learning.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workdir", default="/tmp/portagrpo-learning")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    variants = [v for v in args.variants.split(",") if v]
    unknown = [v for v in variants if v not in VARIANTS]
    if unknown:
        p.error(f"--variants: unknown {unknown}; use some of {', '.join(VARIANTS)}")
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/learning.py " + " ".join(argv), "steps": args.steps, "seeds": seeds,
              "variants": {}}
    for variant in variants:
        report["variants"][variant] = summary([run(variant, seed, args.steps, workdir) for seed in seeds])
        s = report["variants"][variant]
        print(f"{variant:>22}: reward {s['reward_first10']:.3f} -> {s['reward_last10']:.3f} "
              f"(seed spread {s['reward_last10_spread']:.3f}), val {s['val_reward_final']:.3f}, "
              f"|dlogp| {s['abs_logp_diff_mean']:.4f}, kl {s['kl']:.5f}", flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
