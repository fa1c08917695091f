"""An image folder: `DIR/CLASS/**/IMAGE` (one sub-folder per class), or a flat `DIR/**/IMAGE` whose labels
come from a CSV or JSON file mapping each file name (relative to DIR) to a label or a list of labels.
DIR may be a bucket prefix (s3://bucket/prefix, gs://...) in the class layout: its objects are read by the
shard workers.

A class folder is planned by range tasks (data_prep/ranged.py): survey tasks count the files of
SURVEY_FOLDERS class folders each, the driver groups consecutive class folders into ranges of about a
range's rows (O(folders) numbers), and each range task lists its folders. A flat folder with a labels file
is listed on the driver (the labels file is read whole there): at scale, write it as a manifest.

vitpipe shard folder ~/imagenet/train data/in1k --val-fraction 0.02
vitpipe shard folder s3://corpus/train s3://corpus/shards --ray
vitpipe shard folder ~/photos data/photos --labels ~/photos/labels.csv
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

from data_prep.keys import key_from_path
from data_prep.layout import DatasetError
from data_prep.sources import Item, ListingError, Survey
from data_prep.sources.files import FileLoader, LocalTree, StoreTree, file_item, walk_files
from data_prep.sources.labels import LabelSpace, UnknownLabel, parse_label_list
from data_prep.storage import is_uri

FILE_COLUMNS = ("file", "path", "filename", "name", "image")
SURVEY_FOLDERS = 256  # class folders counted by one survey task


def read_labels_file(path: Path) -> tuple[dict[str, object], bool]:
    """{relative file name: raw label or list}, and whether labels are lists (multi-label)."""
    if not path.is_file():
        raise DatasetError(f"{path}: no such labels file")
    if path.suffix.lower() == ".json":
        try:
            data = json.loads(path.read_text())
        except json.JSONDecodeError as exc:
            raise DatasetError(f"{path}: not valid JSON ({exc})") from None
        if isinstance(data, list):  # [{"file": ..., "label(s)": ...}, ...]
            rows = data
        elif isinstance(data, dict):
            mapping = {str(k).replace("\\", "/"): v for k, v in data.items()}
            return mapping, any(isinstance(v, list) for v in mapping.values())
        else:
            raise DatasetError(f"{path}: expected an object {{file name: label(s)}} or a list of rows")
    else:
        with open(path, newline="") as f:
            rows = list(csv.DictReader(f))
    columns = set().union(*(r.keys() for r in rows)) if rows else set()
    file_col = next((c for c in FILE_COLUMNS if c in columns), None)
    label_col = "labels" if "labels" in columns else "label" if "label" in columns else None
    if file_col is None or label_col is None:
        raise DatasetError(
            f"{path}: expected a file-name column ({', '.join(FILE_COLUMNS)}) and a 'label' or 'labels' "
            f"column; found: {', '.join(sorted(columns)) or 'no rows'}"
        )
    multi = label_col == "labels"
    mapping = {}
    for r in rows:
        name = str(r[file_col]).replace("\\", "/")
        mapping[name] = parse_label_list(r[label_col]) if multi else r[label_col]
    return mapping, multi


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
            folders = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
        # The class layout is listed in ranges (one task per run of class folders); a labels file is read
        # whole, here, so that layout is listed here too.
        self.ranged = self.labels_file is None
        if self.labels_file is not None:
            self._mapping, self.multi_label = read_labels_file(self.labels_file)
            values = (v for raw in self._mapping.values() for v in (raw if self.multi_label else [raw]))
            self._space = LabelSpace.infer(values, classes)
        else:
            self._mapping, self.multi_label = {}, False
            if not folders:
                raise DatasetError(
                    f"{root}: no class sub-folders (DIR/CLASS/IMAGE); for a flat folder give --labels FILE"
                )
            self._space = LabelSpace(
                list(classes) if classes is not None else folders, by_index=False, fixed=True
            )
        self.classes = self._space.classes

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
        skip = {self.labels_file}
        seen: set[str] = set()
        for rel in walk_files(self.root, skip):
            name = rel.as_posix()
            key = key_from_path(name)
            path = self.root / rel
            seen.add(name)
            try:
                labels = self._labels_of(name)
            except UnknownLabel as exc:
                yield ListingError(key, str(path), str(exc))
                continue
            yield file_item(path, key, labels)
        # Names the labels file promises but the folder lacks: count them, the user asked for them.
        for name in sorted(self._mapping.keys() - seen):
            yield ListingError(
                key_from_path(name), str(self.root / name), f"listed in {self.labels_file} but no such file"
            )

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

    def _labels_of(self, name: str) -> tuple[int, ...]:
        if name not in self._mapping:
            raise UnknownLabel(f"no label in {self.labels_file}")
        raw = self._mapping[name]
        if self.multi_label:
            return self._space.resolve_all(raw if isinstance(raw, list) else [raw])
        return (self._space.resolve(raw),)

    # Ranges (data_prep/ranged.py), for the class layout: runs of top-level entries in listing order.

    def identity(self) -> dict:
        return {"folder": self.where}

    def labels_known(self) -> bool:
        return True

    def set_label_spaces(self, labels, boxes) -> None:
        pass

    def range_specs(self, rows_per_range: int) -> list[tuple[tuple, int | None]]:
        """Survey ranges of SURVEY_FOLDERS top-level entries each (their files are not counted yet)."""
        names = self.tree.entries()
        return [
            (("folders", *names[i : i + SURVEY_FOLDERS]), None) for i in range(0, len(names), SURVEY_FOLDERS)
        ]

    def survey(self, spec: tuple, tally: bool) -> Survey:
        counts = tuple(sum(1 for _ in self.tree.walk(name)) for name in spec[1:])
        return Survey(sum(counts), units=counts)

    def regroup(self, surveyed: list[tuple[tuple, Survey]], rows_per_range: int) -> list[tuple[tuple, int]]:
        """Consecutive non-empty entries grouped into ranges of at least `rows_per_range` files (one folder
        larger than that is a range of its own)."""
        out, names, rows = [], [], 0
        for spec, found in surveyed:
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
        return out

    def list_rows(self, spec: tuple, first_row: int) -> Iterator[Item | ListingError]:
        for name in spec[1:]:
            yield from self._list_folder(name)
