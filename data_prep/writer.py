"""The small in-process dataset writer: samples in memory -> shards, index.parquet, manifest.json.

    write_dataset("data/syn", synthetic_samples(320, 8), class_names(8), multi_label=True, max_count=40)

Shards are written by the same code as `vitpipe shard`'s (`shard_file.write_shard`: atomic, hashed)
and indexed by the same writer (`index.write_index`), so both give the same layout. `vitpipe shard`
itself uses `data_prep.build` instead: planned, parallel and resumable over inputs on disk.
"""

from __future__ import annotations

import os
import shlex
import sys
from collections.abc import Iterable

from data_prep.dataset_dir import DatasetDir
from data_prep.index import write_index
from data_prep.layout import Manifest, ShardInfo, shard_rel, write_manifest
from data_prep.shard_file import Sample, write_shard


def write_dataset(
    root: str | os.PathLike,
    samples: Iterable[Sample],
    classes: list[str],
    multi_label: bool,
    max_count: int,
    name: str = "shard",
    options: dict | None = None,
    segmentation_classes: list[str] | None = None,
    detection_classes: list[str] | None = None,
) -> Manifest:
    """Stream samples into shards of at most `max_count` per split, then write index.parquet and manifest.json.

    Memory holds at most one open shard per split, whatever the corpus size. `root`: a folder or an
    object store URI. `segmentation_classes`: the names of the mask values, for samples that carry a
    mask (`Sample.extra["seg.png"]`, the layout corpus); recorded in the manifest. `detection_classes`
    likewise, for samples that carry boxes (`Sample.extra["boxes.json"]`).
    """
    out = DatasetDir(root)
    out.make()
    manifest = Manifest(
        classes=classes,
        multi_label=multi_label,
        command=" ".join(shlex.quote(a) for a in sys.argv),
        options=dict(options or {}),
        name=name,
        segmentation_classes=segmentation_classes,
        detection_classes=detection_classes,
    )
    shard_rows: list[dict[str, list]] = []
    buffers: dict[str, list[Sample]] = {}
    next_index: dict[str, int] = {}

    def flush(split: str) -> None:
        batch = buffers.pop(split)
        index = next_index.get(split, 0)
        next_index[split] = index + 1
        relative = shard_rel(split, name, index)
        shard = write_shard(out, relative, batch, multi_label)
        manifest.shards.append(ShardInfo(split, relative, shard.count, shard.bytes, shard.sha256))
        shard_rows.append(shard.rows)

    for s in samples:
        buffers.setdefault(s.split, []).append(s)
        if len(buffers[s.split]) == max_count:
            flush(s.split)
    for split in list(buffers):
        flush(split)
    write_index(out, shard_rows, multi_label)
    write_manifest(out, manifest)  # last: its presence marks the dataset complete
    return manifest
