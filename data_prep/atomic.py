"""Atomic file writes, implemented once for the whole project: a reader, or a process after a crash,
sees the old file or the new one, whole, never part of one.

    from data_prep import atomic
    atomic.write_bytes(path, data)
    atomic.write_text(path, "step_00000040")
    atomic.write_json(path, {"run_id": run_id})
    with atomic.writing(path) as tmp:        # for writers that want a path: safetensors, Parquet, tar
        pq.write_table(table, tmp)

The data goes to `NAME.tmp` beside the file, is fsynced, and renamed over the file; then the folder
is fsynced, so the rename itself survives a power cut. A write that raises leaves no `NAME.tmp`
behind; one killed outright may, and the next write of the same file replaces it.

`shared=True` is for a file that other processes may write at the same moment (the nodes on one shared
disk each fetching the same checkpoint file): each writer has a temporary of its own,
`.NAME.<16 hex digits>.tmp`, and the last rename wins, every version whole. With one `NAME.tmp` the second
writer truncated the first's data and one of the renames failed (FileNotFoundError). A killed shared
writer's hidden temporary stays.
"""

from __future__ import annotations

import json
import os
import secrets
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

TMP_SUFFIX = ".tmp"


def tmp_path(path: Path) -> Path:
    """Where the data is written before the rename: `NAME.tmp` in the same folder (same filesystem)."""
    path = Path(path)
    return path.with_name(path.name + TMP_SUFFIX)


def fsync_dir(path: Path) -> None:
    """Make a rename inside `path` durable (a no-op where folders cannot be opened)."""
    try:
        fd = os.open(path, os.O_RDONLY)
    except OSError:
        return
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def fsync_file(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


@contextmanager
def writing(path: Path, *, shared: bool = False) -> Iterator[Path]:
    """Yield the temporary path to write; on a clean exit it replaces `path`, on an exception it is removed.
    `shared`: other processes may write `path` at the same time (the module docstring)."""
    path = Path(path)
    if shared:  # a name of its own, created by the writer (mkstemp's would be mode 0600, not the umask's)
        tmp = path.with_name(f".{path.name}.{secrets.token_hex(8)}{TMP_SUFFIX}")
    else:
        tmp = tmp_path(path)
    try:
        yield tmp
        fsync_file(tmp)
        os.replace(tmp, path)
    except BaseException:
        tmp.unlink(missing_ok=True)
        raise
    fsync_dir(path.parent)


def write_bytes(path: Path, data: bytes, *, shared: bool = False) -> None:
    with writing(path, shared=shared) as tmp:
        tmp.write_bytes(data)


def write_text(path: Path, text: str, *, shared: bool = False) -> None:
    write_bytes(path, text.encode(), shared=shared)


def write_json(path: Path, obj: Any, *, indent: int | None = None, default=None) -> None:
    """`json.dumps(obj, indent=indent, default=default)`, written atomically."""
    write_text(path, json.dumps(obj, indent=indent, default=default))
