"""Shards -> uint8 batches, split disjointly per rank and per loader worker.

    loader, info = make_train_loader("data/smoke", rank=0, world_size=1, batch_size=16, img_size=224,
                                     seed=0, num_workers=4, shuffle_buffer=256, min_scale=0.08)
    loader, info = make_train_loader("/data/jft/shard-{000000..099999}.tar", ..., resampled=True,
                                     num_classes=18291, multi_label=True)   # URLs: local, pipe:, http
    loader, info = make_eval_loader("data/smoke", "val", rank=0, world_size=2, batch_size=64, img_size=224)
    batch = next(iter(loader))
    # {"image": uint8 [B, 3, H, W], "target": long [B] | multi-hot float [B, K], "key": [B] str,
    #  "skipped": int (this worker's unreadable samples so far), eval only: "valid": bool [B]}

Inputs: a dataset folder written by `vitpipe shard` (exact per-shard counts from its manifest), or
shard URLs: a brace pattern (`/data/shard-{000000..000099}.tar`), a list, or anything webdataset
opens (`pipe:aws s3 cp s3://b/shard-000001.tar -`, `https://...`). Local URLs inside a dataset
folder still get the manifest's counts; other URLs need `num_classes=` and `multi_label=`.

Training streams are endless and step-driven. Two modes:
- epoch mode (default): epoch e deals every shard once over all (rank, worker) slots in an order
  drawn from (seed, e). With exact counts, every worker yields exactly `epoch_batches / workers`
  batches per epoch and drops the rest, so every rank yields `epoch_batches` per epoch (the
  guaranteed minimum over every epoch's deal, `epoch_batches()`), epochs line up with steps
  (epoch = batch // `loader.dataset.epoch_batches`) and `epochs=N` ends every rank after the
  same N x epoch_batches batches. Needs at least ranks x workers shards. Without counts (bare
  URLs) epochs flow into one another and `epoch_batches` is None.
- resampled mode (`resampled=True`, JFT scale): no epochs; each worker draws shards with
  replacement from an rng seeded by (seed, rank, worker), in rounds of shards/slots shards.
The in-worker shuffle of each epoch or round draws from (seed, epoch or round, rank, worker) and
each sample's augmentation from that plus its index, so the same seed gives the same batches.
Seeds are lists of integers tagged by purpose, never hashes (those differ between processes).

Resume guarantee: `start_batch=M` continues the rank's stream exactly where batch M-1 ended. The
DataLoader takes batches from its workers round-robin, so worker w made ceil((M - w) / W) of the
first M batches; a resumed DataLoader starts again at process 0, which plays worker M % W.
Epoch mode with counts: a worker's batches divide into epochs of known length, so it jumps to
epoch done // per_epoch without reading anything and skips (done % per_epoch) x batch_size
samples of that epoch. Resampled mode with counts: the rounds' shard draws and the
manifest's counts say how many samples each round holds, so whole rounds are skipped unread.
Without counts the worker reads (never decodes) done x batch_size samples. Skipping replays the
shuffle; the augmentation RNG is per sample. Samples that fail to decode are skipped, so after
corrupt data in the skipped part the position can be off by that many samples.

Evaluation (`make_eval_loader`): no shuffle, resize + centre crop, every sample exactly once over
all ranks, and every rank yields the same number of batches; the last ones are padded with a
repeated sample marked `valid=False` ([B] bool). Samples go to ranks by shard (rank r reads shards
r, r + world_size, ...) when there are at least as many shards as ranks, else by sample index
(i % world_size); `loader.dataset.by_shard` says which. Each loader worker takes a contiguous
block of the rank's batches (it opens only the shards that block needs), so a full pass holds the
same samples whatever num_workers is, but the first k batches do not.
Corrupt samples are skipped and counted in `skipped`; above `max_skip_fraction` of the samples a
worker has read (once it has read 100), it raises an error that names the last bad shard.
"""

from __future__ import annotations

import io
import itertools
import json
import logging
import math
import os
import re
import signal
import tarfile
from collections.abc import Callable, Iterator, Sequence
from contextlib import closing
from dataclasses import dataclass
from pathlib import Path
from typing import BinaryIO

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.gopen import gopen
from webdataset.shardlists import expand_urls as wds_expand_urls

from data_prep.layout import DatasetError, read_manifest
from pipeline.data.transforms import eval_tensor, train_tensor

log = logging.getLogger(__name__)
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
TAR_SUFFIXES = (".tar", ".tar.gz", ".tgz")
MIN_READ_FOR_SKIP_CHECK = 100  # a fraction of the first few samples says little

# Every random stream is seeded by a list of integers, never by a hash (hashes differ between
# processes). numpy pads short seeds with zeros, so [seed, e] (shard order) and [seed, e, 0, 0]
# (the shuffle of rank 0 worker 0) would be one stream: each purpose but the shuffle (kept as it
# was) gets its own spawn key. Key lengths are fixed per purpose, so no two streams coincide.
_SHUFFLE, _ORDER, _AUGMENT, _DRAW, _ROUND_SHUFFLE, _ROUND_AUGMENT = range(6)

Source = str | os.PathLike | Sequence[str]


def _seed_sequence(purpose: int, *key: int) -> np.random.SeedSequence:
    return np.random.SeedSequence([int(k) for k in key], spawn_key=(purpose,) if purpose != _SHUFFLE else ())


def _rng(purpose: int, *key: int) -> np.random.Generator:
    return np.random.default_rng(_seed_sequence(purpose, *key))


def _sample_rngs(purpose: int, *key: int) -> Callable[[int], np.random.Generator]:
    """Sample i's generator within one round: Philox keyed by (purpose, key) from counter block i,
    so any sample's draws come without replaying the others' (resume skips undecoded samples),
    at half the cost of a SeedSequence per sample."""
    philox_key = _seed_sequence(purpose, *key).generate_state(2, np.uint64)
    return lambda i: np.random.Generator(np.random.Philox(key=philox_key, counter=[0, 0, 0, i]))


@dataclass
class DatasetInfo:
    urls: list[str]
    num_classes: int
    multi_label: bool
    num_samples: int | None  # exact, from the manifest; None for URLs without one
    shard_counts: list[int] | None = None  # per URL, from the manifest

    def epoch_batches(self, world_size: int, batch_size: int, num_workers: int = 1) -> int | None:
        return epoch_batches(self, world_size, batch_size, num_workers)


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


def _is_url_source(source: Source) -> bool:
    if not isinstance(source, (str, os.PathLike)):
        return True  # a list of URLs
    s = os.fspath(source)
    return "{" in s or "::" in s or "://" in s or s.startswith("pipe:") or s.endswith(TAR_SUFFIXES)


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
    if not _is_url_source(source):
        root = Path(source)
        manifest = read_manifest(root)
        shards = manifest.split_shards(split)
        if not shards:
            raise DatasetError(f"{root}: the manifest lists no shards for split {split!r}")
        _check_given("num_classes", num_classes, len(manifest.classes), str(root))
        _check_given("multi_label", multi_label, manifest.multi_label, str(root))
        return DatasetInfo(
            urls=[str(root / s.path) for s in shards],
            num_classes=len(manifest.classes),
            multi_label=manifest.multi_label,
            num_samples=sum(s.count for s in shards),
            shard_counts=[s.count for s in shards],
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


def count_samples(url: str) -> int:
    """Samples in one shard, by reading it (for URLs without a manifest)."""
    with closing(gopen(url, "rb", bufsize=1 << 20)) as stream:
        return sum(1 for _ in tar_samples(stream, url))


def _shuffle(samples: Iterator[dict], bufsize: int, rng: np.random.Generator) -> Iterator[dict]:
    """Reservoir-style shuffle buffer with an explicit generator (no global RNG)."""
    if bufsize <= 1:
        yield from samples
        return
    buf: list[dict] = []
    for s in samples:
        if len(buf) < bufsize:
            buf.append(s)
            continue
        i = int(rng.integers(len(buf)))
        buf[i], s = s, buf[i]
        yield s
    rng.shuffle(buf)
    yield from buf


class SkipCounter:
    """Samples read and skipped by one worker; raises once too large a fraction is unreadable."""

    def __init__(self, max_fraction: float, where: str):
        self.max_fraction, self.where = max_fraction, where
        self.read = self.bad = 0
        self.last_bad = ""

    def good(self) -> None:
        self.read += 1
        if self.bad:
            self._check()

    def skip(self, url: str, what: str, exc: BaseException, n: int = 1) -> None:
        self.read += n
        self.bad += n
        self.last_bad = f"{what} in {url}: {type(exc).__name__}: {exc}"
        log.warning("%s: skipping %s", self.where, self.last_bad)
        self._check()

    def _check(self) -> None:
        if self.read >= MIN_READ_FOR_SKIP_CHECK and self.bad > self.max_fraction * self.read:
            raise DatasetError(
                f"{self.where}: {self.bad} of {self.read} samples read were unreadable "
                f"({self.bad / self.read:.1%} > max_skip_fraction {self.max_fraction:.1%}); "
                f"the last: {self.last_bad}"
            )


# -- tar reading. webdataset opens the URL (local path, file:, pipe:, http, ...); the members are
# parsed here: Python's tarfile plus webdataset's grouping cost ~0.15 ms a sample, a third of
# decoding a 256-pixel JPEG. Plain ustar, pax and GNU long names; anything else is skipped.
TAR_BLOCK = 512
_META_NAME = re.compile(r"__[^/]*__($|/)")  # webdataset's convention for metadata members


def _tar_number(field: bytes) -> int:
    if field[:1] in (b"\x80", b"\xff"):  # GNU base-256, for sizes of 8 GiB and more
        n = int.from_bytes(field[1:], "big")
        return -n if field[:1] == b"\xff" else n
    field = field.strip(b"\0 ")
    return int(field, 8) if field else 0


def _pax_records(data: bytes) -> dict[str, str]:
    out, pos = {}, 0
    while pos < len(data):
        space = data.index(b" ", pos)
        length = int(data[pos:space])
        key, _, value = data[space + 1 : pos + length - 1].partition(b"=")
        out[key.decode()] = value.decode("utf-8", "surrogateescape")
        pos += length
    return out


def tar_members(stream: BinaryIO) -> Iterator[tuple[str, bytes]]:
    """(name, data) of each regular file in a tar stream; a cut or corrupt stream raises ReadError."""
    read = stream.read
    pax: dict[str, str] = {}
    long_name: str | None = None
    while True:
        header = read(TAR_BLOCK)
        if header == bytes(TAR_BLOCK):
            return  # the end-of-archive marker
        if not header:  # tarfile takes this for the end too; a copy cut at a block boundary looks so
            raise tarfile.ReadError("unexpected end of data: no end-of-archive marker")
        if len(header) < TAR_BLOCK:
            raise tarfile.ReadError(f"unexpected end of data in a member header ({len(header)} bytes)")
        if _tar_number(header[148:156]) != sum(header[:148]) + 8 * 32 + sum(header[156:]):
            raise tarfile.ReadError("bad checksum in a member header")
        size = int(pax.get("size", _tar_number(header[124:136])))
        kind = header[156:157]
        raw_name = header[:100].split(b"\0", 1)[0]
        data = read(size) if size else b""
        pad = -size % TAR_BLOCK
        if len(data) < size or (pad and len(read(pad)) < pad):
            raise tarfile.ReadError(f"unexpected end of data in member {raw_name!r}")
        if kind == b"x":  # pax header: its path and size apply to the next member
            pax = _pax_records(data)
            continue
        if kind == b"L":  # GNU long name of the next member
            long_name = data.rstrip(b"\0").decode("utf-8", "surrogateescape")
            continue
        name = pax.get("path") or long_name
        if name is None:
            name = raw_name.decode("utf-8", "surrogateescape")
            prefix = header[345:500].split(b"\0", 1)[0] if header[257:262] == b"ustar" else b""
            if prefix:
                name = prefix.decode("utf-8", "surrogateescape") + "/" + name
        pax, long_name = {}, None
        if kind in (b"0", b"\0", b"7"):  # regular files; directories, links, globals are skipped
            yield name, data


def tar_samples(stream: BinaryIO, url: str) -> Iterator[dict]:
    """Members grouped by key as webdataset does: `a/b.c.jpg` -> key `a/b`, field `c.jpg`."""
    sample: dict | None = None
    for name, data in tar_members(stream):
        if _META_NAME.match(name):
            continue
        dot = name.find(".", name.rfind("/") + 1)
        if dot < 0:
            continue
        key, field = name[:dot], name[dot + 1 :].lower()
        if sample is None or sample["__key__"] != key:
            if sample is not None and len(sample) > 2:
                yield sample
            sample = {"__key__": key, "__url__": url}
        sample[field] = data
    if sample is not None and len(sample) > 2:
        yield sample


def read_shards(
    urls: list[str], counter: SkipCounter, counts: dict[str, int] | None = None
) -> Iterator[dict]:
    """Raw samples of each shard in turn; a shard that fails to open or read (truncated tar,
    missing file) ends there, and its unread samples are counted as skipped."""
    for url in urls:
        n = 0
        try:
            with closing(gopen(url, "rb", bufsize=1 << 20)) as stream:
                for sample in tar_samples(stream, url):
                    n += 1
                    yield sample
        except Exception as exc:  # any read failure skips the rest of this shard, counted
            lost = max(1, (counts or {}).get(url, 0) - n)
            counter.skip(url, f"{lost} sample(s) after sample {n}", exc, lost)


def _image_bytes(sample: dict) -> bytes:
    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    if ext is None:
        raise ValueError(f"no image ({'/'.join(IMAGE_EXTS)}) in sample; it has {sorted(sample)}")
    return sample[ext]


def _labels(sample: dict, multi_label: bool, num_classes: int) -> list[int] | int:
    if multi_label:
        labels = [int(c) for c in json.loads(sample["json"])["labels"]]
        if any(not 0 <= c < num_classes for c in labels):
            raise ValueError(f"labels {labels} outside 0..{num_classes - 1}")
        return labels
    label = int(sample["cls"])
    if not 0 <= label < num_classes:
        raise ValueError(f"class {label} outside 0..{num_classes - 1}")
    return label


def _empty_batch(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """uint8 tensor; `shared`: allocated in shared memory, as default_collate does in a worker, so
    the batch reaches the main process without the copy that sending a private tensor makes
    (64 x 3 x 224 x 224: ~5 ms a batch)."""
    if not shared:
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(math.prod(shape), device="cpu")
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class BatchBuilder:
    """Fills preallocated uint8 batch tensors in place: one copy per image, no torch.stack."""

    def __init__(self, batch_size: int, img_size: int, num_classes: int, multi_label: bool):
        self.batch_size, self.img_size = batch_size, img_size
        self.num_classes, self.multi_label = num_classes, multi_label
        self.shared = get_worker_info() is not None  # in a DataLoader worker process
        self._new()

    def _new(self) -> None:
        b, s = self.batch_size, self.img_size
        self.images = _empty_batch((b, 3, s, s), self.shared)  # [B, 3, H, W]
        self.targets = (
            torch.zeros((b, self.num_classes)) if self.multi_label else torch.zeros(b, dtype=torch.long)
        )  # [B, K] multi-hot or [B] class indices
        self.keys = [""] * b
        self.valid = torch.zeros(b, dtype=torch.bool)  # [B] slots holding a real sample
        self.n = 0

    def put(self, slot: int, image: torch.Tensor, labels: list[int] | int, key: str) -> None:
        self.images[slot] = image  # uint8 [3, H, W] -> its batch slot
        if self.multi_label:
            self.targets[slot].zero_()
            self.targets[slot, labels] = 1.0
        else:
            self.targets[slot] = labels
        self.keys[slot] = key
        self.valid[slot] = True

    def add(self, image: torch.Tensor, labels: list[int] | int, key: str) -> bool:
        """Append one sample; True when the batch is full."""
        self.put(self.n, image, labels, key)
        self.n += 1
        return self.n == self.batch_size

    def pad(self, last: list) -> None:
        """Fill the empty slots with a repeat of a real sample: this batch's last, else `last`
        (updated here: [image, target] of the last real sample seen), else zeros."""
        real = self.valid.nonzero().flatten().tolist()
        if real:
            last[:] = [self.images[real[-1]].clone(), self.targets[real[-1]].clone()]
        for slot in (~self.valid).nonzero().flatten().tolist():
            if last:
                self.images[slot], self.targets[slot] = last
            else:  # no readable sample seen yet: zeros, masked out all the same
                self.images[slot] = 0
                self.targets[slot] = 0

    def take(self, **extra) -> dict:
        """The batch {"image", "target", "key", **extra}; the builder starts a new one."""
        batch = {"image": self.images, "target": self.targets, "key": self.keys, **extra}
        self._new()
        return batch

    def clear(self) -> None:
        self._new()


@dataclass(frozen=True)
class _Round:
    """One epoch (epoch mode) or one round of drawn shards (resampled mode) of one worker."""

    index: int
    urls: list[str]
    shuffle_key: tuple[int, ...]
    augment_key: tuple[int, ...]  # keys the per-sample augmentation generators (`_sample_rngs`)
    num_samples: int | None  # from the manifest
    quota: int | None  # batches this worker yields in it (epoch mode with counts); None: flows on


def _worker() -> tuple[int, int]:
    wi = get_worker_info()
    return (wi.id, wi.num_workers) if wi else (0, 1)


class ShardStream(IterableDataset):
    """Endless (or `epochs`-long) stream of uint8 batches for one rank; each DataLoader worker reads
    its own shards. `epoch_batches`: batches per rank per epoch (None when resampled or uncounted)."""

    def __init__(
        self,
        info: DatasetInfo,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        img_size: int,
        seed: int,
        num_workers: int,
        shuffle_buffer: int = 256,
        min_scale: float = 0.08,
        start_batch: int = 0,
        resampled: bool = False,
        epochs: int | None = None,
        randaugment: tuple[int, float] | None = None,
        hflip: bool = True,
        max_skip_fraction: float = 0.01,
    ):
        workers = max(1, num_workers)
        slots = world_size * workers
        if not resampled and len(info.urls) < slots:
            raise DatasetError(
                f"{len(info.urls)} shards cannot be split over {world_size} ranks x {workers} "
                f"loader workers; write at least {slots} shards (vitpipe shard --max-count), use fewer "
                f"workers, or stream with resampled=True"
            )
        if resampled and epochs is not None:
            raise ValueError("resampled streams have no epochs: leave epochs=None and count steps")
        self.epoch_batches = None if resampled else epoch_batches(info, world_size, batch_size, workers)
        if self.epoch_batches == 0:
            smallest = sorted(info.shard_counts or [])[: len(info.urls) // slots]
            raise DatasetError(
                f"{info.urls[0]}...: a loader worker may get only {sum(smallest)} samples in an epoch "
                f"({len(smallest)} of {len(info.urls)} shards over {world_size} ranks x {workers} workers), "
                f"fewer than batch_size {batch_size}; use fewer workers, a smaller batch, or resampled=True"
            )
        if epochs is not None and self.epoch_batches is None:
            raise DatasetError(
                f"{info.urls[0]}...: epochs={epochs} needs exact per-shard counts (a manifest.json) so that "
                "every rank yields the same number of batches"
            )
        self.info = info
        self.rank, self.world_size, self.num_workers = rank, world_size, workers
        self.batch_size, self.img_size = batch_size, img_size
        self.seed, self.shuffle_buffer, self.min_scale = seed, shuffle_buffer, min_scale
        self.start_batch, self.resampled, self.epochs = start_batch, resampled, epochs
        self.randaugment, self.max_skip_fraction = randaugment, max_skip_fraction
        self.hflip = hflip
        self._counts = dict(zip(info.urls, info.shard_counts)) if info.shard_counts else None

    @staticmethod
    def batches_done_by_worker(start_batch: int, worker: int, num_workers: int) -> int:
        """Of the rank's first `start_batch` batches, how many came from `worker` (round-robin)."""
        return max(0, (start_batch - worker + num_workers - 1) // num_workers)

    def shards_for(self, epoch: int, worker: int, num_workers: int) -> list[str]:
        """Epoch mode: this rank's and worker's shards in `epoch` (every shard once over all slots)."""
        order = _rng(_ORDER, self.seed, epoch).permutation(len(self.info.urls))
        mine = order[self.rank :: self.world_size][worker::num_workers]
        return [self.info.urls[i] for i in mine]

    def _count(self, urls: list[str]) -> int | None:
        return sum(self._counts[u] for u in urls) if self._counts else None

    def _epoch_rounds(self, worker: int, num_workers: int, first: int = 0) -> Iterator[_Round]:
        quota = self.epoch_batches // num_workers if self.epoch_batches is not None else None
        for e in itertools.count(first):
            if self.epochs is not None and e >= self.epochs:
                return
            urls = self.shards_for(e, worker, num_workers)
            yield _Round(
                e, urls, (_SHUFFLE, self.seed, e, self.rank, worker),
                (_AUGMENT, self.seed, e, self.rank, worker), self._count(urls), quota,
            )  # fmt: skip

    def resampled_rounds(self, worker: int, num_workers: int) -> Iterator[_Round]:
        """Resampled mode: rounds of shards drawn with replacement from (seed, rank, worker)."""
        urls = self.info.urls
        draw = _rng(_DRAW, self.seed, self.rank, worker)
        per_round = max(1, len(urls) // (self.world_size * num_workers))
        for k in itertools.count():
            mine = [urls[i] for i in draw.integers(len(urls), size=per_round)]
            yield _Round(
                k, mine, (_ROUND_SHUFFLE, self.seed, self.rank, worker, k),
                (_ROUND_AUGMENT, self.seed, self.rank, worker, k), self._count(mine), None,
            )  # fmt: skip

    def _resume(self, worker: int, num_workers: int) -> tuple[Iterator[_Round], int, int]:
        """The worker's rounds from its resume point, batches already made in the first of them,
        and samples to skip (read, not decoded) from there."""
        done = self.batches_done_by_worker(self.start_batch, worker, num_workers)
        if not self.resampled and self.epoch_batches is not None:
            per_epoch = self.epoch_batches // num_workers
            within = done % per_epoch
            return (
                self._epoch_rounds(worker, num_workers, done // per_epoch),
                within,
                within * self.batch_size,
            )
        to_skip = done * self.batch_size
        if not self.resampled:
            return self._epoch_rounds(worker, num_workers), 0, to_skip
        rounds = self.resampled_rounds(worker, num_workers)
        for rnd in rounds:
            if rnd.num_samples is None or rnd.num_samples > to_skip:
                return itertools.chain([rnd], rounds), 0, to_skip
            to_skip -= rnd.num_samples  # this whole round was consumed before the checkpoint
        raise AssertionError("unreachable: resampled rounds are endless")

    def _round_samples(self, rnd: _Round, counter: SkipCounter) -> Iterator[dict]:
        """The round's samples through the shuffle buffer. With a quota, a round that holds fewer
        readable samples than it owes (corrupt data) is read again rather than end the rank early."""
        shuffle_rng = _rng(*rnd.shuffle_key)
        for repeat in itertools.count():
            good_before = counter.read - counter.bad
            yield from _shuffle(
                read_shards(rnd.urls, counter, self._counts), self.shuffle_buffer, shuffle_rng
            )
            if rnd.quota is None:
                return
            if repeat > 0 and counter.read - counter.bad == good_before:
                raise DatasetError(f"rank {self.rank}: no readable sample in {rnd.urls}")
            log.warning(
                "rank %d epoch %d: too few readable samples for the %d batches every worker owes; "
                "reading its shards again", self.rank, rnd.index, rnd.quota,
            )  # fmt: skip

    def __iter__(self) -> Iterator[dict]:
        process, num_workers = _worker()
        # The DataLoader asks its workers round-robin from process 0, but the uninterrupted stream's
        # batch M came from worker M % W: after a resume, process k plays worker (k + M) % W.
        worker = (process + self.start_batch) % num_workers
        counter = SkipCounter(self.max_skip_fraction, f"rank {self.rank} worker {worker}")
        info = self.info
        builder = BatchBuilder(self.batch_size, self.img_size, info.num_classes, info.multi_label)
        rounds, made, to_skip = self._resume(worker, num_workers)
        for rnd in rounds:
            augment_rng = _sample_rngs(*rnd.augment_key)
            for i, sample in enumerate(self._round_samples(rnd, counter)):
                if to_skip:  # resuming: these were consumed before the checkpoint
                    to_skip -= 1
                    continue
                try:
                    labels = _labels(sample, info.multi_label, info.num_classes)
                    with Image.open(io.BytesIO(_image_bytes(sample))) as img:
                        image = train_tensor(
                            img, self.img_size, augment_rng(i), self.min_scale, self.randaugment, self.hflip
                        )
                except Exception as exc:  # a corrupt sample is skipped and counted, never fatal here
                    counter.skip(sample.get("__url__", "?"), f"sample {sample.get('__key__')}", exc)
                    continue
                counter.good()
                if builder.add(image, labels, sample["__key__"]):
                    yield builder.take(skipped=counter.bad)
                    made += 1
                    if rnd.quota is not None and made == rnd.quota:
                        break
            if rnd.quota is not None:
                builder.clear()  # the epoch's tail (fewer than a batch, or beyond the quota) is dropped
            made = 0


class EvalStream(IterableDataset):
    """A finite, deterministic pass: every sample once over all ranks, the same batch count on every
    rank (`num_batches`), padding marked `valid=False`. `by_shard`: how samples go to ranks."""

    def __init__(
        self,
        info: DatasetInfo,
        *,
        rank: int,
        world_size: int,
        batch_size: int,
        img_size: int,
        crop_fraction: float = 0.875,
        max_skip_fraction: float = 0.01,
    ):
        counts = info.shard_counts
        if counts is None:  # URLs without a manifest: the batch count must be known up front
            log.info(
                "counting the samples of %d shards (no manifest beside %s)", len(info.urls), info.urls[0]
            )
            counts = [count_samples(u) for u in info.urls]
        self.info, self.counts = info, counts
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.img_size, self.crop_fraction = batch_size, img_size, crop_fraction
        self.max_skip_fraction = max_skip_fraction
        self.by_shard = len(info.urls) >= world_size
        starts = np.concatenate([[0], np.cumsum(counts)]).tolist()
        if self.by_shard:  # rank r: shards r, r + world, ...; positions run on through them
            per_rank = [sum(counts[r::world_size]) for r in range(world_size)]
            mine = list(range(rank, len(counts), world_size))
            rank_starts = np.concatenate([[0], np.cumsum([counts[s] for s in mine])]).tolist()
            self._plan = [(info.urls[s], rank_starts[j], counts[s]) for j, s in enumerate(mine)]
        else:  # fewer shards than ranks: sample i goes to rank i % world_size; positions are global
            total = starts[-1]
            per_rank = [len(range(r, total, world_size)) for r in range(world_size)]
            self._plan = [(u, starts[s], counts[s]) for s, u in enumerate(info.urls)]
        self.num_samples = per_rank[rank]  # this rank's real samples
        self.num_batches = math.ceil(max(per_rank) / batch_size)
        log.info(
            "eval rank %d/%d: %d of %d samples (assigned by %s), %d batches of %d, %d padding",
            rank, world_size, self.num_samples, starts[-1], "shard" if self.by_shard else "sample index",
            self.num_batches, batch_size, self.num_batches * batch_size - self.num_samples,
        )  # fmt: skip

    def _position(self, first: int, k: int) -> int | None:
        """Rank position of sample k of a shard whose first sample is at `first`; None: another rank's."""
        if self.by_shard:
            return first + k
        g = first + k
        return g // self.world_size if g % self.world_size == self.rank else None

    def _samples(self, lo: int, hi: int, counter: SkipCounter) -> Iterator[tuple[int, dict]]:
        """(rank position, raw sample) for positions in [lo, hi), in increasing order; shards
        outside the range are not opened, samples before it are read but not decoded."""
        w = 1 if self.by_shard else self.world_size
        for url, first, count in self._plan:
            if count == 0 or first // w >= hi or (first + count - 1) // w < lo:
                continue  # none of this shard's positions are in [lo, hi)
            for k, sample in enumerate(read_shards([url], counter, {url: count})):
                if k >= count:
                    log.warning(
                        "%s holds more than the %d samples its manifest lists; ignoring the rest", url, count
                    )
                    break
                pos = self._position(first, k)
                if pos is None or pos < lo:
                    continue
                if pos >= hi:
                    break
                yield pos, sample

    def __iter__(self) -> Iterator[dict]:
        worker, num_workers = _worker()
        lo, hi = worker * self.num_batches // num_workers, (worker + 1) * self.num_batches // num_workers
        if lo == hi:
            return
        counter = SkipCounter(self.max_skip_fraction, f"eval rank {self.rank} worker {worker}")
        info, bs = self.info, self.batch_size
        builder = BatchBuilder(bs, self.img_size, info.num_classes, info.multi_label)
        last: list = []  # the last real sample, to repeat into padding slots

        def batch() -> dict:
            builder.pad(last)
            return builder.take(valid=builder.valid, skipped=counter.bad)

        b = lo
        for pos, sample in self._samples(lo * bs, min(hi * bs, self.num_samples), counter):
            while pos >= (b + 1) * bs:
                yield batch()
                b += 1
            try:
                labels = _labels(sample, info.multi_label, info.num_classes)
                with Image.open(io.BytesIO(_image_bytes(sample))) as img:
                    image = eval_tensor(img, self.img_size, self.crop_fraction)
            except Exception as exc:  # skipped and counted; its slot stays padding
                counter.skip(sample.get("__url__", "?"), f"sample {sample.get('__key__')}", exc)
                continue
            counter.good()
            builder.put(pos - b * bs, image, labels, sample["__key__"])
        while b < hi:
            yield batch()
            b += 1


def _ignore_sigterm(worker_id: int) -> None:
    # A launcher's SIGTERM (torchrun, a scheduler) reaches the whole process group: loader workers must
    # not die of it, or the rank fails before it can checkpoint. The rank shuts its workers down itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_train_loader(
    source: Source,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    img_size: int,
    seed: int,
    num_workers: int,
    shuffle_buffer: int = 256,
    min_scale: float = 0.08,
    start_batch: int = 0,
    split: str = "train",
    resampled: bool = False,
    epochs: int | None = None,
    randaugment: tuple[int, float] | None = None,
    hflip: bool = True,
    max_skip_fraction: float = 0.01,
    num_classes: int | None = None,
    multi_label: bool | None = None,
) -> tuple[DataLoader, DatasetInfo]:
    """The rank's training batches; `loader.dataset.epoch_batches` is its batches per epoch."""
    info = dataset_info(source, split, num_classes=num_classes, multi_label=multi_label)
    stream = ShardStream(
        info,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        img_size=img_size,
        seed=seed,
        num_workers=num_workers,
        shuffle_buffer=shuffle_buffer,
        min_scale=min_scale,
        start_batch=start_batch,
        resampled=resampled,
        epochs=epochs,
        randaugment=randaugment,
        hflip=hflip,
        max_skip_fraction=max_skip_fraction,
    )
    loader = DataLoader(
        stream,
        batch_size=None,  # batches are built in the workers
        num_workers=num_workers,
        persistent_workers=num_workers > 0,
        prefetch_factor=4 if num_workers > 0 else None,
        pin_memory=torch.cuda.is_available(),
        # Its own generator: drawing worker seeds from the global RNG would shift the model's random
        # stream (stochastic depth) by one draw on resume, and break exactness.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=_ignore_sigterm,
    )
    return loader, info


def make_eval_loader(
    source: Source,
    split: str = "val",
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    img_size: int,
    num_workers: int = 0,
    crop_fraction: float = 0.875,
    max_skip_fraction: float = 0.01,
    num_classes: int | None = None,
    multi_label: bool | None = None,
) -> tuple[DataLoader, DatasetInfo]:
    """One deterministic pass over a split; every rank yields `loader.dataset.num_batches` batches
    {"image", "target", "valid" [B] bool, "skipped"}: sum metrics over valid samples only."""
    info = dataset_info(source, split, num_classes=num_classes, multi_label=multi_label)
    stream = EvalStream(
        info,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        img_size=img_size,
        crop_fraction=crop_fraction,
        max_skip_fraction=max_skip_fraction,
    )
    loader = DataLoader(
        stream,
        batch_size=None,
        num_workers=num_workers,
        pin_memory=torch.cuda.is_available(),
        generator=torch.Generator().manual_seed(0),
        worker_init_fn=_ignore_sigterm,
    )
    return loader, info
