"""Atomic checkpoints: written into a temporary directory, hashed into a manifest, renamed into place.

A checkpoint directory is valid only if its manifest exists and every listed file has the
recorded size and SHA-256; anything else is reported and never loaded.
"""
from __future__ import annotations

import hashlib
import json
import shutil
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from portagrpo.errors import UserError
from portagrpo.fileio import atomic_path

MANIFEST = "manifest.json"
PREFIX = "step_"


class CheckpointError(UserError, RuntimeError):
    pass


def _sha256(path: Path) -> str:
    h = hashlib.sha256()
    with path.open("rb") as fh:
        for block in iter(lambda: fh.read(1 << 20), b""):
            h.update(block)
    return h.hexdigest()


def checkpoint_dir(run_dir: Path, step: int) -> Path:
    return Path(run_dir) / "checkpoints" / f"{PREFIX}{step:08d}"


def save_checkpoint(
    run_dir: Path,
    step: int,
    *,
    model,
    tokenizer,
    model_state: dict[str, torch.Tensor],
    optimizer_state: dict[str, Any],
    scheduler,
    state: dict[str, Any],
    rng: dict[str, Any],
    keep: int,
    inflight: dict[str, Any] | None = None,
) -> Path:
    """Write checkpoint `step` atomically and keep only the newest `keep` ones.

    `model_state` and `optimizer_state` are full (unsharded) state dicts; `model` supplies the
    Hugging Face config so the weights load with `from_pretrained`. `inflight`: the rollout sampled
    ahead of the next step (rollout.mode=one_step_off), saved so a resumed run trains on it next.
    """
    final = checkpoint_dir(run_dir, step)
    # written whole or not at all: a full disk or a kill leaves the previous checkpoints as they were
    with atomic_path(final, directory=True, what=f"saving checkpoint step {step} to") as tmp:
        model.save_pretrained(tmp / "model", state_dict=model_state, safe_serialization=True)
        tokenizer.save_pretrained(tmp / "model")
        torch.save(optimizer_state, tmp / "optimizer.pt")
        torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
        torch.save(rng, tmp / "rng.pt")
        if inflight is not None:
            torch.save(inflight, tmp / INFLIGHT)
        (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1))
        files = {str(p.relative_to(tmp)): {"size": p.stat().st_size, "sha256": _sha256(p)}
                 for p in sorted(tmp.rglob("*")) if p.is_file()}
        (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": files}, indent=1))
    prune_checkpoints(run_dir, keep)
    return final


def verify_checkpoint(path: Path) -> list[str]:
    """Problems that make `path` unloadable (empty when it is whole)."""
    path = Path(path)
    manifest = path / MANIFEST
    if not manifest.is_file():
        return [f"{path} has no {MANIFEST} (half-written or not a portagrpo checkpoint)"]
    try:
        files = json.loads(manifest.read_text())["files"]
    except (json.JSONDecodeError, KeyError) as err:
        return [f"{manifest} is unreadable ({err})"]
    problems = []
    for rel, meta in files.items():
        f = path / rel
        if not f.is_file():
            problems.append(f"{f} is missing")
        elif f.stat().st_size != meta["size"]:
            problems.append(f"{f} has {f.stat().st_size} bytes, expected {meta['size']}")
        elif _sha256(f) != meta["sha256"]:
            problems.append(f"{f} does not match its recorded SHA-256")
    return problems


def list_checkpoints(run_dir: Path) -> list[Path]:
    root = Path(run_dir) / "checkpoints"
    if not root.is_dir():
        return []
    return sorted((p for p in root.iterdir() if p.is_dir() and p.name.startswith(PREFIX)), key=lambda p: p.name)


def latest_valid_checkpoint(run_dir: Path, warn=print) -> Path | None:
    """The newest whole checkpoint of a run; broken ones are reported and skipped."""
    for path in reversed(list_checkpoints(run_dir)):
        problems = verify_checkpoint(path)
        if not problems:
            return path
        warn(f"skipping corrupt checkpoint {path}: {problems[0]}")
    return None


def prune_checkpoints(run_dir: Path, keep: int) -> None:
    for path in list_checkpoints(run_dir)[:-keep]:
        shutil.rmtree(path, ignore_errors=True)


INFLIGHT = "inflight.pt"


@dataclass(frozen=True)
class CheckpointState:
    """The non-model parts of a verified checkpoint (the model loads from `model_dir`)."""

    optimizer: dict[str, Any]
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    step: int
    loader: dict[str, Any]  # the prompt loader's position
    world_size: int | None  # the ranks that wrote it (None in checkpoints older than that field)
    model_dir: Path
    inflight: dict[str, Any] | None  # a batch source's state (train/sources: SourceState.to_saved), if any


def load_checkpoint_state(path: Path) -> CheckpointState:
    """Verify then load the non-model parts of a checkpoint; the model loads from `path/model`."""
    path = Path(path)
    problems = verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt and was not loaded: {problems[0]}.")
    trainer = json.loads((path / "trainer_state.json").read_text())
    return CheckpointState(
        optimizer=torch.load(path / "optimizer.pt", weights_only=False),
        scheduler=torch.load(path / "scheduler.pt", weights_only=False),
        rng=torch.load(path / "rng.pt", weights_only=False),
        step=int(trainer["step"]), loader=trainer["loader"], world_size=trainer.get("world_size"),
        model_dir=path / "model",
        inflight=torch.load(path / INFLIGHT, weights_only=False) if (path / INFLIGHT).exists() else None,
    )


# Hugging Face config fields that fix the shape of the weights.
SHAPE_KEYS = ("model_type", "vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
              "num_attention_heads", "num_key_value_heads", "tie_word_embeddings")


def check_checkpoint_fits(ckpt: Path, model_config, lora_rank: int) -> None:
    """One sentence when a checkpoint cannot be this run's state: LoRA switched on or off, another
    adapter rank, or another model shape (all of which fail deep inside loading otherwise)."""
    model_dir = Path(ckpt) / "model"
    adapter = model_dir / "adapter_config.json"
    fix = "resume with the run's own model settings (its config.yaml) or start a new run"
    if adapter.is_file() != (lora_rank > 0):
        held = "a LoRA adapter" if adapter.is_file() else "a full model"
        asked = "trains the full model" if lora_rank == 0 else "asks for a LoRA adapter"
        raise CheckpointError(f"checkpoint {ckpt} holds {held} but model.lora.rank={lora_rank} {asked}; {fix}.")
    if adapter.is_file():
        saved_rank = json.loads(adapter.read_text()).get("r")
        if saved_rank != lora_rank:
            raise CheckpointError(f"checkpoint {ckpt} holds a rank-{saved_rank} LoRA adapter but model.lora.rank="
                                  f"{lora_rank}; {fix}.")
        return
    config_file = model_dir / "config.json"
    saved = json.loads(config_file.read_text()) if config_file.is_file() else {}
    for key in SHAPE_KEYS:
        ours = getattr(model_config, key, None)
        if key in saved and ours is not None and saved[key] != ours:
            raise CheckpointError(f"checkpoint {ckpt} was trained with {key}={saved[key]} but this run's model has "
                                  f"{key}={ours}; {fix}.")
