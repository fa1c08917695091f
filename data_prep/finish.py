"""Finishing a build: index.parquet and errors.parquet from the shards' sidecars, read by tasks.

At JFT scale the sidecars hold 300M index rows (about 66 GB of JSON); read one by one on the driver they
took hours. Here each index task (the build's `Executor`: this process, worker processes or Ray tasks)
reads the sidecars of a run of consecutive shards (about PART_ROWS samples) and writes their index rows
and rejected inputs as parts of index.parquet and errors.parquet (folders: `index.py`), in row groups of
`index.ROW_GROUP_ROWS` (each part's last one shorter). The driver writes only the listing's rejected
inputs (errors.parquet's first part) and each folder's `_metadata` from the parts' footers: it reads no
sidecar and no index row, O(parts + row groups) whatever the number of samples.
"""

from __future__ import annotations

import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from functools import cached_property

import pyarrow as pa
import pyarrow.parquet as pq

from data_prep.dataset_dir import DatasetDir
from data_prep.index import (
    ROW_GROUP_ROWS,
    GroupedWriter,
    clear_folder,
    index_schema,
    part_name,
    shard_table,
    write_summary,
)
from data_prep.layout import ERRORS, INDEX
from data_prep.shard_worker import ShardResult, read_sidecar

PART_ROWS = 1 << 20  # samples per index task, about (whole shards)
ERROR_SCHEMA = pa.schema(
    [
        ("key", pa.string()),
        ("source", pa.string()),
        ("stage", pa.string()),
        ("reason", pa.string()),
        ("shard", pa.string()),
    ]
)
# The listing's rejected inputs, as planners hand them over (stage "listing", no shard).
LISTING_SCHEMA = pa.schema([("key", pa.string()), ("source", pa.string()), ("reason", pa.string())])


def listing_table(rows: list[tuple[str, str, str]]) -> pa.Table:
    columns = [list(c) for c in zip(*rows)] if rows else [[], [], []]
    return pa.table(columns, schema=LISTING_SCHEMA)


def reason_kind(reason: str) -> str:
    """ "unknown label 'x'" -> "unknown label": the reason without its particulars, for the summary."""
    head = re.split(r":| \(", reason, maxsplit=1)[0]
    words = [w for w in head.split() if not re.search(r"[\d'\"/\\]", w)]
    return " ".join(words) or reason


def count_reasons(reasons: Iterable[str], counts: dict[str, int]) -> dict[str, int]:
    for reason in reasons:
        kind = reason_kind(reason)
        counts[kind] = counts.get(kind, 0) + 1
    return counts


@dataclass(frozen=True)
class IndexPart:
    index: int
    shards: tuple[tuple[str, int, str], ...]  # (split, index, path) of consecutive shards, in shard order


@dataclass(frozen=True)
class FinishJob:
    root: str
    scratch: str
    name: str
    multi_label: bool

    @cached_property
    def out(self) -> DatasetDir:
        return DatasetDir(self.root, self.scratch or None)


def errors_part(index: int) -> str:
    """Index task `index`'s part of errors.parquet, whose first part (0) holds the listing's rejected inputs."""
    return part_name(index + 1)


def part_rel(index: int, kind: str) -> str:
    """Index task `index`'s part of index.parquet ("index") or errors.parquet ("errors")."""
    return f"{INDEX}/{part_name(index)}" if kind == "index" else f"{ERRORS}/{errors_part(index)}"


def index_parts(results: list[ShardResult], rows: int | None = None) -> Iterator[IndexPart]:
    """Consecutive shards (in shard order) of about `rows` (PART_ROWS) samples each; shards with nothing to
    read (no sample written, none rejected) are left out."""
    rows = rows or PART_ROWS
    shards, count, index = [], 0, 0
    for r in results:
        if not (r.count or r.rejected):
            continue
        shards.append((r.split, r.index, r.path))
        count += r.planned
        if count >= rows:
            yield IndexPart(index, tuple(shards))
            shards, count, index = [], 0, index + 1
    if shards:
        yield IndexPart(index, tuple(shards))


def write_index_part(part: IndexPart, job: FinishJob) -> dict:
    """The index rows and rejected inputs of `part`'s shards, from their sidecars, as two Parquet parts.
    Returns the part's numbers: rows, errors, and errors per kind of reason."""
    out, schema = job.out, index_schema(job.multi_label)
    rows, errors = 0, []
    with out.writing(part_rel(part.index, "index")) as tmp, pq.ParquetWriter(tmp, schema) as parquet:
        writer = GroupedWriter(parquet)
        for split, index, path in part.shards:
            side = read_sidecar(out, job.name, split, index)
            if side["count"]:
                table = shard_table(side["rows"], schema, job.multi_label)
                writer.write(table)
                rows += table.num_rows
            errors += [(k, s, stage, reason, path) for k, s, stage, reason in side["errors"]]
        writer.close()
    if errors:
        table = pa.table([list(c) for c in zip(*errors)], schema=ERROR_SCHEMA)
        with out.writing(part_rel(part.index, "errors")) as tmp:
            pq.write_table(table, tmp, row_group_size=ROW_GROUP_ROWS)
    reasons = count_reasons((e[3] for e in errors), {})
    return {"index": part.index, "rows": rows, "errors": len(errors), "reasons": reasons}


def read_tables(out: DatasetDir, rels: Iterable[str]) -> Iterator[pa.Table]:
    """The row groups of Parquet files `rels`, in order."""
    for rel in rels:
        with out.open_file(rel) as f:
            pf = pq.ParquetFile(f)
            for g in range(pf.metadata.num_row_groups):
                yield pf.read_row_group(g)


def _write(out: DatasetDir, rel: str, schema: pa.Schema, tables: Iterable[pa.Table]) -> int:
    """`rel` (atomic) from `tables` in order, in row groups of ROW_GROUP_ROWS; returns its rows."""
    rows = 0
    with out.writing(rel) as tmp, pq.ParquetWriter(tmp, schema) as parquet:
        writer = GroupedWriter(parquet)
        for table in tables:
            if table.num_rows:
                writer.write(table)
                rows += table.num_rows
        writer.close()
    return rows


def finish_index(
    executor,
    out: DatasetDir,
    job: FinishJob,
    results: list[ShardResult],
    listing_errors: Iterable[pa.Table],
    listing_reasons: dict[str, int],
) -> dict[str, int]:
    """index.parquet and errors.parquet (listing rejections, stage "listing", then each shard's: "read",
    "decode", "convert", "resize", "boxes"); returns the rejected inputs per kind of reason.
    `listing_errors`: tables of LISTING_SCHEMA; `listing_reasons`: their counts per kind, complete once the
    tables have been read."""
    clear_folder(out, INDEX)
    clear_folder(out, ERRORS)
    markers = sorted(executor.map(write_index_part, index_parts(results), job), key=lambda m: m["index"])
    index = [part_name(m["index"]) for m in markers if m["rows"]]
    if not index:  # nothing written: one empty part, so the folder reads as a table of the right columns
        _write(out, f"{INDEX}/{part_name(0)}", index_schema(job.multi_label), [])
        index = [part_name(0)]
    write_summary(out, INDEX, index)

    def listed() -> Iterator[pa.Table]:
        for table in listing_errors:
            n = table.num_rows
            yield pa.table(
                [
                    table.column("key"),
                    table.column("source"),
                    pa.repeat(pa.scalar("listing"), n),
                    table.column("reason"),
                    pa.nulls(n, pa.string()),
                ],
                schema=ERROR_SCHEMA,
            )

    errors = [errors_part(m["index"]) for m in markers if m["errors"]]
    first = f"{ERRORS}/{part_name(0)}"
    if _write(out, first, ERROR_SCHEMA, listed()) or not errors:
        errors.insert(0, part_name(0))
    else:
        out.delete(first)
    write_summary(out, ERRORS, errors)
    counts: dict[str, int] = {}
    for kind, n in listing_reasons.items():
        counts[kind] = counts.get(kind, 0) + n
    for m in markers:
        for kind, n in m["reasons"].items():
            counts[kind] = counts.get(kind, 0) + n
    return counts
