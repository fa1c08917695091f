"""Where samples come from: a source lists inputs (driver side) and makes a loader (worker side).

A source's `listing()` streams `Item`s (and `ListingError`s for inputs it can already reject: missing,
empty, unlabelled, unknown label) without reading any image. Its `loader()` is a small picklable object
that a shard worker, a process or a Ray task, uses to turn one item into stored image bytes.

folder.py    an image folder: one sub-folder per class, or flat with a labels file
table.py     a Parquet or CSV manifest of paths and labels
files.py     the loader both of them share (read the file, check, maybe resize)
synthetic.py the generated JFT-like multi-label corpus
digits.py    scikit-learn's bundled 8x8 digits, upsampled
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass
from typing import Protocol

from data_prep.images import Prepared


@dataclass(frozen=True, slots=True)
class Item:
    """One input planned into a shard: everything but its pixels."""

    key: str
    source: str  # what a person reads in errors.parquet / index.parquet: a path, "synthetic:17"
    labels: tuple[int, ...]  # () where the loader draws them with the pixels (synthetic)
    est_bytes: int  # the stored image's size where known (a file kept as is), else an estimate
    stamp: str = ""  # changes when the input does (size:mtime of a file): a re-run rewrites its shard
    split: str | None = None  # an explicit split (manifest column); None: by a hash of the key
    payload: bytes | None = None  # inline pixels of a tiny generated input (digits)
    # (class, (x, y, w, h)) per object, COCO-style in the input's upright pixels (a manifest's boxes column);
    # None: the input has no boxes (the sample gets none; a generator may draw its own)
    boxes: tuple[tuple[int, tuple[float, float, float, float]], ...] | None = None


@dataclass(frozen=True, slots=True)
class ListingError:
    key: str
    source: str
    reason: str


@dataclass(frozen=True, slots=True)
class Unlisted(ListingError):
    """A name a labels file lists with no such file: an error row that is not a file of the range listing
    it, so not numbered among its rows (a flat folder's range gives these after its files)."""


@dataclass(frozen=True)
class Survey:
    """What a survey task finds in one range of a ranged source (data_prep/ranged.py), before any listing."""

    rows: int  # inputs the range's listing will yield (items and error rows)
    labels: object = None  # LabelTally of its label values, where the label space is inferred
    boxes: object = None  # LabelTally of its box labels (a manifest with boxes)
    units: tuple[int, ...] = ()  # inputs per unit of the range (a folder source: per top-level folder)


class Loader(Protocol):
    def load(self, item: Item, resize_max: int | None, quality: int) -> Prepared:
        """Stored bytes of one item; raises `images.Rejected` (with its stage) for a bad input. Any
        other exception (but MemoryError) also rejects just this item, at stage "read"."""
        ...


class Source(Protocol):
    kind: str
    where: str  # what to name in a message: the folder, the manifest file, "synthetic"
    classes: list[str]
    multi_label: bool
    mix: bool  # True: shards hold items in a seeded hash order (classes mixed); False: listing order
    split_salt: int  # salt of the train/val hash (`keys.split_for`; 0: unsalted)

    def describe(self) -> dict:
        """Parameters that change stored bytes: part of every shard's fingerprint."""
        ...

    def count_hint(self) -> int | None: ...

    def listing(self) -> Iterator[Item | ListingError]: ...

    def loader(self) -> Loader: ...


class RangedSource(Source, Protocol):
    """A source whose listing splits into ranges listed by separate tasks (data_prep/ranged.py): a manifest
    (row groups, CSV byte spans), a class folder on a disk or in a bucket (its top-level folders)."""

    ranged: bool

    def identity(self) -> dict:
        """What changes when the input does, where it is cheap to know: part of the plan's fingerprint."""
        ...

    def range_specs(self, rows_per_range: int) -> list[tuple[tuple, int | None]]:
        """(spec, rows or None) of each range: small picklable tuples, O(ranges) of them."""
        ...

    def survey(self, spec: tuple, tally: bool) -> Survey: ...

    def regroup(self, surveyed: list[tuple[tuple, Survey]], rows_per_range: int) -> list[tuple[tuple, int]]:
        """The ranges to list, from the surveyed ones: (spec, rows)."""
        ...

    def list_rows(self, spec: tuple, first_row: int, labels=None) -> Iterator[Item | ListingError]:
        """The listing of one range, whose first row is `first_row` (0-based). `labels`: where the source
        has a labels file (`label_spans`), the (name, label) rows of it that fall in this range, in line
        order (`range_finder`)."""
        ...

    def labels_known(self) -> bool: ...

    def set_label_spaces(self, labels, boxes) -> None: ...
