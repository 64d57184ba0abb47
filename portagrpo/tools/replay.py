"""`portagrpo replay RUN_DIR --device Y`: re-train from the same initial weights on backend Y with
exactly the rollouts a run recorded (`trainer.record_rollouts=true`), and report per step how
loss, KL, entropy, grad norm and the parameters drift from the recorded run.

No sampling happens, so every difference comes from the backend, dtype or kernel.
"""
from __future__ import annotations

import json
from pathlib import Path
from typing import Any

import torch

from portagrpo.config import load_config
from portagrpo.errors import UserError
from portagrpo.fileio import check_output_path, write_text_atomic
from portagrpo.tolerances import DTYPES, TOLERANCES, relative_error
from portagrpo.train.record import StepRecord
from portagrpo.train.run_dir import RunDir

COMPARED = {"loss_policy": "loss", "loss_kl": "kl", "kl": "kl", "entropy": "entropy", "grad_norm": "grad_norm"}


def recorded_steps(run_dir: Path) -> list[Path]:
    folder = Path(run_dir) / "rollouts"
    steps = sorted(folder.glob("step_*.pt")) if folder.is_dir() else []
    if not steps:
        raise UserError(f"{run_dir} has no recorded rollouts; train it with trainer.record_rollouts=true first.")
    return steps


def _fingerprint_vector(fp: dict[str, list[float]]) -> torch.Tensor:
    return torch.tensor([fp[k] for k in sorted(fp)], dtype=torch.float64).reshape(-1)


def curve_error(replayed: list[float], recorded: list[float]) -> float:
    """||a - b|| / ||b|| over the whole curve (a step's value near 0 cannot inflate it)."""
    return relative_error(torch.tensor(replayed, dtype=torch.float64), torch.tensor(recorded, dtype=torch.float64))




def replay(run_dir: str | Path, device: str, steps: int | None, output_dir: str | Path | None,
           overrides: list[str], log=print) -> dict[str, Any]:
    run_dir = Path(run_dir)
    if not (run_dir / "config.yaml").is_file():
        raise UserError(f"{run_dir} is not a portagrpo run directory (no config.yaml).")
    files = recorded_steps(run_dir)
    if steps is not None and not 1 <= steps <= len(files):
        raise UserError(f"--steps {steps}: {run_dir} has {len(files)} recorded step(s); give a number from 1 to "
                        f"{len(files)}, or leave --steps out to replay them all.")
    files = files[:steps] if steps else files
    base = load_config(run_dir / "config.yaml", check_files=False)
    out_dir = Path(output_dir) if output_dir else run_dir / f"replay-{device}"
    check_output_path(out_dir, "--output-dir")
    RunDir(out_dir).check_new_run()  # before any work: a replay never writes into an earlier one
    cfg = load_config(run_dir / "config.yaml", [
        f"model.path={base.model.path or run_dir / 'init_model'}", f"trainer.device={device}",
        "trainer.record_rollouts=false", "trainer.save_freq=0", "trainer.test_freq=0", "trainer.tensorboard=false",
        "trainer.plot=false", "trainer.progress_bar=false",
        # a replay never samples: no sampler process, no tensor-parallel engine group
        "rollout.mode=sync", "rollout.tensor_model_parallel_size=1", *overrides])
    rows, recorded_setting, replayed_setting = replay_steps(cfg, files, out_dir, log)
    loosest = max((DTYPES[base.model.dtype], DTYPES[cfg.model.dtype]), key=lambda d: TOLERANCES[d]["loss"])
    verdict = judge(rows, TOLERANCES[loosest])
    report = {"run": str(run_dir),
              "recorded": recorded_setting or {"device": base.trainer.device, "dtype": base.model.dtype,
                                               "kernel": base.kernels.logprob},
              "replayed": replayed_setting, "steps": rows, "verdict": verdict,
              "passed": all(v["passed"] for v in verdict.values())}
    out_dir.mkdir(parents=True, exist_ok=True)
    write_text_atomic(out_dir / "replay.json", json.dumps(report, indent=1))
    plot_replay(rows, out_dir / "replay.png", report)
    return report


def replay_steps(cfg, files: list[Path], out_dir: Path, log) -> tuple[list[dict], dict | None, dict]:
    """Train on each recorded step in turn; per step, the compared metrics the run logged and the drift."""
    from portagrpo.train import Trainer

    trainer = Trainer(cfg, run_dir=out_dir, log=log).setup()
    rows, recorded_setting = [], None
    try:
        for path in files:
            record = StepRecord.load(path)
            check_images(record, trainer.models.policy, path)
            recorded_setting = recorded_setting or record.setting or None
            metrics = trainer.replay(record).metrics
            drift = relative_error(_fingerprint_vector(trainer.fingerprint()), _fingerprint_vector(record.fingerprint))
            row = {"step": metrics["step"], "param_drift": drift}
            for key in COMPARED:  # kl/loss_kl exist only in runs with a reference model / KL loss
                if key in record.metrics:
                    row[key] = {"recorded": record.metrics[key], "replayed": metrics.get(key)}
            rows.append(row)
        replayed = {"device": trainer.runtime.backend.name, "dtype": cfg.model.dtype,
                    "kernel": trainer.models.kernel_name}
    finally:
        trainer.close()
    return rows, recorded_setting, replayed


def check_images(record: StepRecord, policy, path: Path) -> None:
    """A vision-language step replays with the images it was trained on (a record written before records kept
    them has the image tokens only, and would train on them as text)."""
    from portagrpo.model.vision import hf_config, is_vision_language

    if record.images is not None or not is_vision_language(policy):
        return
    if bool((record.rollout["prompt_ids"] == hf_config(policy).image_token_id).any()):
        raise UserError(f"{path} has image tokens but no images (it was recorded by a portagrpo that did not keep "
                        f"them); record the run again with trainer.record_rollouts=true to replay it.")


def judge(rows: list[dict[str, Any]], tolerance: dict[str, float]) -> dict[str, dict[str, Any]]:
    """Per compared metric the run logged, and for the parameters: the error over the run against its tolerance."""
    verdict = {}
    for key in logged_keys(rows):
        quantity = COMPARED[key]
        err = curve_error([r[key]["replayed"] for r in rows], [r[key]["recorded"] for r in rows])
        verdict[key] = {"error": err, "tolerance": tolerance[quantity], "passed": err <= tolerance[quantity]}
    drift = max(r["param_drift"] for r in rows)
    verdict["params"] = {"error": drift, "tolerance": tolerance["params"], "passed": drift <= tolerance["params"]}
    return verdict


def logged_keys(rows: list[dict[str, Any]]) -> list[str]:
    """The compared metrics this run logged at every step (no kl/loss_kl without a reference, e.g. DrGRPO)."""
    return [k for k in COMPARED if rows and all(k in r for r in rows)]


def format_report(report: dict[str, Any]) -> str:
    rec, rep = report["recorded"], report["replayed"]
    keys = logged_keys(report["steps"])
    lines = [f"replay of {report['run']}: recorded {rec['device']}/{rec['dtype']}/{rec['kernel']} -> "
             f"replayed {rep['device']}/{rep['dtype']}/{rep['kernel']}",
             f"{'step':>4} " + " ".join(f"{k + ' diff':>16}" for k in keys) + f" {'param drift':>12}"]
    for r in report["steps"]:
        diffs = " ".join(f"{r[k]['replayed'] - r[k]['recorded']:16.3e}" for k in keys)
        lines.append(f"{r['step']:>4} {diffs} {r['param_drift']:12.3e}")
    lines.append("verdict (relative error over the run vs the tolerance table):")
    for key, v in report["verdict"].items():
        lines.append(f"  {key:12} {v['error']:10.3e} <= {v['tolerance']:.1e}  {'pass' if v['passed'] else 'FAIL'}")
    lines.append("replay matches the recorded run" if report["passed"] else "replay DIVERGES from the recorded run")
    return "\n".join(lines)


def plot_replay(rows: list[dict[str, Any]], out: Path, report: dict[str, Any]) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    steps = [r["step"] for r in rows]
    fig, axes = plt.subplots(2, 3, figsize=(12, 6))
    rec, rep = report["recorded"], report["replayed"]
    for ax, key in zip(axes.flat, logged_keys(rows) + ["param_drift"]):
        if key == "param_drift":
            ax.semilogy(steps, [max(r[key], 1e-300) for r in rows], "o-", color="tab:purple")
            ax.set_title("parameter drift (relative)")
        else:
            ax.plot(steps, [r[key]["recorded"] for r in rows], "o-", label=f"recorded ({rec['device']}/{rec['dtype']})")
            ax.plot(
                steps, [r[key]["replayed"] for r in rows], "x--", label=f"replayed ({rep['device']}/{rep['dtype']})"
            )
            ax.set_title(key)
            ax.legend(fontsize=7)
        ax.set_xlabel("step")
    fig.suptitle("portagrpo replay: " + ("match" if report["passed"] else "DIVERGES"))
    fig.tight_layout()
    fig.savefig(out, dpi=90)
    plt.close(fig)


def main_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="portagrpo replay")
    p.add_argument("run_dir")
    p.add_argument("--device", default="auto")
    p.add_argument("--steps", type=int, default=None, help="replay only the first K recorded steps")
    p.add_argument("--output-dir", default=None, help="default RUN_DIR/replay-<device>")
    p.add_argument("overrides", nargs="*", help="e.g. model.dtype=bf16 kernels.logprob=chunked")
    args = p.parse_intermixed_args(argv)
    report = replay(args.run_dir, args.device, args.steps, args.output_dir, args.overrides)
    print(format_report(report))
    return 0 if report["passed"] else 1
