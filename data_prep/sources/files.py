"""Image files on a file system or object storage: the listing entry of one file, and the loader shard
workers use (a local path, or a URI such as s3://bucket/key read through `storage.read_object`)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from data_prep.images import Prepared, Rejected, describe, prepare_encoded
from data_prep.sources import Item, ListingError
from data_prep.storage import is_uri, read_object


def file_item(path: Path, key: str, labels: tuple[int, ...], split: str | None = None) -> Item | ListingError:
    """Stat only: a missing, special or empty file is rejected before any worker opens it."""
    source = str(path)
    try:
        st = path.stat()
    except OSError as exc:
        return ListingError(key, source, f"cannot read: {exc.strerror or exc}")
    if not stat.S_ISREG(st.st_mode):
        return ListingError(key, source, "not a regular file")
    if st.st_size == 0:
        return ListingError(key, source, "empty file (0 bytes)")
    return Item(key, source, labels, st.st_size, f"{st.st_size}:{st.st_mtime_ns}", split)


@dataclass(frozen=True)
class FileLoader:
    """`read` (I/O only: a shard worker runs it on threads for object store inputs) then `prepare`
    (decoding, in the worker's own thread: Pillow's warning filters are process-wide)."""

    def read(self, item: Item) -> bytes:
        try:
            if is_uri(item.source):
                return read_object(item.source)
            with open(item.source, "rb") as f:
                return f.read()
        except FileNotFoundError:
            raise Rejected("cannot read: no such file or object", "read") from None
        except OSError as exc:
            raise Rejected(
                f"cannot read: {describe(exc) if exc.strerror is None else exc.strerror}", "read"
            ) from None

    def prepare(self, data: bytes, resize_max: int | None, quality: int) -> Prepared:
        return prepare_encoded(data, resize_max, quality)

    def load(self, item: Item, resize_max: int | None, quality: int) -> Prepared:
        return self.prepare(self.read(item), resize_max, quality)


URI_EST_BYTES = 110_000  # a listed URI is not stat'ed: a typical JPEG's size stands in for --max-size


def uri_item(
    uri: str, key: str, labels: tuple[int, ...], split: str | None = None, size: int | None = None
) -> Item:
    """An object store input, listed without a request per object (at JFT scale that would be hundreds
    of millions of HEADs before the first shard): a missing object is rejected when a worker reads it.
    `size`: the manifest's `bytes` column where it has one, for --max-size planning."""
    return Item(key, uri, labels, size or URI_EST_BYTES, f"uri:{size or ''}", split)


def walk_files(root: Path, skip: set[Path] | None = None):
    """Regular files under `root` in sorted order, hidden names skipped; yields paths relative to root.

    Sorted per folder with os.scandir: the same listing on every machine, one folder in memory at a time.
    """
    skip = skip or set()
    stack = [root]
    while stack:
        folder = stack.pop()
        try:
            entries = sorted(os.scandir(folder), key=lambda e: e.name)
        except OSError:
            continue
        subdirs = []
        for e in entries:
            if e.name.startswith("."):
                continue
            path = Path(e.path)
            if e.is_dir(follow_symlinks=False):
                subdirs.append(path)
            elif path not in skip:
                yield path.relative_to(root)
        stack.extend(reversed(subdirs))  # depth first, in name order
