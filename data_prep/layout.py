"""The dataset layout, defined once: every writer produces it and the loader reads it through here.

OUT/manifest.json            format version, class names, per-shard counts and sha256, totals per split
OUT/index.parquet            one row per sample: the INDEX_COLUMNS below (schema: data_prep/index.py)
OUT/errors.parquet           one row per rejected input: key, source, stage, reason (`vitpipe shard` only)
OUT/{split}/{name}-{i:06d}.tar   plain WebDataset tar: KEY.jpg|png|webp + KEY.cls (single) or KEY.json (multi)
OUT/.work/{split}/{name}-{i:06d}.json   per-shard sidecar: the plan's fingerprint, size, sha256, index rows;
                             how a re-run of `vitpipe shard` knows a shard is complete and skips it

The manifest is written last: its presence marks the dataset complete. Fields added after format
version 1 (`name`, `num_inputs`, `num_errors`) have defaults, so older manifests still read.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

from data_prep import atomic

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.parquet"
ERRORS = "errors.parquet"
WORK = ".work"  # sidecars and scratch files of `vitpipe shard`; without it a re-run rewrites every shard
# index.parquet's columns, in order: one row per sample. A single-label dataset stores `label` (one int) in
# place of `labels` (a list); `bytes` and `sha256` are the stored image's; `source` is what the sample was
# made from, as a person reads it (a path, "synthetic:17"; "" where the writer was given bytes only).
INDEX_COLUMNS = ("key", "split", "shard", "labels", "width", "height", "bytes", "sha256", "source")


class DatasetError(ValueError):
    """A dataset folder that does not hold what the layout promises; the message names the path."""


def shard_name(name: str, index: int) -> str:
    return f"{name}-{index:06d}.tar"


def shard_path(root: Path, split: str, name: str, index: int) -> Path:
    return Path(root) / split / shard_name(name, index)


def sidecar_path(root: Path, split: str, name: str, index: int) -> Path:
    """Where a shard's completion record lives (beside the data, never inside a split folder)."""
    return Path(root) / WORK / split / f"{name}-{index:06d}.json"


@dataclass
class ShardInfo:
    split: str
    path: str  # relative to the dataset root
    count: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    classes: list[str]
    multi_label: bool
    shards: list[ShardInfo] = field(default_factory=list)
    command: str = ""
    options: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    name: str = "shard"  # shard file prefix
    num_inputs: int = 0  # inputs listed, accepted or not (0: unknown, older writers)
    num_errors: int = 0  # inputs rejected; listed in errors.parquet

    @property
    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.shards:
            out[s.split] = out.get(s.split, 0) + s.count
        return out

    def split_shards(self, split: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> str:
        d = asdict(self)
        d["totals"] = self.totals
        return json.dumps(d, indent=2)


def write_manifest(root: Path, manifest: Manifest) -> Path:
    """Atomic: a reader sees the old manifest or the new one, never half of one."""
    path = Path(root) / MANIFEST
    atomic.write_bytes(path, manifest.to_json().encode())
    return path


def read_manifest(root: str | os.PathLike) -> Manifest:
    path = Path(root) / MANIFEST
    if not path.is_file():
        raise DatasetError(f"{path}: no manifest; is {root} a dataset written by `vitpipe shard`?")
    try:
        d = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: manifest is not valid JSON ({exc})") from None
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(f"{path}: format_version {version!r}, this vitpipe reads {FORMAT_VERSION}")
    try:
        shards = [ShardInfo(**s) for s in d["shards"]]
        return Manifest(
            classes=list(d["classes"]),
            multi_label=bool(d["multi_label"]),
            shards=shards,
            command=d.get("command", ""),
            options=d.get("options", {}),
            name=d.get("name", "shard"),
            num_inputs=int(d.get("num_inputs", 0)),
            num_errors=int(d.get("num_errors", 0)),
        )
    except (KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: manifest lacks or misshapes a field ({exc})") from None


def has_dataset(root: str | os.PathLike) -> bool:
    return (Path(root) / MANIFEST).is_file()
