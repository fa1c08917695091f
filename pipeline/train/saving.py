"""Saving a checkpoint: the step waits for a copy of the state in host memory, the rest runs beside training.

    saver = Checkpointer(engine, ckpt_dir, rank, keep_last, local_rank=..., store=..., asynchronous=True)
    saver.save(step, extra, meta, more=ema.snapshot)   # returns once every rank holds its host copy
    ...                                                # training goes on; the files are written meanwhile
    saver.wait()                                       # the save is complete (or raises, naming the rank)

On the step's path (every rank, a collective): leftovers of an interrupted save of this tag removed,
DeepSpeed's `save_checkpoint` run with a checkpoint engine that copies each state dict to host memory
instead of writing it (`HostSnapshot`: ZeRO partitions, optimizer moments, the model states), this rank's
random states and the stage's `extra` taken, and the caller's further state (`more`: the weight EMA) copied.

On a background thread (one per rank, at most one save in flight: the next `save` first waits for the last):
the copies are written into the tag on the local disk, hashed and uploaded to the store (a few files at
once), then the ranks gather their file lists over a gloo group of their own (collectives on a second
thread must not share a group with the training's), and rank 0 writes COMPLETE.json and `latest` locally,
then on the store after every rank's upload: the tag is complete only then, so a process killed during a
background write or upload leaves the previous checkpoint the newest. Every node's first local rank then
writes its own COMPLETE.json where rank 0's disk is not its own, and prunes its disk to `keep_last` tags.

A failure on any rank (a full disk, a refused upload) leaves the tag incomplete everywhere, and `wait` (or
the next `save`) raises it on every rank with the rank that failed. `asynchronous=False` runs the same
steps on the calling thread (and the control group), so `save` returns with the tag complete.

What the layout of a tag is: `pipeline.train.tag`; how a resume reads it: `pipeline.train.checkpoint`.
"""

from __future__ import annotations

import copy
import json
import logging
import shutil
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.distributed as dist

from data_prep import atomic
from data_prep.storage import Store
from data_prep.tario import file_sha256
from pipeline.distributed import deepspeed_module
from pipeline.train.tag import COMPLETE, LATEST, owned_by, prune_local, rng_state, stale_tags, tag_for

# DeepSpeed imported as every rank needs it (without the mlflow import of its autotuner: 0.9 s of CPU per
# process) before the names below are taken from it; this module is the first of a rank's to import it.
deepspeed_module()
from deepspeed.runtime.checkpoint_engine import TorchCheckpointEngine  # noqa: E402
from deepspeed.runtime.checkpoint_engine.checkpoint_engine import CheckpointEngine  # noqa: E402

log = logging.getLogger(__name__)

UPLOADS = 4  # files of one rank uploaded at once


class CheckpointError(RuntimeError):
    """A save that did not complete: the tag is not marked complete on any node or on the store."""


def host_copy(obj):
    """`obj` with every tensor copied to host memory (its own storage: a view no longer drags its base
    along), containers copied, anything else shared (DeepSpeed's configs, version strings)."""
    if isinstance(obj, torch.Tensor):
        return obj.detach().to("cpu", copy=True)
    if isinstance(obj, dict):
        out = copy.copy(obj)  # keeps OrderedDict / defaultdict
        for k, v in obj.items():
            out[k] = host_copy(v)
        return out
    if isinstance(obj, list):
        return [host_copy(v) for v in obj]
    if isinstance(obj, tuple):
        items = [host_copy(v) for v in obj]
        if all(a is b for a, b in zip(items, obj)):
            return (
                obj  # immutable and holds no tensor: itself (a torch.Size stays one: zero_to_fp32 needs it)
            )
        return type(obj)(*items) if hasattr(obj, "_fields") else type(obj)(items)
    return obj


class HostSnapshot(TorchCheckpointEngine):
    """DeepSpeed's checkpoint engine for one save: `save(state, path)` keeps a host copy of `state` for
    `path`; nothing reaches the disk until `write()` (the background thread). Loading is Torch's."""

    def __init__(self, zipfile_serialization: bool = False) -> None:
        CheckpointEngine.__init__(self)  # not Torch's: it logs a line on rank 0 at every construction
        self.name = "HostSnapshot"
        self.zipfile_serialization = zipfile_serialization  # the engine's own engine's (DeepSpeed's config)
        self.pending: list[tuple[str, object]] = []

    def save(self, state_dict, path: str) -> None:
        self.pending.append((path, host_copy(state_dict)))

    def preserves_storage_sharing(self) -> bool:
        return (
            False  # host_copy already gives every tensor its own storage: DeepSpeed's clone would copy twice
        )

    def write(self) -> None:
        while self.pending:
            path, state = self.pending.pop(0)  # each copy freed once written
            torch.save(state, path, _use_new_zipfile_serialization=self.zipfile_serialization)


@dataclass
class _Save:
    """One save in flight on this rank: what is left to write, and how it ended."""

    step: int
    tag_dir: Path
    snapshot: HostSnapshot
    more: Callable[[Path], object] | None
    meta: dict
    started: float = field(default_factory=time.perf_counter)
    thread: threading.Thread | None = None
    error: str | None = None  # set on every rank when any rank failed
    seconds: float = 0.0  # from save() to complete, on this rank


class Checkpointer:
    """Saves of one stage's engine into `ckpt_dir` (and `store`), at most one in flight.

    Collective: every rank constructs it at the same point (an asynchronous one creates its gloo group) and
    calls `save` at the same steps (rank-0-only saving hangs, DeepSpeed issue 2993). `extra`, the stage's
    state beside the engine's (the data stream's position), is the same on every rank: rank 0's file holds
    it. `meta` goes into COMPLETE.json (the loop records its batch shape: a resume on another world size
    keeps it). `more()` copies this rank's further state now and returns its writer into the tag (the weight
    EMA's), files named with `rank_R_` so that they are this rank's (`owned_by`): checked, listed, uploaded.
    Every node's first local rank (`local_rank` 0) tends its own disk: without a shared filesystem the other
    nodes' tags are not on rank 0's disk."""

    def __init__(
        self,
        engine,
        ckpt_dir: Path,
        rank: int,
        keep_last: int,
        *,
        local_rank: int = 0,
        store: Store | None = None,
        group=None,
        asynchronous: bool = True,
    ) -> None:
        self.engine, self.ckpt_dir, self.rank, self.keep_last = engine, ckpt_dir, rank, keep_last
        self.local_rank, self.store, self.asynchronous = local_rank, store, asynchronous
        # A second thread's collectives need a group no other thread uses: gloo, whatever trains.
        self.group = dist.new_group(backend="gloo") if asynchronous else group
        self._current: _Save | None = None
        self.completed: list[tuple[int, float]] = []  # (step, seconds from save() to complete) on this rank

    def save(
        self,
        step: int,
        extra: dict | None = None,
        meta: dict | None = None,
        more: Callable[[], Callable[[Path], object]] | None = None,
    ) -> Path:
        self.wait()  # at most one in flight; a failure of the last one is raised here
        tag = tag_for(step)
        tag_dir = self.ckpt_dir / tag
        if self.local_rank == 0 and tag_dir.exists():
            # A leftover of a run killed mid-save: never mix old and new files. On a shared disk every node
            # removes it; whichever comes second finds (part of) it gone.
            shutil.rmtree(tag_dir, ignore_errors=True)
        if self.rank == 0 and self.store is not None:
            self.store.delete_dir(tag)  # likewise remotely (COMPLETE.json goes first with the folder)
        dist.barrier()
        own = self.engine.checkpoint_engine
        snapshot = HostSnapshot(getattr(own, "zipfile_serialization", False))
        self.engine.checkpoint_engine = snapshot
        try:
            self.engine.save_checkpoint(
                str(self.ckpt_dir), tag=tag, client_state={"step": step}, save_latest=False
            )
        finally:
            self.engine.checkpoint_engine = own
        # `extra` describes the whole stage (the data stream's deal), the same on every rank: written once.
        state = {"rng": rng_state(), "extra": (extra or {}) if self.rank == 0 else {}}
        snapshot.pending.append((str(tag_dir / f"rank_{self.rank}.pt"), host_copy(state)))
        job = _Save(step, tag_dir, snapshot, more() if more is not None else None, meta or {})
        self._current = job
        if self.asynchronous:
            job.thread = threading.Thread(target=self._finish, args=(job,), name=f"save-{tag}", daemon=False)
            job.thread.start()
        else:
            self.wait()
        return tag_dir

    def wait(self) -> Path | None:
        """Block until the save in flight is complete; its tag (None without one). Raises CheckpointError,
        on every rank, when it failed on any."""
        job, self._current = self._current, None
        if job is None:
            return None
        if job.thread is not None:
            job.thread.join()
        else:
            self._finish(job)
        if job.error is not None:
            raise CheckpointError(f"checkpoint {job.tag_dir} was not saved: {job.error}")
        return job.tag_dir

    @property
    def in_flight(self) -> bool:
        return (
            self._current is not None and self._current.thread is not None and self._current.thread.is_alive()
        )

    def _finish(self, job: _Save) -> None:
        """Write, hash and upload this rank's files, then mark the tag complete with the other ranks."""
        files, failure = None, None
        try:
            job.snapshot.write()
            if job.more is not None:
                job.more(job.tag_dir)
            mine = sorted(
                p
                for p in job.tag_dir.iterdir()
                if p.is_file() and owned_by(p.name, self.rank) and p.name != COMPLETE
            )
            files = {p.name: {"bytes": p.stat().st_size, "sha256": file_sha256(p)} for p in mine}
            if self.store is not None:
                with ThreadPoolExecutor(min(UPLOADS, max(1, len(mine)))) as pool:
                    for f in [
                        pool.submit(self.store.upload, p, f"{job.tag_dir.name}/{p.name}") for p in mine
                    ]:
                        f.result()
        except Exception as exc:  # reported through the gather: the other ranks must not wait for this one
            failure = f"rank {self.rank}: {type(exc).__name__}: {exc}"
            log.error("saving %s: %s", job.tag_dir, failure)
        try:
            self._complete(job, files, failure)
        except Exception as exc:  # a collective that failed (a rank gone): this save is not complete
            job.error = job.error or f"rank {self.rank}: {type(exc).__name__}: {exc}"
            log.error("completing %s: %s", job.tag_dir, job.error)
        job.seconds = time.perf_counter() - job.started
        if job.error is None:
            self.completed.append((job.step, job.seconds))  # read (and cleared) by the loop's log step

    def _complete(self, job: _Save, files: dict | None, failure: str | None) -> None:
        world = dist.get_world_size()
        parts: list | None = [None] * world if self.rank == 0 else None
        dist.gather_object((files, failure), parts, dst=0, group=self.group)
        box: list = [None]
        if self.rank == 0:
            failures = [f for _, f in parts if f]
            text = None
            if not failures:
                record = {
                    "step": job.step,
                    "world_size": world,
                    **job.meta,
                    "files": {k: v for part, _ in parts for k, v in sorted(part.items())},
                }
                text = json.dumps(record, indent=1)
                try:
                    atomic.write_text(job.tag_dir / COMPLETE, text)
                    atomic.write_text(self.ckpt_dir / LATEST, job.tag_dir.name)
                    if self.store is not None:
                        # after every rank's upload: the stored tag is complete from here on
                        self.store.write_text(f"{job.tag_dir.name}/{COMPLETE}", text)
                        self.store.write_text(LATEST, job.tag_dir.name)
                        for old in stale_tags(self.store.list_dirs(), job.tag_dir.name, self.keep_last):
                            self.store.delete_dir(old)
                except Exception as exc:
                    failures.append(f"rank 0 marking it complete: {type(exc).__name__}: {exc}")
                    text = None
            box[0] = (text, "; ".join(failures) or None)
        dist.broadcast_object_list(box, src=0, group=self.group)
        text, job.error = box[0]
        if (
            text is not None
            and self.local_rank == 0
            and self.rank != 0
            and not (job.tag_dir / COMPLETE).exists()
        ):
            # A node whose disk rank 0 does not share: its ranks' part of the tag is complete too (rank 0
            # wrote its copy before the broadcast, so on a shared disk this finds it and writes nothing).
            # Nodes sharing a disk rank 0 does not write each their own temporary. A failure (a full disk)
            # still reaches the barrier, where the other ranks wait: the tag stays incomplete on this disk
            # only (complete on rank 0's and the store), and this disk keeps its older tags.
            try:
                atomic.write_text(job.tag_dir / COMPLETE, text, shared=True)
                atomic.write_text(self.ckpt_dir / LATEST, job.tag_dir.name, shared=True)
            except OSError as exc:
                why = f"{type(exc).__name__}: {exc}"
                log.error("rank %d: marking %s complete on this node: %s", self.rank, job.tag_dir, why)
                text = None
        dist.barrier(group=self.group)  # the new tag is complete: older ones may go, on every node's disk
        if text is not None and self.local_rank == 0:
            prune_local(self.ckpt_dir, job.tag_dir.name, self.keep_last)
