"""`portagrpo export RUN_DIR [--merge]`: the trained policy as a plain Hugging Face model directory."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

from portagrpo.checkpoint import (
    PREFIX,
    CheckpointError,
    checkpoint_dir,
    latest_valid_checkpoint,
    list_checkpoints,
    verify_checkpoint,
)
from portagrpo.config import load_config
from portagrpo.errors import UserError
from portagrpo.fileio import atomic_path, check_output_path
from portagrpo.train.run_dir import remove_dead_temporaries

MARKER = ".portagrpo-export.json"  # marks a directory an export may replace


def export(run_dir: str | Path, output: str | Path | None = None, *, merge: bool = False, step: int | None = None,
           log=print) -> Path:
    run_dir = Path(run_dir)
    if step is not None:
        ckpt = checkpoint_dir(run_dir, step)
        if not ckpt.exists():
            kept = ", ".join(str(int(p.name.removeprefix(PREFIX))) for p in list_checkpoints(run_dir)) or "none"
            raise CheckpointError(f"--step {step}: {run_dir} has no checkpoint of step {step} (it keeps steps: {kept}; "
                                  f"older ones are pruned after trainer.max_ckpt_to_keep); pick one of those.")
        problems = verify_checkpoint(ckpt)
        if problems:
            raise CheckpointError(f"checkpoint {ckpt} cannot be exported: {problems[0]}.")
    else:
        ckpt = latest_valid_checkpoint(run_dir, warn=log)
        if ckpt is None:
            raise UserError(f"{run_dir} has no whole checkpoint to export; train with trainer.save_freq > 0.")
    out = Path(output) if output else run_dir / ("export-merged" if merge else "export")
    check_destination(out)
    # an earlier export is moved aside and removed only once the new one is in place, so a kill or a
    # full disk at any moment leaves one whole export (or the old one) and no temporary
    with atomic_path(out, directory=True, what="exporting to") as tmp:
        tmp.rmdir()  # copytree and save_pretrained create it
        _write(run_dir, ckpt / "model", tmp, merge)
        (tmp / MARKER).write_text(json.dumps({"run": str(run_dir.resolve()), "checkpoint": ckpt.name, "merged": merge}))
    return out


def check_destination(out: Path, option: str = "export --output", marker: str = MARKER,
                      what: str = "an earlier portagrpo export") -> None:
    """A command's output directory (an export's, `portagrpo warmstart`'s) replaces only an earlier output of the same
    command, one that holds `marker`: never a user's directory that merely exists, a run directory or another
    command's output."""
    check_output_path(out, option)  # a file there, a file above it, a name too long
    if out.is_dir() and any(out.iterdir()) and not (out / marker).is_file():
        raise UserError(f"{option} {out} is not empty and is not {what}; pass a new or empty directory (nothing was "
                        f"written).")
    for prefix in (f".tmp_{out.name}_", f".tmp_old_{out.name}_"):  # left by killed writers
        remove_dead_temporaries(out.parent, prefix=prefix)


def _write(run_dir: Path, model_dir: Path, dest: Path, merge: bool) -> None:
    if not (model_dir / "adapter_config.json").is_file() or not merge:
        shutil.copytree(model_dir, dest)  # a full Hugging Face model, or a peft adapter for its base
    else:
        _write_merged(run_dir, model_dir, dest)
    _write_processor(model_dir, dest)


def _write_merged(run_dir: Path, model_dir: Path, dest: Path) -> None:
    from peft import PeftModel

    from portagrpo.model.loading import load_model, load_tokenizer

    cfg = load_config(run_dir / "config.yaml", check_files=False)
    base_path = cfg.model.path or str(run_dir / "init_model")
    base = load_model(base_path, "sdpa")
    merged = PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload()
    merged.save_pretrained(dest, safe_serialization=True)
    load_tokenizer(cfg.model.tokenizer_path or base_path).save_pretrained(dest)


def _write_processor(model_dir: Path, dest: Path) -> None:
    """A vision-language run's checkpoint holds its processor (image processor, tokenizer, chat template). The export
    gets it saved again as transformers' own Qwen2.5-VL processor saves (model/vision.py), so transformers alone loads
    it with AutoProcessor, also from a checkpoint that an older portagrpo wrote under its own class name."""
    from portagrpo.model.vision import load_processor
    from portagrpo.paths import has_processor

    if has_processor(model_dir):
        load_processor(model_dir, "the checkpoint's model").save_pretrained(dest)


def main_cli(argv: list[str]) -> int:
    import argparse

    p = argparse.ArgumentParser(prog="portagrpo export")
    p.add_argument("run_dir")
    p.add_argument("--merge", action="store_true", help="merge a LoRA adapter into the base weights")
    p.add_argument("--step", type=int, default=None, help="checkpoint step (default: the newest whole one)")
    p.add_argument("--output", default=None, help="default RUN_DIR/export or RUN_DIR/export-merged")
    args = p.parse_args(argv)
    out = export(args.run_dir, args.output, merge=args.merge, step=args.step)
    print(f"exported {out}")
    return 0
