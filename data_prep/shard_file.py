"""One shard file: samples in, a complete WebDataset tar and its index rows out. The only code that
writes a shard: `vitpipe shard`'s workers (shard_worker.py) and the in-process `writer.write_dataset`.

The tar is streamed to a local staging file one sample at a time (memory: one image, plus the inputs a worker reads ahead from object
storage), hashed as it
is written, and published under its name only once complete (`DatasetDir.publish`: fsync and rename
in a local folder, a whole upload to object storage), so a killed run never leaves a partial shard
that looks complete. A shard that gets no sample leaves no file. Imports stay light (no pyarrow.parquet).
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable
from dataclasses import dataclass, field

from data_prep.dataset_dir import DatasetDir
from data_prep.layout import INDEX_COLUMNS
from data_prep.tario import HashingWriter, add_member, open_writer


@dataclass
class Sample:
    key: str
    image: bytes  # encoded image, stored as is
    ext: str  # "jpg", "png" or "webp"
    labels: list[int]
    width: int
    height: int
    split: str = "train"
    source: str = ""  # what it was made from (a path, "synthetic:17"), for index.parquet
    # More members, stored after the image in this order: extension -> bytes ({"seg.png": mask PNG})
    extra: dict[str, bytes] = field(default_factory=dict)


@dataclass
class WrittenShard:
    count: int  # samples written
    bytes: int  # 0 when no sample was written (no file)
    sha256: str  # "" when no sample was written
    rows: dict[str, list]  # its samples' index.parquet rows, by column (layout.INDEX_COLUMNS)


def write_shard(out: DatasetDir, shard: str, samples: Iterable[Sample], multi_label: bool) -> WrittenShard:
    """Write `samples` as the tar `shard` (its path inside `out`, as the index names it): `KEY.EXT` with
    the image, then each of `Sample.extra` as `KEY.{ext}` (`KEY.seg.png`), then `KEY.json`
    {"labels": [...]} or `KEY.cls`."""
    tmp = out.staging(shard)
    rows: dict[str, list] = {c: [] for c in INDEX_COLUMNS}
    with open(tmp, "wb") as f:
        hashed = HashingWriter(f)
        with open_writer(hashed) as tar:
            for s in samples:
                add_member(tar, f"{s.key}.{s.ext}", s.image)
                for ext, data in s.extra.items():
                    add_member(tar, f"{s.key}.{ext}", data)
                if multi_label:
                    add_member(tar, f"{s.key}.json", json.dumps({"labels": s.labels}).encode())
                else:
                    add_member(tar, f"{s.key}.cls", str(s.labels[0]).encode())
                sha256 = hashlib.sha256(s.image).hexdigest()
                row = (s.key, s.split, shard, s.labels, s.width, s.height, len(s.image), sha256, s.source)
                for c, v in zip(INDEX_COLUMNS, row):
                    rows[c].append(v)
    count = len(rows["key"])
    if not count:  # nothing to store: no shard file
        tmp.unlink()
        out.delete(shard)
        return WrittenShard(0, 0, "", rows)
    out.publish(tmp, shard)  # only now does the shard exist under its name
    return WrittenShard(count, hashed.size, hashed.sha256.hexdigest(), rows)
