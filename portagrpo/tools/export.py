"""`portagrpo export RUN_DIR [--merge]`: the trained policy as a plain Hugging Face model directory."""
from __future__ import annotations

import json
import math
import shutil
import struct
import warnings
from pathlib import Path

import torch

from portagrpo.checkpoint import (
    PREFIX,
    SHARDS,
    SINGLE_PROCESS,
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
        _write(run_dir, ckpt, tmp, merge)
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


def _write(run_dir: Path, ckpt: Path, dest: Path, merge: bool) -> None:
    model_dir = ckpt / "model"
    if (ckpt / SHARDS).is_dir():  # FSDP2's sharded format: the config and tokenizer here, the weights in its shards
        shutil.copytree(model_dir, dest)
        write_sharded_weights(ckpt / SHARDS, dest)
    elif not (model_dir / "adapter_config.json").is_file() or not merge:
        shutil.copytree(model_dir, dest)  # a full Hugging Face model, or a peft adapter for its base
    else:
        _write_merged(run_dir, model_dir, dest)
    _write_processor(model_dir, dest)


SAFETENSORS_DTYPES = {torch.float64: "F64", torch.float32: "F32", torch.float16: "F16", torch.bfloat16: "BF16",
                      torch.int64: "I64", torch.int32: "I32", torch.int16: "I16", torch.int8: "I8", torch.uint8: "U8",
                      torch.bool: "BOOL"}
SHARD_BYTES = 5 << 30  # at most this much per safetensors file, as transformers' save_pretrained shards


def write_sharded_weights(shards: Path, dest: Path, *, shard_bytes: int = SHARD_BYTES) -> list[Path]:
    """The model weights of a sharded checkpoint as Hugging Face safetensors files in `dest`, read one tensor at a
    time from every rank's shard files and written straight out: this process holds one whole tensor at most, never
    the model, and needs no process group. The safetensors headers come from the checkpoint's metadata alone."""
    import torch.distributed.checkpoint as dcp
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    reader = dcp.FileSystemReader(str(shards))
    metadata = reader.read_metadata().state_dict_metadata
    weights = {key: meta for key, meta in sorted(metadata.items())
               if key.startswith("model.") and isinstance(meta, TensorStorageMetadata)}
    files = _plan_files(weights, shard_bytes)

    def read(key: str) -> torch.Tensor:
        meta = weights[key]
        tensor = torch.empty(meta.size, dtype=meta.properties.dtype)
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", message=SINGLE_PROCESS)
            dcp.load({key: tensor}, storage_reader=reader)  # no process group: torch reads in this process alone
        return tensor

    written = []
    for name, keys in files.items():
        written.append(dest / name)
        _write_safetensors(dest / name, [(key.removeprefix("model."), weights[key], key) for key in keys], read)
    if len(files) > 1:  # transformers finds the files through the index
        total = sum(_nbytes(meta) for meta in weights.values())
        index = {k.removeprefix("model."): name for name, keys in files.items() for k in keys}
        (dest / "model.safetensors.index.json").write_text(json.dumps(
            {"metadata": {"total_size": total}, "weight_map": dict(sorted(index.items()))}, indent=1))
    return written


def _nbytes(meta) -> int:
    return meta.properties.dtype.itemsize * math.prod(meta.size)


def _plan_files(weights: dict, shard_bytes: int) -> dict[str, list[str]]:
    """Tensor keys grouped into files of at most `shard_bytes` each (a larger tensor gets a file of its own), named
    as transformers names them."""
    groups: list[list[str]] = [[]]
    size = 0
    for key, meta in weights.items():
        if groups[-1] and size + _nbytes(meta) > shard_bytes:
            groups.append([])
            size = 0
        groups[-1].append(key)
        size += _nbytes(meta)
    if len(groups) == 1:
        return {"model.safetensors": groups[0]}
    return {f"model-{i + 1:05d}-of-{len(groups):05d}.safetensors": keys for i, keys in enumerate(groups)}


def _write_safetensors(path: Path, entries: list, read) -> None:
    """A safetensors file written tensor by tensor: the header (names, dtypes, shapes, byte ranges) from the
    metadata of `entries` (name, metadata, key) first, then each tensor's bytes as `read(key)` returns it."""
    header, offset = {"__metadata__": {"format": "pt"}}, 0
    for name, meta, _ in entries:
        header[name] = {"dtype": SAFETENSORS_DTYPES[meta.properties.dtype], "shape": list(meta.size),
                        "data_offsets": [offset, offset + _nbytes(meta)]}
        offset += _nbytes(meta)
    text = json.dumps(header, separators=(",", ":")).encode()
    text += b" " * (-len(text) % 8)  # the data starts 8-byte aligned, as the safetensors writer pads it
    with path.open("wb") as fh:
        fh.write(struct.pack("<Q", len(text)))
        fh.write(text)
        for _, _, key in entries:
            fh.write(read(key).contiguous().reshape(-1).view(torch.uint8).numpy().tobytes())


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
