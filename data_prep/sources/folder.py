"""An image folder: `DIR/CLASS/**/IMAGE` (one sub-folder per class), or a flat `DIR/**/IMAGE` whose labels
come from a CSV or JSON file mapping each file name (relative to DIR) to a label or a list of labels.

vitpipe shard folder ~/imagenet/train data/in1k --val-fraction 0.02
vitpipe shard folder ~/photos data/photos --labels ~/photos/labels.csv
"""

from __future__ import annotations

import csv
import json
from collections.abc import Iterator
from pathlib import Path

from data_prep.keys import key_from_path
from data_prep.layout import DatasetError
from data_prep.sources import Item, ListingError
from data_prep.sources.files import FileLoader, file_item, walk_files
from data_prep.sources.labels import LabelSpace, UnknownLabel, parse_label_list

FILE_COLUMNS = ("file", "path", "filename", "name", "image")


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

    def __init__(
        self,
        root: str | Path,
        labels_file: str | Path | None = None,
        classes: list[str] | None = None,
        seed: int = 0,
    ):
        self.root = Path(root).resolve()
        if not self.root.is_dir():
            raise DatasetError(f"{root}: no such folder")
        self.where = str(root)
        self.split_salt = seed
        self.labels_file = Path(labels_file).resolve() if labels_file else None
        if self.labels_file is not None:
            self._mapping, self.multi_label = read_labels_file(self.labels_file)
            values = (v for raw in self._mapping.values() for v in (raw if self.multi_label else [raw]))
            self._space = LabelSpace.infer(values, classes)
        else:
            self._mapping, self.multi_label = {}, False
            folders = sorted(p.name for p in self.root.iterdir() if p.is_dir() and not p.name.startswith("."))
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
        skip = {self.labels_file} if self.labels_file else set()
        seen: set[str] = set()
        for rel in walk_files(self.root, skip):
            name = rel.as_posix()
            key = key_from_path(name)
            path = self.root / rel
            if self.labels_file is not None:
                seen.add(name)
            try:
                labels = self._labels_of(name, rel)
            except UnknownLabel as exc:
                yield ListingError(key, str(path), str(exc))
                continue
            yield file_item(path, key, labels)
        # Names the labels file promises but the folder lacks: count them, the user asked for them.
        for name in sorted(self._mapping.keys() - seen):
            yield ListingError(
                key_from_path(name), str(self.root / name), f"listed in {self.labels_file} but no such file"
            )

    def _labels_of(self, name: str, rel: Path) -> tuple[int, ...]:
        if self.labels_file is None:
            if len(rel.parts) < 2:
                raise UnknownLabel("not inside a class folder")
            return (self._space.resolve(rel.parts[0]),)
        if name not in self._mapping:
            raise UnknownLabel(f"no label in {self.labels_file}")
        raw = self._mapping[name]
        if self.multi_label:
            return self._space.resolve_all(raw if isinstance(raw, list) else [raw])
        return (self._space.resolve(raw),)
