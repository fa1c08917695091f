"""Planning in parallel: the driver handles ranges, buckets and shards, never a sample.

At JFT scale (300M inputs) the serial planner (`plan.py`) lists, hashes and sorts every input on the driver,
which caps the whole cluster near one core's 46k inputs/s. Here each phase is a set of independent tasks run
by the build's `Executor` (this process, worker processes or Ray tasks), MapReduce-style, over the ranges of
a ranged source (`sources.RangedSource`): a Parquet manifest's runs of row groups, a CSV manifest's byte
spans (cut at line starts), a class folder's runs of class folders (on a disk or under a bucket prefix), a
flat folder's runs of top-level folders (its CSV labels file in byte spans, joined to them in 1b).

1. survey (where a range's rows are not known before it is read, as in a CSV or a folder, or where labels
   are inferred, not given by --classes): each range's rows (per class folder for a folder) and distinct
   label values; the driver merges the tallies into the label space (memory: the class names), numbers the
   ranges' rows and lets the source regroup them (class folders into runs of about RANGE_ROWS files).
   A flat folder's labels file (CSV) is surveyed too, in byte spans: its lines and label values.
1b. partition (a source with a labels file, `label_spans`): each span of the labels file sends its (name,
   label) rows to the range that lists the name (`range_finder`: O(ranges) boundaries) and writes
   `plan_labels_S.arrows`, one piece per range (an Arrow IPC stream each, one after another: a task reads
   its own with one ranged read), and its malformed lines to
   `plan_labels_S.errors.parquet`: the join of files and labels, by range, with no row on the driver.
2. list: each range (about RANGE_ROWS inputs) lists its inputs as the serial listing does (keys, labels,
   splits, a stat per local file; a flat folder's range reads its piece of each labels part), places
   each key in the shard order (`order_hash`) and writes its items to `.work/plan_range_R.arrows`, one
   piece per order bucket (buckets cut the 64-bit hash range into equal parts: bucket b holds hashes
   [b, b + 1) * 2^64 / B), and
   its rejected rows to `plan_range_R.errors.parquet` (a labels file's names with no such file, which the
   serial listing gives after every file, to `plan_range_R.unlisted.parquet`).
3. sort: each bucket reads its piece of every range file, sorts by (hash, key, row), drops later
   duplicates of a key (error rows, `plan_bucket_B.errors.parquet`), and cuts each split's items into shards
   (--max-count, --max-size) into `plan_bucket_B.parquet`, split after split, in row groups of SLICE_ROWS.
4. write: shard i of a split is a slice of one bucket file; its task carries (split, index, bucket, start,
   count), and the worker reads the slice, builds the shard's items and fingerprint and writes it as
   `shard_worker.write_planned_shard` always has.

The output is that of the serial planner (the same order, the same duplicates dropped, the same error rows),
except that a shard never spans two buckets: with B > 1 (manifests of more than BUCKET_ROWS rows) each
split gets up to B - 1 shorter shards (at 300M rows and 1,000 per shard: 300 of 300,000). B follows from the
manifest's row count and ranges from its row groups, and every sort is total, so the shards are the same
bytes whatever the number of workers or tasks.

The driver holds O(ranges x buckets + shards) small numbers (and O(class folders) names): never an item.
The listing's error rows reach errors.parquet as Arrow tables copied from the parts (`finish.py`), their
reasons counted by the tasks, in the serial listing's order: the labels file's malformed lines, each
range's rejected rows, each range's unlisted names, then the duplicates.

Resume: each part is published whole, then a JSON marker naming the plan's fingerprint (the source's
identity, every range's rows and every option that moves an item); a part whose marker matches is not redone, so a killed build
re-runs only the ranges and buckets it had not finished. The plan folder goes when the dataset is complete.
"""

from __future__ import annotations

import hashlib
import json
import math
from collections.abc import Iterator
from dataclasses import dataclass, field, replace
from functools import cached_property

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq

from data_prep.dataset_dir import DatasetDir
from data_prep.finish import LISTING_SCHEMA, count_reasons, read_tables
from data_prep.keys import order_hash, split_for
from data_prep.layout import WORK, DatasetError
from data_prep.plan import _boxes_list, cut_shards, sample_bytes, shard_task
from data_prep.shard_worker import ShardJob, ShardResult, write_planned_shard
from data_prep.sources import Item, ListingError, RangedSource, Survey, Unlisted
from data_prep.sources.labels import LabelTally
from data_prep.tario import archive_bytes

RANGE_ROWS = 1_000_000  # rows per list task (whole row groups: at least one)
BUCKET_ROWS = 1_000_000  # rows per sort task, about: a bucket is sorted in one task's memory
BATCH_ROWS = 8192  # items a list task holds as Python objects at once
SLICE_ROWS = 1024  # row groups of a bucket file: a shard's read is its rows and at most two groups more
# In .work/ itself, beside job.json, which stays: on object stores pyarrow puts an empty marker object for a
# folder emptied by deletes.
PLAN = f"{WORK}/plan"
PLAN_FORMAT = 2  # in the plan's fingerprint: parts of another format (1: row groups) are not resumed from
MANIFEST_COPY = f"{PLAN}_manifest"  # a manifest's copy, for --ray into a bucket (`RangedPlanner.make`)

ITEM_SCHEMA = pa.schema(
    [
        ("bucket", pa.int32()),
        ("hash", pa.uint64()),
        ("key", pa.string()),
        ("row", pa.int64()),  # 1-based row of the manifest: the first listed of two equal keys is kept
        ("source", pa.string()),
        ("labels", pa.list_(pa.int64())),
        ("est_bytes", pa.int64()),
        ("stamp", pa.string()),
        ("split", pa.string()),
        ("boxes", pa.string()),  # JSON [[class, [x, y, w, h]], ...]; null: no boxes column
    ]
)


def supports(source) -> bool:
    """Whether `source` is planned here: a manifest, a folder in the class layout, or a flat folder with a
    CSV labels file."""
    return bool(getattr(source, "ranged", False))


@dataclass(frozen=True)
class Range:
    index: int
    spec: tuple  # the source's own description: ("groups", a, b), ("bytes", a, b), ("folders", names...)
    first_row: int  # 0-based, in the whole listing
    rows: int
    labels: tuple[tuple[int, int, int], ...] | None = None  # (labels part, offset, length): its labels rows


@dataclass(frozen=True)
class SliceTask:
    """Shard `index` of `split`: rows [start, start + count) of bucket file `bucket`."""

    split: str
    index: int
    bucket: int
    start: int
    count: int


@dataclass(frozen=True)
class Plan:
    """Everything a task needs besides its own part: the same for every task of a build, pickled once."""

    source: RangedSource
    root: str  # the dataset (local folder or URI)
    scratch: str
    job_fingerprint: str
    name: str
    max_count: int
    max_size: int | None
    val_fraction: float
    seed: int
    buckets: int
    fingerprint: str = ""
    finder: object = None  # the source's `range_finder`: which range lists a labels row (1b)

    @cached_property
    def out(self) -> DatasetDir:
        return DatasetDir(self.root, self.scratch or None)

    def marker(self, rel: str) -> dict | None:
        """A finished part's marker, if it is this plan's."""
        raw = self.out.read_bytes(rel)
        if raw is None:
            return None
        try:
            found = json.loads(raw)
        except json.JSONDecodeError:
            return None
        return found if found.get("plan") == self.fingerprint else None


def range_rel(index: int, suffix: str) -> str:
    return f"{PLAN}_range_{index:06d}.{suffix}"


def bucket_rel(index: int, suffix: str) -> str:
    return f"{PLAN}_bucket_{index:05d}.{suffix}"


def labels_rel(index: int, suffix: str) -> str:
    return f"{PLAN}_labels_{index:06d}.{suffix}"


def _write_parquet(out: DatasetDir, rel: str, table: pa.Table, row_group_rows: int) -> None:
    with out.writing(rel) as tmp:
        pq.write_table(table, tmp, row_group_size=max(1, row_group_rows))


# A part's pieces: Arrow IPC streams, their buffers zstd-compressed. For a piece of 3,300 items (a 1M-row
# range's share of one of 300 buckets) measured against a Parquet file of the same rows: 0.63x the bytes, 1.3
# against 3.5 ms to write and 0.7 against 2.1 ms to read. A piece of a few rows (many ranges and buckets over
# few inputs) is written plain: compressing each of its ~25 buffers costs more than its bytes are worth.
PIECE_ZSTD = pa.ipc.IpcWriteOptions(compression="zstd")
PIECE_PLAIN = pa.ipc.IpcWriteOptions()
PIECE_ZSTD_ROWS = 256


def _write_pieces(out: DatasetDir, rel: str, table: pa.Table, column: str) -> list[list[int]]:
    """`table`, sorted by `column`, as one piece per value present, written one after another into `rel`:
    each piece an Arrow IPC stream of its own (schema, batches, end). Returns [value, offset, length] of
    each: a task of the next phase reads its piece with one ranged read and decodes it alone. (As row groups
    of one Parquet file, each read parsed a footer describing every bucket's group: at 300M, 300 ranges x
    300 buckets x a 300-group footer.)"""
    pieces: list[list[int]] = []
    with out.writing(rel) as tmp, open(tmp, "wb") as f:
        values = table.column(column).to_numpy()
        start = 0
        while start < len(values):
            end = int(values.searchsorted(values[start], side="right"))
            buf = pa.BufferOutputStream()
            options = PIECE_ZSTD if end - start >= PIECE_ZSTD_ROWS else PIECE_PLAIN
            with pa.ipc.new_stream(buf, table.schema, options=options) as w:
                w.write_table(table.slice(start, end - start))
            piece = buf.getvalue()
            pieces.append([int(values[start]), f.tell(), piece.size])
            f.write(piece)
            start = end
    return pieces


def _read_piece(out: DatasetDir, rel: str, offset: int, length: int, columns=None) -> pa.Table:
    """One piece of a part `_write_pieces` wrote: `length` bytes at `offset`."""
    with out.open_file(rel) as f:
        f.seek(offset)
        data = f.read(length)
    if len(data) != length:
        raise DatasetError(
            f"{out.location}/{rel}: {len(data)} bytes at offset {offset} where its marker names a piece of "
            f"{length}; the plan's part is damaged: delete {out.location}/{PLAN}_* and re-run the command"
        )
    table = pa.ipc.open_stream(pa.py_buffer(data)).read_all()
    return table if columns is None else table.select(columns)


# 1. survey


@dataclass(frozen=True)
class SurveyTask:
    index: int
    spec: tuple
    tally: bool


def survey_range(task: SurveyTask, plan: Plan) -> tuple[int, Survey]:
    return task.index, plan.source.survey(task.spec, task.tally)


# 1b. partition


LABELS_SCHEMA = pa.schema(
    [("range", pa.int32()), ("line", pa.int64()), ("name", pa.string()), ("label", pa.string())]
)


@dataclass(frozen=True)
class LabelsTask:
    index: int
    spec: tuple  # a span of the labels file
    first_line: int  # lines before it


def partition_labels(task: LabelsTask, plan: Plan) -> dict:
    """One span of a labels file, its rows sent to the ranges that list their names; returns (and stores)
    its marker: lines, error rows and, per range with rows, its piece of the part (offset, length)."""
    rel = labels_rel(task.index, "json")
    done = plan.marker(rel)
    if done is not None:
        return done
    cols: dict[str, list] = {name: [] for name in LABELS_SCHEMA.names}
    tables: list[pa.Table] = []  # the span's rows in Arrow, BATCH_ROWS at a time
    errors: list[tuple[str, str, str]] = []
    line = task.first_line
    for row in plan.source.label_rows(task.spec, task.first_line):
        line += 1
        if isinstance(row, ListingError):
            errors.append((row.key, row.source, row.reason))
            continue
        cols["range"].append(plan.finder(row[0]))
        cols["line"].append(line)
        cols["name"].append(row[0])
        cols["label"].append(row[1])
        if len(cols["line"]) >= BATCH_ROWS:
            tables.append(pa.table(cols, schema=LABELS_SCHEMA))
            cols = {name: [] for name in LABELS_SCHEMA.names}
    table = pa.concat_tables([*tables, pa.table(cols, schema=LABELS_SCHEMA)])
    table = table.take(pc.sort_indices(table, [("range", "ascending"), ("line", "ascending")]))
    pieces = _write_pieces(plan.out, labels_rel(task.index, "arrows"), table, "range")
    if errors:
        _write_parquet(plan.out, labels_rel(task.index, "errors.parquet"), _errors_table(errors), 65_536)
    marker = {
        "plan": plan.fingerprint,
        "index": task.index,
        "lines": line - task.first_line,
        "errors": len(errors),
        "reasons": count_reasons((reason for _, _, reason in errors), {}),
        "pieces": pieces,
    }
    plan.out.write_bytes(rel, json.dumps(marker).encode())  # last: the span is done
    return marker


def _range_labels(rng: Range, plan: Plan) -> Iterator[tuple[str, str]]:
    """(name, label) of the labels rows a range lists, in line order: its piece of each part."""
    for part, offset, length in rng.labels:
        table = _read_piece(plan.out, labels_rel(part, "arrows"), offset, length, ["name", "label"])
        yield from zip(table.column("name").to_pylist(), table.column("label").to_pylist())


# 2. list


def list_range(rng: Range, plan: Plan) -> dict:
    """Lists one range into its bucketed item file and error file; returns (and stores) its marker:
    rows, items, errors and, per bucket with items, its piece of the file (offset, length)."""
    rel = range_rel(rng.index, "json")
    done = plan.marker(rel)
    if done is not None:
        return done
    src, b = plan.source, plan.buckets
    cols: dict[str, list] = {name: [] for name in ITEM_SCHEMA.names}
    tables: list[pa.Table] = []  # the range's items in Arrow, BATCH_ROWS at a time (not as Python objects)
    errors: list[tuple[str, str, str]] = []
    unlisted: list[tuple[str, str, str]] = []  # not rows of the range: they come after every range's errors
    row = rng.first_row
    labels = None if rng.labels is None else _range_labels(rng, plan)
    for entry in src.list_rows(rng.spec, rng.first_row, labels):
        if isinstance(entry, Unlisted):
            unlisted.append((entry.key, entry.source, entry.reason))
            continue
        row += 1
        if isinstance(entry, ListingError):
            errors.append((entry.key, entry.source, entry.reason))
            continue
        h = order_hash(entry.key, plan.seed)
        cols["bucket"].append((h * b) >> 64)
        cols["hash"].append(h)
        cols["key"].append(entry.key)
        cols["row"].append(row)
        cols["source"].append(entry.source)
        cols["labels"].append(list(entry.labels))
        cols["est_bytes"].append(entry.est_bytes)
        cols["stamp"].append(entry.stamp)
        cols["split"].append(entry.split or split_for(entry.key, plan.val_fraction, src.split_salt))
        cols["boxes"].append(None if entry.boxes is None else json.dumps(_boxes_list(entry.boxes)))
        if len(cols["key"]) >= BATCH_ROWS:
            tables.append(pa.table(cols, schema=ITEM_SCHEMA))
            cols = {name: [] for name in ITEM_SCHEMA.names}
    if row - rng.first_row != rng.rows:
        raise DatasetError(
            f"{src.where}: changed while it was planned: range {rng.index} ({_describe(rng.spec)}) had "
            f"{rng.rows} inputs when surveyed and {row - rng.first_row} now; re-run the command"
        )
    table = pa.concat_tables([*tables, pa.table(cols, schema=ITEM_SCHEMA)])
    table = table.take(pc.sort_indices(table, [("bucket", "ascending"), ("row", "ascending")]))
    pieces = _write_pieces(plan.out, range_rel(rng.index, "arrows"), table, "bucket")
    if errors:
        _write_parquet(plan.out, range_rel(rng.index, "errors.parquet"), _errors_table(errors), 65_536)
    if unlisted:
        _write_parquet(plan.out, range_rel(rng.index, "unlisted.parquet"), _errors_table(unlisted), 65_536)
    marker = {
        "plan": plan.fingerprint,
        "index": rng.index,
        "rows": rng.rows,
        "items": table.num_rows,
        "errors": len(errors),
        "unlisted": len(unlisted),
        "reasons": count_reasons((reason for _, _, reason in [*errors, *unlisted]), {}),
        "pieces": pieces,
    }
    plan.out.write_bytes(rel, json.dumps(marker).encode())  # last: the range is done
    return marker


def _errors_table(rows: list[tuple[str, str, str]]) -> pa.Table:
    return pa.table([list(c) for c in zip(*rows)], schema=LISTING_SCHEMA)


def _describe(spec: tuple) -> str:
    kind, *rest = spec
    if kind == "folders":
        return f"folders {rest[0]!r}..{rest[-1]!r}" if len(rest) > 1 else f"folder {rest[0]!r}"
    return f"{'row groups' if kind == 'groups' else 'bytes'} {rest[0]}-{rest[1]}"


# 3. sort


@dataclass(frozen=True)
class BucketTask:
    index: int
    parts: tuple[tuple[int, int, int], ...]  # (range, offset, length) of its piece of each range file


def sort_bucket(task: BucketTask, plan: Plan) -> dict:
    """One bucket, from every range: sorted, duplicates dropped, each split cut into shards. Returns (and
    stores) its marker: per split in name order, [split, first row in the file, [items per shard...]]."""
    rel = bucket_rel(task.index, "json")
    done = plan.marker(rel)
    if done is not None:
        return done
    pieces = []
    for r, offset, length in task.parts:
        pieces.append(_read_piece(plan.out, range_rel(r, "arrows"), offset, length))
    table = pa.concat_tables(pieces) if pieces else ITEM_SCHEMA.empty_table()
    table = table.take(
        pc.sort_indices(table, [("hash", "ascending"), ("key", "ascending"), ("row", "ascending")])
    )
    keys = table.column("key").to_pylist()
    sources = table.column("source").to_pylist()
    keep, dups, kept = [], [], 0
    for i, key in enumerate(keys):  # equal keys are adjacent (same hash): the first listed is kept
        if i and key == keys[kept]:
            dups.append((key, sources[i], f"duplicate key {key!r} (kept {sources[kept]})"))
        else:
            kept = i
            keep.append(i)
    if dups:
        table = table.take(pa.array(keep, pa.int64()))
        _write_parquet(plan.out, bucket_rel(task.index, "errors.parquet"), _errors_table(dups), 65_536)
    splits, parts, first = [], [], 0
    for split in sorted(set(table.column("split").to_pylist())):
        part = table.filter(pc.equal(table.column("split"), split))  # keeps the order
        if plan.max_size:
            sizes = (sample_bytes(it, plan.source.multi_label) for it in _items(part))
            lengths = [n for n, _ in cut_shards(sizes, plan.max_count, plan.max_size)]
        else:
            lengths = [
                min(plan.max_count, part.num_rows - s) for s in range(0, part.num_rows, plan.max_count)
            ]
        splits.append([split, first, lengths])
        parts.append(part)
        first += part.num_rows
    ordered = pa.concat_tables(parts) if parts else table
    _write_parquet(plan.out, bucket_rel(task.index, "parquet"), ordered.drop_columns(["bucket"]), SLICE_ROWS)
    marker = {
        "plan": plan.fingerprint,
        "index": task.index,
        "duplicates": len(dups),
        "reasons": count_reasons((reason for _, _, reason in dups), {}),
        "splits": splits,
    }
    plan.out.write_bytes(rel, json.dumps(marker).encode())  # last: the bucket is done
    return marker


def _items(table: pa.Table) -> Iterator[Item]:
    cols = {name: table.column(name).to_pylist() for name in ("key", "source", "labels", "est_bytes")}
    cols |= {name: table.column(name).to_pylist() for name in ("stamp", "split", "boxes")}
    for i, key in enumerate(cols["key"]):
        raw = cols["boxes"][i]
        boxes = None if raw is None else tuple((c, tuple(b)) for c, b in json.loads(raw))
        yield Item(
            key,
            cols["source"][i],
            tuple(cols["labels"][i]),
            cols["est_bytes"][i],
            cols["stamp"][i],
            cols["split"][i],
            boxes=boxes,
        )


# 4. write


def read_slice(out: DatasetDir, bucket: int, start: int, count: int) -> pa.Table:
    """Rows [start, start + count) of a bucket file, reading only the row groups that hold them."""
    with out.open_file(bucket_rel(bucket, "parquet")) as f:
        pf = pq.ParquetFile(f)
        groups, first, offset = [], None, 0
        for g in range(pf.metadata.num_row_groups):
            n = pf.metadata.row_group(g).num_rows
            if offset + n > start and offset < start + count:
                groups.append(g)
                first = offset if first is None else first
            offset += n
        table = pf.read_row_groups(groups) if groups else pf.schema_arrow.empty_table()
    return table.slice(start - (first or 0), count)


def write_slice(task: SliceTask, shared: tuple[Plan, ShardJob]) -> ShardResult:
    plan, job = shared
    items = tuple(_items(read_slice(plan.out, task.bucket, task.start, task.count)))
    shard = shard_task(plan.job_fingerprint, plan.name, task.split, task.index, items)
    members = sum(sample_bytes(it, plan.source.multi_label) for it in items)
    return write_planned_shard(replace(shard, planned_bytes=archive_bytes(members)), job)


# The driver


def _compact(marker: dict) -> dict:
    """A part's marker as the driver keeps it: its [value, offset, length] pieces as one int64 array (24
    bytes a piece, not a list of ints: at 300M inputs 300 ranges x 300 buckets and ~160 spans x 300 ranges)."""
    return {**marker, "pieces": np.asarray(marker["pieces"], dtype=np.int64).reshape(-1, 3)}


def _invert(markers: dict[int, dict]) -> Iterator[tuple[int, tuple[tuple[int, int, int], ...]]]:
    """From parts' markers ([value, offset, length] per piece), each value present in value order with its
    (part, offset, length) pieces in part order: what a task of the next phase reads."""
    order = sorted(markers)
    if not order:
        return
    arrays = [markers[i]["pieces"] for i in order]
    owner = np.repeat(np.asarray(order, dtype=np.int64), [len(a) for a in arrays])
    pieces = np.concatenate(arrays)
    by_value = np.argsort(pieces[:, 0], kind="stable")  # stable: each value's parts stay in part order
    owner, pieces = owner[by_value], pieces[by_value]
    cuts = np.flatnonzero(np.diff(pieces[:, 0])) + 1
    for idx in np.split(np.arange(len(pieces)), cuts):
        if len(idx):
            where = zip(owner[idx].tolist(), pieces[idx, 1].tolist(), pieces[idx, 2].tolist())
            yield int(pieces[idx[0], 0]), tuple(where)


def _with_labels(ranges: list[Range], labels: Iterator[tuple[int, tuple]]) -> Iterator[Range]:
    """Each range with its (labels part, offset, length) pieces (`_invert` of the labels parts' markers),
    made as its list task is (the pieces of every range are never held as Python objects at once)."""
    found = next(labels, None)
    for r in ranges:
        mine = ()
        if found is not None and found[0] == r.index:
            mine, found = found[1], next(labels, None)
        yield replace(r, labels=mine)


@dataclass
class RangedPlanner:
    """The driver's side: builds the tasks of each phase from the markers of the last, and the numbers the
    build's report needs. Memory: O(ranges x buckets present + shards)."""

    plan: Plan
    specs: list[tuple[tuple, int | None]]  # the source's ranges before the survey
    ranges: list[Range] = field(default_factory=list)
    num_inputs: int = 0
    range_markers: dict[int, dict] = field(default_factory=dict)
    bucket_markers: dict[int, dict] = field(default_factory=dict)
    labels_markers: dict[int, dict] = field(default_factory=dict)

    @classmethod
    def make(
        cls, source: RangedSource, root: DatasetDir, scratch: str, job_fingerprint: str, opts
    ) -> RangedPlanner:
        specs = source.range_specs(RANGE_ROWS)
        share = getattr(source, "share_through", None)
        if opts.use_ray and root.remote and share is not None:
            # Ray tasks may run on nodes that see only their own disk and the bucket: they read the manifest's
            # ranges from a copy beside the dataset (one streamed upload; no row is parsed here).
            share(root.store, MANIFEST_COPY)
        plan = Plan(
            source,
            root.location,
            scratch,
            job_fingerprint,
            opts.name,
            opts.max_count,
            opts.max_size,
            opts.val_fraction,
            opts.seed,
            buckets=1,
        )
        return cls(plan, specs)

    def survey(self, executor) -> None:
        """Each range's rows where unknown and the label spaces where not given (both in parallel); then the
        ranges, numbered, and the number of buckets."""
        src = self.plan.source
        tally = not src.labels_known()
        specs = self.specs
        if tally or any(rows is None for _, rows in specs):
            tasks = (SurveyTask(i, spec, tally) for i, (spec, _) in enumerate(specs))
            # Each tally merged as it comes and dropped (a merge is a set union: order-free): the driver holds
            # the distinct names once, not once per range (at 300M, 300 ranges x 18k names).
            labels, boxes = LabelTally(), LabelTally() if tally and src.has_boxes else None
            found: dict[int, Survey] = {}
            for i, surveyed in executor.map(survey_range, tasks, self.plan):
                if tally:
                    labels.merge(surveyed.labels)
                    if boxes is not None:
                        boxes.merge(surveyed.boxes)
                found[i] = replace(surveyed, labels=None, boxes=None)
            if tally:
                src.set_label_spaces(labels, boxes)
            specs = src.regroup([(spec, found[i]) for i, (spec, _) in enumerate(specs)], RANGE_ROWS)
        first = 0
        for spec, rows in specs:
            if rows or len(specs) == 1:  # an empty one alone: a flat folder's labels without files
                self.ranges.append(Range(len(self.ranges), spec, first, rows))
                first += rows
        finder = None
        if self.label_spans():
            finder = src.range_finder([r.spec for r in self.ranges])
        self.plan = replace(self.plan, buckets=max(1, math.ceil(first / BUCKET_ROWS)), finder=finder)

    def label_spans(self) -> list[tuple[tuple, int]]:
        return getattr(self.plan.source, "label_spans", list)()

    def seal(self) -> None:
        """Fix the plan's fingerprint once the label spaces are known (they change the items' labels)."""
        src, p = self.plan.source, self.plan
        parts = {
            "format": PLAN_FORMAT,
            "job": p.job_fingerprint,
            "source": src.identity(),
            "ranges": [(r.spec, r.rows) for r in self.ranges],
            "buckets": p.buckets,
            "options": [p.name, p.max_count, p.max_size, p.val_fraction, p.seed, src.split_salt],
            "classes": src.classes,
            "detection_classes": getattr(src, "detection_classes", None),
        }
        if self.label_spans():
            parts["labels"] = self.label_spans()
        digest = hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()
        self.plan = replace(self.plan, fingerprint=digest)

    def list(self, executor, on_range=None) -> None:
        ranges = self.ranges
        spans = self.label_spans()
        if spans:  # 1b: the labels rows partitioned by range, then each range told where its rows are
            tasks = (LabelsTask(i, spec, first) for i, (spec, first) in enumerate(spans))
            for marker in executor.map(partition_labels, tasks, self.plan):
                self.labels_markers[marker["index"]] = _compact(marker)
            ranges = _with_labels(ranges, _invert(self.labels_markers))
        for marker in executor.map(list_range, ranges, self.plan):
            self.range_markers[marker["index"]] = _compact(marker)
            if on_range is not None:
                on_range(marker["rows"])
        self.num_inputs = sum(m["rows"] + m.get("unlisted", 0) for m in self.range_markers.values())
        self.num_inputs += sum(m["errors"] for m in self.labels_markers.values())

    def sort(self, executor) -> None:
        tasks = (BucketTask(b, parts) for b, parts in _invert(self.range_markers))
        for marker in executor.map(sort_bucket, tasks, self.plan):
            self.bucket_markers[marker["index"]] = marker

    def items(self) -> int:
        return sum(sum(sum(lengths) for _, _, lengths in m["splits"]) for m in self.bucket_markers.values())

    def shard_tasks(self) -> Iterator[SliceTask]:
        """Each split's shards, numbered in bucket order (the global order)."""
        next_index: dict[str, int] = {}
        for b in sorted(self.bucket_markers):
            for split, first, lengths in self.bucket_markers[b]["splits"]:
                start = first
                for n in lengths:
                    index = next_index.get(split, 0)
                    next_index[split] = index + 1
                    yield SliceTask(split, index, b, start, n)
                    start += n

    def error_tables(self) -> Iterator[pa.Table]:
        """The listing's rejected rows (LISTING_SCHEMA), in the serial planner's order: each range's (listing
        order), then the duplicates (shard order); read by Arrow from the parts, never as Python rows. A
        labels file's malformed lines come first, and its names with no such file after every range's."""
        parts = [
            labels_rel(s, "errors.parquet")
            for s in sorted(self.labels_markers)
            if self.labels_markers[s]["errors"]
        ]
        parts += [
            range_rel(r, "errors.parquet")
            for r in sorted(self.range_markers)
            if self.range_markers[r]["errors"]
        ]
        parts += [
            range_rel(r, "unlisted.parquet")
            for r in sorted(self.range_markers)
            if self.range_markers[r].get("unlisted")
        ]
        parts += [
            bucket_rel(b, "errors.parquet")
            for b in sorted(self.bucket_markers)
            if self.bucket_markers[b]["duplicates"]
        ]
        return read_tables(self.plan.out, parts)

    def error_reasons(self) -> dict[str, int]:
        """Rejected rows per kind of reason, as the tasks counted them."""
        counts: dict[str, int] = {}
        markers = [*self.labels_markers.values(), *self.range_markers.values(), *self.bucket_markers.values()]
        for m in markers:
            for kind, n in m["reasons"].items():
                counts[kind] = counts.get(kind, 0) + n
        return counts

    def clean(self) -> None:
        """Remove the plan's parts (the dataset is complete): every `.work/plan_*` file, an earlier plan's
        too (a labels file edited between runs is cut into other spans). .work/ holds little else."""
        out = self.plan.out
        prefix = PLAN.rsplit("/", 1)[1] + "_"
        for name in out.list_files(WORK):
            if name.startswith(prefix):
                out.delete(f"{WORK}/{name}")
