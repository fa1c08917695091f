"""One planned shard -> one complete tar and its sidecar: the only code a shard worker runs, the same
in this process, in a worker process (`--workers N`) and in a Ray task (`--ray`).

The tar is streamed to `NAME.tar.tmp` one sample at a time (memory: one image), hashed as it is
written, fsynced and renamed; the sidecar (`.work/SPLIT/NAME.json`: fingerprint, size, sha256, index
rows, rejected inputs) is written after the rename. A shard whose sidecar matches the task's
fingerprint and whose file still has the recorded size and sha256 is complete: a re-run skips it.
Imports stay light (no pyarrow, no Ray): a spawned worker starts in well under a second.
"""

from __future__ import annotations

import hashlib
import json
import os
import tarfile
import time
from dataclasses import dataclass
from pathlib import Path

from data_prep.images import Rejected
from data_prep.layout import fsync_dir, sidecar_path, write_atomic
from data_prep.plan import ShardTask
from data_prep.sources import Loader
from data_prep.tario import TAR_FORMAT, HashingWriter, add_member, file_sha256

INDEX_COLUMNS = ("key", "split", "shard", "labels", "width", "height", "bytes", "sha256", "source")


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
        task.split, task.index, task.path, side["count"], side["bytes"], side["sha256"],
        len(task.items), len(side["errors"]), resumed=True, seconds=0.0,
    )  # fmt: skip


def write_planned_shard(task: ShardTask, job: ShardJob) -> ShardResult:
    done = completed(task, job)
    if done is not None:
        return done
    t0 = time.perf_counter()
    root = Path(job.root)
    final = root / task.path
    final.parent.mkdir(parents=True, exist_ok=True)
    tmp = final.with_name(final.name + ".tmp")
    rows: dict[str, list] = {c: [] for c in INDEX_COLUMNS}
    errors: list[list[str]] = []
    with open(tmp, "wb") as f:
        out = HashingWriter(f)
        with tarfile.open(fileobj=out, mode="w", format=TAR_FORMAT) as tar:
            for item in task.items:
                try:
                    img = job.loader.load(item, job.resize_max, job.quality)
                except (Rejected, OSError) as exc:
                    errors.append([item.key, item.source, str(exc)])
                    continue
                labels = list(item.labels if img.labels is None else img.labels)
                add_member(tar, f"{item.key}.{img.ext}", img.data)
                if job.multi_label:
                    add_member(tar, f"{item.key}.json", json.dumps({"labels": labels}).encode())
                else:
                    add_member(tar, f"{item.key}.cls", str(labels[0]).encode())
                row = (item.key, task.split, task.path, labels, img.width, img.height,
                       len(img.data), hashlib.sha256(img.data).hexdigest(), item.source)  # fmt: skip
                for c, v in zip(INDEX_COLUMNS, row):
                    rows[c].append(v)
        out.sync()
    count, size, digest = len(rows["key"]), out.size, out.sha256.hexdigest()
    if count:
        os.replace(tmp, final)  # only now does the shard exist under its name
        fsync_dir(final.parent)
    else:  # every input rejected: no shard file, the sidecar still records the shard as done
        tmp.unlink()
        final.unlink(missing_ok=True)
        size, digest = 0, ""
    side = {
        "fingerprint": task.fingerprint, "split": task.split, "index": task.index, "path": task.path,
        "count": count, "bytes": size, "sha256": digest, "planned_bytes": task.planned_bytes,
        "rows": rows, "errors": errors,
    }  # fmt: skip
    side_path = sidecar_path(root, task.split, job.name, task.index)
    side_path.parent.mkdir(parents=True, exist_ok=True)
    write_atomic(side_path, json.dumps(side).encode())
    return ShardResult(
        task.split, task.index, task.path, count, size, digest, len(task.items), len(errors),
        resumed=False, seconds=time.perf_counter() - t0,
    )  # fmt: skip


def read_sidecar(root: Path, name: str, split: str, index: int) -> dict:
    side = _load_sidecar(sidecar_path(root, split, name, index))
    if side is None:
        raise FileNotFoundError(sidecar_path(root, split, name, index))
    return side
