"""The tiny mixture-of-experts policy learning the embedded task, with and without router replay.

    python bench/moe_learning.py [--steps 120] [--seeds 1,2,3] [--workdir DIR] [--json out.json]

Each (variant, seed) is one `portagrpo train` of the default recipe with `model.tiny.moe=qwen3_moe` (4 experts, top-2,
2 layers, hidden 64) on the hf engine, in a fresh process with one torch thread:

    moe        routing live (actor.router_replay=null)
    moe+R3     the scoring and update forwards replay the experts the sampler chose
    moe+R2     the update replays the experts the old policy's scoring pass chose
    moe+bf16   the sampler a bf16 copy of the policy (rollout.precision=bf16), routing live
    moe+bf16+R3  the same, the trainer replaying the bf16 sampler's experts

Reported per variant, mean over seeds: the training reward in the first and last 10% of steps and its seed spread,
the held-out reward at the last step, `moe/route_agreement` (mean, and its minimum over every step of every seed),
and the sampler/trainer gap (`rollout_corr/kl`, largest |value| of any step). The reward curve (every 10th step,
mean over seeds) is printed as a table.
"""
from __future__ import annotations

import argparse
import json
import statistics
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))  # bench/learning.py, the runner

MOE = ["model.tiny.moe=qwen3_moe"]
BF16 = [*MOE, "rollout.precision=bf16"]  # the hf sampler on a bf16 copy of the fp32 policy: its routes can differ
VARIANTS = {"moe": MOE, "moe+R3": [*MOE, "actor.router_replay=R3"], "moe+R2": [*MOE, "actor.router_replay=R2"],
            "moe+bf16": BF16, "moe+bf16+R3": [*BF16, "actor.router_replay=R3"]}


def run(variant: str, seed: int, steps: int, workdir: Path) -> list[dict]:
    """One `portagrpo train` of the default recipe with the variant's overrides (bench/learning.py's runner)."""
    import learning

    learning.VARIANTS.update(VARIANTS)
    return learning.run(variant, seed, steps, workdir)


def summary(runs: list[list[dict]]) -> dict:
    first, last, val, agree, kl = [], [], [], [], []
    for rows in runs:
        steps = [r for r in rows if "reward_mean" in r]
        k = max(1, len(steps) // 10)
        first.append(statistics.mean(r["reward_mean"] for r in steps[:k]))
        last.append(statistics.mean(r["reward_mean"] for r in steps[-k:]))
        val.append([r["val/reward_mean"] for r in rows if "val/reward_mean" in r][-1])
        agree += [r["moe/route_agreement"] for r in steps if "moe/route_agreement" in r]
        kl += [abs(r["rollout_corr/kl"]) for r in steps if "rollout_corr/kl" in r]
    n = min(len(rows) for rows in runs)
    curve = [statistics.mean(rows[i]["reward_mean"] for rows in runs) for i in range(0, n, 10)]
    return {"reward_first10": statistics.mean(first), "reward_last10": statistics.mean(last),
            "reward_last10_spread": max(last) - min(last), "val_reward_final": statistics.mean(val),
            "route_agreement_mean": statistics.mean(agree), "route_agreement_min": min(agree),
            "kl_max_abs": max(kl), "curve_every_10": curve}


def main(argv: list[str]) -> int:
    p = argparse.ArgumentParser(prog="bench/moe_learning.py", description=__doc__.split("\n\n")[0])
    p.add_argument("--steps", type=int, default=120)
    p.add_argument("--seeds", default="1,2,3")
    p.add_argument("--variants", default=",".join(VARIANTS))
    p.add_argument("--workdir", default="/tmp/portagrpo-moe-learning")
    p.add_argument("--json", default=None)
    args = p.parse_args(argv)
    seeds = [int(s) for s in args.seeds.split(",")]
    workdir = Path(args.workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    report = {"command": "python bench/moe_learning.py " + " ".join(argv), "steps": args.steps, "seeds": seeds,
              "variants": {}}
    for variant in [v for v in args.variants.split(",") if v]:
        s = report["variants"][variant] = summary([run(variant, seed, args.steps, workdir) for seed in seeds])
        print(f"{variant:>7}: reward {s['reward_first10']:.3f} -> {s['reward_last10']:.3f} (seed spread "
              f"{s['reward_last10_spread']:.3f}), val {s['val_reward_final']:.3f}, route agreement "
              f"{s['route_agreement_mean']:.4f} (min {s['route_agreement_min']:.4f}), max |kl| {s['kl_max_abs']:.1e}",
              flush=True)
        print("         curve (every 10th step): " + " ".join(f"{x:.3f}" for x in s["curve_every_10"]), flush=True)
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
