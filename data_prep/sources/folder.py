"""An image folder: `DIR/CLASS/**/IMAGE` (one sub-folder per class), or a flat `DIR/**/IMAGE` whose labels
come from a CSV or JSON file mapping each file name (relative to DIR) to a label or a list of labels.
DIR may be a bucket prefix (s3://bucket/prefix, gs://...) in the class layout: its objects are read by the
shard workers.

Both layouts on disk, and the class layout in a bucket, are planned by range tasks (data_prep/ranged.py):
survey tasks count the files of SURVEY_FOLDERS top-level folders each, and the driver groups consecutive
top-level folders into ranges of about a range's rows (O(folders) numbers); each range task lists its
folders. A flat folder's CSV labels file is joined to the files by those ranges, never read on the driver:
survey tasks read byte spans of it (tallying the label values where --classes is not given), partition
tasks send each (name, label) row to the range of its top-level folder (`entry_of`), and each range task
looks its files up in its own rows. A name the file lists with no such file is an error row after the
range's files (`Unlisted`); a malformed labels line, one before any file. The ranges' order is the
listing's: "." (the files directly in DIR) first, then the folders in name order (`entry_order`).
A JSON labels file is one document: it is read whole, on the driver (at scale, write CSV).

vitpipe shard folder ~/imagenet/train data/in1k --val-fraction 0.02
vitpipe shard folder s3://corpus/train s3://corpus/shards --ray
vitpipe shard folder ~/photos data/photos --labels ~/photos/labels.csv
"""

from __future__ import annotations

import json
from bisect import bisect_right
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pyarrow as pa

from data_prep.keys import key_from_path
from data_prep.layout import DatasetError
from data_prep.sources import Item, ListingError, Survey, Unlisted
from data_prep.sources.files import FileLoader, LocalTree, StoreTree, file_item
from data_prep.sources.labels import LabelSpace, LabelTally, UnknownLabel, parse_label_list
from data_prep.sources.table import CSV_ROW_BYTES, MALFORMED, CsvTable, _cells, _list_values
from data_prep.storage import is_uri

FILE_COLUMNS = ("file", "path", "filename", "name", "image")
SURVEY_FOLDERS = 256  # top-level folders counted by one survey task


def entry_of(name: str) -> str:
    """The top-level entry a file name (relative to DIR) is listed under: its first folder, or "." for a
    file directly in DIR."""
    head, sep, _ = name.partition("/")
    return head if sep else "."


def entry_order(entry: str) -> tuple[bool, str]:
    """The listing's order of top-level entries (`LocalTree.entries`): ".", then the folders by name."""
    return (entry != ".", entry)


def _unlisted_order(name: str) -> tuple:
    return (entry_order(entry_of(name)), name)


@dataclass(frozen=True)
class EntryRanges:
    """Which range lists a file name: ranges are runs of top-level entries in `entry_order`, `starts` the
    first entry of each. A name under an entry no range holds (no such folder, or an empty one) goes to
    the range whose run it would fall in, so that its error row comes where the serial listing puts it."""

    starts: tuple[str, ...]

    def __call__(self, name: str) -> int:
        return max(0, bisect_right(self.starts, entry_order(entry_of(name)), key=entry_order) - 1)


def read_labels_json(path: Path) -> tuple[dict[str, object], bool, list]:
    """{relative file name: raw label or list}, whether labels are lists (multi-label), and every row's label
    values (a name listed twice: both rows'; the classes are every label the file names, as for a CSV)."""
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: not valid JSON ({exc})") from None
    if isinstance(data, dict):
        mapping = {str(k).replace("\\", "/"): v for k, v in data.items()}
        return mapping, any(isinstance(v, list) for v in mapping.values()), _values(mapping.values())
    if not isinstance(data, list):  # [{"file": ..., "label(s)": ...}, ...]
        raise DatasetError(f"{path}: expected an object {{file name: label(s)}} or a list of rows")
    file_col, label_col = _label_columns(path, set().union(*(r.keys() for r in data)) if data else set())
    multi = label_col == "labels"
    mapping, raws = {}, []
    for r in data:
        try:
            raw = parse_label_list(r.get(label_col)) if multi else r.get(label_col)
        except UnknownLabel as exc:
            raise DatasetError(f"{path}: {r.get(file_col)!r}: {exc}") from None
        mapping[str(r.get(file_col)).replace("\\", "/")] = raw
        raws.append(raw)
    return mapping, multi, _values(raws)


def _values(raws) -> list:
    return [v for raw in raws for v in (raw if isinstance(raw, list) else [raw])]


def _label_columns(path: Path, columns) -> tuple[str, str]:
    file_col = next((c for c in FILE_COLUMNS if c in columns), None)
    label_col = "labels" if "labels" in columns else "label" if "label" in columns else None
    if file_col is None or label_col is None:
        raise DatasetError(
            f"{path}: expected a file-name column ({', '.join(FILE_COLUMNS)}) and a 'label' or 'labels' "
            f"column; found: {', '.join(sorted(columns)) or 'no rows'}"
        )
    return file_col, label_col


class FolderSource:
    kind = "folder"
    mix = True
    has_boxes = False
    detection_classes = None

    def __init__(
        self,
        root: str | Path,
        labels_file: str | Path | None = None,
        classes: list[str] | None = None,
        seed: int = 0,
    ):
        self.where = str(root)
        self.split_salt = seed
        self.labels_file = Path(labels_file).resolve() if labels_file else None
        if is_uri(root):
            if self.labels_file is not None:
                raise DatasetError(
                    f"{root}: --labels goes with a folder on this machine; for a bucket, list the objects and "
                    "their labels in a manifest (vitpipe shard manifest FILE, with s3:// paths)"
                )
            self.root = None
            self.tree = StoreTree(str(root))
            try:
                folders = self.tree.folders()
            except OSError as exc:
                raise DatasetError(f"{root}: cannot list the folder ({exc})") from None
        else:
            self.root = Path(root).resolve()
            if not self.root.is_dir():
                raise DatasetError(f"{root}: no such folder")
            self.tree = LocalTree(self.root)
            # The class layout's classes (a stat per entry); a flat folder's DIR may hold millions of files.
            folders = (
                []
                if self.labels_file
                else sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
            )
        self._mapping: dict[str, object] | None = None  # a JSON labels file, read whole
        self._csv: CsvTable | None = None  # a CSV one, read in spans
        self._label_spans: list[tuple[tuple, int]] = []  # (("lines", a, b), rows before it): `regroup`
        self._skip: str | None = None  # the labels file's name in DIR, where it is there: not an input
        if self.labels_file is None:
            self.multi_label = False
            if not folders:
                raise DatasetError(
                    f"{root}: no class sub-folders (DIR/CLASS/IMAGE); for a flat folder give --labels FILE"
                )
            self._space = LabelSpace(
                list(classes) if classes is not None else folders, by_index=False, fixed=True
            )
            self.ranged = True
            return
        if not self.labels_file.is_file():
            raise DatasetError(f"{self.labels_file}: no such labels file")
        if self.labels_file.is_relative_to(self.root):
            self._skip = self.labels_file.relative_to(self.root).as_posix()
        if self.labels_file.suffix.lower() == ".json":
            self._mapping, self.multi_label, values = read_labels_json(self.labels_file)
            self._space = LabelSpace.infer(values, classes)
            self.ranged = False
            return
        try:
            self._csv = CsvTable(self.labels_file)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{self.labels_file}: not a readable CSV labels file ({exc})") from None
        self._file_col, self._label_col = _label_columns(self.labels_file, set(self._csv.names))
        self.multi_label = self._label_col == "labels"
        # Inferred from the labels on first use (a serial pass), unless `set_label_spaces` gave it first: a
        # ranged build tallies the file's spans in parallel.
        self._space = LabelSpace.infer((), classes) if classes is not None else None
        self.ranged = True

    @property
    def space(self) -> LabelSpace:
        if self._space is None:
            self._space = self._tally(None)[1].space()
        return self._space

    @property
    def classes(self) -> list[str]:
        return self.space.classes

    def describe(self) -> dict:
        return {"kind": self.kind, "multi_label": self.multi_label}

    def count_hint(self) -> int | None:
        return None

    def loader(self) -> FileLoader:
        return FileLoader()

    def listing(self) -> Iterator[Item | ListingError]:
        if self.labels_file is None:
            for name in self.tree.entries():
                yield from self._list_folder(name)
            return
        mapping = self._mapping
        if mapping is None:
            mapping = {}
            for row in self.label_rows(None, 0):
                if isinstance(row, ListingError):
                    yield row
                else:
                    mapping[row[0]] = row[1]
        yield from self._list_flat(self.tree.entries(), mapping)

    def _list_folder(self, name: str) -> Iterator[Item | ListingError]:
        """The class layout's listing of one top-level entry ("." : the files beside the class folders)."""
        for rel, entry in self.tree.walk(name):
            key = key_from_path(rel)
            if name == ".":
                yield ListingError(key, self.tree.describe(rel, entry), "not inside a class folder")
                continue
            try:
                labels = (self._space.resolve(name),)
            except UnknownLabel as exc:
                yield ListingError(key, self.tree.describe(rel, entry), str(exc))
                continue
            yield self.tree.item(rel, entry, key, labels)

    def _files(self, entry: str):
        """(name, entry) of the files of one top-level entry, but a flat folder's labels file."""
        return ((rel, path) for rel, path in self.tree.walk(entry) if rel != self._skip)

    def _list_flat(self, entries, mapping: dict[str, object]) -> Iterator[Item | ListingError]:
        """A flat folder's listing of `entries`, each file looked up in `mapping`; then, as `Unlisted` error
        rows, the names in `mapping` that are no file (in `_unlisted_order`)."""
        seen: set[str] = set()
        for entry in entries:
            for name, path in self._files(entry):
                seen.add(name)
                key = key_from_path(name)
                try:
                    labels = self._labels_of(name, mapping)
                except UnknownLabel as exc:
                    yield ListingError(key, str(path), str(exc))
                    continue
                yield file_item(path, key, labels)
        # Names the labels file promises but the folder lacks: count them, the user asked for them.
        for name in sorted(mapping.keys() - seen, key=_unlisted_order):
            yield Unlisted(
                key_from_path(name), str(self.root / name), f"listed in {self.labels_file} but no such file"
            )

    def _labels_of(self, name: str, mapping: dict[str, object]) -> tuple[int, ...]:
        if name not in mapping:
            raise UnknownLabel(f"no label in {self.labels_file}")
        raw = mapping[name]
        if not self.multi_label:
            return (self.space.resolve(raw),)
        if isinstance(raw, list):
            return self.space.resolve_all(raw)
        return self.space.resolve_all([raw] if self._csv is None else parse_label_list(raw))

    # A CSV labels file, read whole (spec None) or in byte spans (("lines", start, end)).

    def label_rows(self, spec: tuple | None, first_line: int) -> Iterator[tuple[str, str] | ListingError]:
        """(file name, raw label cell) of each line, or an error row for a line that is none (malformed, or
        with no file name); `first_line`: the lines before the span (0-based)."""
        line = first_line
        where = self._csv.path.name
        for batch in self._label_batches([self._file_col, self._label_col], spec):
            bad = batch.get(MALFORMED)
            n = len(bad) if bad is not None else len(batch[self._file_col])
            names, cells = batch.get(self._file_col) or [None] * n, batch.get(self._label_col) or [None] * n
            for i in range(n):
                line += 1
                if bad is not None and bad[i] is not None:
                    yield ListingError("", f"{where} row {line}", bad[i])
                    continue
                name = (names[i] or "").strip().replace("\\", "/")
                if not name:
                    yield ListingError("", f"{where} row {line}", "no file name")
                    continue
                yield name, cells[i]

    def _label_batches(self, columns: list[str], spec: tuple | None) -> Iterator[dict[str, list]]:
        try:
            yield from self._csv.batches(columns, None if spec is None else (spec[1], spec[2]))
        except pa.ArrowInvalid as exc:
            at = "" if spec is None else f", in bytes {spec[1]}-{spec[2]}"
            raise DatasetError(f"{self.labels_file}: cannot read the labels file ({exc}{at})") from None

    def _tally(self, spec: tuple | None) -> tuple[int, LabelTally]:
        """The lines of the file (or of a span) and a tally of every label value in them."""
        tally, rows = LabelTally(), 0
        for batch in self._label_batches([self._label_col], spec):
            rows += len(batch.get(MALFORMED) or batch[self._label_col])
            cells = _cells(batch, self._label_col)
            tally.add(_list_values(cells) if self.multi_label else cells)
        return rows, tally

    # Ranges (data_prep/ranged.py): runs of top-level entries in listing order; for a flat folder, the
    # labels file's byte spans too, surveyed and partitioned by range before the listing.

    def identity(self) -> dict:
        if self._csv is None:
            return {"folder": self.where}
        st = self.labels_file.stat()
        return {"folder": self.where, "labels": [str(self.labels_file), st.st_size, st.st_mtime_ns]}

    def labels_known(self) -> bool:
        return self._space is not None

    def set_label_spaces(self, labels, boxes) -> None:
        if self._space is None:
            self._space = labels.space()

    def range_specs(self, rows_per_range: int) -> list[tuple[tuple, int | None]]:
        """Survey ranges of SURVEY_FOLDERS top-level entries each (their files are not counted yet), and a
        labels file's spans (its lines not counted yet)."""
        names = self.tree.entries()
        specs = [
            (("folders", *names[i : i + SURVEY_FOLDERS]), None) for i in range(0, len(names), SURVEY_FOLDERS)
        ]
        if self._csv is not None:
            specs += [(("lines", a, b), None) for a, b in self._csv.spans(rows_per_range * CSV_ROW_BYTES)]
        return specs

    def survey(self, spec: tuple, tally: bool) -> Survey:
        if spec[0] == "lines":
            rows, found = self._tally(spec)
            return Survey(rows, found if tally else None)
        counts = tuple(sum(1 for _ in self._files(name)) for name in spec[1:])
        return Survey(sum(counts), LabelTally() if tally else None, units=counts)

    def regroup(self, surveyed: list[tuple[tuple, Survey]], rows_per_range: int) -> list[tuple[tuple, int]]:
        """Consecutive non-empty entries grouped into ranges of at least `rows_per_range` files (one folder
        larger than that is a range of its own); a labels file's spans numbered (`label_spans`). A flat
        folder without files is one empty range: its labels file's names are still error rows."""
        out, names, rows, lines = [], [], 0, 0
        self._label_spans = []
        for spec, found in surveyed:
            if spec[0] == "lines":
                self._label_spans.append((spec, lines))
                lines += found.rows
                continue
            for name, n in zip(spec[1:], found.units):
                if not n:
                    continue
                names.append(name)
                rows += n
                if rows >= rows_per_range:
                    out.append((("folders", *names), rows))
                    names, rows = [], 0
        if names:
            out.append((("folders", *names), rows))
        if self._csv is not None and not out:
            out.append((("folders", "."), 0))
        return out

    def label_spans(self) -> list[tuple[tuple, int]]:
        """(span, lines before it) of a CSV labels file, once surveyed; none for the class layout."""
        return self._label_spans

    def range_finder(self, specs: list[tuple]) -> EntryRanges:
        """Which of the ranges `specs` (in order) lists a file name: where a labels row goes."""
        return EntryRanges(tuple(spec[1] for spec in specs))

    def list_rows(self, spec: tuple, first_row: int, labels=None) -> Iterator[Item | ListingError]:
        if self.labels_file is None:
            for name in spec[1:]:
                yield from self._list_folder(name)
            return
        yield from self._list_flat(spec[1:], dict(labels or ()))
