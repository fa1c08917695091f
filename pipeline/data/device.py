"""Loader batches -> the training device; with `data.decode: cuda`, JPEGs decoded there in batches, a step ahead.

    to_device = batch_to_device(torch.device("cuda", 0), cfg.data, img_size=224)
    batch = to_device(next(batches))      # {"image": uint8 [B, 3, 224, 224] on the GPU, "target", ...}
    batches, to_device = prefetch(iter(loader), to_device, device)   # decode cuda: what the loop does
    batches.gpu_idle_seconds()            # GPU idle between batches since the last call (syncs: log steps only)

CPU decode (the default, the only path CI runs): the workers made the images; this moves the tensors
(pinned memory, non-blocking). CUDA decode: the workers send each RGB or grey JPEG still encoded with the
crop box and flip they drew (`BatchBuilder(encoded=True)`: no image tensor for those slots). `DeviceDecode`
decodes them with one batched nvJPEG call (torchvision's `decode_jpeg(device="cuda")`) and crops, resizes
and flips the whole batch at once (`crop_resize_flip_batch`: two batched matmuls, not kernels per image).
Slots the workers decoded (PNG, WebP) arrive as a tensor of just those images and go to their slots.

nvJPEG blocks the calling thread until its decode is done, so in the loop a `Prefetcher` thread runs
`DeviceDecode` on batch N+1, on a side stream, while the training stream runs step N; the training stream
waits on an event for the batch, never the host. It also measures, with CUDA events, how long the training
stream sat idle between one step's last kernel and the next batch's first: `data/gpu_idle_fraction`,
beside the host's `data/wait_fraction`.

A JPEG the GPU decoder refuses (its call raises: a header or stream it cannot parse) is replaced by another
image of the same batch and counted in the batch's "skipped", as the workers count the samples they cannot
read. nvJPEG's batched decoder may decode a body corrupt past its header to garbage without an error:
those are not seen here (`vitpipe shard verify` decodes every image of a dataset on the CPU).
The decoder is a parameter, so tests run this path, prefetcher included, on the CPU with a PIL decoder in
nvJPEG's place (`tests/test_gpu_path.py`); `bench/gpu.py` runs it on a GPU.
"""

from __future__ import annotations

import io
import logging
import queue
import threading
from collections.abc import Callable, Iterator
from functools import partial

import torch
from PIL import Image

from pipeline.config import DataConfig
from pipeline.data.transforms import crop_resize_flip_batch, to_hwc

log = logging.getLogger(__name__)

# A batch decoder: JPEG byte tensors (uint8, 1-D, on the CPU) -> uint8 [3, H, W] images on the device.
Decoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]
# The encoded batch's host-side fields (`BatchBuilder(encoded=True)`), read here and not moved.
ENCODED_KEYS = ("jpeg_data", "jpeg_offsets", "box", "flip", "decoded_slots")


def move(batch: dict, device: torch.device) -> dict:
    """Every tensor of the batch on `device` (non-blocking: the loader pins its batches on GPU hosts)."""
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def nvjpeg_decoder(device: torch.device) -> Decoder:
    """torchvision's batched GPU JPEG decoder (nvJPEG), RGB out whatever the JPEG's colour space."""
    try:
        from torchvision.io import ImageReadMode, decode_jpeg
    except ImportError as exc:  # not installed, or built for another torch
        raise RuntimeError(
            "data.decode: cuda needs torchvision built for the installed torch: pip install '.[gpu]' "
            f"(or set data.decode: cpu); importing it failed: {exc}"
        ) from None
    return partial(decode_jpeg, mode=ImageReadMode.RGB, device=device)


def pil_decoder(device: torch.device) -> Decoder:
    """The same contract on the CPU with PIL: tests run the CUDA-decode path with it."""

    def decode(jpegs: list[torch.Tensor]) -> list[torch.Tensor]:
        out = []
        for data in jpegs:
            with Image.open(io.BytesIO(data.numpy().tobytes())) as img:
                # contiguous [3, H, W], as nvJPEG returns its images
                out.append(to_hwc(img.convert("RGB")).permute(2, 0, 1).contiguous().to(device))
        return out

    return decode


def _decode_each(decoder: Decoder, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
    """All at once; when the batch call fails, one by one, None for each image that cannot be decoded."""
    try:
        return list(decoder(jpegs))
    except Exception:  # one bad image fails nvJPEG's whole batch: find it
        out: list[torch.Tensor | None] = []
        for data in jpegs:
            try:
                out.append(decoder([data])[0])
            except Exception as exc:
                log.warning(
                    "GPU JPEG decode failed (%s: %s); the sample is replaced", type(exc).__name__, exc
                )
                out.append(None)
        return out


def _copy_runs(dst: torch.Tensor, slots: list[int], src: torch.Tensor) -> None:
    """dst[slots[k]] = src[k] for every k, one copy per run of consecutive slots (slots ascending): a batch
    with a few slots of another kind costs a few copies, not one per image, and no index tensor on the device."""
    k = 0
    while k < len(slots):
        end = k + 1
        while end < len(slots) and slots[end] == slots[end - 1] + 1:
            end += 1
        dst[slots[k] : slots[end - 1] + 1] = src[k:end]
        k = end


class DeviceDecode:
    """`to_device` for encoded batches (`BatchBuilder(encoded=True)`): the usual batch, every image on
    `device`, made on the caller's current stream (the `Prefetcher`'s side stream in the loop). Reads only
    the batch's host tensors (offsets, boxes, flips, slots): no device sync. `failed` counts the JPEGs it
    could not decode, added to every batch's "skipped" (the workers' count, also cumulative)."""

    def __init__(self, device: torch.device, size: int, decoder: Decoder):
        self.device, self.size, self.decoder = device, size, decoder
        self.failed = 0
        # nvJPEG writes its outputs on an internal stream that waits for no other, into tensors taken from
        # the caching allocator's pool of the stream current at the call. Made under this stream, they come
        # from a pool that holds nothing but decoder outputs, each released only once the kernels that read
        # it (record_stream below) are done; from the caller's pool they could land on memory that kernels
        # still queued there (the last crop, the last step) are about to read.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _decode(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if self.stream is None:
            return _decode_each(self.decoder, jpegs)
        current = torch.cuda.current_stream(self.device)
        with torch.cuda.stream(self.stream):  # torchvision makes this stream wait for nvJPEG's
            decoded = _decode_each(self.decoder, jpegs)
        current.wait_stream(self.stream)
        for img in decoded:
            if img is not None:
                img.record_stream(current)  # read (and freed) on the caller's stream from here on
        return decoded

    def __call__(self, batch: dict) -> dict:
        offsets = batch["jpeg_offsets"].tolist()
        data, boxes, flips = batch["jpeg_data"], batch["box"].tolist(), batch["flip"].tolist()
        n = len(offsets) - 1
        out = move({k: v for k, v in batch.items() if k not in ENCODED_KEYS}, self.device)
        slots = [i for i in range(n) if offsets[i + 1] > offsets[i]]
        decoded = self._decode([data[offsets[i] : offsets[i + 1]] for i in slots]) if slots else []
        good = [i for i, img in zip(slots, decoded) if img is not None]
        failed = [i for i, img in zip(slots, decoded) if img is None]
        worker_slots = batch["decoded_slots"].tolist()  # the workers decoded these (PNG, WebP)
        worker_images = out.pop("decoded_images")  # [len(worker_slots), 3, size, size]
        cropped = None
        if good:
            images_in = [img for img in decoded if img is not None]
            cropped = crop_resize_flip_batch(
                images_in, [boxes[i] for i in good], [flips[i] for i in good], self.size
            )  # [len(good), 3, size, size]
        if len(good) == n:  # the usual batch: every slot a JPEG, all decoded
            images = cropped
        else:
            images = torch.empty((n, 3, self.size, self.size), dtype=torch.uint8, device=self.device)
            if cropped is not None:
                _copy_runs(images, good, cropped)
            _copy_runs(images, worker_slots, worker_images)
        if failed:
            # Another image of the batch in each failed slot: the batch keeps its size on every rank.
            others = sorted(good + worker_slots)
            if not others:
                raise RuntimeError(
                    f"no image of the batch decodes on {self.device} (keys {batch.get('key')})"
                )
            for j, i in enumerate(failed):
                src = others[j % len(others)]
                images[i], out["target"][i] = images[src], out["target"][src]
            self.failed += len(failed)
        out["image"] = images
        out["skipped"] = batch.get("skipped", 0) + self.failed
        return out


def batch_to_device(device: torch.device, data: DataConfig, img_size: int) -> Callable[[dict], dict]:
    """The loop's `to_device` for this data config: moves (decode cpu) or decodes there (decode cuda)."""
    if data.decode == "cuda":
        if device.type != "cuda":
            raise RuntimeError(f"data.decode: cuda, but this rank trains on {device}: set data.decode: cpu")
        return DeviceDecode(device, img_size, nvjpeg_decoder(device))
    return partial(move, device=device)


class GpuIdle:
    """How long the training stream sat idle between batches, from CUDA event pairs: one recorded when the
    host asks for the next batch (it completes when the kernels queued before it, the last step's, have
    run), one after the stream's wait for that batch, just before its first kernel. Host time between steps
    (logging, checkpoint saves) is not counted: this is the GPU side of the host's wait for data. Reading
    the events needs them done, a host sync: `seconds()` belongs where the loop syncs anyway."""

    def __init__(self) -> None:
        self._asked: torch.cuda.Event | None = None
        self._pending: list[tuple[torch.cuda.Event, torch.cuda.Event]] = []
        self._done_s = 0.0  # pairs already complete, folded in without waiting
        self._first = True  # before the first batch there is no step to be idle after

    def asked(self, stream: torch.cuda.Stream) -> None:
        if self._first:
            self._first = False
            return
        self._asked = torch.cuda.Event(enable_timing=True)
        self._asked.record(stream)

    def started(self, stream: torch.cuda.Stream) -> None:
        if self._asked is None:
            return
        start = torch.cuda.Event(enable_timing=True)
        start.record(stream)
        self._pending.append((self._asked, start))
        self._asked = None
        # Fold in the pairs the GPU has passed (query() does not wait): the list stays short when nobody reads.
        while self._pending and self._pending[0][1].query():
            end, start = self._pending.pop(0)
            self._done_s += end.elapsed_time(start) / 1000

    def seconds(self) -> float:
        """Idle seconds since the last call; waits for the last recorded event."""
        total, self._done_s = self._done_s, 0.0
        for end, start in self._pending:
            start.synchronize()
            total += end.elapsed_time(start) / 1000
        self._pending.clear()
        return total


_END = object()


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


class Prefetcher:
    """An iterator of device batches, `to_device(batch)` for each batch of `batches` in order, made ahead in
    a thread while the caller trains: at most `depth` batches wait. On CUDA the thread works on a side stream
    of its own and `next()` only makes the caller's current stream wait on the batch's event (and marks the
    batch's tensors as used there, `record_stream`): no host sync. An exception in the thread (the loader's,
    the decoder's) is raised by the `next()` that reaches it; `close()` stops the thread (the loop's
    `_shutdown_loader` calls it before shutting the loader's workers down: `source` is the loader's iterator).
    On the CPU the same code runs with no streams and no idle measurement (tests use it so)."""

    def __init__(
        self, batches: Iterator[dict], to_device: Callable[[dict], dict], device: torch.device, depth: int = 2
    ):
        self.source = batches
        self._to_device = to_device
        self._cuda = device.type == "cuda"
        if self._cuda and device.index is None:
            device = torch.device("cuda", torch.cuda.current_device())
        self.device = device
        self.stream = torch.cuda.Stream(device) if self._cuda else None
        self.idle = GpuIdle() if self._cuda else None
        self._queue: queue.Queue = queue.Queue(maxsize=depth)
        self._stop = threading.Event()
        self._finished = False
        self._thread = threading.Thread(target=self._run, name="device-prefetch", daemon=True)
        self._thread.start()

    def _put(self, item) -> bool:
        while not self._stop.is_set():
            try:
                self._queue.put(item, timeout=0.1)
                return True
            except queue.Full:
                continue
        return False

    def _run(self) -> None:
        try:
            if self._cuda:
                # The thread's own current device: torchvision's decoder, the allocator and current_stream()
                # otherwise act for device 0 whatever device the batches go to.
                torch.cuda.set_device(self.device)
            while not self._stop.is_set():
                try:
                    host = next(self.source)
                except StopIteration:
                    self._put(_END)
                    return
                if self.stream is None:
                    item = (self._to_device(host), None)
                else:
                    with torch.cuda.stream(self.stream):
                        batch = self._to_device(host)
                        ready = torch.cuda.Event()
                        ready.record(self.stream)
                    item = (batch, ready)
                del host  # pinned host memory back to the allocator (its copies' events keep it until done)
                if not self._put(item):
                    return
        except BaseException as exc:  # re-raised in the caller's thread by next()
            self._put(_Failure(exc))

    def __iter__(self) -> Prefetcher:
        return self

    def __next__(self) -> dict:
        if self._finished:
            raise StopIteration
        current = torch.cuda.current_stream(self.device) if self._cuda else None
        if self.idle is not None:
            self.idle.asked(current)
        while True:
            try:
                item = self._queue.get(timeout=1.0)
                break
            except queue.Empty:
                if not self._thread.is_alive() and self._queue.empty():
                    self._finished = True
                    raise RuntimeError("the device prefetch thread has stopped (closed?)") from None
        if item is _END or isinstance(item, _Failure):
            self._finished = True
            if item is _END:
                raise StopIteration
            raise item.exc
        batch, ready = item
        if ready is not None:
            current.wait_event(ready)
            for v in batch.values():
                if torch.is_tensor(v) and v.device.type == "cuda":
                    v.record_stream(current)  # made on the side stream, used and freed on this one
            self.idle.started(current)
        return batch

    def gpu_idle_seconds(self) -> float | None:
        """Seconds the caller's stream sat idle between batches since the last call (None off CUDA).
        Waits for the events recorded so far: call it where the host syncs anyway (the loop's log steps)."""
        return None if self.idle is None else self.idle.seconds()

    def close(self, timeout: float = 10.0) -> None:
        """Stop the thread: it finishes the batch in hand and takes no other. A thread still waiting on the
        loader after `timeout` seconds ends when the loader's workers are shut down (a daemon either way)."""
        self._stop.set()
        self._finished = True
        self._drain()
        self._thread.join(timeout)
        self._drain()

    def _drain(self) -> None:
        while True:
            try:
                self._queue.get_nowait()
            except queue.Empty:
                return


def _as_made(batch: dict) -> dict:
    return batch


def prefetch(
    batches: Iterator[dict], to_device: Callable[[dict], dict], device: torch.device
) -> tuple[Prefetcher, Callable[[dict], dict]]:
    """(batches, to_device) for the loop's `train_step`, with `to_device` run a step ahead in a `Prefetcher`
    thread: the batches come out on the device, so the step's own `to_device` is nothing."""
    return Prefetcher(batches, to_device, device), _as_made
