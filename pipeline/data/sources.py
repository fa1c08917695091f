"""Where a dataset's shards are and how many samples each holds: `DatasetInfo` from a folder or URLs.

    info = dataset_info("data/smoke", "train")          # a folder written by `vitpipe shard`
    info = dataset_info("s3://corpus/jft", "train")     # the same, on object storage
    info = dataset_info("/data/jft/shard-{000000..099999}.tar", num_classes=18291, multi_label=True)

Inputs: a dataset folder or object store prefix (exact per-shard counts from its manifest; a URI's
query, such as an S3 endpoint, rides along on every shard URL), or shard URLs: a brace pattern
(`/data/shard-{000000..000099}.tar`), a list, or anything webdataset opens (`pipe:aws s3 cp
s3://b/shard-000001.tar -`, `https://...`). Local URLs inside a dataset folder still get the
manifest's counts; other URLs need `num_classes=` and `multi_label=`.
"""

from __future__ import annotations

import os
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from webdataset.shardlists import expand_urls as wds_expand_urls

from data_prep.dataset_dir import DatasetDir, names_shards
from data_prep.layout import DatasetError, read_manifest

Source = str | os.PathLike | Sequence[str]


@dataclass
class DatasetInfo:
    urls: list[str]
    num_classes: int
    multi_label: bool
    num_samples: int | None  # exact, from the manifest; None for URLs without one
    shard_counts: list[int] | None = None  # per URL, from the manifest
    segmentation_classes: list[str] | None = None  # per-pixel mask classes (KEY.seg.png), from the manifest
    detection_classes: list[str] | None = None  # object classes of KEY.boxes.json, from the manifest

    def mask_classes(self) -> int:
        """Classes of the per-pixel masks (KEY.seg.png) a segmentation stage reads; an error naming the
        dataset when its manifest lists none."""
        if self.segmentation_classes is None:
            raise DatasetError(
                f"{self.urls[0]}...: per-pixel masks were asked for, and the manifest lists no "
                "segmentation_classes (write a dataset with masks, e.g. vitpipe shard synthetic --layout)"
            )
        return len(self.segmentation_classes)

    def box_classes(self) -> int:
        """Classes of the objects' boxes (KEY.boxes.json) a detection stage reads; an error naming the
        dataset when its manifest lists none."""
        if self.detection_classes is None:
            raise DatasetError(
                f"{self.urls[0]}...: boxes were asked for, and the manifest lists no detection_classes (write a "
                "dataset with boxes: vitpipe shard synthetic --layout, or vitpipe shard manifest with a boxes column)"
            )
        return len(self.detection_classes)

    def epoch_batches(self, world_size: int, batch_size: int, num_workers: int = 1) -> int | None:
        return epoch_batches(self, world_size, batch_size, num_workers)

    def packed(self) -> dict:
        """The info as a few compact values, to hand from the one process that read the manifest to the
        others (`unpacked`): the URLs as a numbered template where they follow one (`shard-{i:06d}.tar`),
        else one compressed text; the counts as int32 bytes. About 400 kB at 100k shards, against the
        manifest's 21 MB."""
        return {
            **{k: v for k, v in vars(self).items() if k not in ("urls", "shard_counts")},
            "urls": _url_template(self.urls) or zlib.compress("\n".join(self.urls).encode(), 6),
            "shard_counts": None
            if self.shard_counts is None
            else np.asarray(self.shard_counts, dtype="<i4").tobytes(),
        }

    @classmethod
    def unpacked(cls, packed: dict) -> DatasetInfo:
        urls, counts = packed["urls"], packed["shard_counts"]
        if isinstance(urls, bytes):
            urls = zlib.decompress(urls).decode().split("\n")
        else:
            prefix, first, n, width, suffix = urls
            urls = [f"{prefix}{i:0{width}d}{suffix}" for i in range(first, first + n)]
        return cls(
            **{
                **packed,
                "urls": urls,
                "shard_counts": None if counts is None else np.frombuffer(counts, "<i4").tolist(),
            }
        )


def _url_template(urls: list[str]) -> tuple[str, int, int, int, str] | None:
    """(prefix, first, n, width, suffix) when urls[k] == f"{prefix}{first + k:0{width}d}{suffix}" for every k."""
    if len(urls) < 2:
        return None
    a, b = urls[0], urls[-1]
    head = len(os.path.commonprefix([a, b]))
    tail = len(os.path.commonprefix([a[::-1], b[::-1]]))
    while head and a[head - 1].isdigit():  # the number's leading digits may be common to both
        head -= 1
    while tail and a[len(a) - tail].isdigit():
        tail -= 1
    digits = a[head : len(a) - tail]
    if not digits.isdigit() or len(a) != len(b):
        return None
    template = (a[:head], int(digits), len(urls), len(digits), a[len(a) - tail :])
    prefix, first, _, width, suffix = template
    if any(u != f"{prefix}{first + k:0{width}d}{suffix}" for k, u in enumerate(urls)):
        return None
    return template


def epoch_batches(info: DatasetInfo, world_size: int, batch_size: int, num_workers: int = 1) -> int | None:
    """Batches every rank yields per epoch in epoch mode: a bound that holds for every epoch's deal.

    Each epoch deals the shards over world_size x workers slots in a new order, so a slot gets at
    least floor(shards / slots) shards, at worst the smallest ones. Every worker yields that many
    samples // batch_size batches per epoch; a rank yields its workers' sum. None without counts.
    """
    if info.shard_counts is None:
        return None
    workers = max(1, num_workers)
    per_slot = len(info.shard_counts) // (world_size * workers)
    return workers * (sum(sorted(info.shard_counts)[:per_slot]) // batch_size)


def is_url_source(source: Source) -> bool:
    """True for shard URLs (a list, a brace pattern, a .tar path or URL); False for a dataset root (a
    folder, or an object store prefix such as s3://bucket/prefix)."""
    if not isinstance(source, (str, os.PathLike)):
        return True  # a list of URLs
    return names_shards(source)


def expand_urls(source: str | Sequence[str]) -> list[str]:
    """Brace patterns (`shard-{000000..000099}.tar`) and '::'-joined lists -> one URL per shard."""
    specs = [source] if isinstance(source, (str, os.PathLike)) else list(source)
    return [url for spec in specs for url in wds_expand_urls(os.fspath(spec))]


def _local_manifest(urls: list[str]) -> tuple[list[str], bool, list[int]] | None:
    """Classes, multi_label and per-URL counts when every URL is a shard of one local dataset folder."""
    if any("://" in u or u.startswith("pipe:") for u in urls):
        return None
    paths = [Path(u.removeprefix("file:")).resolve() for u in urls]
    root = paths[0].parent.parent  # ROOT/{split}/{name}-{i:06d}.tar
    try:
        manifest = read_manifest(root)
    except DatasetError:
        return None
    by_path = {(root / s.path).resolve(): s.count for s in manifest.shards}
    counts = [by_path.get(p) for p in paths]
    if None in counts:
        return None
    return manifest.classes, manifest.multi_label, counts


def _check_given(name: str, given, found, where: str) -> None:
    if given is not None and given != found:
        raise DatasetError(f"{where}: {name}={given!r} was given, but the manifest says {found!r}")


def dataset_info(
    source: Source, split: str = "train", *, num_classes: int | None = None, multi_label: bool | None = None
) -> DatasetInfo:
    """Shard URLs and, where a manifest exists, exact counts: from a dataset folder or from URLs."""
    if not is_url_source(source):
        manifest = read_manifest(source)  # a storage or URI problem: a DatasetError naming it
        root = DatasetDir(source)
        shards = manifest.split_shards(split)
        if not shards:
            raise DatasetError(f"{root.describe()}: the manifest lists no shards for split {split!r}")
        _check_given("num_classes", num_classes, len(manifest.classes), root.describe())
        _check_given("multi_label", multi_label, manifest.multi_label, root.describe())
        return DatasetInfo(
            urls=[root.url(s.path) for s in shards],
            num_classes=len(manifest.classes),
            multi_label=manifest.multi_label,
            num_samples=sum(s.count for s in shards),
            shard_counts=[s.count for s in shards],
            segmentation_classes=manifest.segmentation_classes,
            detection_classes=manifest.detection_classes,
        )
    urls = expand_urls(source)
    if not urls:
        raise DatasetError(f"{source!r}: expands to no shard URLs")
    found = _local_manifest(urls)
    if found is not None:
        classes, found_multi, counts = found
        _check_given("num_classes", num_classes, len(classes), urls[0])
        _check_given("multi_label", multi_label, found_multi, urls[0])
        return DatasetInfo(urls, len(classes), found_multi, sum(counts), counts)
    if num_classes is None or multi_label is None:
        raise DatasetError(
            f"{urls[0]} (and {len(urls) - 1} more URLs): no manifest.json beside these shards, so pass "
            f"num_classes= and multi_label= (got num_classes={num_classes}, multi_label={multi_label})"
        )
    return DatasetInfo(urls, num_classes, multi_label, None, None)
