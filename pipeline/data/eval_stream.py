"""The evaluation stream of one rank: a finite, deterministic pass, every sample exactly once over all ranks.

No shuffle, resize + centre crop (detection: the whole image resized, boxes as fractions of it). Every
rank yields the same number of batches (`num_batches`); the last ones are padded with a repeated sample
marked `valid=False` ([B] bool). Samples go to ranks by shard (rank r reads shards r, r + world_size, ...)
when there are at least as many shards as ranks, else by sample index (i % world_size); `by_shard` says
which. Each loader worker takes a contiguous block of the rank's batches (it opens only the shards that
block needs), so a full pass holds the same samples whatever num_workers is, but the first k batches do
not. Corrupt samples and unreadable
shards are skipped and counted in `skipped` (their slots stay padding) up to `max_skip_fraction` of the
pass, checked once more when the pass ends however few samples it read; then the error names the shard.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Iterator

import numpy as np
import torch
from PIL import Image
from torch.utils.data import IterableDataset

from pipeline.data.batching import BatchBuilder, decode, decode_boxes, decode_pair, loader_worker
from pipeline.data.shard_reader import SkipCounter, count_samples, read_shards
from pipeline.data.sources import DatasetInfo
from pipeline.data.transforms import eval_boxes, eval_pair, eval_tensor

log = logging.getLogger(__name__)


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
        interpolation: str = "bilinear",
        max_skip_fraction: float = 0.01,
        masks: bool = False,
        boxes: int = 0,
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
        self.interpolation = interpolation
        self.max_skip_fraction = max_skip_fraction
        self.mask_classes = info.mask_classes() if masks else 0
        self.masks = masks
        self.box_classes = info.box_classes() if boxes else 0
        self.boxes = boxes
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
            rank,
            world_size,
            self.num_samples,
            starts[-1],
            "shard" if self.by_shard else "sample index",
            self.num_batches,
            batch_size,
            self.num_batches * batch_size - self.num_samples,
        )

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

    def _transform(self, img: Image.Image) -> torch.Tensor:
        return eval_tensor(img, self.img_size, self.crop_fraction, self.interpolation)

    def _pair(self, img: Image.Image, mask: Image.Image) -> tuple[torch.Tensor, torch.Tensor]:
        return eval_pair(img, mask, self.img_size, self.crop_fraction, self.interpolation)

    def _boxes(self, img: Image.Image, boxes: np.ndarray):
        return eval_boxes(
            img, boxes, self.img_size, self.interpolation
        )  # the whole image: a centre crop would cut objects

    def __iter__(self) -> Iterator[dict]:
        worker, num_workers = loader_worker()
        lo, hi = worker * self.num_batches // num_workers, (worker + 1) * self.num_batches // num_workers
        if lo == hi:
            return
        counter = SkipCounter(self.max_skip_fraction, f"eval rank {self.rank} worker {worker}")
        info, bs = self.info, self.batch_size
        builder = BatchBuilder(
            bs, self.img_size, info.num_classes, info.multi_label, masks=self.masks, boxes=self.boxes
        )
        last: list = []  # the last real sample, to repeat into padding slots

        def batch() -> dict:
            builder.pad(last)
            return builder.take(valid=builder.valid, skipped=counter.bad)

        b = lo
        for pos, sample in self._samples(lo * bs, min(hi * bs, self.num_samples), counter):
            while pos >= (b + 1) * bs:
                yield batch()
                b += 1
            mask = objects = None
            try:
                if self.boxes:
                    image, objects, labels = decode_boxes(
                        sample, info.multi_label, info.num_classes, self.box_classes, self.boxes, self._boxes
                    )
                elif self.masks:
                    image, mask, labels = decode_pair(
                        sample, info.multi_label, info.num_classes, self.mask_classes, self._pair
                    )
                else:
                    image, labels = decode(sample, info.multi_label, info.num_classes, self._transform)
            except Exception as exc:  # skipped and counted; its slot stays padding
                counter.skip(sample.get("__url__", "?"), f"sample {sample.get('__key__')}", exc)
                continue
            counter.good()
            builder.put(pos - b * bs, image, labels, sample["__key__"], mask, objects)
        counter.finish()  # a small split never reaches the running check's minimum: judge the whole pass
        while b < hi:
            yield batch()
            b += 1
