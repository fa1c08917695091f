"""The dataset layout, defined once: every writer produces it and the loader reads it through here.

OUT/manifest.json            format version, class names, per-shard counts and sha256, totals per split
OUT/index.parquet            one row per sample: key, split, shard, labels, width, height, bytes, sha256
OUT/{split}/{name}-{i:06d}.tar   plain WebDataset tar: KEY.jpg|png|webp + KEY.cls (single) or KEY.json (multi)
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.parquet"


class DatasetError(ValueError):
    """A dataset folder that does not hold what the layout promises; the message names the path."""


def shard_name(name: str, index: int) -> str:
    return f"{name}-{index:06d}.tar"


def shard_path(root: Path, split: str, name: str, index: int) -> Path:
    return Path(root) / split / shard_name(name, index)


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
    tmp = path.with_name(MANIFEST + ".tmp")
    tmp.write_text(manifest.to_json())
    os.replace(tmp, path)
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
        )
    except (KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: manifest lacks or misshapes a field ({exc})") from None


def has_dataset(root: str | os.PathLike) -> bool:
    return (Path(root) / MANIFEST).is_file()
