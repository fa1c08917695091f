"""Deterministic tar members: the same samples always give the same shard bytes.

Members carry mtime 0, mode 0644 and no owner, in the order given; PAX headers appear only for names
plain USTAR cannot hold (longer than 100 bytes, or not ASCII), so ordinary shards are plain USTAR.
"""

from __future__ import annotations

import hashlib
import io
import os
import tarfile

BLOCK = tarfile.BLOCKSIZE  # 512
RECORD = tarfile.RECORDSIZE  # 10240: tarfile pads the archive to a whole record
TAR_FORMAT = tarfile.PAX_FORMAT


def member_info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    info.mtime = 0  # deterministic bytes: the same input gives the same shard
    info.mode = 0o644
    return info


def add_member(tar: tarfile.TarFile, name: str, data: bytes) -> None:
    tar.addfile(member_info(name, len(data)), io.BytesIO(data))


def member_bytes(name: str, size: int) -> int:
    """Bytes one member takes in a shard: its header(s) plus the data padded to whole blocks."""
    if name.isascii() and len(name) <= 100 and size < 8**11:  # one plain USTAR header; skips a ~40 us tobuf
        header = BLOCK
    else:
        header = len(member_info(name, size).tobuf(TAR_FORMAT, "utf-8", "surrogateescape"))
    return header + -(-size // BLOCK) * BLOCK


def archive_bytes(members_bytes: int) -> int:
    """Total shard size: the members, two zero blocks, then padding to a whole record."""
    return -(-(members_bytes + 2 * BLOCK) // RECORD) * RECORD


class HashingWriter:
    """A write-only file that hashes and counts what passes through (no second read of the shard)."""

    def __init__(self, f):
        self._f = f
        self.sha256 = hashlib.sha256()
        self.size = 0

    def write(self, data: bytes) -> int:
        self._f.write(data)
        self.sha256.update(data)
        self.size += len(data)
        return len(data)

    def tell(self) -> int:
        return self.size

    def sync(self) -> None:
        self._f.flush()
        os.fsync(self._f.fileno())


def file_sha256(path: str | os.PathLike, chunk: int = 1 << 20) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while block := f.read(chunk):
            h.update(block)
    return h.hexdigest()
