"""The training stream of one rank: endless (or `epochs`-long), step-driven, resumable exactly.

Two modes:
- epoch mode (default): with exact counts (a manifest), epoch e lays the shards end to end in an order
  drawn from (seed, e) and cuts the samples into runs of whole batches, one per (rank, worker) slot
  (`deal.slot_range`): every rank yields `epoch_batches` = samples // (ranks x batch_size) batches per
  epoch, its workers within one batch of each other, and an epoch reads every sample once but fewer
  than ranks x batch_size; `epochs=N` ends every rank after the same N x epoch_batches batches. Without
  counts (bare URLs) epoch e deals whole shards over the slots (at least one each), epochs flow into
  one another and `epoch_batches` is None; so do streams resumed from a checkpoint of before
  (`Deal.epochs`), with the quota of the worst share (`sources.epoch_batches()`).
- resampled mode (`resampled=True`, JFT scale): no epochs; each worker draws shards with
  replacement from an rng seeded by (seed, rank, worker), in rounds of shards/slots shards.
The in-worker shuffle of each epoch or round draws from (seed, epoch or round, rank, worker) and
each sample's augmentation from that plus its index, so the same seed gives the same batches.

Resume: `start_batch=M` continues the rank's stream exactly where batch M-1 ended, M counted from the
start of its deal (`pipeline.data.deal`: which slot reads what, and the carry of an epoch begun on
another world size, read before the deal's own epochs).
1. Who made what. The DataLoader takes batches from its W workers round-robin, so batch b came from
   worker b % W, and worker w made ceil((M - w) / W) of the first M batches
   (`batches_done_by_worker`). A resumed DataLoader starts asking at process 0 again, so process k
   plays worker (k + M) % W: the stream's batch M comes from process 0.
2. Where that worker was. Call its batches done D.
   - Epoch mode with counts: every epoch the worker yields exactly Q batches (its quota), so it
     starts at epoch D // Q without reading anything, with D % Q batches of that epoch made: it skips
     (D % Q) x batch_size samples of it.
   - Resampled mode with counts: the rounds' shard draws and the manifest's counts say how many
     samples each round holds, so whole rounds are skipped unread; the skip count carries the rest.
   - Without counts: the worker reads (never decodes) D x batch_size samples from the start.
3. Why that is exact. Skipped samples still pass through the shuffle buffer, so the shuffle's draws
   replay; the augmentation generator is per sample (`seeds.sample_rngs`), so nothing is replayed
   for it. Samples that fail to decode are skipped, so after corrupt data in the skipped part the
   position can be off by that many samples.
"""

from __future__ import annotations

import io
import itertools
import logging
from collections.abc import Iterator
from dataclasses import dataclass, replace
from functools import partial

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset

from data_prep.layout import DatasetError
from pipeline.data import seeds
from pipeline.data.batching import (
    BatchBuilder,
    decode,
    decode_boxes,
    decode_pair,
    image_bytes,
    loader_worker,
    sample_labels,
)
from pipeline.data.deal import (
    SAMPLES,
    Deal,
    Piece,
    batches_done_by_worker,
    position,
    rank_quota,
    slot_quota,
)
from pipeline.data.shard_reader import SkipCounter, read_shards
from pipeline.data.sources import DatasetInfo, epoch_batches
from pipeline.data.transforms import train_boxes, train_crop_plan, train_pair, train_tensor

log = logging.getLogger(__name__)


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


@dataclass(frozen=True)
class _Round:
    """One epoch (epoch mode), one round of drawn shards (resampled mode) or one carried piece of an
    earlier deal's epoch (`pipeline.data.deal`) of one worker."""

    index: int  # the epoch (or round) the samples belong to
    urls: list[str]
    shuffle_key: tuple[int, ...]
    augment_key: tuple[int, ...]  # keys the per-sample augmentation generators (`seeds.sample_rngs`)
    num_samples: int | None  # from the manifest
    quota: int | None  # batches this worker yields in it (epoch mode with counts); None: flows on
    skip: int = 0  # samples of its stream read past, unused (made before a resume, or by another slot)
    passed: int = 0  # samples of its first shard before its own run (another slot's): never its stream's
    limit: int | None = None  # samples of its shards that are its stream (from `passed` on); None: all
    made: int = 0  # batches of the quota made before a resume
    take: int | None = None  # a carried piece: samples to use after `skip`; its batches run on into the next
    ends_carry: bool = False  # the last carried piece: a batch it leaves unfilled is dropped


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
        decode: str = "cpu",
        masks: bool = False,
        boxes: int = 0,
        deal: Deal | None = None,
    ):
        if decode not in ("cpu", "cuda"):
            raise ValueError(f"decode must be 'cpu' or 'cuda', got {decode!r}")
        if decode == "cuda" and randaugment is not None:
            raise ValueError("decode='cuda' has no RandAugment (a PIL op): decode on the CPU")
        if masks and (decode != "cpu" or randaugment is not None):
            raise ValueError(
                "masks (segmentation) need decode='cpu' and no RandAugment: both move pixels off their mask"
            )
        if boxes and (decode != "cpu" or randaugment is not None):
            raise ValueError(
                "boxes (detection) need decode='cpu' and no RandAugment: its ops move pixels off their boxes"
            )
        self.mask_classes = info.mask_classes() if masks else 0
        self.box_classes = info.box_classes() if boxes else 0
        workers = max(1, num_workers)
        slots = world_size * workers
        deal = deal or Deal(world_size, workers, batch_size, 1)
        if (deal.world_size, deal.workers, deal.batch_size) != (world_size, workers, batch_size):
            raise ValueError(
                f"the deal is for {deal.world_size} ranks x {deal.workers} workers x batch {deal.batch_size}, "
                f"the stream has {world_size} x {workers} x {batch_size}: re-deal first (deal.continue_deal)"
            )
        if epochs is not None and (deal.carry or deal.base_step):
            raise ValueError("epochs=N counts from the initial deal: a re-dealt stream counts steps instead")
        # runs of samples need the counts; without them an epoch deals whole shards, at least one per slot
        self.runs = not resampled and info.shard_counts is not None and deal.epochs == SAMPLES
        if not resampled and not self.runs and len(info.urls) < slots:
            raise DatasetError(
                f"{len(info.urls)} shards cannot be split over {world_size} ranks x {workers} "
                f"loader workers; write at least {slots} shards (vitpipe shard --max-count), use fewer "
                f"workers, or stream with resampled=True"
            )
        if resampled and epochs is not None:
            raise ValueError("resampled streams have no epochs: leave epochs=None and count steps")
        if resampled:
            self.epoch_batches = None
        elif self.runs:
            self.epoch_batches = rank_quota(info.shard_counts, world_size, batch_size)
        else:
            self.epoch_batches = epoch_batches(info, world_size, batch_size, workers)
        if self.epoch_batches == 0 and self.runs:
            raise DatasetError(
                f"{info.urls[0]}...: {sum(info.shard_counts)} samples do not make one batch of {batch_size} "
                f"on each of {world_size} ranks; use a smaller batch or fewer ranks"
            )
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
        self.deal = deal
        self.randaugment, self.max_skip_fraction = randaugment, max_skip_fraction
        self.hflip, self.decode, self.masks, self.boxes = hflip, decode, masks, boxes
        self._counts = dict(zip(info.urls, info.shard_counts)) if info.shard_counts else None

    @staticmethod
    def batches_done_by_worker(start_batch: int, worker: int, num_workers: int) -> int:
        """Of the rank's first `start_batch` batches, how many came from `worker` (round-robin)."""
        return batches_done_by_worker(start_batch, worker, num_workers)

    def slot_piece(self, epoch: int, worker: int, num_workers: int) -> Piece:
        """Epoch mode: this rank's and worker's whole `epoch` (in runs of samples where the counts allow,
        else in whole shards)."""
        batch = self.batch_size if self.runs else 0
        return Piece(self.seed, epoch, self.world_size, num_workers, self.rank, worker, 0, 0, batch)

    def slot_run(self, epoch: int, worker: int, num_workers: int) -> tuple[list[str], int, int | None]:
        """This rank's and worker's shards in `epoch`, the samples of the first of them that are another
        slot's, and the samples of its run (None: every sample of its shards)."""
        shards, passed, n = self.slot_piece(epoch, worker, num_workers).extent(self.info)
        return [self.info.urls[i] for i in shards], passed, n

    def _piece_round(self, piece: Piece, quota: int | None, **extra) -> _Round:
        shards, passed, n = piece.extent(self.info)
        urls = [self.info.urls[i] for i in shards]
        return _Round(
            piece.epoch,
            urls,
            piece.shuffle_key,
            piece.augment_key,
            self._count(urls) if n is None else n,
            quota,
            passed=passed,
            limit=n,
            **extra,
        )

    def _count(self, urls: list[str] | tuple[str, ...]) -> int | None:
        return sum(self._counts[u] for u in urls) if self._counts else None

    def _epoch_rounds(self, worker: int, num_workers: int, first: int = 0) -> Iterator[_Round]:
        quota = slot_quota(self.deal, self.epoch_batches, worker)
        for e in itertools.count(first):
            if self.epochs is not None and e >= self.epochs:
                return
            yield self._piece_round(self.slot_piece(e, worker, num_workers), quota)

    def resampled_rounds(self, worker: int, num_workers: int) -> Iterator[_Round]:
        """Resampled mode: rounds of shards drawn with replacement from (seed, rank, worker), and the deal's
        base step after a re-deal (a stream resumed on another shape draws afresh). Base step 0 adds nothing
        to the keys: the streams of before there were deals."""
        urls, base = self.info.urls, self.deal.base_step
        extra = (base,) if base else ()
        draw = seeds.rng(seeds.DRAW, self.seed, self.rank, worker, *extra)
        per_round = max(1, len(urls) // (self.world_size * num_workers))
        for k in itertools.count():
            mine = [urls[i] for i in draw.integers(len(urls), size=per_round)]
            yield _Round(
                k,
                mine,
                (seeds.ROUND_SHUFFLE, self.seed, self.rank, worker, k, *extra),
                (seeds.ROUND_AUGMENT, self.seed, self.rank, worker, k, *extra),
                self._count(mine),
                None,
            )

    def _carried_rounds(self, pieces: tuple[Piece, ...]) -> list[_Round]:
        return [
            self._piece_round(p, None, skip=p.skip, take=p.take, ends_carry=i == len(pieces) - 1)
            for i, p in enumerate(pieces)
        ]

    def _resume(self, worker: int, num_workers: int) -> tuple[Iterator[_Round], int]:
        """The worker's rounds from its resume point and samples to skip (read, not decoded) before them
        beyond their own `skip` (the module docstring's step 2)."""
        done = self.batches_done_by_worker(self.start_batch, worker, num_workers)
        if not self.resampled and self.epoch_batches is not None:
            q = slot_quota(self.deal, self.epoch_batches, worker)
            pos = position(self.deal, self.rank * num_workers + worker, done, q)
            rounds = self._epoch_rounds(worker, num_workers, pos.epoch)
            if pos.carry:
                return itertools.chain(self._carried_rounds(pos.carry), rounds), 0
            first = next(rounds, None)
            if first is None:
                return iter(()), 0
            head = replace(first, skip=pos.within * self.batch_size, made=pos.within)
            return itertools.chain([head], rounds), 0
        to_skip = done * self.batch_size
        if not self.resampled:
            return self._epoch_rounds(worker, num_workers), to_skip
        rounds = self.resampled_rounds(worker, num_workers)
        for rnd in rounds:
            if rnd.num_samples is None or rnd.num_samples > to_skip:
                return itertools.chain([rnd], rounds), to_skip
            to_skip -= rnd.num_samples  # this whole round was consumed before the checkpoint
        raise AssertionError("unreachable: resampled rounds are endless")

    def _round_samples(self, rnd: _Round, counter: SkipCounter) -> Iterator[dict]:
        """The round's samples through the shuffle buffer. With a quota, a round that holds fewer
        readable samples than it owes (corrupt data) is read again rather than end the rank early."""
        shuffle_rng = seeds.rng(*rnd.shuffle_key)
        for repeat in itertools.count():
            good_before = counter.read - counter.bad
            samples = read_shards(rnd.urls, counter, self._counts)
            if rnd.passed or rnd.limit is not None:  # its run: read past the slot before's samples
                stop = None if rnd.limit is None else rnd.passed + rnd.limit
                samples = itertools.islice(samples, rnd.passed, stop)
            yield from _shuffle(samples, self.shuffle_buffer, shuffle_rng)
            if rnd.quota is None:
                return
            if repeat > 0 and counter.read - counter.bad == good_before:
                raise DatasetError(f"rank {self.rank}: no readable sample in {rnd.urls}")
            log.warning(
                "rank %d epoch %d: too few readable samples for the %d batches every worker owes; "
                "reading its shards again",
                self.rank,
                rnd.index,
                rnd.quota,
            )

    def _augment(self, img: Image.Image, rng: np.random.Generator) -> torch.Tensor:
        return train_tensor(img, self.img_size, rng, self.min_scale, self.randaugment, self.hflip)

    def _add(self, builder: BatchBuilder, sample: dict, rng: np.random.Generator) -> bool:
        """Decode and augment one sample into the batch (True when full). With decode="cuda" a JPEG goes in
        still encoded, with its crop box and flip drawn from the same `rng` as the CPU path draws them:
        only its header is read here. Other formats are decoded here either way."""
        multi, k = self.info.multi_label, self.info.num_classes
        if self.masks:
            image, mask, labels = decode_pair(
                sample,
                multi,
                k,
                self.mask_classes,
                partial(train_pair, size=self.img_size, rng=rng, min_scale=self.min_scale, hflip=self.hflip),
            )
            return builder.add(image, labels, sample["__key__"], mask)
        if self.boxes:
            image, objects, labels = decode_boxes(
                sample,
                multi,
                k,
                self.box_classes,
                self.boxes,
                partial(train_boxes, size=self.img_size, rng=rng, min_scale=self.min_scale, hflip=self.hflip),
            )
            return builder.add(image, labels, sample["__key__"], objects=objects)
        if self.decode == "cuda":
            data = image_bytes(sample)
            with Image.open(io.BytesIO(data)) as img:  # the header only: size and format
                if img.format == "JPEG" and img.mode in ("RGB", "L"):  # nvJPEG refuses CMYK and YCCK
                    labels = sample_labels(sample, multi, k)
                    box, flip = train_crop_plan(img.width, img.height, rng, self.min_scale, self.hflip)
                    return builder.add_encoded(data, box, flip, labels, sample["__key__"])
        image, labels = decode(sample, multi, k, partial(self._augment, rng=rng))
        return builder.add(image, labels, sample["__key__"])

    def __iter__(self) -> Iterator[dict]:
        process, num_workers = loader_worker()
        # The DataLoader asks its workers round-robin from process 0, but the uninterrupted stream's
        # batch M came from worker M % W: after a resume, process k plays worker (k + M) % W.
        worker = (process + self.start_batch) % num_workers
        counter = SkipCounter(self.max_skip_fraction, f"rank {self.rank} worker {worker}")
        multi, k = self.info.multi_label, self.info.num_classes
        builder = BatchBuilder(
            self.batch_size,
            self.img_size,
            k,
            multi,
            encoded=self.decode == "cuda",
            masks=self.masks,
            boxes=self.boxes,
        )
        rounds, to_skip = self._resume(worker, num_workers)
        for rnd in rounds:
            augment_rng = seeds.sample_rngs(*rnd.augment_key)
            to_skip += rnd.skip
            made, used = rnd.made, 0
            for i, sample in enumerate(self._round_samples(rnd, counter)):
                if to_skip:  # resuming: these were consumed before the checkpoint (or by another slot)
                    to_skip -= 1
                    continue
                try:
                    full = self._add(builder, sample, augment_rng(i))
                except Exception as exc:  # a corrupt sample is skipped and counted, never fatal here
                    counter.skip(sample.get("__url__", "?"), f"sample {sample.get('__key__')}", exc)
                    continue
                counter.good()
                used += 1
                if full:
                    yield builder.take(skipped=counter.bad, epoch=rnd.index)
                    made += 1
                    if rnd.quota is not None and made == rnd.quota:
                        break
                if rnd.take is not None and used == rnd.take:
                    break
            if rnd.quota is not None or rnd.ends_carry:
                builder.clear()  # the epoch's tail (fewer than a batch, or beyond the quota) is dropped
