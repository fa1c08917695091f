"""One planned shard -> one complete tar and its sidecar: the only code a shard worker runs, the same
in this process, in a worker process (`--workers N`) and in a Ray task (`--ray`).

The tar is written by `shard_file.write_shard` (streamed, hashed, fsynced, renamed); the sidecar
(`.work/SPLIT/NAME.json`: fingerprint, size, sha256, index rows, rejected inputs) is written after
the rename. A shard whose sidecar matches the task's
fingerprint and whose file still has the recorded size and sha256 is complete: a re-run skips it.
Imports stay light (no pyarrow, no Ray): a spawned worker starts in well under a second.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

from data_prep import atomic
from data_prep.images import Rejected
from data_prep.layout import sidecar_path
from data_prep.plan import ShardTask
from data_prep.shard_file import Sample, write_shard
from data_prep.sources import Loader
from data_prep.tario import file_sha256


@dataclass(frozen=True)
class ShardJob:
    """Everything a worker needs besides its task: small, picklable, the same for every shard."""

    root: str
    name: str
    loader: Loader
    multi_label: bool
    resize_max: int | None
    quality: int


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


def _load_sidecar(path: Path) -> dict | None:
    try:
        return json.loads(path.read_text())
    except (OSError, json.JSONDecodeError):
        return None


def completed(task: ShardTask, job: ShardJob) -> ShardResult | None:
    """The recorded result if this exact shard is already on disk, whole; else None."""
    side = _load_sidecar(sidecar_path(Path(job.root), task.split, job.name, task.index))
    if side is None or side.get("fingerprint") != task.fingerprint:
        return None
    shard = Path(job.root) / task.path
    if side["count"] > 0:
        try:
            if shard.stat().st_size != side["bytes"] or file_sha256(shard) != side["sha256"]:
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


def write_planned_shard(task: ShardTask, job: ShardJob) -> ShardResult:
    done = completed(task, job)
    if done is not None:
        return done
    t0 = time.perf_counter()
    root = Path(job.root)
    errors: list[list[str]] = []

    def samples() -> Iterator[Sample]:  # loaded one at a time, as the tar is written
        for item in task.items:
            try:
                img = job.loader.load(item, job.resize_max, job.quality)
            except (Rejected, OSError) as exc:
                errors.append([item.key, item.source, str(exc)])
                continue
            labels = list(item.labels if img.labels is None else img.labels)
            yield Sample(item.key, img.data, img.ext, labels, img.width, img.height, task.split, item.source)

    # Every input rejected: no shard file, the sidecar still records the shard as done.
    shard = write_shard(root / task.path, task.path, samples(), job.multi_label)
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
    side_path = sidecar_path(root, task.split, job.name, task.index)
    side_path.parent.mkdir(parents=True, exist_ok=True)
    atomic.write_bytes(side_path, json.dumps(side).encode())
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


def read_sidecar(root: Path, name: str, split: str, index: int) -> dict:
    side = _load_sidecar(sidecar_path(root, split, name, index))
    if side is None:
        raise FileNotFoundError(sidecar_path(root, split, name, index))
    return side
