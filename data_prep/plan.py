"""Planning: a source's listing in, shard tasks out, before any image is read.

Each task is one whole shard: its split, index, path, the (key, source, labels) of its items and a
fingerprint of all of it plus every option that changes the stored bytes. Tasks depend only on the
listing and the options, never on the worker count, so any worker (a process, a Ray task, a later
re-run) writes the same bytes, and a re-run can tell a shard it already wrote by its fingerprint.

Order inside a split: file sources (`mix`) are sorted by a seeded 64-bit hash of the key, so a shard
of an ImageNet-style class folder holds many classes rather than one; the sort is external (items
spooled to 256 hash-range buckets on disk, each sorted alone), so memory holds one bucket, not the
corpus, and duplicate keys end up adjacent, where they are found without a set of every key.
Generated sources keep their listing order.
"""

from __future__ import annotations

import hashlib
import json
import shutil
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field, replace
from pathlib import Path

from data_prep.keys import order_hash, split_for
from data_prep.layout import BOXES_EXT, shard_rel
from data_prep.sources import Item, ListingError, Source
from data_prep.tario import archive_bytes, member_bytes

BUCKET_BITS = 8  # 256 buckets: a bucket holds about 1/256 of the listing while it is sorted


@dataclass(frozen=True)
class ShardTask:
    split: str
    index: int
    path: str  # relative to the dataset root: "{split}/{name}-{index:06d}.tar"
    items: tuple[Item, ...]
    fingerprint: str
    planned_bytes: int  # the shard's size if every estimate holds (exact for files stored as is)


class ErrorLog:
    """Rejected inputs, appended to a JSON-lines file as they are found (memory: none per error)."""

    def __init__(self, path: Path):
        path.parent.mkdir(parents=True, exist_ok=True)
        self.path = path
        self._f = open(path, "w")
        self.count = 0

    def add(self, err: ListingError) -> None:
        self._f.write(json.dumps([err.key, err.source, err.reason]) + "\n")
        self.count += 1

    def close(self) -> None:
        self._f.close()

    @staticmethod
    def batches(path: Path, rows: int = 10_000) -> Iterator[list[tuple[str, str, str]]]:
        """The log's (key, source, reason) rows, `rows` at a time."""
        batch: list[tuple[str, str, str]] = []
        with open(path) as f:
            for line in f:
                batch.append(tuple(json.loads(line)))
                if len(batch) >= rows:
                    yield batch
                    batch = []
        if batch:
            yield batch


def _boxes_list(boxes) -> list:
    """An item's boxes as JSON lists: [[class, [x, y, w, h]], ...]."""
    return [[c, list(b)] for c, b in boxes]


class HashOrder:
    """External sort of a listing by `order_hash(seed, key)`; drops later duplicates of a key as errors."""

    def __init__(self, folder: Path, seed: int):
        self.folder = folder
        self.seed = seed
        shutil.rmtree(folder, ignore_errors=True)
        folder.mkdir(parents=True)

    def spool(self, items: Iterable[Item]) -> int:
        files: dict[int, object] = {}
        n = 0
        try:
            for pos, it in enumerate(items):
                h = order_hash(it.key, self.seed)
                b = h >> (64 - BUCKET_BITS)
                if b not in files:
                    files[b] = open(self.folder / f"{b:03d}.jsonl", "w")
                row = [h, it.key, pos, it.source, list(it.labels), it.est_bytes, it.stamp, it.split]
                if it.boxes is not None:
                    row.append(_boxes_list(it.boxes))
                files[b].write(json.dumps(row) + "\n")
                n += 1
        finally:
            for f in files.values():
                f.close()
        return n

    def __iter__(self) -> Iterator[Item | ListingError]:
        for path in sorted(self.folder.glob("*.jsonl")):
            with open(path) as f:
                rows = [json.loads(line) for line in f]
            rows.sort(
                key=lambda r: (r[0], r[1], r[2])
            )  # hash, then key: equal keys adjacent, first listed first
            previous: list | None = None
            for r in rows:
                if previous is not None and r[1] == previous[1]:
                    yield ListingError(r[1], r[3], f"duplicate key {r[1]!r} (kept {previous[3]})")
                    continue
                previous = r
                boxes = tuple((c, tuple(b)) for c, b in r[8]) if len(r) > 8 else None
                yield Item(r[1], r[3], tuple(r[4]), r[5], r[6], r[7], boxes=boxes)
            path.unlink()
        shutil.rmtree(self.folder, ignore_errors=True)


def sample_bytes(item: Item, multi_label: bool) -> int:
    """The tar bytes an item's members will take if its size estimate holds."""
    if multi_label:
        label = (f"{item.key}.json", len(json.dumps({"labels": list(item.labels)})))
    else:
        label = (f"{item.key}.cls", len(str(item.labels[0])))
    size = member_bytes(f"{item.key}.webp", item.est_bytes) + member_bytes(*label)
    if item.boxes is not None:  # KEY.boxes.json: about 40 bytes per box
        size += member_bytes(f"{item.key}.{BOXES_EXT}", 32 + 40 * len(item.boxes))
    return size


def shard_task(job_fingerprint: str, name: str, split: str, index: int, items: tuple[Item, ...]) -> ShardTask:
    """The task of shard `index` of `split` holding `items` in order, with its path and fingerprint
    (`planned_bytes` left 0: the caller knows the members' sizes)."""
    path = shard_rel(split, name, index)
    h = hashlib.sha256(f"{job_fingerprint}\0{path}".encode())
    for it in items:
        h.update(json.dumps([it.key, it.source, list(it.labels), it.stamp]).encode())
        if it.payload is not None:
            h.update(it.payload)
        if it.boxes is not None:  # changed boxes change the shard's KEY.boxes.json
            h.update(json.dumps(_boxes_list(it.boxes)).encode())
    return ShardTask(split, index, path, tuple(items), h.hexdigest(), 0)


def cut_shards(sizes: Iterable[int], max_count: int, max_size: int | None) -> Iterator[tuple[int, int]]:
    """(items, member bytes) of each shard cut from one split's items in order, given each item's
    `sample_bytes`: the rule `Planner.tasks` applies per split (a shard ends at `max_count` items, or
    before the item that would take it past `max_size`; it holds at least one item)."""
    count = members = 0
    for size in sizes:
        if count and max_size and archive_bytes(members + size) > max_size:
            yield count, members
            count = members = 0
        count += 1
        members += size
        if count >= max_count:
            yield count, members
            count = members = 0
    if count:
        yield count, members


@dataclass
class _OpenShard:
    split: str
    index: int
    items: list[Item] = field(default_factory=list)
    members: int = 0  # tar bytes of the members so far


@dataclass
class Planner:
    """Streams `ShardTask`s; `prepare()` first (it lists the source when the order needs all of it)."""

    scratch: Path  # local work files: the hash-order spool, the listing's error log
    source: Source
    job_fingerprint: str
    name: str = "shard"
    max_count: int = 1000
    max_size: int | None = None
    val_fraction: float = 0.0
    seed: int = 0
    num_inputs: int = 0
    total: int | None = None  # items to write, where known before writing (set by the build)
    errors: ErrorLog | None = None
    on_input: Callable[[], None] | None = None  # called per listed input (a progress counter)
    _ordered: Iterable[Item | ListingError] | None = None

    def prepare(self) -> int | None:
        """Open the error log and, for hash-ordered sources, list everything; returns the items to write."""
        self.errors = ErrorLog(self.scratch / "listing-errors.jsonl")
        if not self.source.mix:
            self._ordered = self._counted(self.source.listing())
            return self.source.count_hint()
        order = HashOrder(self.scratch / "order", self.seed)
        total = order.spool(self._counted(self.source.listing()))
        self._ordered = order
        return total

    def _counted(self, listing: Iterable[Item | ListingError]) -> Iterator[Item]:
        for entry in listing:
            self.num_inputs += 1
            if self.on_input is not None:
                self.on_input()
            if isinstance(entry, ListingError):
                self.errors.add(entry)
            else:
                yield entry

    def _close(self, shard: _OpenShard) -> ShardTask:
        task = shard_task(self.job_fingerprint, self.name, shard.split, shard.index, tuple(shard.items))
        return replace(task, planned_bytes=archive_bytes(shard.members))

    def tasks(self) -> Iterator[ShardTask]:
        if self._ordered is None:
            raise RuntimeError("Planner.prepare() first")
        open_shards: dict[str, _OpenShard] = {}
        next_index: dict[str, int] = {}
        for entry in self._ordered:
            if isinstance(entry, ListingError):  # a duplicate found by the hash order
                self.errors.add(entry)
                continue
            item = entry
            split = item.split or split_for(item.key, self.val_fraction, self.source.split_salt)
            size = sample_bytes(item, self.source.multi_label)
            cur = open_shards.get(split)
            if cur is not None and self.max_size and archive_bytes(cur.members + size) > self.max_size:
                yield self._close(open_shards.pop(split))
                cur = None
            if cur is None:
                cur = open_shards[split] = _OpenShard(split, next_index.get(split, 0))
                next_index[split] = cur.index + 1
            cur.items.append(item)
            cur.members += size
            if len(cur.items) >= self.max_count:
                yield self._close(open_shards.pop(split))
        for split in sorted(open_shards):
            yield self._close(open_shards[split])
        self.errors.close()
