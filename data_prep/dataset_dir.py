"""Where a dataset lives: a local folder or an object store prefix (`s3://bucket/prefix`, `gs://...`,
any pyarrow or fsspec URI), behind one small interface that `vitpipe shard`, `verify` and the loader use.

    out = DatasetDir("s3://corpus/jft?endpoint_override=minio:9000&scheme=http")
    path = out.staging("train/shard-000000.tar")     # a local file to write the shard into
    ...                                             # write it whole, then
    out.publish(path, "train/shard-000000.tar")     # it appears under its name only now, complete

Local folders keep today's guarantees (write to NAME.tmp, fsync, rename). On object storage a file is
written on local scratch first and uploaded whole: an object store shows an object only once its
upload completes, and an upload that stops early is deleted (`storage.Store.upload`), so no reader
ever finds half a shard under a shard's name. Small records (sidecars, the manifest) are one PUT.
Scratch on a remote dataset: a folder named by the URI under `scratch=` or the system temp dir;
nothing in it is needed after a run, and a killed run resumes from what the bucket holds.

Credentials come from the environment only (see `storage.py`).
"""

from __future__ import annotations

import hashlib
import os
import tempfile
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

from data_prep import atomic
from data_prep.storage import Store, child, is_uri
from data_prep.tario import file_sha256

SHARD_SUFFIXES = (".tar", ".tar.gz", ".tgz")


def names_shards(source: str | os.PathLike) -> bool:
    """True where `source` names shard files (a brace pattern, a '::' list, a `.tar` path or URL, a
    `pipe:` command) rather than a dataset root (a folder, or an object store prefix with a manifest)."""
    s = os.fspath(source)
    return (
        "{" in s
        or "::" in s
        or s.startswith(("pipe:", "http://", "https://"))  # no dataset roots over HTTP: these are shards
        or s.split("?", 1)[0].endswith(SHARD_SUFFIXES)
    )


def scratch_for(uri: str, base: str | os.PathLike | None = None) -> Path:
    """A remote dataset's local work folder, the same on every run: BASE/vitpipe-shard/HASH-OF-URI, so
    two datasets sharing one --scratch never share files; BASE defaults to the system temp dir (on each
    node its own)."""
    name = hashlib.sha256(uri.split("?", 1)[0].encode()).hexdigest()[:16]
    return Path(base or tempfile.gettempdir()).absolute() / "vitpipe-shard" / name


class DatasetDir:
    """A dataset root, local or remote; paths inside are relative POSIX strings ("train/x.tar")."""

    def __init__(self, location: str | os.PathLike, scratch: str | os.PathLike | None = None):
        location = os.fspath(location)
        if location.startswith("file://"):  # a local folder: keep rename-into-place and fsync
            location = location.removeprefix("file://")
        self.remote = is_uri(location)
        if self.remote:
            self.location = location
            self.store: Store | None = Store(location)
            self.root: Path | None = None
            self.scratch = scratch_for(location, scratch)
        else:
            self.location = os.path.abspath(location)  # the same folder from any process's CWD
            self.store = None
            self.root = Path(self.location)
            self.scratch = self.root / ".work"  # a local dataset keeps its work files beside it

    def __repr__(self) -> str:
        return f"DatasetDir({self.describe()!r})"

    def describe(self, rel: str = "") -> str:
        """What a message names: the local path or the URI (without its query) of `rel`."""
        if self.store is not None:
            return self.store.describe(rel)
        return str(self.root / rel) if rel else str(self.root)

    def url(self, rel: str) -> str:
        """What the loader opens for `rel`: a local path, or the URI with its query (endpoint) kept."""
        return child(self.location, rel) if self.remote else str(self.root / rel)

    def make(self) -> None:
        """Create the root (a no-op on object stores, whose prefixes need no creating)."""
        if self.root is not None:
            if self.root.exists() and not self.root.is_dir():
                raise NotADirectoryError(f"{self.root}: exists and is not a folder")
            self.root.mkdir(parents=True, exist_ok=True)

    def read_bytes(self, rel: str) -> bytes | None:
        if self.store is not None:
            return self.store.read_bytes(rel)
        try:
            return (self.root / rel).read_bytes()
        except (FileNotFoundError, NotADirectoryError):
            return None

    def write_bytes(self, rel: str, data: bytes) -> None:
        """Atomic: a reader sees the old file or the new one, never half of one."""
        if self.store is not None:
            self.store.write_bytes(rel, data)
        else:
            path = self.root / rel
            path.parent.mkdir(parents=True, exist_ok=True)
            atomic.write_bytes(path, data)

    def size(self, rel: str) -> int | None:
        if self.store is not None:
            return self.store.size(rel)
        path = self.root / rel
        return path.stat().st_size if path.is_file() else None  # a folder is no file, as in a bucket

    def sha256(self, rel: str) -> str | None:
        """The file's sha256 where reading it back is cheap (local); None on object storage, where a
        completed upload of a file hashed on the way is trusted (its size is still checked)."""
        return None if self.store is not None else file_sha256(self.root / rel)

    def delete(self, rel: str) -> None:
        if self.store is not None:
            self.store.delete_file(rel)
        else:
            (self.root / rel).unlink(missing_ok=True)

    def list_files(self, folder: str) -> list[str]:
        """Names of the files directly in `folder` ([] where it does not exist)."""
        if self.store is not None:
            return self.store.list_files(folder)
        path = self.root / folder
        return sorted(p.name for p in path.iterdir() if p.is_file()) if path.is_dir() else []

    def list_dirs(self) -> list[str]:
        if self.store is not None:
            return self.store.list_dirs("")
        return sorted(p.name for p in self.root.iterdir() if p.is_dir()) if self.root.is_dir() else []

    def open(self, rel: str):
        """A binary stream to read `rel` from the start."""
        return self.store.open_input(rel) if self.store is not None else open(self.root / rel, "rb")

    def open_file(self, rel: str):
        """A seekable binary file (Parquet footers: a reader fetches only the ranges it needs)."""
        if self.store is not None:
            return self.store.open_file(rel)
        return open(self.root / rel, "rb")

    def staging(self, rel: str) -> Path:
        """A local file to write `rel` into before `publish`: beside it locally, on scratch remotely."""
        path = atomic.tmp_path(self.root / rel) if self.root is not None else self.scratch / "staging" / rel
        if self.root is None:
            # A file staged where a folder is now wanted (index.parquet, one file before it was a folder of
            # parts), left by a killed run: staged files are never resumed from, so it goes.
            for parent in reversed(path.relative_to(self.scratch).parents):
                if (self.scratch / parent).is_file():
                    (self.scratch / parent).unlink()
        path.parent.mkdir(parents=True, exist_ok=True)
        return path

    def publish(self, staged: Path, rel: str) -> None:
        """Make the complete local file `staged` the dataset's `rel`; `staged` is gone afterwards."""
        if self.store is not None:
            try:
                self.store.upload(staged, rel)
            finally:
                staged.unlink(missing_ok=True)
        else:
            atomic.fsync_file(staged)
            os.replace(staged, self.root / rel)
            atomic.fsync_dir((self.root / rel).parent)

    @contextmanager
    def writing(self, rel: str) -> Iterator[Path]:
        """Yield a local path to write `rel` into (Parquet writers want a path); published on a clean
        exit, removed on an exception."""
        staged = self.staging(rel)
        try:
            yield staged
        except BaseException:
            staged.unlink(missing_ok=True)
            raise
        self.publish(staged, rel)
