"""Writing files so that nothing is lost: the one atomic-write helper every writer uses, checks of a
path the CLI will write before any work starts, and one sentence for an operating-system refusal
(full disk, read-only file system, a name too long, a file where a directory should be). Reading
YAML with a key given twice refused (configs and tool files).

This module sits at the bottom of the package: it imports nothing of portagrpo but `errors`.
"""
from __future__ import annotations

import contextlib
import errno
import json
import os
import re
import shutil
from pathlib import Path
from typing import Any, Iterator

import yaml

from portagrpo.errors import UserError

NAME_MAX = 255  # bytes in one path component on every Linux file system portagrpo writes to


class WriteError(UserError, OSError):
    """The operating system refused a write; the message says what to do."""


class UniqueKeyLoader(yaml.SafeLoader):
    """A YAML loader that refuses a key given twice in one mapping (the last would silently win)."""


def _mapping(loader: UniqueKeyLoader, node: yaml.MappingNode, deep: bool = False) -> dict:
    seen: dict[Any, int] = {}
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        if key in seen:
            raise yaml.constructor.ConstructorError(
                None, None, f"key {key!r} appears twice (lines {seen[key] + 1} and {key_node.start_mark.line + 1}); "
                            f"merge the two into one", key_node.start_mark)
        seen[key] = key_node.start_mark.line
    return loader.construct_mapping(node, deep=deep)


UniqueKeyLoader.add_constructor(yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _mapping)


def describe_os_error(err: OSError, path: str | Path, what: str = "writing") -> str:
    """One sentence for `err`, raised while `what` at `path`."""
    where = str(path)
    code = getattr(err, "errno", None)
    if code in (errno.ENOSPC, errno.EDQUOT):
        limit = "no space left" if code == errno.ENOSPC else "the disk quota is used up"
        return f"{what} {where} failed: {limit} on the device that holds it; free some space or pick another directory."
    if code == errno.EFBIG:
        return f"{what} {where} failed: the file grew past the size this system allows (ulimit -f or the file system)."
    if code == errno.EROFS:
        return f"{what} {where} failed: the file system is read-only; pick a writable directory."
    if code in (errno.EACCES, errno.EPERM):
        return f"{what} {where} failed: permission denied; pick a directory you can write to."
    if code == errno.ENAMETOOLONG:
        return f"{what} {where} failed: a name in that path is too long (at most {NAME_MAX} bytes per name)."
    if code == errno.ENOTDIR:
        return f"{what} {where} failed: a part of that path is a file, not a directory."
    if code == errno.EISDIR:
        return f"{what} {where} failed: it is a directory where a file was expected."
    reason = err.strerror or type(err).__name__
    return f"{what} {where} failed: {reason}."


def output_path_problem(path: str | Path, option: str, *, kind: str = "dir") -> str | None:
    """Why `path` cannot be written as a `kind` ("dir" or "file") by option `option`, or None.

    Checked before any work: a name over the file system's limit, a file where a directory is
    expected (the path itself or any parent), a directory where a file is expected, and no
    permission to create it in the nearest existing parent. Whether an existing path may be
    replaced is the caller's rule, not this function's."""
    p = Path(path)
    for part in p.parts:
        if len(os.fsencode(part)) > NAME_MAX:
            return (f"{option} {shorten(str(p))}: the name {shorten(part, 40)} is {len(os.fsencode(part))} bytes, over "
                    f"the {NAME_MAX}-byte limit of a file name; pick a shorter one.")
    if p.exists():
        if kind == "dir" and not p.is_dir():
            return f"{option} {p} is a file; pass a directory."
        if kind == "file" and p.is_dir():
            return f"{option} {p} is a directory; name the file to write."
        target = p if kind == "dir" else p.parent
        if not os.access(target, os.W_OK | os.X_OK):
            return f"{option} {p}: {target} is not writable; pick a directory you can write to."
        return None
    parent = p.parent
    while not parent.exists() and parent != parent.parent:
        parent = parent.parent
    if not parent.is_dir():
        return f"{option} {p}: {parent} is a file, so nothing can be created under it; pick another path."
    if not os.access(parent, os.W_OK | os.X_OK):
        return f"{option} {p}: {parent} is not writable; pick a directory you can write to."
    return None


def check_output_path(path: str | Path, option: str, *, kind: str = "dir") -> None:
    problem = output_path_problem(path, option, kind=kind)
    if problem:
        raise WriteError(problem)


def shorten(text: str, limit: int = 80) -> str:
    """`text` cut to about `limit` characters with its length named: a bad value is named, never echoed whole."""
    text = str(text)
    return text if len(text) <= limit else f"{text[:limit // 2]}...{text[-limit // 4:]} ({len(text)} characters)"


def temporary_sibling(final: str | Path) -> Path:
    """The temporary a writer fills before renaming it to `final`: `.tmp_<name>_<pid>`, so the
    run directory's clean-up can tell a dead writer's leftovers (see run_dir.remove_dead_temporaries)."""
    final = Path(final)
    return final.parent / f".tmp_{final.name}_{os.getpid()}"


def _fsync_path(path: Path) -> None:
    paths = sorted(p for p in path.rglob("*") if p.is_file()) if path.is_dir() else [path]
    for f in paths:
        with f.open("rb") as fh:
            os.fsync(fh.fileno())


def _remove(path: Path) -> None:
    if path.is_dir() and not path.is_symlink():
        shutil.rmtree(path, ignore_errors=True)
    else:
        with contextlib.suppress(FileNotFoundError):
            path.unlink()


@contextlib.contextmanager
def atomic_path(final: str | Path, *, what: str = "writing", directory: bool = False,
                fsync: bool = True) -> Iterator[Path]:
    """Yield a temporary sibling of `final` to fill (a directory when `directory`), then put it in
    place with one rename. On any error the temporary is removed and `final` is as it was; an
    operating-system refusal becomes a WriteError with one sentence. An existing directory `final`
    is moved aside first and deleted only once the new one is in place, so a kill at any moment
    leaves one whole version."""
    final = Path(final)
    tmp = temporary_sibling(final)
    _remove(tmp)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if directory:
            tmp.mkdir()
        yield tmp
        if fsync:
            _fsync_path(tmp)
        if directory and final.exists():
            old = final.parent / f".tmp_old_{final.name}_{os.getpid()}"
            os.replace(final, old)
            os.replace(tmp, final)
            _remove(old)
        else:
            os.replace(tmp, final)
    except OSError as err:
        _remove(tmp)
        if isinstance(err, UserError):
            raise
        raise WriteError(describe_os_error(err, final, what)) from None
    except Exception as err:
        _remove(tmp)
        system = system_error_in(err, final.parent)
        if system is None:
            raise
        raise WriteError(describe_os_error(system, final, what)) from None
    except BaseException:
        _remove(tmp)
        raise


def system_error_in(err: BaseException, where: Path) -> OSError | None:
    """The operating-system error behind a writer's own exception type, or None. safetensors reports
    "I/O error: ... (os error 28)", torch.save "file write failed" with no errno: then a nearly full
    device is taken as the cause (its free space is read after the temporary was removed). torch's zip writer says
    "unexpected pos" after a short write, and torch.distributed.checkpoint's CheckpointException carries every rank's
    failure in its text."""
    text = str(err)
    found = re.search(r"os error (\d+)|\[Errno (\d+)\]", text)
    if found:
        code = int(found.group(1) or found.group(2))
        return OSError(code, os.strerror(code))
    if "write failed" in text or "No space left" in text or "unexpected pos" in text:
        try:
            free = shutil.disk_usage(where).free
        except OSError:
            return None
        if free < LOW_SPACE_BYTES:
            return OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
    return None


LOW_SPACE_BYTES = 64 << 20  # a write that failed on a device with less free space than this ran out of it


def write_text_atomic(final: str | Path, text: str, *, what: str = "writing") -> None:
    with atomic_path(final, what=what) as tmp:
        tmp.write_text(text)


REPORT_KEY = "portagrpo_report"  # marks a JSON report that a later run of the same command may replace


def check_report_destination(path: str | Path, option: str, kind: str) -> None:
    """A report file may be new, or an earlier report of the same command (it carries REPORT_KEY);
    any other existing file is refused, so a report never replaces a user's file."""
    check_output_path(path, option, kind="file")
    p = Path(path)
    if not p.exists():
        return
    try:
        earlier = json.loads(p.read_text())
    except (OSError, UnicodeDecodeError, ValueError):
        earlier = None
    items = earlier if isinstance(earlier, list) else [earlier]
    if not items or not all(isinstance(i, dict) and i.get(REPORT_KEY) == kind for i in items):
        raise WriteError(f"{option} {p} exists and is not an earlier portagrpo {kind} report; pass a new file name "
                         f"(nothing was written).")


def write_report(path: str | Path, report, kind: str) -> None:
    """Write a JSON report (a dict or a list of dicts) marked as `kind`, atomically."""
    marked = (
        [dict(r, **{REPORT_KEY: kind}) for r in report]
        if isinstance(report, list)
        else dict(report, **{REPORT_KEY: kind})
    )
    write_text_atomic(path, json.dumps(marked, indent=1, default=str) + "\n", what=f"writing the {kind} report")
