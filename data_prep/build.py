"""`vitpipe shard SOURCE ... OUT`: plan, write shards in parallel, then index, errors and manifest.

1. Plan: list the source, assign every input to a shard; nothing is decoded yet. A manifest (Parquet or
   CSV), a class folder (on a disk or a bucket prefix) and a flat folder with a CSV labels file are
   planned by tasks on the same workers as the shards (`ranged.py`: the driver never holds an item); the
   generated sources and a flat folder with a JSON labels file on this process (`plan.py`).
2. Write (`executors.py` -> `shard_worker.py`): whole shards, in this process, in worker processes
   or as Ray tasks; a shard already complete from an earlier run (same fingerprint, size, sha256) is
   skipped, so a killed run resumes where it stopped and ends with the same bytes.
3. Finish: index.parquet and errors.parquet streamed from the per-shard sidecars, then manifest.json,
   last, and only if the rejected fraction is within --max-errors.
OUT may be an object store URI (s3://bucket/prefix, gs://...): shards, sidecars, index, errors and
manifest go to the bucket (`dataset_dir.py`), the listing's scratch files to a local folder.

Memory: the planner's open shard per split (ranged: O(ranges x buckets + shards) numbers), 2 x workers
tasks in flight, one sidecar while finishing.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import re
import sys
import time
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field
from pathlib import Path

import PIL
from tqdm import tqdm

from data_prep.dataset_dir import DatasetDir
from data_prep.executors import Executor
from data_prep.finish import FinishJob, count_reasons, finish_index, listing_table
from data_prep.layout import (
    ERRORS,
    FORMAT_VERSION,
    MANIFEST,
    WORK,
    DatasetError,
    Manifest,
    ShardInfo,
    write_manifest,
)
from data_prep.plan import ErrorLog, Planner
from data_prep.ranged import RangedPlanner, write_slice
from data_prep.ranged import supports as supports_ranges
from data_prep.shard_worker import ShardJob, ShardResult, write_planned_shard
from data_prep.sources import Source

log = logging.getLogger(__name__)
# Bump when the same inputs and options would give different shard bytes or sidecars.
# 2: the stored-image contract (images.py: RGB/L, upright, first frame); sidecar errors carry a stage.
WRITER_VERSION = 2


@dataclass(frozen=True)
class BuildOptions:
    name: str = "shard"
    max_count: int = 1000
    max_size: int | None = None  # bytes per shard
    val_fraction: float = 0.0
    resize_max: int | None = None  # longer side, pixels
    quality: int = 95  # JPEG/WebP quality when an image must be re-encoded
    workers: int = 1
    use_ray: bool = False
    max_errors: float = 0.1  # fraction of inputs that may be rejected before the run fails
    seed: int = 0
    progress: bool = True
    scratch: str | None = None  # base of the local work folder when OUT is object storage (default: temp dir)


@dataclass
class BuildReport:
    out: DatasetDir
    num_inputs: int = 0
    num_written: int = 0
    num_new: int = 0  # written by this run (not kept from an earlier one): what images/s counts
    num_errors: int = 0
    totals: dict[str, int] = field(default_factory=dict)
    num_shards: int = 0
    resumed_shards: int = 0
    seconds: float = 0.0
    over_size: list[str] = field(default_factory=list)  # shards past --max-size (re-encoded estimates)
    reasons: dict[str, int] = field(default_factory=dict)  # rejection reason (first words) -> count
    failure: str | None = None  # set when --max-errors is exceeded; no manifest is written then
    manifest: Manifest | None = None


def job_fingerprint(source: Source, opts: BuildOptions) -> str:
    """Everything besides the items that changes a shard's bytes; part of every shard's fingerprint."""
    parts = {
        "format_version": FORMAT_VERSION,
        "writer": WRITER_VERSION,
        "source": source.describe(),
        "multi_label": source.multi_label,
        "resize_max": opts.resize_max,
        "quality": opts.quality,
        "pillow": PIL.__version__,
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True).encode()).hexdigest()


def _progress(total: int | None, enabled: bool, desc: str = "shard", unit: str = "img") -> tqdm:
    tty = sys.stderr.isatty()
    return tqdm(
        total=total,
        unit=unit,
        desc=desc,
        file=sys.stderr,
        disable=not enabled,
        mininterval=0.5 if tty else 15.0,
        smoothing=0.05,
        dynamic_ncols=True,
    )


def build_dataset(
    source: Source, out: str | os.PathLike, opts: BuildOptions, command: str = "", options: dict | None = None
) -> BuildReport:
    t0 = time.perf_counter()
    fingerprint = job_fingerprint(source, opts)
    try:
        root = DatasetDir(out, opts.scratch)
        root.make()
        # The manifest marks a complete dataset; shards are about to change, so it goes first.
        root.delete(MANIFEST)
        # One small write before any work: a missing bucket or a read-only folder fails here, named.
        root.write_bytes(
            f"{WORK}/job.json", json.dumps({"fingerprint": fingerprint, "command": command}).encode()
        )
    except (OSError, ValueError) as exc:
        raise DatasetError(
            f"{os.fspath(out).split('?', 1)[0]}: cannot write the dataset there ({exc})"
        ) from None
    # Each worker (a Ray task on another node too) derives its own scratch from the same base.
    scratch = os.path.abspath(opts.scratch) if opts.scratch and root.remote else ""
    job = ShardJob(
        root.location, scratch, opts.name, source.loader(), source.multi_label, opts.resize_max, opts.quality
    )
    results: dict[tuple[str, int], ShardResult] = {}
    with Executor(opts.workers, opts.use_ray) as executor:
        if supports_ranges(source):  # planned in parallel: the driver sees no item
            planner = RangedPlanner.make(source, root, scratch, fingerprint, opts)
            planner.survey(executor)
            planner.seal()
            rows = sum(r.rows for r in planner.ranges)
            with _progress(rows, opts.progress, "listing", "row") as bar:
                planner.list(executor, bar.update)
            planner.sort(executor)
            if planner.num_inputs == 0:
                raise DatasetError(f"{source.where}: no inputs found")
            total, write, tasks, shared = (
                planner.items(),
                write_slice,
                planner.shard_tasks(),
                (planner.plan, job),
            )
        else:
            planner = _serial_planner(root, source, opts, fingerprint)
            total, write, tasks, shared = planner.total, write_planned_shard, planner.tasks(), job
        with _progress(total, opts.progress) as bar:
            for r in executor.map(write, tasks, shared):
                results[(r.split, r.index)] = r
                if r.resumed and bar.total:  # not work done now: keep images/s and the ETA honest
                    bar.total -= r.planned
                    bar.refresh()
                else:
                    bar.update(r.planned)
        if planner.num_inputs == 0:  # a generated source lists as its shards are written
            raise DatasetError(f"{source.where}: no inputs found")
        serial = isinstance(planner, Planner)
        if serial:
            reasons: dict[str, int] = {}
            errors = _counted(ErrorLog.batches(planner.errors.path), reasons)
        else:
            errors, reasons = planner.error_tables(), planner.error_reasons()
        try:
            report = _finish(
                executor,
                root,
                scratch,
                source,
                opts,
                planner.num_inputs,
                errors,
                reasons,
                results,
                command,
                options or {},
            )
            if serial:
                planner.errors.path.unlink(missing_ok=True)
            elif report.failure is None:
                planner.clean()
        except OSError as exc:  # writing the index, errors or manifest: the storage, not an input
            raise DatasetError(f"{root.describe()}: cannot finish the dataset ({exc})") from None
    report.seconds = time.perf_counter() - t0
    return report


def _counted(batches: Iterable[list[tuple[str, str, str]]], reasons: dict[str, int]) -> Iterator:
    """The serial listing's error rows as tables, counted per kind of reason into `reasons` as they go."""
    for rows in batches:
        count_reasons((reason for _, _, reason in rows), reasons)
        yield listing_table(rows)


def _serial_planner(root: DatasetDir, source: Source, opts: BuildOptions, fingerprint: str) -> Planner:
    """Every other source: listed (and hash-ordered) on this process, tasks streamed as they are planned."""
    planner = Planner(
        root.scratch,
        source,
        fingerprint,
        name=opts.name,
        max_count=opts.max_count,
        max_size=opts.max_size,
        val_fraction=opts.val_fraction,
        seed=opts.seed,
    )
    if source.mix:  # the whole listing comes first (hash order): count it where people can see
        with tqdm(
            unit="file", desc="listing", file=sys.stderr, disable=not opts.progress, mininterval=1.0
        ) as bar:
            planner.on_input = bar.update
            planner.total = planner.prepare()
        planner.on_input = None
    else:
        planner.total = planner.prepare()
    return planner


def _finish(
    executor: Executor,
    root: DatasetDir,
    scratch: str,
    source: Source,
    opts: BuildOptions,
    num_inputs: int,
    listing_errors: Iterable,
    listing_reasons: dict[str, int],
    results: dict[tuple[str, int], ShardResult],
    command: str,
    options: dict,
) -> BuildReport:
    ordered = [results[k] for k in sorted(results)]
    _remove_stale(root, opts.name, ordered)
    job = FinishJob(root.location, scratch, opts.name, source.multi_label)
    reasons = finish_index(executor, root, job, ordered, listing_errors, listing_reasons)
    report = BuildReport(out=root, num_inputs=num_inputs, reasons=reasons)
    report.num_errors = sum(reasons.values())
    report.num_written = sum(r.count for r in ordered)
    report.num_new = sum(r.count for r in ordered if not r.resumed)
    report.num_shards = sum(1 for r in ordered if r.count)
    report.resumed_shards = sum(1 for r in ordered if r.resumed)
    report.over_size = [r.path for r in ordered if opts.max_size and r.bytes > opts.max_size]
    for r in ordered:
        report.totals[r.split] = report.totals.get(r.split, 0) + r.count
    fraction = report.num_errors / max(1, report.num_inputs)
    if fraction > opts.max_errors:
        report.failure = (
            f"{report.num_errors} of {report.num_inputs} inputs rejected ({fraction:.1%}), more than "
            f"--max-errors {opts.max_errors:g}; see {root.describe(ERRORS)}. No manifest written. Fix the inputs, "
            f"or re-run with a higher --max-errors to accept them (complete shards are reused)."
        )
        return report
    manifest = Manifest(
        classes=list(source.classes),
        multi_label=source.multi_label,
        shards=[ShardInfo(r.split, r.path, r.count, r.bytes, r.sha256) for r in ordered if r.count],
        command=command,
        options=options,
        name=opts.name,
        num_inputs=report.num_inputs,
        num_errors=report.num_errors,
        # Only a source that stores masks (synthetic --layout) has this: the other sources leave it out.
        segmentation_classes=getattr(source, "segmentation_classes", None),
        # Sources that store boxes: synthetic --layout, and a manifest with a boxes column.
        detection_classes=getattr(source, "detection_classes", None),
    )
    write_manifest(root, manifest)  # last: its presence marks the dataset complete
    report.manifest = manifest
    return report


def _remove_stale(root: DatasetDir, name: str, results: list[ShardResult]) -> None:
    """Shards and sidecars of this name that the plan no longer has (an earlier, larger run)."""
    pattern = re.compile(rf"^{re.escape(name)}-\d{{6}}\.(tar|tar\.tmp|json|json\.tmp)$")
    keep = {r.path for r in results if r.count}
    keep |= {f"{WORK}/{r.split}/{Path(r.path).stem}.json" for r in results}
    splits = [d for d in root.list_dirs() if not d.startswith(".")]
    for folder in splits + [f"{WORK}/{split}" for split in splits]:
        for f in root.list_files(folder):
            if pattern.match(f) and f"{folder}/{f}" not in keep:
                root.delete(f"{folder}/{f}")
