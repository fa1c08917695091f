"""index.parquet at JFT scale: what a reader pays to open it and to find one shard's rows.

    .venv/bin/python bench/index.py --out bench/results/index.json      # 1-3 minutes on 2 cores

A footer's size and parse time grow with its row groups (each holds every column's statistics and
offsets), not with its rows. At 300M samples in 100k shards, one row group per shard (the writer before
`index.ROW_GROUP_ROWS`) made 100,000 groups; groups of 65,536 rows make 4,578. Writing 300M rows here would
take an hour and 30 GB, so each layout is written with its real number of row groups and a few rows per
group (the footer is the same; a group's data is what a lookup reads either way, one or two groups), through
the real writer (`index.write_index`) and the real lookup (`index.read_shard_rows`, as `vitpipe shard verify`
runs it for a damaged shard). Per layout, the median of `--repeats`: footer bytes, the time to open the file
(parse the footer) and the time to read one shard's rows. Goal: the fixed-size layout's footer and lookup
<= 1/10 of the per-shard layout's (the ratio of their group counts is 1/22).
"""

from __future__ import annotations

import argparse
import math
import statistics
import struct
import tempfile
import time
from pathlib import Path

import pyarrow.parquet as pq
from provenance import write_result  # bench/provenance.py, beside this file

from data_prep.dataset_dir import DatasetDir
from data_prep.index import ROW_GROUP_ROWS, read_shard_rows, write_index

SAMPLES, SHARDS = 300_000_000, 100_000


def _rows(groups: int, per_group: int):
    """`groups` shards of `per_group` rows each, shaped like a vitpipe index's (sha256 and path strings)."""
    for s in range(groups):
        shard = f"train/shard-{s:06d}.tar"
        yield {
            "key": [f"{s:06d}/{i:04d}" for i in range(per_group)],
            "split": ["train"] * per_group,
            "shard": [shard] * per_group,
            "labels": [[s % 18_291, (s * 7 + i) % 18_291] for i in range(per_group)],
            "width": [384] * per_group,
            "height": [288] * per_group,
            "bytes": [110_000 + i for i in range(per_group)],
            "sha256": [f"{s:032x}{i:032x}" for i in range(per_group)],
            "source": [f"s3://corpus/images/{s:06d}/{i:04d}.jpg" for i in range(per_group)],
        }


def _footer_bytes(path: Path) -> int:
    with open(path, "rb") as f:
        f.seek(-8, 2)
        return struct.unpack("<i", f.read(4))[0]


def measure(path: Path, groups: int, repeats: int) -> dict:
    opens, lookups = [], []
    shard = f"train/shard-{groups // 2:06d}.tar"  # in the middle: every statistic is checked before it
    for _ in range(repeats):
        t0 = time.perf_counter()
        meta = pq.ParquetFile(path).metadata
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        with open(path, "rb") as f:
            found = read_shard_rows(f, shard, ["key", "sha256", "labels"])
        lookups.append(time.perf_counter() - t0)
        assert found.num_rows > 0, shard
    return {
        "row_groups": meta.num_row_groups,
        "footer_bytes": _footer_bytes(path),
        "open_s": round(statistics.median(opens), 4),
        "lookup_s": round(statistics.median(lookups), 4),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out", default=None)
    p.add_argument("--repeats", type=int, default=5)
    args = p.parse_args()
    layouts = {"per_shard": SHARDS, "fixed_groups": math.ceil(SAMPLES / ROW_GROUP_ROWS)}
    result: dict = {"samples": SAMPLES, "shards": SHARDS, "row_group_rows": ROW_GROUP_ROWS, "layouts": {}}
    with tempfile.TemporaryDirectory() as tmp:
        for name, groups in layouts.items():
            folder = Path(tmp) / name
            folder.mkdir()
            t0 = time.perf_counter()
            # 2 rows a group, groups of 2 rows: the real number of groups, each group one shard.
            write_index(DatasetDir(folder), _rows(groups, 2), multi_label=True, row_group_rows=2)
            layout = measure(folder / "index.parquet", groups, args.repeats)
            layout["write_s"] = round(time.perf_counter() - t0, 1)
            result["layouts"][name] = layout
    old, new = result["layouts"]["per_shard"], result["layouts"]["fixed_groups"]
    for key in ("footer_bytes", "open_s", "lookup_s"):
        ratio = new[key] / old[key]
        result[f"{key}_ratio"] = {"value": round(ratio, 4), "goal": 0.1, "ok": ratio <= 0.1}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
