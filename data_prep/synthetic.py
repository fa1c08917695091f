"""A procedurally generated JFT-like corpus: multi-label images whose labels are visible in the pixels.

Each class is a (shape, colour) pair drawn at a random position and size on a textured
background; an image carries 1 + Poisson(labels_per_image - 1) distinct classes. Deterministic
in (seed, index): image i is the same whatever else is generated.
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageDraw

from data_prep.keys import split_for
from data_prep.shard_file import Sample

SHAPES = ("ellipse", "rectangle", "triangle", "cross")
PALETTE = (
    (230, 25, 75),
    (60, 180, 75),
    (255, 225, 25),
    (0, 130, 200),
    (245, 130, 48),
    (145, 30, 180),
    (70, 240, 240),
    (240, 50, 230),
    (210, 245, 60),
    (250, 190, 212),
    (0, 128, 128),
    (170, 110, 40),
)


def class_names(num_classes: int) -> list[str]:
    return [f"{SHAPES[c % len(SHAPES)]}_{c // len(SHAPES)}" for c in range(num_classes)]


def _class_style(c: int) -> tuple[str, tuple[int, int, int]]:
    return SHAPES[c % len(SHAPES)], PALETTE[(c // len(SHAPES) + 3 * c) % len(PALETTE)]


def _draw(draw: ImageDraw.ImageDraw, shape: str, box: tuple[int, int, int, int], colour) -> None:
    x0, y0, x1, y1 = box
    if shape == "ellipse":
        draw.ellipse(box, fill=colour)
    elif shape == "rectangle":
        draw.rectangle(box, fill=colour)
    elif shape == "triangle":
        draw.polygon([((x0 + x1) // 2, y0), (x0, y1), (x1, y1)], fill=colour)
    else:
        w, h = (x1 - x0) // 3, (y1 - y0) // 3
        draw.rectangle((x0 + w, y0, x1 - w, y1), fill=colour)
        draw.rectangle((x0, y0 + h, x1, y1 - h), fill=colour)


def _draw_labels(rng: np.random.Generator, num_classes: int, labels_per_image: float) -> list[int]:
    n = min(num_classes, 1 + int(rng.poisson(labels_per_image - 1.0)))
    return sorted(int(c) for c in rng.choice(num_classes, size=n, replace=False))


def synthetic_key(seed: int, index: int) -> str:
    return f"syn{seed:04d}_{index:09d}"


def render(index: int, seed: int, num_classes: int, labels_per_image: float, width: int, height: int):
    rng = np.random.default_rng([seed, index])
    labels = _draw_labels(rng, num_classes, labels_per_image)
    base = rng.integers(0, 90, size=3)
    noise = rng.integers(0, 40, size=(height, width, 1))
    img = Image.fromarray((base + noise).clip(0, 255).astype(np.uint8))
    draw = ImageDraw.Draw(img)
    for c in labels:
        shape, colour = _class_style(c)
        s = int(rng.integers(min(width, height) // 3, min(width, height) // 2 + 1))
        x = int(rng.integers(0, width - s + 1))
        y = int(rng.integers(0, height - s + 1))
        _draw(draw, shape, (x, y, x + s, y + s), colour)
    return img, labels


def synthetic_samples(
    num: int,
    num_classes: int,
    seed: int = 0,
    labels_per_image: float = 1.3,
    width: int = 500,
    height: int = 375,
    val_fraction: float = 0.0,
    quality: int = 90,
) -> Iterator[Sample]:
    for i in range(num):
        img, labels = render(i, seed, num_classes, labels_per_image, width, height)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        key = synthetic_key(seed, i)
        split = split_for(key, val_fraction)  # the same split `vitpipe shard synthetic` gives
        yield Sample(key, buf.getvalue(), "jpg", labels, width, height, split, f"synthetic:{i}")
