"""Sample keys, train/val splits and the shard order: pure functions of the key, stable across machines.

A WebDataset key ends at the first dot of a tar member's base name (`a/b.c.jpg` is key `a/b`, suffix
`c.jpg`), so keys made from file names lose their dots and anything else a shell or a URL would trip on.
"""

from __future__ import annotations

import hashlib
import re
import zlib

_UNSAFE = re.compile(r"[^\w\-/]+")  # \w is Unicode-aware: letters of any script stay
_SPLIT_NAME = re.compile(r"^[A-Za-z0-9_-]+$")


def key_from_path(relative: str) -> str:
    """`cat/img 01.v2.jpg` -> `cat/img_01_v2`: the path without its extension, one safe tar member stem."""
    stem = relative.replace("\\", "/")
    base = stem.rsplit("/", 1)[-1]
    if "." in base.lstrip("."):
        stem = stem[: stem.rfind(".")]
    return sanitize_key(stem)


def sanitize_key(key: str) -> str:
    parts = [_UNSAFE.sub("_", p) for p in key.replace("\\", "/").split("/") if p not in ("", ".")]
    return "/".join(p for p in parts if p)


def split_for(key: str, val_fraction: float, seed: int = 0) -> str:
    """Deterministic train/val split by a hash of the key: the one split hash (`vitpipe shard` and
    `synthetic_samples`), stable across runs, machines and worker counts; `seed` salts it."""
    salted = key if seed == 0 else f"{seed}/{key}"
    return "val" if (zlib.crc32(salted.encode()) % 10_000) < val_fraction * 10_000 else "train"


def order_hash(key: str, seed: int) -> int:
    """64-bit position of a key in the shard order: sorting by it mixes classes and ignores listing order."""
    return int.from_bytes(hashlib.blake2b(f"{seed}\0{key}".encode(), digest_size=8).digest(), "big")


def check_split_name(split: str) -> str:
    if not _SPLIT_NAME.match(split):
        raise ValueError(f"split {split!r} is not a folder name of letters, digits, '_' or '-'")
    return split
