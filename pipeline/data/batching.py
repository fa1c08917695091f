"""Raw samples -> uint8 batches: decode one sample, fill preallocated (shared-memory) batch tensors.

    image, labels = decode(sample, info.multi_label, info.num_classes, lambda img: eval_tensor(img, 224))
    builder = BatchBuilder(64, 224, num_classes, multi_label)
    if builder.add(image, labels, sample["__key__"]):
        yield builder.take(skipped=counter.bad)
    # {"image": uint8 [B, 3, H, W], "target": long [B] | multi-hot float [B, K], "key": [B] str, **extra}
    # masks=True (segmentation): also "mask" uint8 [B, H, W], the class of each pixel (decode_pair)
    # boxes=M (detection): also "boxes" float [B, M, 4] (centre x, centre y, w, h as fractions of the image),
    # "box_classes" long [B, M] (-1: no object in that row), "image_size" long [B, 2] (w, h as stored)

The streams (train_stream, eval_stream) drive this; the loader's workers hand the batches over in shared memory.
"""

from __future__ import annotations

import io
import json
import math
from collections.abc import Callable

import numpy as np
import torch
from PIL import Image
from torch.utils.data import get_worker_info

from data_prep.layout import (  # KEY.seg.png: per-pixel classes; KEY.boxes.json: objects
    BOXES_EXT,
    MASK_EXT,
    MASK_IGNORE,
    mask_problem,
    parse_boxes,
)

IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")


def loader_worker() -> tuple[int, int]:
    """(this DataLoader worker's id, the number of workers); (0, 1) in the main process."""
    wi = get_worker_info()
    return (wi.id, wi.num_workers) if wi else (0, 1)


def image_bytes(sample: dict) -> bytes:
    ext = next((e for e in IMAGE_EXTS if e in sample), None)
    if ext is None:
        raise ValueError(f"no image ({'/'.join(IMAGE_EXTS)}) in sample; it has {sorted(sample)}")
    return sample[ext]


def sample_labels(sample: dict, multi_label: bool, num_classes: int) -> list[int] | int:
    """The label (`KEY.cls`) or labels (`KEY.json` {"labels": [...]}), checked against num_classes."""
    if multi_label:
        labels = [int(c) for c in json.loads(sample["json"])["labels"]]
        if any(not 0 <= c < num_classes for c in labels):
            raise ValueError(f"labels {labels} outside 0..{num_classes - 1}")
        return labels
    label = int(sample["cls"])
    if not 0 <= label < num_classes:
        raise ValueError(f"class {label} outside 0..{num_classes - 1}")
    return label


def decode(
    sample: dict, multi_label: bool, num_classes: int, transform: Callable[[Image.Image], torch.Tensor]
) -> tuple[torch.Tensor, list[int] | int]:
    """(uint8 [3, H, W] image, labels) of one raw sample; raises on anything unreadable."""
    labels = sample_labels(sample, multi_label, num_classes)
    with Image.open(io.BytesIO(image_bytes(sample))) as img:  # not decoded yet: the transform drafts
        return transform(img), labels


def decode_pair(
    sample: dict,
    multi_label: bool,
    num_classes: int,
    mask_classes: int,
    transform: Callable[[Image.Image, Image.Image], tuple[torch.Tensor, torch.Tensor]],
) -> tuple[torch.Tensor, torch.Tensor, list[int] | int]:
    """(uint8 [3, H, W] image, uint8 [H, W] mask, labels) of one raw sample of a segmentation dataset;
    raises, naming what is wrong, on a missing mask, one of another size, or a class beyond `mask_classes`."""
    labels = sample_labels(sample, multi_label, num_classes)
    data = sample.get(MASK_EXT)
    if data is None:
        members = sorted(k for k in sample if not k.startswith("__"))
        raise ValueError(f"no {MASK_EXT} mask member (it has {members}); segmentation needs KEY.{MASK_EXT}")
    with Image.open(io.BytesIO(data)) as mask, Image.open(io.BytesIO(image_bytes(sample))) as img:
        problem = mask_problem(mask, img.size, mask_classes)
        if problem:
            raise ValueError(problem)
        image, target = transform(img, mask)
    return image, target, labels


def decode_boxes(
    sample: dict,
    multi_label: bool,
    num_classes: int,
    box_classes: int,
    max_boxes: int,
    transform: Callable[[Image.Image, np.ndarray], tuple[torch.Tensor, np.ndarray, np.ndarray]],
) -> tuple[torch.Tensor, tuple[torch.Tensor, torch.Tensor, tuple[int, int]], list[int] | int]:
    """(uint8 [3, H, W] image, (boxes [K, 4] float centre x, centre y, w, h as fractions of the output,
    classes [K] long, the stored image's (w, h)), labels) of one raw sample of a detection dataset, its boxes
    following the transform's crop and flip (`transforms.train_boxes` / `eval_boxes`); raises, naming what
    is wrong, on a missing or bad KEY.boxes.json or more than `max_boxes` objects."""
    labels = sample_labels(sample, multi_label, num_classes)
    data = sample.get(BOXES_EXT)
    if data is None:
        members = sorted(k for k in sample if not k.startswith("__"))
        raise ValueError(f"no {BOXES_EXT} member (it has {members}); detection needs KEY.{BOXES_EXT}")
    with Image.open(io.BytesIO(image_bytes(sample))) as img:
        boxes, classes = parse_boxes(data, img.size, box_classes)
        if len(boxes) > max_boxes:
            raise ValueError(
                f"{len(boxes)} objects, more than the model's {max_boxes} queries (model.overrides.num_queries)"
            )
        corners = np.array([[x, y, x + w, y + h] for x, y, w, h in boxes], dtype=np.float64).reshape(-1, 4)
        size = img.size
        image, out, keep = transform(img, corners)
    out = torch.from_numpy(out).float()
    cxcywh = torch.stack(
        [
            (out[:, 0] + out[:, 2]) / 2,
            (out[:, 1] + out[:, 3]) / 2,
            out[:, 2] - out[:, 0],
            out[:, 3] - out[:, 1],
        ],
        1,
    )
    kept = torch.tensor(classes, dtype=torch.long)[torch.from_numpy(keep)]
    return image, (cxcywh, kept, size), labels


def _empty_batch(shape: tuple[int, ...], shared: bool) -> torch.Tensor:
    """uint8 tensor; `shared`: allocated in shared memory, as default_collate does in a worker, so
    the batch reaches the main process without the copy that sending a private tensor makes
    (64 x 3 x 224 x 224: ~5 ms a batch)."""
    if not shared:
        return torch.empty(shape, dtype=torch.uint8)
    storage = torch.empty(0, dtype=torch.uint8)._typed_storage()._new_shared(math.prod(shape), device="cpu")
    return torch.empty(0, dtype=torch.uint8).set_(storage).view(shape)


class BatchBuilder:
    """Fills preallocated uint8 batch tensors in place: one copy per image, no torch.stack.

    With `encoded=True` (data.decode: cuda) a slot may instead hold a JPEG still encoded, with the crop box
    and flip drawn for it (`add_encoded`); the batch then carries, in place of "image", "jpeg_data" (uint8
    [total bytes], the JPEGs one after another), "jpeg_offsets" (long [B + 1]: slot i's bytes are
    jpeg_data[offsets[i]:offsets[i + 1]], empty for a slot decoded here), "box" (float [B, 4]: left, top,
    right, bottom in pixels), "flip" (bool [B]), and the images decoded here (PNG, WebP): "decoded_images"
    (uint8 [N, 3, H, W], N usually 0) of "decoded_slots" (long [N], ascending). No full image batch is
    made, pinned or copied for slots the device fills. `pipeline.data.device` decodes the JPEGs on the GPU.
    """

    def __init__(
        self,
        batch_size: int,
        img_size: int,
        num_classes: int,
        multi_label: bool,
        encoded: bool = False,
        masks: bool = False,
        boxes: int = 0,
    ):
        self.batch_size, self.img_size = batch_size, img_size
        self.num_classes, self.multi_label = num_classes, multi_label
        self.encoded, self.with_masks, self.max_boxes = encoded, masks, boxes
        self.shared = get_worker_info() is not None  # in a DataLoader worker process
        self._new()

    def _new(self) -> None:
        b, s = self.batch_size, self.img_size
        # [B, 3, H, W]; encoded batches keep only the images decoded here, by slot, until `take`
        self.images = None if self.encoded else _empty_batch((b, 3, s, s), self.shared)
        self.targets = (
            torch.zeros((b, self.num_classes)) if self.multi_label else torch.zeros(b, dtype=torch.long)
        )  # [B, K] multi-hot or [B] class indices
        self.keys = [""] * b
        self.valid = torch.zeros(b, dtype=torch.bool)  # [B] slots holding a real sample
        self.n = 0
        if self.with_masks:
            self.masks = _empty_batch((b, s, s), self.shared)  # [B, H, W] class per pixel
        if self.max_boxes:
            self.boxes = torch.zeros((b, self.max_boxes, 4))  # [B, M, 4] centre x, y, w, h (fractions)
            self.box_classes = torch.full((b, self.max_boxes), -1, dtype=torch.long)  # [B, M], -1: none
            self.image_sizes = torch.zeros((b, 2), dtype=torch.long)  # [B, 2] stored (w, h)
        if self.encoded:
            self.jpegs: list[bytes] = [b""] * b
            self.decoded: dict[int, torch.Tensor] = {}  # slot -> uint8 [3, H, W] decoded here
            self.boxes = torch.zeros((b, 4))  # [B, 4] crop boxes of the encoded slots
            self.flips = torch.zeros(b, dtype=torch.bool)  # [B]

    def put(
        self,
        slot: int,
        image: torch.Tensor | None,
        labels: list[int] | int,
        key: str,
        mask: torch.Tensor | None = None,
        objects: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
    ) -> None:
        if image is not None and self.encoded:
            self.decoded[slot] = image  # uint8 [3, H, W], copied into the batch at `take`
        elif image is not None:  # None: an encoded slot, decoded on the training device
            self.images[slot] = image  # uint8 [3, H, W] -> its batch slot
        if mask is not None:
            self.masks[slot] = mask  # uint8 [H, W]
        if objects is not None:  # (boxes [K, 4], classes [K], (w, h)) of `decode_boxes`
            boxes, classes, size = objects
            k = len(classes)
            self.boxes[slot].zero_()
            self.boxes[slot, :k] = boxes
            self.box_classes[slot] = -1
            self.box_classes[slot, :k] = classes
            self.image_sizes[slot] = torch.tensor(size)
        if self.multi_label:
            self.targets[slot].zero_()
            self.targets[slot, labels] = 1.0
        else:
            self.targets[slot] = labels
        self.keys[slot] = key
        self.valid[slot] = True

    def add(
        self,
        image: torch.Tensor,
        labels: list[int] | int,
        key: str,
        mask: torch.Tensor | None = None,
        objects: tuple[torch.Tensor, torch.Tensor, tuple[int, int]] | None = None,
    ) -> bool:
        """Append one sample (and its mask, with masks=True; its objects, with boxes=M); True when the batch
        is full."""
        self.put(self.n, image, labels, key, mask, objects)
        self.n += 1
        return self.n == self.batch_size

    def add_encoded(
        self,
        jpeg: bytes,
        box: tuple[float, float, float, float],
        flip: bool,
        labels: list[int] | int,
        key: str,
    ) -> bool:
        """Append one sample whose JPEG the training device decodes; True when the batch is full."""
        slot = self.n
        self.put(slot, None, labels, key)
        self.jpegs[slot], self.flips[slot] = jpeg, flip
        self.boxes[slot] = torch.tensor(box, dtype=torch.float32)
        self.n += 1
        return self.n == self.batch_size

    def _encoded_fields(self) -> dict:
        sizes = torch.tensor([0] + [len(j) for j in self.jpegs], dtype=torch.long)
        offsets = sizes.cumsum(0)  # [B + 1]
        total = int(offsets[-1])
        data = _empty_batch((total,), self.shared and total > 0)  # one buffer: one shared-memory segment
        for i, jpeg in enumerate(self.jpegs):
            if jpeg:
                data[offsets[i] : offsets[i + 1]] = torch.frombuffer(bytearray(jpeg), dtype=torch.uint8)
        slots = sorted(self.decoded)
        s = self.img_size
        images = _empty_batch((len(slots), 3, s, s), self.shared and len(slots) > 0)  # [N, 3, H, W]
        for j, slot in enumerate(slots):
            images[j] = self.decoded[slot]
        return {
            "jpeg_data": data,
            "jpeg_offsets": offsets,
            "box": self.boxes,
            "flip": self.flips,
            "decoded_images": images,
            "decoded_slots": torch.tensor(slots, dtype=torch.long),
        }

    def pad(self, last: list) -> None:
        """Fill the empty slots with a repeat of a real sample: this batch's last, else `last`
        (updated here: [image, target] of the last real sample seen), else zeros. Not for encoded batches
        (training batches, which are never padded)."""
        if self.encoded:
            raise ValueError("BatchBuilder.pad: an encoded batch (data.decode: cuda) is never padded")
        real = self.valid.nonzero().flatten().tolist()
        if real:
            last[:] = [self.images[real[-1]].clone(), self.targets[real[-1]].clone()]
        for slot in (~self.valid).nonzero().flatten().tolist():
            if last:
                self.images[slot], self.targets[slot] = last
            else:  # no readable sample seen yet: zeros, masked out all the same
                self.images[slot] = 0
                self.targets[slot] = 0
            if self.with_masks:
                self.masks[slot] = MASK_IGNORE  # a padding slot's pixels count nowhere
            if self.max_boxes:
                self.box_classes[slot] = -1  # nor its objects

    def take(self, **extra) -> dict:
        """The batch {"image", "target", "key", **extra} (encoded: the fields of the class docstring in place of
        "image"); the builder starts a new one."""
        batch = {"target": self.targets, "key": self.keys, **extra}
        if not self.encoded:
            batch = {"image": self.images, **batch}
        if self.with_masks:
            batch["mask"] = self.masks
        if self.max_boxes:
            batch.update(boxes=self.boxes, box_classes=self.box_classes, image_size=self.image_sizes)
        if self.encoded:
            batch.update(self._encoded_fields())
        self._new()
        return batch

    def clear(self) -> None:
        self._new()
