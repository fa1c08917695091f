"""scikit-learn's bundled handwritten digits (`load_digits`: 1,797 8x8 images, 10 classes), upsampled and
stored as PNG: a real labelled image set that needs no download, for smoke runs and tests.

vitpipe shard digits data/digits --size 32 --val-fraction 0.2
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import numpy as np
from PIL import Image

from data_prep.images import Prepared, prepare_generated
from data_prep.layout import DatasetError
from data_prep.sources import Item, ListingError

NUM_DIGITS = 1797


@dataclass(frozen=True)
class DigitsLoader:
    size: int

    def load(self, item: Item, resize_max: int | None, quality: int) -> Prepared:
        assert item.payload is not None
        pixels = np.frombuffer(item.payload, dtype=np.uint8).reshape(8, 8)  # 0..16 ink levels
        img = Image.fromarray((pixels.astype(np.uint16) * 255 // 16).astype(np.uint8), mode="L")
        img = img.resize((self.size, self.size), Image.Resampling.BICUBIC)
        return prepare_generated(img, "png", resize_max, quality)


class DigitsSource:
    kind = "digits"
    where = "sklearn load_digits()"
    multi_label = False
    mix = False  # the set is small; its own order already cycles through the classes
    classes = [str(d) for d in range(10)]

    def __init__(self, size: int = 32, seed: int = 0):
        if size < 8:
            raise DatasetError(f"--size {size}: the digits are 8x8; ask for 8 or more")
        self.size = size
        self.split_salt = seed

    def describe(self) -> dict:
        import sklearn  # heavy (scipy): only in the driver, and only for this source

        return {"kind": self.kind, "size": self.size, "sklearn": sklearn.__version__}

    def count_hint(self) -> int | None:
        return NUM_DIGITS

    def loader(self) -> DigitsLoader:
        return DigitsLoader(self.size)

    def listing(self) -> Iterator[Item | ListingError]:
        from sklearn.datasets import load_digits  # heavy import (scipy): only in the driver, only here

        digits = load_digits()
        for i, (pixels, target) in enumerate(zip(digits.images, digits.target)):
            payload = pixels.astype(np.uint8).tobytes()
            yield Item(f"digits_{i:04d}", f"sklearn load_digits()[{i}]", (int(target),), 300, payload=payload)
