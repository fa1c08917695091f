"""index.parquet: its Arrow schema, its writer and its readers (pyarrow, so shard workers never import this).

The columns and their order are the layout's (`layout.INDEX_COLUMNS`); this adds their types. Rows go in
shard order, in row groups of `ROW_GROUP_ROWS` whatever the shard size: at JFT scale (300M rows in 100k
shards) one group per shard made a footer of 110 MB that every reader parsed; 64k-row groups make about
4,900 groups and a 6 MB summary (bench/index.py), and each group's `shard` statistics still narrow a lookup
to the one or two groups that hold a shard (`Table.shard_rows`).

index.parquet (and errors.parquet) is a folder of parts, `part-NNNNNN.parquet` in row order, with a
`_metadata` summary: every part's footer in one file, each row group naming its part (Hive/Spark's and
Dask's layout). pyarrow, pandas and Spark read the folder as one table (`pd.read_parquet(".../index.parquet")`;
`pyarrow.dataset.parquet_dataset(".../_metadata")` from the summary alone). A build's index tasks write the
parts where they stay, so no process copies the 300M rows into one file; the driver only joins the parts'
footers. Datasets written before are one Parquet file at the same path, and still read here.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_prep.dataset_dir import DatasetDir
from data_prep.layout import INDEX, INDEX_COLUMNS

_TYPES = {
    "key": pa.string(),
    "split": pa.string(),
    "shard": pa.string(),
    "labels": pa.list_(pa.int64()),
    "width": pa.int32(),
    "height": pa.int32(),
    "bytes": pa.int64(),
    "sha256": pa.string(),
    "source": pa.string(),
}


def index_schema(multi_label: bool) -> pa.Schema:
    """A single-label dataset stores `label` (int64) in place of `labels` (list<int64>)."""
    fields = [pa.field(c, _TYPES[c]) for c in INDEX_COLUMNS]
    if not multi_label:
        fields[INDEX_COLUMNS.index("labels")] = pa.field("label", pa.int64())
    return pa.schema(fields)


ROW_GROUP_ROWS = 65_536
SUMMARY = "_metadata"  # beside the parts: their footers joined, each row group with its part's name


def part_name(index: int) -> str:
    return f"part-{index:06d}.parquet"


class GroupedWriter:
    """A ParquetWriter fed tables of any size (a shard's rows, a batch of errors) that writes row groups of
    `rows` rows (the last one shorter): memory holds at most one group and the table that completed it."""

    def __init__(self, writer: pq.ParquetWriter, rows: int = ROW_GROUP_ROWS):
        self.writer, self.rows = writer, rows
        self.pending: list[pa.Table] = []
        self.count = 0

    def write(self, table: pa.Table) -> None:
        self.pending.append(table)
        self.count += table.num_rows
        if self.count >= self.rows:
            whole = pa.concat_tables(self.pending)
            full = (self.count // self.rows) * self.rows
            self.writer.write_table(whole.slice(0, full), row_group_size=self.rows)
            rest = whole.slice(full)
            self.pending, self.count = [rest.combine_chunks()], rest.num_rows

    def close(self) -> None:
        if self.count:
            self.writer.write_table(pa.concat_tables(self.pending), row_group_size=self.rows)
        self.pending, self.count = [], 0


def write_index(
    out: DatasetDir,
    shard_rows: Iterable[dict[str, list]],
    multi_label: bool,
    row_group_rows: int = ROW_GROUP_ROWS,
) -> None:
    """index.parquet from each shard's rows ({column: values}, layout.INDEX_COLUMNS), in shard order: one
    part and the summary, each file atomic; the manifest, written after, marks the dataset complete."""
    clear_folder(out, INDEX)
    write_index_file(out, f"{INDEX}/{part_name(0)}", shard_rows, multi_label, row_group_rows)
    write_summary(out, INDEX, [part_name(0)])


def write_index_file(
    out: DatasetDir,
    rel: str,
    shard_rows: Iterable[dict[str, list]],
    multi_label: bool,
    row_group_rows: int = ROW_GROUP_ROWS,
) -> None:
    """One Parquet file `rel` (atomic) of index rows, in row groups of `row_group_rows`."""
    schema = index_schema(multi_label)
    with out.writing(rel) as tmp, pq.ParquetWriter(tmp, schema) as parquet:
        writer = GroupedWriter(parquet, row_group_rows)
        for rows in shard_rows:
            writer.write(shard_table(rows, schema, multi_label))
        writer.close()


def clear_folder(out: DatasetDir, folder: str) -> None:
    """Make room for the parts of `folder`: a one-file table there (a dataset written before) is removed."""
    if out.size(folder) is not None:
        out.delete(folder)


def write_summary(out: DatasetDir, folder: str, parts: list[str]) -> None:
    """`folder/_metadata` from the footers of `parts` (in row order; O(row groups), no row is read), then
    every other file in `folder` removed: a part of a larger build before, a staged file a killed task left
    (a folder reader such as pandas would read them as rows)."""
    summary = None
    for name in parts:
        with out.open_file(f"{folder}/{name}") as f:
            meta = pq.read_metadata(f)
        meta.set_file_path(name)
        if summary is None:
            summary = meta
        else:
            summary.append_row_groups(meta)
    with out.writing(f"{folder}/{SUMMARY}") as tmp:
        summary.write_metadata_file(str(tmp))
    for name in out.list_files(folder):
        if name != SUMMARY and name not in parts:
            out.delete(f"{folder}/{name}")


class Table:
    """A table of the layout as written (a folder of parts with its summary, or one Parquet file), read a
    row group at a time: the footer (the summary's) says which groups to read and in which part."""

    def __init__(self, out: DatasetDir, rel: str):
        self.out, self.rel = out, rel
        self.parted = out.size(f"{rel}/{SUMMARY}") is not None
        if not self.parted and out.size(rel) is None:
            raise FileNotFoundError(f"{out.describe(rel)}: no such table (neither {SUMMARY} nor a file)")
        with out.open_file(f"{rel}/{SUMMARY}" if self.parted else rel) as f:
            self.meta = pq.read_metadata(f)
        self.places = []  # per row group: (file, its index in that file)
        seen: dict[str, int] = {}
        for i in range(self.meta.num_row_groups):
            path = self.meta.row_group(i).column(0).file_path if self.parted else ""
            self.places.append((path, seen.get(path, 0)))
            seen[path] = seen.get(path, 0) + 1
        self.files = list(seen) if self.parted else [""]

    @property
    def num_rows(self) -> int:
        return self.meta.num_rows

    def file_rel(self, name: str) -> str:
        return f"{self.rel}/{name}" if self.parted else self.rel

    def read_groups(self, groups: Iterable[int], columns: list[str] | None = None) -> Iterable[pa.Table]:
        """Row groups `groups` (in the table's numbering), each file opened once, on this thread."""
        opened: dict[str, tuple] = {}  # file -> (its stream, its ParquetFile)
        try:
            for g in groups:
                path, within = self.places[g]
                if path not in opened:
                    f = self.out.open_file(self.file_rel(path))
                    opened[path] = (f, pq.ParquetFile(f, pre_buffer=False))
                yield opened[path][1].read_row_group(within, columns=columns, use_threads=False)
        finally:
            for f, pf in opened.values():
                pf.close()
                f.close()  # ParquetFile leaves a stream it was given open

    def shard_rows(self, shard: str, columns: list[str]) -> pa.Table:
        """The index rows of one shard (`columns` of them): only the row groups whose `shard` statistics
        can hold it are read (see `read_shard_rows`)."""
        groups = self.read_groups(_groups_of(self.meta, shard), [*columns, "shard"])
        return _rows_of(shard, groups, columns, self.meta.schema.to_arrow_schema())

    def read(self) -> pa.Table:
        """The whole table, in row order."""
        groups = list(self.read_groups(range(self.meta.num_row_groups)))
        return pa.concat_tables(groups) if groups else self.meta.schema.to_arrow_schema().empty_table()


def shard_table(rows: dict[str, list], schema: pa.Schema, multi_label: bool) -> pa.Table:
    """One shard's index rows ({column: values}, as its sidecar holds them) as a table of `schema`."""
    if not multi_label:
        rows = {**rows, "label": [labels[0] for labels in rows["labels"]]}
    return pa.table({f.name: rows[f.name] for f in schema}, schema=schema)


def _groups_of(meta: pq.FileMetaData, shard: str) -> list[int]:
    """The row groups whose `shard` statistics can hold `shard` (the writer writes shards in order, so one
    or two groups)."""
    leaf = next((j for j in range(meta.num_columns) if meta.schema.column(j).path == "shard"), None)
    if leaf is None:
        raise ValueError(f"{INDEX} has no 'shard' column (columns: {meta.schema.names})")
    groups = []
    for i in range(meta.num_row_groups):
        stats = meta.row_group(i).column(leaf).statistics
        if stats is not None and stats.has_min_max and not (stats.min <= shard <= stats.max):
            continue
        groups.append(i)
    return groups


def read_shard_rows(f, shard: str, columns: list[str]) -> pa.Table:
    """The index rows of one shard (`columns` of them) from one open Parquet file of the index.

    Only the row groups whose `shard` statistics can hold it are read (the writer writes each shard
    as its own row groups), on this thread: no pyarrow dataset scan, whose read-ahead threads, left
    reading a Python file object at exit, abort the interpreter ("terminate called without an active
    exception": apache/arrow issues 34314, 39162; 9 runs in 100 of `vitpipe shard verify` on a busy
    machine when it went through `pq.read_table(filters=...)`, even with use_threads=False)."""
    pf = pq.ParquetFile(f, pre_buffer=False)
    groups = (
        pf.read_row_group(i, columns=[*columns, "shard"], use_threads=False)
        for i in _groups_of(pf.metadata, shard)
    )
    return _rows_of(shard, groups, columns, pf.schema_arrow)


def _rows_of(shard: str, groups: Iterable[pa.Table], columns: list[str], schema: pa.Schema) -> pa.Table:
    """`shard`'s rows of `groups` (read with their `shard` column), `columns` of them."""
    parts = [g.filter(pc.equal(g["shard"], shard)).select(columns) for g in groups]
    if not parts:
        return pa.schema([schema.field(c) for c in columns]).empty_table()
    return pa.concat_tables(parts)
