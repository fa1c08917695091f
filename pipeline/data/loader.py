"""The two loader factories: a dataset's shards -> uint8 batches for one rank, split over its workers.

    info = dataset_info(cfg.data.train, "train", num_classes=cfg.data.num_classes,
                        multi_label=cfg.data.multi_label)              # pipeline/data/sources.py
    loader = make_train_loader(info, cfg.data, rank=0, world_size=1, img_size=224, seed=0, start_batch=0)
    loader = make_eval_loader(info, cfg.data, rank=0, world_size=2, batch_size=64, img_size=224)
    batch = next(iter(loader))
    # {"image": uint8 [B, 3, H, W], "target": long [B] | multi-hot float [B, K], "key": [B] str,
    #  "skipped": int (this worker's unreadable samples so far), eval only: "valid": bool [B]}

The pieces, each in its own module of pipeline/data/:
- sources.py       DatasetInfo, dataset_info: shard URLs and exact counts from a folder or URLs
- shard_reader.py  raw samples out of shard URLs (tar parsing: data_prep/tario.py), the corrupt-sample budget
- batching.py      decode a sample, fill preallocated shared-memory batches
- seeds.py         the seeded random streams (shard order, shuffles, augmentation)
- train_stream.py  ShardStream: epoch and resampled modes, and the exact-resume arithmetic
- eval_stream.py   EvalStream: one padded pass, every sample once over all ranks
- transforms.py    pure image transforms
The data config (`pipeline.config.DataConfig`) gives the batch size, workers, shuffle buffer,
augmentation and skip budget; the call gives what differs per rank and per run.
"""

from __future__ import annotations

import atexit
import os
import signal
import sys
import weakref

import torch
from torch.utils.data import DataLoader, IterableDataset

from pipeline.config import DataConfig
from pipeline.data.deal import Deal
from pipeline.data.eval_stream import EvalStream
from pipeline.data.sources import DatasetInfo
from pipeline.data.train_stream import ShardStream


def _own_process_group(worker_id: int) -> None:
    # A launcher's SIGTERM (torchrun, a scheduler, Ctrl-C) reaches the rank's whole process group: loader
    # workers must not die of it, or the rank fails before it can checkpoint. In a group of their own they
    # do not get it; the rank shuts them down itself. They still die of a SIGTERM sent to them: ignoring the
    # signal instead made an exiting process whose loader was left running (after an error) wait forever,
    # since multiprocessing ends daemonic children at exit with SIGTERM, then joins them.
    os.setpgrp()
    # The worker started with SIGTERM blocked (`_Loader`): one sent to the rank's group before the line above
    # is pending here. Take it off (sigtimedwait, Linux; elsewhere it is delivered as before this change),
    # then take SIGTERM again, with the handler torch's worker loop installed (its parent's SIGTERM ends it).
    if hasattr(signal, "sigtimedwait"):
        signal.sigtimedwait({signal.SIGTERM}, 0)
    signal.pthread_sigmask(signal.SIG_UNBLOCK, {signal.SIGTERM})


# The worker iterators of this process's loaders that may still run, for `_stop_live_workers` at exit.
_LIVE: weakref.WeakSet = weakref.WeakSet()


def _stop_live_workers() -> None:
    """At interpreter exit, stop every loader's workers still running (a stage that failed with its loader
    open): each is sent its stop message and joined, as when an iterator is deleted.

    Without this, multiprocessing's own exit handler ends them with SIGTERM and then joins them without a
    timeout; a worker still starting has SIGTERM blocked (`_Loader`) and then discards it as a group-wide
    one (`_own_process_group`), so it lived on and the exiting process waited for it forever (seen under a
    loaded CI). torch's iterator skips this clean-up once the interpreter is exiting, so it runs first:
    registered after torch's and multiprocessing's exit handlers (imported above), it is called before them.
    A worker that reads its stop message after it has started exits on its own, whatever became of SIGTERM.
    """
    for iterator in list(_LIVE):
        try:
            iterator._shutdown_workers()
        except Exception as exc:  # the others still get theirs
            print(f"loader: stopping workers at exit failed: {exc!r}", file=sys.stderr)


atexit.register(_stop_live_workers)
# A process forked from this one does not own these workers (loader workers leave through os._exit).
os.register_at_fork(after_in_child=_LIVE.clear)


class _Loader(DataLoader):
    """A DataLoader whose workers start with SIGTERM blocked, until they have left the rank's process group
    (`_own_process_group`): a group-wide SIGTERM while a worker was still starting killed it, and the rank
    failed with "DataLoader worker exited unexpectedly" instead of checkpointing (seen under a loaded CI)."""

    def __iter__(self):
        if self.num_workers == 0:
            return super().__iter__()
        # Per thread (Ray Train's loop thread too); forked workers inherit this thread's mask.
        blocked = signal.pthread_sigmask(signal.SIG_BLOCK, {signal.SIGTERM})
        try:
            iterator = super().__iter__()
            _LIVE.add(iterator)
            return iterator
        finally:  # a SIGTERM to the rank meanwhile is delivered here, to its own handler
            signal.pthread_sigmask(signal.SIG_SETMASK, blocked)


def _data_loader(
    stream: IterableDataset, num_workers: int, seed: int, pin_memory: bool = False, **kw
) -> DataLoader:
    """`pin_memory`: page-locked batches for a CUDA device's asynchronous copies, for a stage on a GPU only
    (pinning starts CUDA: a CPU stage on a host with GPUs would hold a context on the first of them)."""
    return _Loader(
        stream,
        batch_size=None,  # batches are built in the workers
        num_workers=num_workers,
        pin_memory=pin_memory,
        # Its own generator: drawing worker seeds from the global RNG would shift the model's random
        # stream (stochastic depth) by one draw on resume, and break exactness.
        generator=torch.Generator().manual_seed(seed),
        worker_init_fn=_own_process_group,
        **kw,
    )


def make_train_loader(
    info: DatasetInfo,
    data: DataConfig,
    *,
    rank: int,
    world_size: int,
    img_size: int,
    seed: int,
    start_batch: int = 0,
    epochs: int | None = None,
    masks: bool = False,
    boxes: int = 0,
    deal: Deal | None = None,
    pin_memory: bool = False,
) -> DataLoader:
    """The rank's training batches of `data.batch_size`, continuing at batch `start_batch` of `deal` (resume;
    `pipeline.data.deal`: which samples each rank and worker reads, and how that changes with the world size);
    `loader.dataset.epoch_batches` is its batches per epoch. `epochs`: stop after that many."""
    stream = ShardStream(
        info,
        rank=rank,
        world_size=world_size,
        batch_size=data.batch_size,
        img_size=img_size,
        seed=seed,
        num_workers=data.num_workers,
        shuffle_buffer=data.shuffle_buffer,
        min_scale=data.min_scale,
        start_batch=start_batch,
        resampled=data.resampled,
        epochs=epochs,
        randaugment=data.randaugment,
        hflip=data.hflip,
        max_skip_fraction=data.max_skip_fraction,
        decode=data.decode,
        masks=masks,
        boxes=boxes,
        deal=deal,
    )
    workers = data.num_workers
    return _data_loader(
        stream,
        workers,
        seed,
        pin_memory,
        persistent_workers=workers > 0,
        prefetch_factor=4 if workers > 0 else None,
    )


def make_eval_loader(
    info: DatasetInfo,
    data: DataConfig,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    img_size: int,
    crop_fraction: float = 0.875,
    interpolation: str = "bilinear",
    masks: bool = False,
    boxes: int = 0,
    pin_memory: bool = False,
) -> DataLoader:
    """One deterministic pass over `info`'s split; every rank yields `loader.dataset.num_batches` batches
    {"image", "target", "valid" [B] bool, "skipped"}: sum metrics over valid samples only."""
    stream = EvalStream(
        info,
        rank=rank,
        world_size=world_size,
        batch_size=batch_size,
        img_size=img_size,
        crop_fraction=crop_fraction,
        interpolation=interpolation,
        max_skip_fraction=data.max_skip_fraction,
        masks=masks,
        boxes=boxes,
    )
    return _data_loader(stream, data.num_workers, 0, pin_memory)
