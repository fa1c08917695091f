"""The generated JFT-like corpus (`data_prep.synthetic`) as a source: items are image indices,
workers draw the pixels, so nothing but (key, labels) crosses a process boundary.

vitpipe shard synthetic data/syn --num 100000 --classes 100 --labels-per-image 1.3
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import asdict, dataclass

from data_prep.images import Prepared, prepare_generated
from data_prep.sources import Item, ListingError
from data_prep.synthetic import class_names, render, synthetic_key


@dataclass(frozen=True)
class SyntheticLoader:
    seed: int
    num_classes: int
    labels_per_image: float
    width: int
    height: int
    quality: int  # the generator's JPEG quality (90, as `synthetic_samples`), not --quality

    def load(self, item: Item, resize_max: int | None, quality: int) -> Prepared:
        index = int(item.source.rsplit(":", 1)[1])
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
        num_classes: int,
        seed: int = 0,
        labels_per_image: float = 1.3,
        width: int = 500,
        height: int = 375,
    ):
        self._loader = SyntheticLoader(seed, num_classes, labels_per_image, width, height, quality=90)
        self.num = num
        self.classes = class_names(num_classes)
        # Measured on this generator's noise texture at quality 90: about 0.36 bytes per pixel at 500x375.
        self._est = 600 + int(0.4 * width * height)

    def describe(self) -> dict:
        return {"kind": self.kind, **asdict(self._loader)}

    def count_hint(self) -> int | None:
        return self.num

    def loader(self) -> SyntheticLoader:
        return self._loader

    def listing(self) -> Iterator[Item | ListingError]:
        # Labels are left to the worker, which draws them with the pixels: listing stays ~1 us an image.
        # The fingerprint still pins them: they follow from (seed, index) and `describe()`.
        for i in range(self.num):
            yield Item(synthetic_key(self._loader.seed, i), f"synthetic:{i}", (), self._est)
