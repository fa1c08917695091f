"""The generated JFT-like corpora (`data_prep.synthetic`) as a source: items are image indices,
workers draw the pixels, so nothing but (key, labels) crosses a process boundary.

vitpipe shard synthetic data/syn --num 100000 --classes 100 --labels-per-image 1.3
vitpipe shard synthetic data/layout --num 100000 --layout --objects 6    # + KEY.seg.png masks, KEY.boxes.json
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

from data_prep.images import Prepared, prepare_generated
from data_prep.layout import BOXES_EXT
from data_prep.sources import Item, ListingError
from data_prep.synthetic import (
    MASK_EXT,
    check_layout,
    class_names,
    layout_class_names,
    layout_type_names,
    render,
    render_layout_objects,
    segmentation_class_names,
    synthetic_key,
)


@dataclass(frozen=True)
class SyntheticLoader:
    seed: int
    num_classes: int
    labels_per_image: float
    width: int
    height: int
    quality: int  # the generator's JPEG quality (90, as `synthetic_samples`), not --quality
    layout: bool = False  # the layout corpus, with masks; num_classes and labels_per_image do not apply
    objects: int = 6  # its object types

    def load(self, item: Item, resize_max: int | None, quality: int) -> Prepared:
        index = int(item.source.rsplit(":", 1)[1])
        if self.layout:
            img, mask, labels, boxes = render_layout_objects(
                index, self.seed, self.objects, self.width, self.height
            )
            return prepare_generated(
                img, "jpg", resize_max, self.quality, tuple(labels), {MASK_EXT: mask}, boxes, self.objects
            )
        img, labels = render(
            index, self.seed, self.num_classes, self.labels_per_image, self.width, self.height
        )
        return prepare_generated(img, "jpg", resize_max, self.quality, tuple(labels))


class SyntheticSource:
    kind = "synthetic"
    where = "synthetic"
    multi_label = True
    mix = False  # already random; listing order keeps shard i = images [i*count, (i+1)*count)
    split_salt = 0  # keys already hold the seed; 0 gives the split `synthetic_samples` gives

    def __init__(
        self,
        num: int,
        num_classes: int | None,
        seed: int = 0,
        labels_per_image: float = 1.3,
        width: int = 500,
        height: int = 375,
        layout: bool = False,
        objects: int = 6,
    ):
        """`layout`: the layout corpus of `objects` types, its classes and masks; `num_classes` (None is
        fine) and `labels_per_image` do not apply to it."""
        if layout:
            check_layout(objects, width, height)
            self.classes = layout_class_names(objects)
            self.segmentation_classes: list[str] | None = segmentation_class_names(objects)
            self.detection_classes: list[str] | None = layout_type_names(objects)
            num_classes, labels_per_image = len(self.classes), 1.0  # fixed: not part of what it draws
        else:
            if num_classes is None:
                raise ValueError("the synthetic corpus needs a number of classes (or layout=True)")
            self.classes = class_names(num_classes)
            self.segmentation_classes = None
            self.detection_classes = None
        self._loader = SyntheticLoader(
            seed, num_classes, labels_per_image, width, height, quality=90, layout=layout, objects=objects
        )
        self.num = num
        # Measured on this generator's noise texture at quality 90: about 0.36 bytes per pixel at 500x375.
        # A layout mask's member: its 512-byte tar header and a PNG of long runs, which grows with the
        # rows and the edges rather than the area (measured: 0.2 kB at 48x40, 2.2 kB at 500x375).
        # Its boxes member: a header and about 30 bytes per object.
        self._est = 600 + int(0.4 * width * height) + (600 + 4 * (width + height) + 640 if layout else 0)

    def describe(self) -> dict:
        d = {"kind": self.kind, **asdict(self._loader)}
        if not self._loader.layout:  # as before the layout corpus existed: its shards stay complete
            del d["layout"], d["objects"]
        else:  # layout shards written before boxes existed lack KEY.boxes.json: a re-run rewrites them
            d["members"] = [MASK_EXT, BOXES_EXT]
        return d

    def count_hint(self) -> int | None:
        return self.num

    def loader(self) -> SyntheticLoader:
        return self._loader

    def listing(self) -> Iterator[Item | ListingError]:
        # Labels are left to the worker, which draws them with the pixels: listing stays ~1 us an image.
        # The fingerprint still pins them: they follow from (seed, index) and `describe()`.
        for i in range(self.num):
            yield Item(synthetic_key(self._loader.seed, i), f"synthetic:{i}", (), self._est)
