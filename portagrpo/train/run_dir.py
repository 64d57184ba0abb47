"""The run directory: what lives in it, who may write it, and what `--output-dir`/`--resume` mean.

Layout: config.yaml, init_model/, checkpoints/step_*/, rollouts/, metrics.jsonl, tensorboard/,
reward.png, and `.lock` (held by the one process that writes the run).

Rules (docs/quickstart.md has the user-facing table):
- A new run needs a directory that is absent, empty, or holds only the leftovers of a portagrpo
  run that never finished a step; anything else is refused, so a run never truncates another
  run's metrics or mixes its checkpoints with them.
- `--resume RUN|CHECKPOINT` continues RUN in place and needs a whole checkpoint;
  `--resume auto` resumes the --output-dir when it holds one and starts it fresh otherwise.
- One writer at a time: the main process holds an exclusive lock on `.lock` while it trains.
- Temporaries (`.tmp_*`) of writers that died are removed when the next writer takes the lock.
"""
from __future__ import annotations

import os
import shutil
from pathlib import Path

from portagrpo.checkpoint import PREFIX, latest_valid_checkpoint, list_checkpoints
from portagrpo.errors import UserError
from portagrpo.fileio import check_output_path

LOCK = ".lock"
# What a portagrpo run writes; a directory holding only these and no finished step is reusable.
RUN_ENTRIES = {
    "config.yaml",
    "init_model",
    "checkpoints",
    "rollouts",
    "metrics.jsonl",
    "tensorboard",
    "reward.png",
    LOCK,
    "export",
    "export-merged",
}


class RunDirError(UserError, RuntimeError):
    pass


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # alive, owned by someone else
        return True
    return True


def remove_dead_temporaries(folder: Path, *, prefix: str = ".tmp_", everyone: bool = False) -> list[Path]:
    """Remove `<prefix>*_<pid>` entries of `folder` whose writer is dead (every one when `everyone`:
    the caller holds the run's lock, so no live process can be writing them)."""
    removed = []
    if not folder.is_dir():
        return removed
    for path in folder.iterdir():
        if not path.name.startswith(prefix):
            continue
        pid = path.name.rsplit("_", 1)[-1]
        if not everyone and pid.isdigit() and pid_alive(int(pid)) and int(pid) != os.getpid():
            continue
        shutil.rmtree(path, ignore_errors=True) if path.is_dir() else path.unlink(missing_ok=True)
        removed.append(path)
    return removed


class RunDir:
    def __init__(self, path: str | Path) -> None:
        self.path = Path(path)
        self._lock_fd: int | None = None

    config = property(lambda self: self.path / "config.yaml")
    init_model = property(lambda self: self.path / "init_model")
    checkpoints = property(lambda self: self.path / "checkpoints")
    rollouts = property(lambda self: self.path / "rollouts")
    metrics = property(lambda self: self.path / "metrics.jsonl")

    def has_finished_step(self) -> bool:
        metrics = self.metrics.is_file() and self.metrics.stat().st_size > 0
        return metrics or bool(list_checkpoints(self.path)) or (self.rollouts.is_dir() and any(self.rollouts.iterdir()))

    def foreign_entries(self) -> list[str]:
        if not self.path.is_dir():
            return []
        return sorted(
            p.name for p in self.path.iterdir() if p.name not in RUN_ENTRIES and not p.name.startswith(".tmp_")
        )

    def check_new_run(self) -> list[str]:
        """Refuse a directory a new run would damage; returns our own leftovers to clear."""
        if self.path.exists() and not self.path.is_dir():
            raise RunDirError(f"--output-dir {self.path} is a file; pass a directory.")
        foreign = self.foreign_entries()
        if foreign:
            raise RunDirError(
                f"--output-dir {self.path} is not empty and not a portagrpo run (it holds {foreign[0]!r}); "
                f"pick a new directory."
            )
        if self.has_finished_step():
            raise RunDirError(f"--output-dir {self.path} already holds a run; continue it with --resume {self.path}, "
                              f"or pick a new --output-dir.")
        return [p.name for p in self.path.iterdir() if p.name != LOCK] if self.path.is_dir() else []

    def lock(self) -> None:
        """Take the run's exclusive lock or say which process holds it."""
        try:
            import fcntl
        except ImportError:  # no advisory locks on this platform
            return
        self.path.mkdir(parents=True, exist_ok=True)
        fd = os.open(self.path / LOCK, os.O_RDWR | os.O_CREAT, 0o644)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError:
            holder = os.pread(fd, 32, 0).decode(errors="replace").strip() or "unknown"
            os.close(fd)
            raise RunDirError(f"run directory {self.path} is in use by pid {holder}; wait for that run to end or pick "
                              f"another --output-dir.") from None
        os.ftruncate(fd, 0)
        os.pwrite(fd, str(os.getpid()).encode(), 0)
        self._lock_fd = fd

    def unlock(self) -> None:
        if self._lock_fd is not None:
            os.close(self._lock_fd)
            self._lock_fd = None

    def claim(self, *, resuming: bool, log=print) -> None:
        """Become the run's writer: lock, refuse what a new run would damage, clear dead temporaries."""
        leftovers = [] if resuming else self.check_new_run()
        self.lock()
        try:
            if not resuming:
                leftovers = self.check_new_run()  # again under the lock: nobody wrote meanwhile
                for name in leftovers:
                    entry = self.path / name
                    shutil.rmtree(entry) if entry.is_dir() else entry.unlink()
                if leftovers:
                    log(f"{self.path} held an earlier run that never finished a step; starting it afresh")
            removed = [p for folder in (self.checkpoints, self.rollouts, self.path)
                       for p in remove_dead_temporaries(folder, everyone=True)]
            if removed:
                log(f"removed {len(removed)} half-written temporary entr{'y' if len(removed) == 1 else 'ies'} left by "
                    f"a killed run ({', '.join(p.name for p in removed[:3])})")
        except BaseException:
            self.unlock()
            raise


def resolve_run(output_dir: str | Path | None, resume: str | None) -> tuple[Path | None, Path | None]:
    """(run directory or None for the default, checkpoint or run to resume from or None), checked
    before anything is written."""
    if output_dir:
        check_output_path(output_dir, "--output-dir")
    if resume is None:
        return (Path(output_dir) if output_dir else None), None
    if resume == "auto":
        if output_dir:
            run = Path(output_dir)
            ckpt = latest_valid_checkpoint(run, warn=lambda message: None)
            if ckpt is None and RunDir(run).has_finished_step():
                raise RunDirError(f"--resume auto: {run} holds a run with no whole checkpoint; nothing can be resumed "
                                  f"there, so pick a new --output-dir.")
            return run, ckpt
        runs = sorted((p for p in Path("runs").glob("*") if latest_valid_checkpoint(p, warn=lambda m: None)),
                      key=lambda p: p.stat().st_mtime)
        if not runs:
            raise RunDirError("--resume auto found no run with a whole checkpoint under runs/; pass the run directory.")
        return runs[-1], latest_valid_checkpoint(runs[-1], warn=lambda m: None)
    target = Path(resume)
    if not target.exists():
        raise RunDirError(f"--resume {resume!r} does not exist; pass a run directory or a checkpoint directory.")
    if not target.is_dir():
        raise RunDirError(
            f"--resume {resume!r} is a file; pass a run directory or a checkpoint directory (checkpoints/step_N)."
        )
    is_ckpt = target.name.startswith(PREFIX) and target.parent.name == "checkpoints"
    run = target.parent.parent if is_ckpt else target
    if output_dir and Path(output_dir).resolve() != run.resolve():
        raise RunDirError(f"--resume {resume} continues {run} in place, but --output-dir names {output_dir}; drop "
                          f"--output-dir (or, to branch a run, copy {run} to the new directory and resume the copy).")
    if is_ckpt:
        return run, target
    if not (run / "config.yaml").is_file() and not (run / "checkpoints").is_dir():
        raise RunDirError(f"--resume {resume!r} is not a portagrpo run directory (no config.yaml or checkpoints/).")
    if latest_valid_checkpoint(run, warn=lambda message: None) is None:
        what = "no whole checkpoint" if list_checkpoints(run) else "no checkpoint yet (trainer.save_freq)"
        raise RunDirError(f"--resume {resume!r}: the run has {what}; nothing can be resumed, so start a new run with "
                          f"another --output-dir.")
    return run, run
