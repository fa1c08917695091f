"""Shards -> uint8 batches, split disjointly per rank and per loader worker.

The stream is endless: epoch e reads every shard once across all (rank, worker) pairs in an
order drawn from (seed, e), the in-worker shuffle draws from (seed, e, rank, worker) and each
sample's augmentation from (seed, e, rank, worker, i), so the same seed gives the same batches.
Training is step-driven, so every rank runs the same number of steps and uneven shards can never
leave one rank waiting in a collective.

Resume guarantee: `start_batch=M` continues the rank's stream exactly where batch M-1 ended. The
DataLoader takes batches from its workers round-robin, so worker w has produced ceil((M - w) / W)
of the first M batches; it skips that many batches' worth of samples without decoding them (the
shuffle is replayed, the augmentation RNG is per sample). Samples that fail to decode are skipped,
so after corrupt data the position can be off by the number of corrupt samples in the skipped part.
"""

from __future__ import annotations

import io
import json
import logging
import signal
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from PIL import Image
from torch.utils.data import DataLoader, IterableDataset, get_worker_info
from webdataset.tariterators import tarfile_samples

from data_prep.layout import DatasetError, read_manifest
from pipeline.data.transforms import eval_transform, train_transform

log = logging.getLogger(__name__)
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


@dataclass
class DatasetInfo:
    urls: list[str]
    num_classes: int
    multi_label: bool
    num_samples: int


def dataset_info(root: str | Path, split: str = "train") -> DatasetInfo:
    """Shard URLs and exact counts of one split, read through the layout's manifest."""
    root = Path(root)
    manifest = read_manifest(root)
    shards = manifest.split_shards(split)
    if not shards:
        raise DatasetError(f"{root}: the manifest lists no shards for split {split!r}")
    return DatasetInfo(
        urls=[str(root / s.path) for s in shards],
        num_classes=len(manifest.classes),
        multi_label=manifest.multi_label,
        num_samples=sum(s.count for s in shards),
    )


def _shuffle(samples: Iterator[dict], bufsize: int, rng: np.random.Generator) -> Iterator[dict]:
    """Reservoir-style shuffle buffer with an explicit generator (no global RNG)."""
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


class ShardStream(IterableDataset):
    """Endless stream of uint8 batches for one rank; each DataLoader worker reads its own shards."""

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
        train: bool = True,
        start_batch: int = 0,
    ):
        slots = world_size * max(1, num_workers)
        if len(info.urls) < slots:
            raise DatasetError(
                f"{len(info.urls)} shards cannot be split over {world_size} ranks x {max(1, num_workers)} "
                f"loader workers; write at least {slots} shards (vitpipe shard --max-count) or use fewer workers"
            )
        self.info = info
        self.rank, self.world_size = rank, world_size
        self.batch_size, self.img_size = batch_size, img_size
        self.seed, self.shuffle_buffer, self.min_scale, self.train = seed, shuffle_buffer, min_scale, train
        self.start_batch = start_batch

    @staticmethod
    def batches_done_by_worker(start_batch: int, worker: int, num_workers: int) -> int:
        """Of the rank's first `start_batch` batches, how many came from `worker` (round-robin)."""
        return max(0, (start_batch - worker + num_workers - 1) // num_workers)

    def shards_for(self, epoch: int, worker: int, num_workers: int) -> list[str]:
        order = np.random.default_rng([self.seed, epoch]).permutation(len(self.info.urls))
        mine = order[self.rank :: self.world_size][worker::num_workers]
        return [self.info.urls[i] for i in mine]

    def _decode(self, sample: dict, rng: np.random.Generator):
        ext = next((e for e in IMAGE_EXTS if e in sample), None)
        if ext is None:
            raise ValueError(f"no image ({'/'.join(IMAGE_EXTS)}) in sample")
        with Image.open(io.BytesIO(sample[ext])) as img:
            img.draft("RGB", (self.img_size, self.img_size))  # JPEG: decode at reduced scale if possible
            arr = (
                train_transform(img, self.img_size, rng, self.min_scale)
                if self.train
                else eval_transform(img, self.img_size)
            )
        if self.info.multi_label:
            target = torch.zeros(self.info.num_classes)
            target[json.loads(sample["json"])["labels"]] = 1.0
        else:
            target = torch.tensor(int(sample["cls"]))
        return torch.from_numpy(arr), target

    def __iter__(self):
        wi = get_worker_info()
        worker, num_workers = (wi.id, wi.num_workers) if wi else (0, 1)
        skipped = 0

        def on_read_error(exc: Exception) -> bool:  # a truncated or unreadable tar: skip, count, go on
            nonlocal skipped
            skipped += 1
            log.warning("rank %d worker %d: skipping unreadable data: %s", self.rank, worker, exc)
            return True

        images, targets = [], []
        to_skip = self.batches_done_by_worker(self.start_batch, worker, num_workers) * self.batch_size
        epoch = 0
        while True:
            shuffle_rng = np.random.default_rng([self.seed, epoch, self.rank, worker])
            urls = [{"url": u} for u in self.shards_for(epoch, worker, num_workers)]
            samples = _shuffle(
                tarfile_samples(iter(urls), handler=on_read_error), self.shuffle_buffer, shuffle_rng
            )
            for i, sample in enumerate(samples):
                if to_skip:  # resuming: these were consumed before the checkpoint
                    to_skip -= 1
                    continue
                try:
                    image, target = self._decode(
                        sample, np.random.default_rng([self.seed, epoch, self.rank, worker, i])
                    )
                except Exception as exc:  # a corrupt sample is skipped and counted, never fatal here
                    skipped += 1
                    log.warning("skipping %s in %s: %s", sample.get("__key__"), sample.get("__url__"), exc)
                    continue
                images.append(image)
                targets.append(target)
                if len(images) == self.batch_size:
                    yield {"image": torch.stack(images), "target": torch.stack(targets), "skipped": skipped}
                    images, targets = [], []
            epoch += 1


def _ignore_sigterm(worker_id: int) -> None:
    # A launcher's SIGTERM (torchrun, a scheduler) reaches the whole process group: loader workers must
    # not die of it, or the rank fails before it can checkpoint. The rank shuts its workers down itself.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)


def make_train_loader(
    root: str | Path,
    *,
    rank: int,
    world_size: int,
    batch_size: int,
    img_size: int,
    seed: int,
    num_workers: int,
    shuffle_buffer: int,
    min_scale: float,
    start_batch: int = 0,
) -> tuple[DataLoader, DatasetInfo]:
    info = dataset_info(root, "train")
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
