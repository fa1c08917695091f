"""A manifest table: Parquet or CSV (TSV) with a `path` column and `label` (single-label) or `labels`
(a list, a JSON list string or names joined by '|': multi-label), optionally `split`, `key` and `bytes`,
and for detection `boxes` with `box_labels`: per image a list of COCO-style [x, y, w, h] boxes in the
image's pixels (x, y the top-left corner; as it stands upright) and a list of as many class names (or
indices); in CSV each a JSON list ('[[10, 20, 30, 40]]', '["cat"]'); empty: an image without objects.
The detection classes come from `box_classes` (--box-classes) or, without it, from the box labels
(like labels). Each sample then stores KEY.boxes.json (scaled where the image is resized) and the
manifest lists `detection_classes`. A box that is not 4 numbers with w, h > 0, or of an unknown class,
is an error row at listing; one outside its image, when a worker has read the image's size.
Relative paths resolve against the manifest's own folder; a path may be a URI (s3://bucket/img.jpg,
gs://..., credentials from the environment), read by the shard workers, several at a time each. Read
in record batches: memory stays flat.

vitpipe shard manifest ~/data/train.parquet data/mydata --max-size 1G
vitpipe shard manifest photos.parquet s3://corpus/photos --workers 32   # s3:// images in, shards to a bucket
vitpipe shard manifest boxes.csv data/det --box-classes cat,dog         # + KEY.boxes.json per image
"""

from __future__ import annotations

import io
import json
import os
from collections.abc import Generator, Iterator
from dataclasses import replace
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data_prep.keys import check_split_name, key_from_path, sanitize_key
from data_prep.layout import DatasetError, check_box
from data_prep.sources import Item, ListingError, Survey
from data_prep.sources.files import FileLoader, file_item, uri_item
from data_prep.sources.labels import LabelSpace, LabelTally, UnknownLabel, parse_label_list
from data_prep.storage import Store, is_uri

BATCH_ROWS = 8192
# A CSV manifest is cut into byte spans of about rows_per_range x CSV_ROW_BYTES (a path, a label and a key
# make 40-100 bytes a row): 64 MiB for the 1M rows of a range task.
CSV_ROW_BYTES = 64
HEADER_BLOCK = 1 << 16  # bytes read first to find a CSV's header


def _list_values(cells: list) -> Iterator:
    """The values of multi-label cells; a malformed cell is skipped (the listing reports it per row)."""
    for raw in cells:
        try:
            yield from parse_label_list(raw)
        except UnknownLabel:
            continue


# A batch's column for the CSV lines the reader could not parse (a wrong number of fields): the reason for
# such a row (its other columns None), None for a parsed one; absent where the batch has no such line.
MALFORMED = "__malformed__"


def _cells(batch: dict[str, list], column: str) -> list:
    """`column`'s values of the parsed rows of `batch`."""
    bad = batch.get(MALFORMED)
    if bad is None:
        return batch[column]
    return [v for v, b in zip(batch.get(column, [None] * len(bad)), bad) if b is None]


def _malformed_reason(row) -> str:
    return (
        f"malformed CSV line: {row.actual_columns} fields where the header has {row.expected_columns} "
        f"({row.text[:80]!r})"
    )


def _with_malformed(batches: Iterator[dict[str, list]], skipped: list, header: int) -> Iterator[dict]:
    """The reader's batches with the lines it skipped (`skipped`: pyarrow's InvalidRow, appended by the
    handler as it parses) put back where they were, as rows with a MALFORMED reason, so every line of a
    manifest is a row of the listing: a sample or an error row, numbered as it stands. `header`: 1 where
    the reader's line numbers count a header line."""
    at, pending = 1, []  # the next data row's number; skipped lines not yet placed

    def number(row) -> int:
        return at if row.number is None else row.number - header

    for batch in batches:
        pending += skipped
        skipped.clear()
        n = len(next(iter(batch.values()))) if batch else 0
        if not pending:
            at += n
            yield batch
            continue
        pending.sort(key=number)
        out: dict[str, list] = {c: [] for c in batch}
        out[MALFORMED] = []
        i = 0
        while i < n or (pending and number(pending[0]) <= at):
            if pending and number(pending[0]) <= at:
                row = pending.pop(0)
                for c in batch:
                    out[c].append(None)
                out[MALFORMED].append(_malformed_reason(row))
            else:
                for c in batch:
                    out[c].append(batch[c][i])
                out[MALFORMED].append(None)
                i += 1
            at += 1
        yield out
    pending += skipped
    if pending:
        pending.sort(key=number)
        yield {MALFORMED: [_malformed_reason(r) for r in pending]}


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


class _Span(io.RawIOBase):
    """Bytes [start, end) of a seekable binary file, as a stream (a CSV span for pyarrow's reader)."""

    def __init__(self, f, start: int, end: int):
        self._f, self._left = f, end - start
        f.seek(start)

    def readable(self) -> bool:
        return True

    def readinto(self, buf) -> int:
        n = min(len(buf), self._left)
        if n <= 0:
            return 0
        data = self._f.read(n)
        buf[: len(data)] = data
        self._left -= len(data)
        return len(data)

    def close(self) -> None:
        self._f.close()
        super().close()


def next_line_start(f, pos: int, size: int, chunk: int = 1 << 16) -> int:
    """The offset of the first line that starts at or after `pos` (`size` where none does)."""
    f.seek(pos - 1)  # the byte before: where it ends a line, a line starts at pos
    at = pos - 1
    while at < size:
        data = f.read(min(chunk, size - at))
        if not data:
            break
        nl = data.find(b"\n")
        if nl >= 0:
            return at + nl + 1
        at += len(data)
    return size


class CsvTable:
    """A CSV file (TSV by its suffix) read by pyarrow as text columns, whole or in byte spans cut at line
    starts (`spans`), each line a row: a line with a wrong number of fields comes back where it stood as a
    row with a MALFORMED reason (`_with_malformed`). A span is read with the header's names (it has none
    of its own). `opener`: the file as a seekable binary stream, where not at `path` on this node."""

    def __init__(self, path: Path, opener=None):
        self.path = path
        self._opener = opener
        with open(path, "rb") as f:
            head = f.read(HEADER_BLOCK)
        cr, lf = head.find(b"\r"), head.find(b"\n")
        if cr >= 0 and (lf < 0 or cr < lf) and head[cr + 1 : cr + 2] != b"\n":
            # pyarrow reads them, but byte spans are cut at line feeds: a task would read the whole file.
            raise DatasetError(
                f"{path}: its lines end in a lone carriage return (CR, classic Mac); give it LF or CRLF "
                "line ends (tr '\\r' '\\n' < OLD > NEW)"
            )
        # The header, whatever the lines, from a reader of one small block (the default one's first blocks,
        # parsed, held about 45 MB more of a 1M-line file on the driver); a longer header, from the default.
        try:
            self.names = list(self.reader(None, skipped=[], block_size=HEADER_BLOCK).schema.names)
        except pa.ArrowInvalid:
            self.names = list(self.reader(None, skipped=[]).schema.names)

    def open(self):
        return open(self.path, "rb") if self._opener is None else self._opener()

    def spans(self, span_bytes: int) -> list[tuple[int, int]]:
        """Byte spans of whole lines after the header, each about `span_bytes` long. Reads a line's worth
        at each cut: O(spans) bytes, never the rows."""
        size = os.path.getsize(self.path)
        with open(self.path, "rb") as f:
            header_end = 0  # after the header: the first line that is not blank, as the reader finds it
            for line in iter(f.readline, b""):
                header_end += len(line)
                if line.strip():
                    break
            cuts = [header_end]
            while cuts[-1] + span_bytes < size:
                cut = next_line_start(f, cuts[-1] + span_bytes, size)
                if cut >= size:
                    break
                cuts.append(cut)
        cuts.append(size)
        return [(a, b) for a, b in zip(cuts, cuts[1:]) if b > a]

    def reader(
        self,
        columns: list[str] | None,
        span_stream=None,
        skipped: list | None = None,
        block_size: int = 1 << 22,
    ):
        """The whole file, or the lines of `span_stream` (a span of it, read with the header's names).
        `skipped`: where the lines with a wrong number of fields go (pyarrow's InvalidRow), the reader
        going on past them; on one thread, so that each carries its line number."""
        delimiter = "\t" if self.path.suffix.lower() == ".tsv" else ","
        convert = pacsv.ConvertOptions(
            include_columns=columns,
            # Everything as text: a column's type must not depend on the first block's values.
            column_types={c: pa.string() for c in (columns or [])},
        )
        read = pacsv.ReadOptions(block_size=block_size, use_threads=skipped is None)
        source = self.path
        if span_stream is not None:
            read = pacsv.ReadOptions(
                block_size=block_size, column_names=self.names, use_threads=skipped is None
            )
            source = span_stream

        def skip(row) -> str:
            skipped.append(row)
            return "skip"

        return pacsv.open_csv(
            source,
            read_options=read,
            parse_options=pacsv.ParseOptions(
                delimiter=delimiter, invalid_row_handler=None if skipped is None else skip
            ),
            convert_options=convert,
        )

    def batches(self, columns: list[str], span: tuple[int, int] | None = None) -> Iterator[dict[str, list]]:
        """Batches of `columns` (with MALFORMED where a batch holds a malformed line): the whole file, or
        the lines of bytes [span[0], span[1]). Raises pyarrow's ArrowInvalid on what it cannot read."""
        skipped: list = []
        if span is None:
            reader = self.reader(columns, skipped=skipped)
            yield from _with_malformed((b.to_pydict() for b in reader), skipped, header=1)
            return
        with io.BufferedReader(_Span(self.open(), *span), 1 << 20) as stream:
            reader = self.reader(columns, stream, skipped)
            yield from _with_malformed((b.to_pydict() for b in reader), skipped, header=0)


class ManifestSource:
    kind = "manifest"
    mix = True

    # Planned by range tasks (data_prep/ranged.py): a Parquet manifest by runs of row groups, a CSV one by
    # byte spans cut at line starts. A line with a wrong number of fields is an error row. A quoted value
    # holding a line break is not for CSV manifests: read whole it is one row, but a span cut inside it
    # reads its halves as two lines (an error row and a row with a wrong path), so the serial and the
    # ranged planner disagree on it (write such a manifest as Parquet).
    ranged = True

    def __init__(
        self,
        path: str | Path,
        classes: list[str] | None = None,
        seed: int = 0,
        box_classes: list[str] | None = None,
    ):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise DatasetError(f"{path}: no such manifest file")
        self.where = str(path)
        self.base = self.path.parent
        self.split_salt = seed
        self.parquet = _is_parquet(self.path)
        self.csv: CsvTable | None = None  # a CSV manifest's reader (`_columns`)
        columns = self._columns()
        label_col = "labels" if "labels" in columns else "label" if "label" in columns else None
        if "path" not in columns or label_col is None:
            raise DatasetError(
                f"{path}: expected a 'path' column and a 'label' or 'labels' column "
                f"(optional: 'split', 'key'); found: {', '.join(columns) or 'no columns'}"
            )
        self.label_col = label_col
        self.multi_label = label_col == "labels"
        self.read_cols = ["path", label_col] + [c for c in ("split", "key", "bytes") if c in columns]
        # Inferred from the data on first use (a serial pass over the column), unless `set_label_spaces`
        # gave them first: a Parquet manifest's ranges are tallied in parallel (data_prep/ranged.py).
        self._space = LabelSpace.infer((), classes) if classes is not None else None
        self._box_space: LabelSpace | None = None
        self.has_boxes = "boxes" in columns
        # (store URI, relative path) of a copy every node reads where the manifest's own path is not on its
        # disk: `data_prep.ranged` publishes one beside a bucket dataset for `--ray` (nodes with own disks).
        self.copy: tuple[str, str] | None = None
        if ("boxes" in columns) != ("box_labels" in columns):
            raise DatasetError(
                f"{path}: detection needs both a 'boxes' column ([[x, y, w, h], ...] per image) and a "
                f"'box_labels' column (a class per box); found only '{'boxes' if 'boxes' in columns else 'box_labels'}'"
            )
        if self.has_boxes:
            self.read_cols += ["boxes", "box_labels"]
            self._box_space = LabelSpace.infer((), box_classes) if box_classes is not None else None
        elif box_classes is not None:
            raise DatasetError(f"{path}: --box-classes given, but the manifest has no 'boxes' column")

    def _parquet_file(self) -> pq.ParquetFile:
        if self.copy is not None and not self.path.is_file():
            return pq.ParquetFile(self._open())
        return pq.ParquetFile(self.path)

    def _open(self):
        """The manifest as a seekable binary file; on a node that does not see its path, the copy in object
        storage (range reads: a Parquet footer and the row groups asked for, or a CSV span)."""
        if self.copy is not None and not self.path.is_file():
            return Store(self.copy[0]).open_file(self.copy[1])
        return open(self.path, "rb")

    def share_through(self, store: Store, rel: str) -> None:
        """For range tasks on nodes that see only their own disk and `store`: one streamed upload of the
        manifest (no row is parsed here), read from there where the path is missing."""
        store.upload(self.path, rel)
        self.copy = (store.uri, rel)

    @property
    def space(self) -> LabelSpace:
        if self._space is None:
            self._space = LabelSpace.infer(self._label_values(), None)
        return self._space

    @property
    def box_space(self) -> LabelSpace:
        if self._box_space is None:
            self._box_space = LabelSpace.infer(self._box_label_values(), None)
        return self._box_space

    @property
    def classes(self) -> list[str]:
        return self.space.classes

    @property
    def detection_classes(self) -> list[str] | None:
        return self.box_space.classes if self.has_boxes else None

    def labels_known(self) -> bool:
        """Whether every label space is fixed or already inferred (no tally needed)."""
        return self._space is not None and (not self.has_boxes or self._box_space is not None)

    def set_label_spaces(self, labels: LabelTally, boxes: LabelTally | None) -> None:
        """The spaces inferred from tallies of the whole manifest (`tally_rows`, merged); fixed ones stay."""
        if self._space is None:
            self._space = labels.space()
        if self.has_boxes and self._box_space is None:
            self._box_space = boxes.space()

    # Ranges (data_prep/ranged.py): runs of whole row groups of a Parquet manifest, rows known from its
    # footer; byte spans of a CSV one, cut at line starts, rows counted by the survey tasks.

    def identity(self) -> dict:
        """What changes when the manifest file does: part of a ranged plan's fingerprint."""
        st = self.path.stat()
        return {"path": str(self.path), "size": st.st_size, "mtime_ns": st.st_mtime_ns}

    def range_specs(self, rows_per_range: int) -> list[tuple[tuple, int | None]]:
        """(spec, rows or None where unknown before a survey) of ranges of about `rows_per_range` rows:
        ("groups", first, end) row groups, from the footer alone, or ("bytes", start, end) of a CSV."""
        if not self.parquet:
            return [(("bytes", a, b), None) for a, b in self.csv.spans(rows_per_range * CSV_ROW_BYTES)]
        meta = self._parquet_file().metadata
        out, start, rows = [], 0, 0
        for g in range(meta.num_row_groups):
            rows += meta.row_group(g).num_rows
            if rows >= rows_per_range or g == meta.num_row_groups - 1:
                out.append((("groups", start, g + 1), rows))
                start, rows = g + 1, 0
        return [r for r in out if r[1]]

    def survey(self, spec: tuple, tally: bool) -> Survey:
        """A range's rows and, with `tally`, its label (and box label) tallies."""
        labels, boxes = LabelTally(), LabelTally() if self.has_boxes and tally else None
        if not tally:
            columns = ["path"]
        else:
            columns = [self.label_col] + (["box_labels"] if boxes is not None else [])
        rows = 0
        for batch in self._batches(columns, spec):
            rows += len(batch.get(MALFORMED) or batch[columns[0]])  # a malformed line is a row too
            if tally:
                labels.add(self._label_cell_values(_cells(batch, self.label_col)))
            if boxes is not None:
                boxes.add(_list_values(_cells(batch, "box_labels")))
        return Survey(rows, labels if tally else None, boxes)

    def regroup(self, surveyed: list[tuple[tuple, Survey]], rows_per_range: int) -> list[tuple[tuple, int]]:
        return [(spec, s.rows) for spec, s in surveyed]

    def list_rows(self, spec: tuple, first_row: int, labels=None) -> Iterator[Item | ListingError]:
        """The listing of one range, whose first row is `first_row` (0-based); its labels are its own."""
        row = first_row
        for batch in self._batches(self.read_cols, spec):
            row = yield from self._rows(row, batch)

    def _columns(self) -> list[str]:
        try:
            if self.parquet:
                return list(pq.ParquetFile(self.path).schema_arrow.names)
            self.csv = CsvTable(self.path, self._open)
            return self.csv.names
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{self.path}: not a readable Parquet or CSV manifest ({exc})") from None

    def _batches(self, columns: list[str], spec: tuple | None = None) -> Iterator[dict[str, list]]:
        """Batches of `columns`: the whole manifest, or one range's ("groups", a, b) / ("bytes", a, b)."""
        try:
            if self.parquet:
                with self._parquet_file() as pf:
                    yield from (
                        b.to_pydict()
                        for b in pf.iter_batches(
                            batch_size=BATCH_ROWS,
                            columns=columns,
                            row_groups=None if spec is None else range(spec[1], spec[2]),
                        )
                    )
                return
            yield from self.csv.batches(columns, None if spec is None else (spec[1], spec[2]))
        except pa.ArrowInvalid as exc:
            at = "" if spec is None or self.parquet else f", in bytes {spec[1]}-{spec[2]}"
            raise DatasetError(f"{self.path}: cannot read the manifest ({exc}{at})") from None

    def _label_values(self) -> Iterator:
        for batch in self._batches([self.label_col]):
            yield from self._label_cell_values(_cells(batch, self.label_col))

    def _label_cell_values(self, cells: list) -> Iterator:
        return _list_values(cells) if self.multi_label else iter(cells)

    def _box_label_values(self) -> Iterator:
        for batch in self._batches(["box_labels"]):
            yield from _list_values(_cells(batch, "box_labels"))

    def _boxes(self, r: dict) -> tuple:
        """A row's boxes as ((class, (x, y, w, h)), ...); raises ValueError naming what is wrong."""
        raw, names = r["boxes"], parse_label_list(r["box_labels"])
        if isinstance(raw, str):
            text = raw.strip()
            try:
                raw = json.loads(text) if text else []
            except json.JSONDecodeError:
                raise ValueError(
                    f"malformed boxes ({text[:80]!r} is not a JSON list of [x, y, w, h])"
                ) from None
        raw = [] if raw is None else raw
        if not isinstance(raw, list):
            raise ValueError(f"malformed boxes ({raw!r} is not a list of [x, y, w, h])")
        if len(raw) != len(names):
            raise ValueError(f"box_labels do not match boxes ({len(raw)} boxes, {len(names)} box_labels)")
        out = []
        for i, (box, name) in enumerate(zip(raw, names)):
            x, y, w, h = check_box(list(box) if isinstance(box, tuple) else box, None, f"box {i}")
            try:
                cls = self.box_space.resolve(name)
            except UnknownLabel as exc:
                known = ", ".join(self.detection_classes[:8]) + (
                    ", ..." if len(self.detection_classes) > 8 else ""
                )
                raise ValueError(f"unknown box label (box {i}: {exc}; box classes: {known})") from None
            out.append((cls, (x, y, w, h)))
        return tuple(out)

    def describe(self) -> dict:
        return {"kind": self.kind, "multi_label": self.multi_label}

    def count_hint(self) -> int | None:
        return pq.ParquetFile(self.path).metadata.num_rows if self.parquet else None

    def loader(self) -> FileLoader:
        return FileLoader()

    def listing(self) -> Iterator[Item | ListingError]:
        row = 0
        for batch in self._batches(self.read_cols):
            row = yield from self._rows(row, batch)

    def _rows(self, row: int, batch: dict[str, list]) -> Generator[Item | ListingError, None, int]:
        """The listing of `batch`, whose rows follow row `row`; returns the last row's number."""
        bad = batch.get(MALFORMED)
        for i in range(len(bad) if bad is not None else len(batch["path"])):
            row += 1
            if bad is not None and bad[i] is not None:
                yield ListingError("", f"{self.path.name} row {row}", bad[i])
            else:
                yield self._row(row, {c: batch[c][i] for c in self.read_cols})
        return row

    def _row(self, row: int, r: dict) -> Item | ListingError:
        raw_path = r["path"]
        where = f"{self.path.name} row {row}"
        if not raw_path or not str(raw_path).strip():
            return ListingError("", where, "no path")
        written = str(raw_path).strip()
        if is_uri(written):
            return self._uri_row(written, r, where)
        path = Path(written)
        if not path.is_absolute():
            path = self.base / path
        elif path.is_relative_to(self.base):  # the same file gets the same key however it is written
            written = path.relative_to(self.base).as_posix()
        key = sanitize_key(str(r["key"])) if r.get("key") else key_from_path(written.lstrip("/"))
        if not key:
            return ListingError("", str(path), f"{where}: no usable key")
        try:
            labels, split = self._labels_and_split(r)
            boxes = self._boxes(r) if self.has_boxes else None
        except (UnknownLabel, ValueError) as exc:
            return ListingError(key, str(path), str(exc))
        item = file_item(path, key, labels, split)
        return item if boxes is None or isinstance(item, ListingError) else replace(item, boxes=boxes)

    def _labels_and_split(self, r: dict) -> tuple[tuple[int, ...], str | None]:
        raw = r[self.label_col]
        labels = (
            self.space.resolve_all(parse_label_list(raw)) if self.multi_label else (self.space.resolve(raw),)
        )
        split = r.get("split")
        return labels, check_split_name(str(split).strip()) if split and str(split).strip() else None

    def _uri_row(self, uri: str, r: dict, where: str) -> Item | ListingError:
        bucket_and_path = uri.partition("://")[2].split("?", 1)[0]
        key = sanitize_key(str(r["key"])) if r.get("key") else key_from_path(bucket_and_path)
        if not key:
            return ListingError("", uri, f"{where}: no usable key")
        try:
            labels, split = self._labels_and_split(r)
            size = int(r["bytes"]) if r.get("bytes") else None
            boxes = self._boxes(r) if self.has_boxes else None
        except (UnknownLabel, ValueError) as exc:
            return ListingError(key, uri, str(exc))
        return replace(uri_item(uri, key, labels, split, size), boxes=boxes)
