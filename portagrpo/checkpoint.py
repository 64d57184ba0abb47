"""Atomic checkpoints: written into a temporary directory, hashed into a manifest, renamed into place.

A checkpoint directory is valid only if its manifest exists and every listed file has the
recorded size and SHA-256; anything else is reported and never loaded.

Two formats. Whole: `model/` (Hugging Face safetensors) and `optimizer.pt`, written by rank 0 from
state gathered onto it (one process, DDP, LoRA). Sharded (FSDP2 on several ranks): `shards/`, the
files of `torch.distributed.checkpoint`, each rank writing and reading only its own shards, and
`model/` with the config and tokenizer but no weights. Both hold the scheduler, the RNG streams,
the loader's position and any batch in flight.
"""
from __future__ import annotations

import hashlib
import json
import shutil
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from portagrpo.errors import UserError
from portagrpo.fileio import WriteError, atomic_path, describe_os_error, system_error_in

MANIFEST = "manifest.json"
PREFIX = "step_"
SHARDS = "shards"  # a sharded checkpoint's model and optimizer state (torch.distributed.checkpoint's files)
SINGLE_PROCESS = ".*assuming the intent"  # torch's warning that it loads in one process, where that is meant


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
        torch.save(optimizer_state, tmp / "optimizer.pt")
        _write_run_state(tmp, step, tokenizer, scheduler, state, rng, inflight)
        _write_manifest(tmp, step, _hashes(tmp, [p for p in tmp.rglob("*") if p.is_file()]))
    prune_checkpoints(run_dir, keep)
    return final


def save_sharded_checkpoint(
    run_dir: Path,
    step: int,
    *,
    comm,
    model,
    tokenizer,
    shards: dict[str, Any],
    scheduler,
    state: dict[str, Any],
    rng: dict[str, Any],
    keep: int,
    inflight: dict[str, Any] | None = None,
) -> Path | None:
    """Write checkpoint `step` with each rank's own `shards` (`ParallelStrategy.sharded_state`); a collective, the
    path on rank 0 (None elsewhere). No rank gathers the model: every rank writes its shards and hashes them.

    The order keeps a kill -9 at any moment from leaving a checkpoint that looks whole:
    1. rank 0 makes the temporary directory (`.tmp_step_*_<pid>`, no `step_` name) and names it to the others;
    2. every rank writes its shards (torch.distributed.checkpoint: rank 0 writes `.metadata` once all ranks'
       files are written, and each file is fsynced) and hashes the files it wrote;
    3. rank 0 writes the rest, gathers every rank's hashes, writes the manifest last and renames the temporary
       into place; 4. a barrier, so no rank trains on before the checkpoint is in place.
    Before the rename only a temporary exists (removed by the next writer of the run); after it, a whole checkpoint.
    """
    final = checkpoint_dir(run_dir, step)
    if not comm.is_main:
        tmp = Path(comm.broadcast_object(None))
        try:
            mine = _write_shards(tmp, shards, comm)
        except Exception as err:  # torch.distributed.checkpoint raises the same failure on every rank: one sentence
            system = system_error_in(err, tmp.parent)
            if system is None:
                raise
            raise WriteError(describe_os_error(system, final, f"saving checkpoint step {step} to")) from None
        comm.all_gather_object(mine)
        comm.barrier()
        return None
    with atomic_path(final, directory=True, what=f"saving checkpoint step {step} to") as tmp:
        comm.broadcast_object(str(tmp))
        mine = _write_shards(tmp, shards, comm)
        model.config.save_pretrained(tmp / "model")  # the shape check and the export read it; no weights here
        if getattr(model, "generation_config", None) is not None:
            model.generation_config.save_pretrained(tmp / "model")
        _write_run_state(tmp, step, tokenizer, scheduler, state, rng, inflight)
        hashed = _hashes(tmp, [p for p in tmp.rglob("*") if p.is_file() and p.parent.name != SHARDS])
        for part in comm.all_gather_object(mine):
            hashed.update(part)
        _write_manifest(tmp, step, hashed)
    prune_checkpoints(run_dir, keep)
    comm.barrier()
    return final


def _write_shards(tmp: Path, shards: dict[str, Any], comm) -> dict[str, dict[str, Any]]:
    """This rank's shards written into `tmp/shards` (a collective); the sizes and hashes of the files it wrote."""
    import torch.distributed.checkpoint as dcp

    folder = tmp / SHARDS
    try:
        dcp.save(shards, storage_writer=dcp.FileSystemWriter(str(folder)))
    except dcp.api.CheckpointException as err:  # a BaseException, raised on every rank with every rank's failure:
        raise RuntimeError(str(err)) from None  # an Exception, which the writers read for the system's refusal
    # torch.distributed.checkpoint names rank r's files `__r_<n>.distcp`; rank 0 hashes any other file (.metadata)
    files = sorted(p for p in folder.iterdir() if p.is_file())
    others = tuple(f"__{r}_" for r in range(comm.world_size) if r != comm.rank)
    own = [p for p in files if p.name.startswith(f"__{comm.rank}_") or (comm.is_main and not p.name.startswith(others))]
    return _hashes(tmp, own)


def load_shards(path: Path, shards: dict[str, Any]) -> None:
    """Read checkpoint `path`'s shards into `shards` (`ParallelStrategy.sharded_state`, in place): each rank reads the
    slices its tensors hold, so a checkpoint written by another number of ranks is resharded as it loads."""
    import torch.distributed.checkpoint as dcp

    with warnings.catch_warnings():  # one process (no process group) is told apart by torch itself
        warnings.filterwarnings("ignore", message=SINGLE_PROCESS)
        dcp.load(shards, storage_reader=dcp.FileSystemReader(str(Path(path) / SHARDS)))


def load_model_shards(path: Path, model: torch.nn.Module) -> None:
    """A sharded checkpoint's weights read into `model`, a whole Hugging Face model of its shape, in place (eval)."""
    aliases = {n for n, _ in model.named_parameters(remove_duplicate=False)} - {n for n, _ in model.named_parameters()}
    load_shards(path, {"model": {k: v for k, v in model.state_dict().items() if k not in aliases}})


def _write_run_state(tmp: Path, step: int, tokenizer, scheduler, state: dict[str, Any], rng: dict[str, Any],
                     inflight: dict[str, Any] | None) -> None:
    """What both formats hold beside the model and optimizer state."""
    tokenizer.save_pretrained(tmp / "model")
    torch.save(scheduler.state_dict(), tmp / "scheduler.pt")
    torch.save(rng, tmp / "rng.pt")
    if inflight is not None:
        torch.save(inflight, tmp / INFLIGHT)
    (tmp / "trainer_state.json").write_text(json.dumps({"step": step, **state}, indent=1))


def _hashes(root: Path, files: list[Path]) -> dict[str, dict[str, Any]]:
    return {str(p.relative_to(root)): {"size": p.stat().st_size, "sha256": _sha256(p)} for p in sorted(files)}


def _write_manifest(tmp: Path, step: int, files: dict[str, dict[str, Any]]) -> None:
    """Last, once every listed file is written: a checkpoint without it is never loaded."""
    (tmp / MANIFEST).write_text(json.dumps({"step": step, "files": dict(sorted(files.items()))}, indent=1))


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
    """The non-model parts of a verified checkpoint (the model loads from `model_dir`, or from `shards`)."""

    optimizer: dict[str, Any] | None  # None in a sharded checkpoint: its optimizer state is in `shards`
    scheduler: dict[str, Any]
    rng: dict[str, Any]
    step: int
    loader: dict[str, Any]  # the prompt loader's position
    world_size: int | None  # the ranks that wrote it (None in checkpoints older than that field)
    model_dir: Path
    inflight: dict[str, Any] | None  # a batch source's state (train/sources: SourceState.to_saved), if any
    shards: Path | None = None  # a sharded checkpoint's folder (load_shards), None in the whole format


def load_checkpoint_state(path: Path, *, verified: bool = False) -> CheckpointState:
    """Verify (unless the caller has) then load the non-model parts of a checkpoint; the model loads from
    `path/model` or, in a sharded checkpoint, with `load_shards`."""
    path = Path(path)
    problems = [] if verified else verify_checkpoint(path)
    if problems:
        raise CheckpointError(f"checkpoint {path} is corrupt and was not loaded: {problems[0]}.")
    trainer = json.loads((path / "trainer_state.json").read_text())
    sharded = (path / SHARDS).is_dir()
    return CheckpointState(
        optimizer=None if sharded else torch.load(path / "optimizer.pt", weights_only=False),
        scheduler=torch.load(path / "scheduler.pt", weights_only=False),
        rng=torch.load(path / "rng.pt", weights_only=False),
        step=int(trainer["step"]), loader=trainer["loader"], world_size=trainer.get("world_size"),
        model_dir=path / "model",
        inflight=torch.load(path / INFLIGHT, weights_only=False) if (path / INFLIGHT).exists() else None,
        shards=path / SHARDS if sharded else None,
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
