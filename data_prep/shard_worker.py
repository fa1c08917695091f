"""One planned shard -> one complete tar and its sidecar: the only code a shard worker runs, the same
in this process, in a worker process (`--workers N`) and in a Ray task (`--ray`).

The tar is written by `shard_file.write_shard` (streamed, hashed, published whole); the sidecar
(`.work/SPLIT/NAME.json`: fingerprint, size, sha256, index rows, rejected inputs) is written after
it, beside the dataset (in the bucket for a dataset on object storage, so a re-run on another
machine sees it). A shard whose sidecar matches the task's fingerprint and whose file still has the
recorded size (and, in a local folder, sha256) is complete: a re-run skips it.
Imports stay light (no pyarrow.parquet, no Ray): a spawned worker starts in well under a second.
"""

from __future__ import annotations

import json
import time
from collections import deque
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from functools import cached_property

from data_prep.dataset_dir import DatasetDir
from data_prep.images import Prepared, Rejected, boxes_member
from data_prep.layout import BOXES_EXT, DatasetError, sidecar_rel
from data_prep.plan import ShardTask
from data_prep.shard_file import Sample, write_shard
from data_prep.sources import Item, Loader
from data_prep.storage import is_uri


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs besides its task: small, picklable, the same for every shard."""

    root: str  # the dataset: a local folder or an object store URI
    scratch: str  # base of a remote dataset's local work folder ("": the system temp dir of each node)
    name: str
    loader: Loader
    multi_label: bool
    resize_max: int | None
    quality: int

    @cached_property
    def out(self) -> DatasetDir:
        return DatasetDir(self.root, self.scratch or None)


@dataclass(frozen=True)
class ShardResult:
    split: str
    index: int
    path: str
    count: int  # samples written
    bytes: int
    sha256: str
    planned: int  # items planned into the shard (count + rejected)
    rejected: int
    resumed: bool  # already complete: not rewritten
    seconds: float


def _load_sidecar(out: DatasetDir, rel: str) -> dict | None:
    try:
        raw = out.read_bytes(rel)
        return None if raw is None else json.loads(raw)
    except (OSError, json.JSONDecodeError):
        return None


def completed(task: ShardTask, job: ShardJob) -> ShardResult | None:
    """The recorded result if this exact shard is already written, whole, and none of its inputs failed to
    be read (those are read again: the cause may have been the network or a file since put right); else None."""
    out = job.out
    side = _load_sidecar(out, sidecar_rel(task.split, job.name, task.index))
    if side is None or side.get("fingerprint") != task.fingerprint:
        return None
    if any(stage == "read" for _, _, stage, _ in side["errors"]):
        return None  # an input that could not be read (a network error, a file fixed since): try again
    if side["count"] > 0:
        try:
            if out.size(task.path) != side["bytes"] or out.sha256(task.path) not in (None, side["sha256"]):
                return None
        except OSError:
            return None
    return ShardResult(
        task.split,
        task.index,
        task.path,
        side["count"],
        side["bytes"],
        side["sha256"],
        len(task.items),
        len(side["errors"]),
        resumed=True,
        seconds=0.0,
    )


READ_AHEAD = 16  # object store inputs in flight per worker: each read waits on the network, not the CPU


def _rejected(exc: Exception) -> Rejected:
    if isinstance(exc, MemoryError):
        raise exc  # the machine, not this input
    return Rejected.of(exc, "read")  # not a Rejected: the loader's own reading failed


def _load_one(item: Item, job: ShardJob) -> Prepared | Rejected:
    try:
        return job.loader.load(item, job.resize_max, job.quality)
    except Exception as exc:  # whatever one input raises, it must not stop the shard
        return _rejected(exc)


def _read_one(item: Item, loader) -> bytes | Rejected:
    try:
        return loader.read(item)
    except Exception as exc:
        return _rejected(exc)


def _loaded(items: tuple[Item, ...], job: ShardJob) -> Iterator[tuple[Item, Prepared | Rejected]]:
    """Each item with its stored bytes or its rejection, in order. Files on local disk load one at a
    time (memory: one image); object store URIs are read READ_AHEAD at a time on threads (a worker
    overlaps the requests' latency) and decoded here, one at a time, in order."""
    read = getattr(job.loader, "read", None)
    if read is None or not any(is_uri(item.source) for item in items):
        for item in items:
            yield item, _load_one(item, job)
        return

    def finish(item: Item, data: bytes | Rejected) -> Prepared | Rejected:
        if isinstance(data, Rejected):
            return data
        try:
            return job.loader.prepare(data, job.resize_max, job.quality)
        except Exception as exc:
            return _rejected(exc)

    with ThreadPoolExecutor(READ_AHEAD, thread_name_prefix="shard-read") as pool:
        window: deque = deque()
        for item in items:
            window.append((item, pool.submit(_read_one, item, job.loader)))
            if len(window) >= READ_AHEAD:
                first, future = window.popleft()
                yield first, finish(first, future.result())
        while window:
            first, future = window.popleft()
            yield first, finish(first, future.result())


def write_planned_shard(task: ShardTask, job: ShardJob) -> ShardResult:
    done = completed(task, job)
    if done is not None:
        return done
    t0 = time.perf_counter()
    out = job.out
    errors: list[list[str]] = []  # [key, source, stage, reason] per rejected input

    def samples() -> Iterator[Sample]:  # loaded in order, as the tar is written
        for item, img in _loaded(task.items, job):
            if isinstance(img, Rejected):
                errors.append([item.key, item.source, img.stage, str(img)])
                continue
            labels = list(item.labels if img.labels is None else img.labels)
            extra = img.extra
            if (
                item.boxes is not None
            ):  # a manifest's boxes: checked against the input, scaled to the stored size
                stored = (img.width, img.height)
                try:
                    extra = {**extra, BOXES_EXT: boxes_member(item.boxes, img.source_size or stored, stored)}
                except Rejected as exc:
                    errors.append([item.key, item.source, exc.stage, str(exc)])
                    continue
            yield Sample(
                item.key, img.data, img.ext, labels, img.width, img.height, task.split, item.source, extra
            )

    # Every input rejected: no shard file, the sidecar still records the shard as done.
    try:
        shard = write_shard(out, task.path, samples(), job.multi_label)
        side = {
            "fingerprint": task.fingerprint,
            "split": task.split,
            "index": task.index,
            "path": task.path,
            "count": shard.count,
            "bytes": shard.bytes,
            "sha256": shard.sha256,
            "planned_bytes": task.planned_bytes,
            "rows": shard.rows,
            "errors": errors,
        }
        out.write_bytes(sidecar_rel(task.split, job.name, task.index), json.dumps(side).encode())
    except OSError as exc:  # the output's storage (disk full, bucket gone), not an input: stop, named
        raise DatasetError(f"{out.describe(task.path)}: cannot write the shard ({exc})") from None
    return ShardResult(
        task.split,
        task.index,
        task.path,
        shard.count,
        shard.bytes,
        shard.sha256,
        len(task.items),
        len(errors),
        resumed=False,
        seconds=time.perf_counter() - t0,
    )


def read_sidecar(out: DatasetDir, name: str, split: str, index: int) -> dict:
    rel = sidecar_rel(split, name, index)
    side = _load_sidecar(out, rel)
    if side is None:
        raise FileNotFoundError(out.describe(rel))
    return side
