"""`portagrpo export RUN_DIR [--merge]`: the trained policy as a plain Hugging Face model directory."""
from __future__ import annotations

import shutil
from pathlib import Path

from .checkpoint import CheckpointError, checkpoint_dir, latest_valid_checkpoint, verify_checkpoint
from .config import load_config
from .errors import UserError


def export(run_dir: str | Path, output: str | Path | None = None, *, merge: bool = False, step: int | None = None,
           log=print) -> Path:
    run_dir = Path(run_dir)
    if step is not None:
        ckpt = checkpoint_dir(run_dir, step)
        problems = verify_checkpoint(ckpt)
        if problems:
            raise CheckpointError(f"checkpoint {ckpt} cannot be exported: {problems[0]}.")
    else:
        ckpt = latest_valid_checkpoint(run_dir, warn=log)
        if ckpt is None:
            raise UserError(f"{run_dir} has no whole checkpoint to export; train with trainer.save_freq > 0.")
    out = Path(output) if output else run_dir / ("export-merged" if merge else "export")
    model_dir = ckpt / "model"
    is_adapter = (model_dir / "adapter_config.json").is_file()
    if out.exists():
        shutil.rmtree(out)
    if not is_adapter:
        shutil.copytree(model_dir, out)  # already a full Hugging Face model
        return out
    if not merge:
        shutil.copytree(model_dir, out)  # a peft adapter directory; load it onto the base model
        return out
    from peft import PeftModel

    from .modeling import load_model, load_tokenizer

    cfg = load_config(run_dir / "config.yaml", check_files=False)
    base_path = cfg.model.path or str(run_dir / "init_model")
    base = load_model(base_path, "sdpa")
    merged = PeftModel.from_pretrained(base, str(model_dir)).merge_and_unload()
    merged.save_pretrained(out, safe_serialization=True)
    load_tokenizer(cfg.model.tokenizer_path or base_path).save_pretrained(out)
    return out


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
