"""Image files on a file system or object storage: the listing entry of one file, and the loader shard
workers use (a local path, or a URI such as s3://bucket/key read through `storage.read_object`)."""

from __future__ import annotations

import os
import stat
from dataclasses import dataclass
from pathlib import Path

from data_prep.images import Prepared, Rejected, describe, prepare_encoded
from data_prep.sources import Item, ListingError
from data_prep.storage import Store, child, is_uri, read_object


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


def walk_files(root: Path):
    """Regular files under `root` in sorted order, hidden names skipped; yields paths relative to root.

    Sorted per folder with os.scandir: the same listing on every machine, one folder in memory at a time.
    """
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
            else:
                yield path.relative_to(root)
        stack.extend(reversed(subdirs))  # depth first, in name order


def _hidden(name: str) -> bool:
    return name.startswith(".")


def _walk_order(rel: str) -> tuple:
    """`walk_files`'s order as a sort key: depth first, in each folder its files, then its sub-folders, each
    in name order."""
    parts = rel.split("/")
    return (*((1, p) for p in parts[:-1]), (0, parts[-1]))


class LocalTree:
    """A folder on this machine's disk, listed one top-level entry at a time: "." (the files directly in
    it), then each sub-folder (walked whole). Together: `walk_files(root)`, in its order."""

    def __init__(self, root: Path):
        self.root = root

    def entries(self) -> list[str]:
        """ ".", then the sub-folders' names: only those are held (a flat folder's files may be millions)."""
        try:
            with os.scandir(self.root) as found:
                names = [e.name for e in found if not _hidden(e.name) and e.is_dir(follow_symlinks=False)]
        except OSError:
            return []
        return [".", *sorted(names)]

    def walk(self, name: str):
        """(relative POSIX path, entry) of each file of one top-level entry."""
        if name == ".":
            try:
                found = sorted(os.scandir(self.root), key=lambda e: e.name)
            except OSError:
                return
            for e in found:
                if not _hidden(e.name) and not e.is_dir(follow_symlinks=False):
                    yield e.name, Path(e.path)
            return
        folder = self.root / name
        for rel in walk_files(folder):
            yield f"{name}/{rel.as_posix()}", folder / rel

    def describe(self, rel: str, entry) -> str:
        return str(entry)

    def item(self, rel: str, entry, key: str, labels: tuple[int, ...]) -> Item | ListingError:
        return file_item(entry, key, labels)


class StoreTree:
    """A folder in object storage (s3://bucket/prefix, gs://..., credentials from the environment), listed as
    `LocalTree` lists a disk and in the same order: each top-level prefix is one recursive listing (pages of
    1,000 keys), and its objects become URI inputs with their listed sizes (no request per object)."""

    def __init__(self, uri: str):
        self.uri = uri.rstrip("/")

    def _infos(self, rel: str, recursive: bool) -> list[tuple[str, int, bool]]:
        """(path relative to the folder, size, is a file) below `rel`."""
        import pyarrow.fs as pafs

        store = Store(self.uri)
        base = store.root + "/" if store.root else ""
        selector = pafs.FileSelector(store._path(rel), recursive=recursive, allow_not_found=True)
        return [
            (i.path[len(base) :], i.size or 0, i.type == pafs.FileType.File)
            for i in store.fs.get_file_info(selector)
            if i.type in (pafs.FileType.File, pafs.FileType.Directory)
        ]

    def folders(self) -> list[str]:
        return sorted(r for r, _, f in self._infos("", False) if not f and not _hidden(r))

    def entries(self) -> list[str]:
        return ["."] + self.folders()

    def walk(self, name: str):
        infos = self._infos("" if name == "." else name, name != ".")
        found = [(r, size) for r, size, f in infos if f and not any(_hidden(p) for p in r.split("/"))]
        yield from sorted(found, key=lambda rs: _walk_order(rs[0]))

    def describe(self, rel: str, entry) -> str:
        return Store(self.uri).describe(rel)

    def item(self, rel: str, size: int, key: str, labels: tuple[int, ...]) -> Item | ListingError:
        if size == 0:
            return ListingError(key, self.describe(rel, size), "empty file (0 bytes)")
        return uri_item(child(self.uri, rel), key, labels, None, size)
