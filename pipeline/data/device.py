"""Loader batches -> the training device; with `data.decode: cuda`, JPEGs decoded there in batches.

    to_device = batch_to_device(torch.device("cuda", 0), cfg.data, img_size=224)
    batch = to_device(next(batches))      # {"image": uint8 [B, 3, 224, 224] on the GPU, "target", ...}

CPU decode (the default, the only path CI runs): the workers made the images; this moves the tensors
(pinned memory, non-blocking). CUDA decode: the workers send each RGB or grey JPEG still encoded with the crop box and
flip they drew (`BatchBuilder(encoded=True)`); here one batched nvJPEG call (torchvision's
`decode_jpeg(device="cuda")`) decodes them and `crop_resize_flip` crops, resizes and flips each on the
GPU, into the slots of the batch's image tensor. Slots the workers decoded (PNG, WebP) arrive as images.

A JPEG the GPU cannot decode (a body corrupt past its header) is replaced by another image of the same
batch and counted in the batch's "skipped", as the workers count the samples they cannot read.
The decoder is a parameter, so tests run this path on the CPU with a PIL decoder in nvJPEG's place.
"""

from __future__ import annotations

import io
import logging
from collections.abc import Callable
from functools import partial

import torch
from PIL import Image

from pipeline.config import DataConfig
from pipeline.data.transforms import crop_resize_flip, to_hwc

log = logging.getLogger(__name__)

# A batch decoder: JPEG byte tensors (uint8, 1-D, on the CPU) -> uint8 [3, H, W] images on the device.
Decoder = Callable[[list[torch.Tensor]], list[torch.Tensor]]
ENCODED_KEYS = ("jpeg_data", "jpeg_offsets", "box", "flip")


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
                out.append(to_hwc(img.convert("RGB")).permute(2, 0, 1).to(device))
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


class DeviceDecode:
    """`to_device` for encoded batches (`BatchBuilder(encoded=True)`): the usual batch, every image on
    `device`. Reads only the batch's host tensors (offsets, boxes, flips): no device sync. `failed` counts
    the JPEGs it could not decode, added to every batch's "skipped" (the workers' count, also cumulative)."""

    def __init__(self, device: torch.device, size: int, decoder: Decoder):
        self.device, self.size, self.decoder = device, size, decoder
        self.failed = 0
        # nvJPEG works on a stream of its own; the outputs are made on a side stream and handed to the
        # training stream with a wait, so the allocator never gives the decoder memory that kernels still
        # queued on the training stream (the last step's) have yet to release.
        self.stream = torch.cuda.Stream(device) if device.type == "cuda" else None

    def _decode(self, jpegs: list[torch.Tensor]) -> list[torch.Tensor | None]:
        if self.stream is None:
            return _decode_each(self.decoder, jpegs)
        current = torch.cuda.current_stream(self.device)
        self.stream.wait_stream(current)
        with torch.cuda.stream(self.stream):
            decoded = _decode_each(self.decoder, jpegs)
        current.wait_stream(self.stream)
        for img in decoded:
            if img is not None:
                img.record_stream(current)  # used (and freed) on the training stream from here on
        return decoded

    def __call__(self, batch: dict) -> dict:
        offsets = batch["jpeg_offsets"].tolist()
        data, boxes, flips = batch["jpeg_data"], batch["box"].tolist(), batch["flip"].tolist()
        out = move({k: v for k, v in batch.items() if k not in ENCODED_KEYS}, self.device)
        slots = [i for i in range(len(offsets) - 1) if offsets[i + 1] > offsets[i]]
        decoded = self._decode([data[offsets[i] : offsets[i + 1]] for i in slots]) if slots else []
        images = out["image"]
        for i, img in zip(slots, decoded):
            if img is not None:
                images[i] = crop_resize_flip(img, boxes[i], flips[i], self.size)
        failed = [i for i, img in zip(slots, decoded) if img is None]
        if failed:
            # Another image of the batch in each failed slot: the batch keeps its size on every rank.
            others = [i for i in range(len(offsets) - 1) if i not in failed]
            if not others:
                raise RuntimeError(
                    f"no image of the batch decodes on {self.device} (keys {batch.get('key')})"
                )
            for j, i in enumerate(failed):
                src = others[j % len(others)]
                images[i], out["target"][i] = images[src], out["target"][src]
            self.failed += len(failed)
        out["skipped"] = batch.get("skipped", 0) + self.failed
        return out


def batch_to_device(device: torch.device, data: DataConfig, img_size: int) -> Callable[[dict], dict]:
    """The loop's `to_device` for this data config: moves (decode cpu) or decodes there (decode cuda)."""
    if data.decode == "cuda":
        if device.type != "cuda":
            raise RuntimeError(f"data.decode: cuda, but this rank trains on {device}: set data.decode: cpu")
        return DeviceDecode(device, img_size, nvjpeg_decoder(device))
    return partial(move, device=device)
