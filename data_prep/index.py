"""index.parquet: its Arrow schema and its one writer (pyarrow, so shard workers never import this).

The columns and their order are the layout's (`layout.INDEX_COLUMNS`); this adds their types.
"""

from __future__ import annotations

from collections.abc import Iterable

import pyarrow as pa
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


def write_index(out: DatasetDir, shard_rows: Iterable[dict[str, list]], multi_label: bool) -> None:
    """index.parquet from each shard's rows ({column: values}, layout.INDEX_COLUMNS), in shard order;
    atomic, so a reader never sees half of it."""
    schema = index_schema(multi_label)
    with out.writing(INDEX) as tmp, pq.ParquetWriter(tmp, schema) as writer:
        for rows in shard_rows:
            if not multi_label:
                rows = {**rows, "label": [labels[0] for labels in rows["labels"]]}
            writer.write_table(pa.table({f.name: rows[f.name] for f in schema}, schema=schema))
