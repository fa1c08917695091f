"""A manifest table: Parquet or CSV (TSV) with a `path` column and `label` (single-label) or `labels`
(a list, a JSON list string or names joined by '|': multi-label), optionally `split`, `key` and `bytes`.
Relative paths resolve against the manifest's own folder; a path may be a URI (s3://bucket/img.jpg,
gs://..., credentials from the environment), read by the shard workers, several at a time each. Read
in record batches: memory stays flat.

vitpipe shard manifest ~/data/train.parquet data/mydata --max-size 1G
vitpipe shard manifest photos.parquet s3://corpus/photos --workers 32   # s3:// images in, shards to a bucket
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pyarrow as pa
import pyarrow.csv as pacsv
import pyarrow.parquet as pq

from data_prep.keys import check_split_name, key_from_path, sanitize_key
from data_prep.layout import DatasetError
from data_prep.sources import Item, ListingError
from data_prep.sources.files import FileLoader, file_item, uri_item
from data_prep.sources.labels import LabelSpace, UnknownLabel, parse_label_list
from data_prep.storage import is_uri

BATCH_ROWS = 8192


def _is_parquet(path: Path) -> bool:
    with open(path, "rb") as f:
        return f.read(4) == b"PAR1"


class ManifestSource:
    kind = "manifest"
    mix = True

    def __init__(self, path: str | Path, classes: list[str] | None = None, seed: int = 0):
        self.path = Path(path).resolve()
        if not self.path.is_file():
            raise DatasetError(f"{path}: no such manifest file")
        self.where = str(path)
        self.base = self.path.parent
        self.split_salt = seed
        self.parquet = _is_parquet(self.path)
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
        self._space = LabelSpace.infer(self._label_values(), classes)
        self.classes = self._space.classes

    def _columns(self) -> list[str]:
        try:
            if self.parquet:
                return list(pq.ParquetFile(self.path).schema_arrow.names)
            return list(self._csv_reader(None).schema.names)
        except (pa.ArrowInvalid, OSError) as exc:
            raise DatasetError(f"{self.path}: not a readable Parquet or CSV manifest ({exc})") from None

    def _csv_reader(self, columns: list[str] | None):
        delimiter = "\t" if self.path.suffix.lower() == ".tsv" else ","
        convert = pacsv.ConvertOptions(
            include_columns=columns,
            # Everything as text: the label column's type must not depend on the first block's values.
            column_types={c: pa.string() for c in (columns or [])},
        )
        return pacsv.open_csv(
            self.path,
            read_options=pacsv.ReadOptions(block_size=1 << 22),
            parse_options=pacsv.ParseOptions(delimiter=delimiter),
            convert_options=convert,
        )

    def _batches(self, columns: list[str]) -> Iterator[dict[str, list]]:
        try:
            if self.parquet:
                batches = pq.ParquetFile(self.path).iter_batches(batch_size=BATCH_ROWS, columns=columns)
            else:
                batches = self._csv_reader(columns)
            for batch in batches:
                yield batch.to_pydict()
        except pa.ArrowInvalid as exc:
            raise DatasetError(f"{self.path}: cannot read the manifest ({exc})") from None

    def _label_values(self) -> Iterator:
        for batch in self._batches([self.label_col]):
            for raw in batch[self.label_col]:
                if self.multi_label:
                    try:
                        yield from parse_label_list(raw)
                    except UnknownLabel:
                        continue  # reported per row by the listing
                else:
                    yield raw

    def describe(self) -> dict:
        return {"kind": self.kind, "multi_label": self.multi_label}

    def count_hint(self) -> int | None:
        return pq.ParquetFile(self.path).metadata.num_rows if self.parquet else None

    def loader(self) -> FileLoader:
        return FileLoader()

    def listing(self) -> Iterator[Item | ListingError]:
        row = 0
        for batch in self._batches(self.read_cols):
            n = len(batch["path"])
            for i in range(n):
                row += 1
                yield self._row(row, {c: batch[c][i] for c in self.read_cols})

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
        except (UnknownLabel, ValueError) as exc:
            return ListingError(key, str(path), str(exc))
        return file_item(path, key, labels, split)

    def _labels_and_split(self, r: dict) -> tuple[tuple[int, ...], str | None]:
        raw = r[self.label_col]
        labels = (
            self._space.resolve_all(parse_label_list(raw))
            if self.multi_label
            else (self._space.resolve(raw),)
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
        except (UnknownLabel, ValueError) as exc:
            return ListingError(key, uri, str(exc))
        return uri_item(uri, key, labels, split, size)
