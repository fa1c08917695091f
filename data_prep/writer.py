"""Shard writing: samples in, complete WebDataset tar shards plus index and manifest out.

A shard is written as `NAME.tar.tmp` and renamed to `NAME.tar` only once it is complete and
its sha256 known, so a killed run never leaves a partial shard that looks complete.
"""

from __future__ import annotations

import hashlib
import json
import os
import shlex
import sys
import tarfile
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from data_prep.layout import INDEX, Manifest, ShardInfo, shard_path, write_manifest
from data_prep.tario import add_member


@dataclass
class Sample:
    key: str
    image: bytes  # encoded image, stored as is
    ext: str  # "jpg", "png" or "webp"
    labels: list[int]
    width: int
    height: int
    split: str = "train"


def write_shard(path: Path, samples: list[Sample], multi_label: bool) -> ShardInfo:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(path.name + ".tmp")
    with tarfile.open(tmp, "w", format=tarfile.USTAR_FORMAT) as tar:
        for s in samples:
            add_member(tar, f"{s.key}.{s.ext}", s.image)
            if multi_label:
                add_member(tar, f"{s.key}.json", json.dumps({"labels": s.labels}).encode())
            else:
                add_member(tar, f"{s.key}.cls", str(s.labels[0]).encode())
    digest = hashlib.sha256(tmp.read_bytes()).hexdigest()
    size = tmp.stat().st_size
    os.replace(tmp, path)
    return ShardInfo(split=samples[0].split, path="", count=len(samples), bytes=size, sha256=digest)


def write_dataset(
    root: Path,
    samples: Iterable[Sample],
    classes: list[str],
    multi_label: bool,
    max_count: int,
    name: str = "shard",
    options: dict | None = None,
) -> Manifest:
    """Stream samples into shards of at most `max_count` per split, then write index.parquet and manifest.json.

    Memory holds at most one open shard per split, whatever the corpus size. (`vitpipe shard` uses
    `data_prep.build` instead: planned, parallel and resumable; this is the small in-process writer.)
    """
    # Imported here: `Sample` is imported by shard workers, which never need pyarrow.
    import pyarrow as pa
    import pyarrow.parquet as pq

    root = Path(root)
    root.mkdir(parents=True, exist_ok=True)
    manifest = Manifest(
        classes=classes,
        multi_label=multi_label,
        command=" ".join(shlex.quote(a) for a in sys.argv),
        options=dict(options or {}),
    )
    columns = ("key", "split", "shard", "labels", "width", "height", "bytes", "sha256")
    index_rows: dict[str, list] = {k: [] for k in columns}
    buffers: dict[str, list[Sample]] = {}
    next_index: dict[str, int] = {}

    def flush(split: str) -> None:
        batch = buffers.pop(split)
        path = shard_path(root, split, name, next_index.get(split, 0))
        next_index[split] = next_index.get(split, 0) + 1
        info = write_shard(path, batch, multi_label)
        info.path = path.relative_to(root).as_posix()
        manifest.shards.append(info)
        for s in batch:
            row = (s.key, split, info.path, s.labels, s.width, s.height, len(s.image),
                   hashlib.sha256(s.image).hexdigest())  # fmt: skip
            for k, v in zip(columns, row):
                index_rows[k].append(v)

    for s in samples:
        buffers.setdefault(s.split, []).append(s)
        if len(buffers[s.split]) == max_count:
            flush(s.split)
    for split in list(buffers):
        flush(split)
    tmp = root / (INDEX + ".tmp")
    pq.write_table(pa.table(index_rows), tmp)
    os.replace(tmp, root / INDEX)
    write_manifest(root, manifest)  # last: its presence marks the dataset complete
    return manifest
