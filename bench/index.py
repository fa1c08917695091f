"""index.parquet at JFT scale: what a reader pays to open it and to find one shard's rows.

    .venv/bin/python bench/index.py --out bench/results/index.json      # 1-3 minutes on 2 cores

A footer's size and parse time grow with its row groups (each holds every column's statistics and
offsets), not with its rows. At 300M samples in 100k shards, one row group per shard (the writer before
`index.ROW_GROUP_ROWS`) made 100,000 groups; groups of 65,536 rows make 4,578. Writing 300M rows here would
take an hour and 30 GB, so each layout is written with its real number of row groups and a few rows per
group (the footer is the same; a group's data is what a lookup reads either way, one or two groups), through
the real writer (`index.write_index_file`) and the real lookup (`index.read_shard_rows`) on one file. A
dataset's index is a folder of parts whose `_metadata` holds every part's row groups, so its footer is this
file's (plus each group's part name); `vitpipe shard verify` parses it once per process and then reads the
one or two groups that hold a damaged shard. Per layout, the median of `--repeats`: footer bytes, the time to open the file
(parse the footer) and the time to read one shard's rows. Goal: the fixed-size layout's footer and lookup
<= 1/10 of the per-shard layout's (the ratio of their group counts is 1/22). A third layout is the one a
build writes (`parts`): the index tasks' parts and their `_metadata`, looked up through `index.Table`; its
summary within 1.5x of the one-file footer, its open and lookup <= 1/10 of the per-shard layout's.
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
from data_prep.finish import PART_ROWS
from data_prep.index import ROW_GROUP_ROWS, Table, part_name, read_shard_rows, write_index_file, write_summary

SAMPLES, SHARDS = 300_000_000, 100_000


def _rows(groups: int, per_group: int, first: int = 0):
    """`groups` shards of `per_group` rows each, shaped like a vitpipe index's (sha256 and path strings)."""
    for s in range(first, first + groups):
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


def measure_parts(folder: Path, groups: int, repeats: int) -> dict:
    """The layout a build writes: the summary parsed (`open_s`), then one shard's rows looked up through it
    (`lookup_s`: the summary, the part's footer, the group)."""
    opens, lookups = [], []
    shard = f"train/shard-{groups // 2:06d}.tar"
    out = DatasetDir(folder)
    for _ in range(repeats):
        t0 = time.perf_counter()
        meta = pq.read_metadata(folder / "index.parquet" / "_metadata")
        opens.append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        found = Table(out, "index.parquet").shard_rows(shard, ["key", "sha256", "labels"])
        lookups.append(time.perf_counter() - t0)
        assert found.num_rows > 0, shard
    return {
        "row_groups": meta.num_row_groups,
        "parts": len({meta.row_group(i).column(0).file_path for i in range(meta.num_row_groups)}),
        "footer_bytes": _footer_bytes(folder / "index.parquet" / "_metadata"),
        "open_s": round(statistics.median(opens), 4),
        "lookup_s": round(statistics.median(lookups), 4),
    }


def write_parts(folder: Path) -> int:
    """index.parquet as `vitpipe shard` leaves it at JFT scale: a part per index task (whole shards of 3,000
    samples up to PART_ROWS: 350 shards, 1.05M rows, 17 groups of 65,536 rows, the last short), 286 parts,
    and their summary. Each group is written as one shard of 2 rows: the real number of groups and parts."""
    per_shard = SAMPLES // SHARDS
    shards_per_part = math.ceil(PART_ROWS / per_shard)
    groups_per_part = math.ceil(shards_per_part * per_shard / ROW_GROUP_ROWS)
    parts = math.ceil(SHARDS / shards_per_part)
    out = DatasetDir(folder)
    (folder / "index.parquet").mkdir()
    for n in range(parts):
        rows = _rows(groups_per_part, 2, first=n * groups_per_part)
        write_index_file(out, f"index.parquet/{part_name(n)}", rows, True, row_group_rows=2)
    write_summary(out, "index.parquet", [part_name(n) for n in range(parts)])
    return parts * groups_per_part


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
            write_index_file(DatasetDir(folder), "index.parquet", _rows(groups, 2), True, row_group_rows=2)
            layout = measure(folder / "index.parquet", groups, args.repeats)
            layout["write_s"] = round(time.perf_counter() - t0, 1)
            result["layouts"][name] = layout
        folder = Path(tmp) / "parts"
        folder.mkdir()
        t0 = time.perf_counter()
        groups = write_parts(folder)
        layout = measure_parts(folder, groups, args.repeats)
        layout["write_s"] = round(time.perf_counter() - t0, 1)
        result["layouts"]["parts"] = layout
    parts, fixed = result["layouts"]["parts"], result["layouts"]["fixed_groups"]
    # The summary is the one-file footer with each group's part named: the same order of size.
    ratio = parts["footer_bytes"] / fixed["footer_bytes"]
    result["summary_bytes_vs_one_file"] = {"value": round(ratio, 4), "goal": 1.5, "ok": ratio <= 1.5}
    old, new = result["layouts"]["per_shard"], result["layouts"]["fixed_groups"]
    for key in ("footer_bytes", "open_s", "lookup_s"):
        ratio = new[key] / old[key]
        result[f"{key}_ratio"] = {"value": round(ratio, 4), "goal": 0.1, "ok": ratio <= 0.1}
        ratio = parts[key] / old[key]
        result[f"parts_{key}_ratio"] = {"value": round(ratio, 4), "goal": 0.1, "ok": ratio <= 0.1}
    write_result(result, args.out)


if __name__ == "__main__":
    main()
