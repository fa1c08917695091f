"""Procedurally generated JFT-like corpora: multi-label images whose labels are visible in the pixels.

Two generators, each deterministic in (seed, index): image i is the same whatever else is generated.

- The default corpus: each class is a (shape, colour) pair drawn at a random position and size on a
  textured background; an image carries 1 + Poisson(labels_per_image - 1) distinct classes. Position
  carries no information (a ViT without position embedding does as well as one with).
- The layout corpus (`layout=True`): `objects` types (default 6), each a distinct (shape, colour) pair
  (`layout_type_names`: "yellow_ellipse", "cyan_rectangle", ...); an image holds 2..4 objects, each
  1/5..1/3 of the shorter side, at uniform random positions, later ones over earlier ones, but never
  over an earlier object's centre. Its labels say where things are, from the objects' centres:
  `{t}_top` / `{t}_bottom` (an object of type t whose centre is in the top / bottom half),
  `{t}_left_of_{u}` with u the next type (t + 1 mod objects: an object of type t has its centre left
  of one of type u) and `crowded_{tl,tr,bl,br}` (at least 2 centres in that quadrant): 3 * objects + 4
  classes (`layout_class_names`). Each image also has a per-pixel object mask (`render_layout`): an
  8-bit "L" image of its size, 0 = background, 1 + type index where that type's object is visible,
  exactly as painted; `segmentation_class_names` names the values. Shards store it as `KEY.seg.png`, and
  each labelled object's box and type as `KEY.boxes.json` (`render_layout_objects`; the detection classes
  are `layout_type_names`).

    vitpipe shard synthetic data/syn --num 100000 --classes 100
    vitpipe shard synthetic data/layout --num 100000 --layout --objects 6
"""

from __future__ import annotations

import io
from collections.abc import Iterator

import numpy as np
from PIL import Image, ImageDraw

from data_prep.images import prepare_generated
from data_prep.keys import split_for
from data_prep.layout import MASK_EXT
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
PALETTE_NAMES = (
    "red",
    "green",
    "yellow",
    "blue",
    "orange",
    "purple",
    "cyan",
    "magenta",
    "lime",
    "pink",
    "teal",
    "brown",
)
# The layout corpus's colours, as PALETTE indices, most distinct first: yellow, cyan, red, green,
# magenta, blue, orange, pink, lime, purple. Teal and brown are left out: the background (a dark
# grey-ish tint, every channel 0..128) comes too close to them.
LAYOUT_COLOURS = (2, 6, 0, 1, 7, 3, 4, 9, 8, 5)
LAYOUT_MAX_OBJECTS = len(LAYOUT_COLOURS)
LAYOUT_MIN_SIDE = 16  # objects of at least 3 px, whose centre pixel is always their own
QUADRANTS = ("tl", "tr", "bl", "br")
# Positions tried for an object before it is left out (each would cover an earlier centre); the first
# _FIRST_TRIES are drawn with the image's other numbers, the rest only when those all fail.
_FIRST_TRIES = 8
_PLACEMENT_TRIES = 100


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


# --- the layout corpus ---


def check_layout(objects: int, width: int, height: int) -> None:
    """Raise ValueError, saying what fits, unless the layout corpus can be drawn with these settings."""
    if not 2 <= objects <= LAYOUT_MAX_OBJECTS:
        raise ValueError(f"layout corpus: objects {objects}, use 2..{LAYOUT_MAX_OBJECTS} types")
    if min(width, height) < LAYOUT_MIN_SIDE:
        raise ValueError(
            f"layout corpus: images of {width}x{height} px, the shorter side must be at least {LAYOUT_MIN_SIDE}"
        )


def _layout_style(t: int) -> tuple[str, int]:
    """(shape, PALETTE index) of object type t: every type a distinct colour, shapes in turn."""
    return SHAPES[t % len(SHAPES)], LAYOUT_COLOURS[t]


def layout_type_names(objects: int) -> list[str]:
    """["yellow_ellipse", "cyan_rectangle", "red_triangle", "green_cross", ...]: object type t's name."""
    styles = [_layout_style(t) for t in range(objects)]
    return [f"{PALETTE_NAMES[colour]}_{shape}" for shape, colour in styles]


def layout_class_names(objects: int) -> list[str]:
    """The layout corpus's 3 * objects + 4 classes, in label order: `{t}_top`, `{t}_bottom` for each
    type t, then `{t}_left_of_{t+1 mod objects}` for each t, then `crowded_{tl,tr,bl,br}`."""
    types = layout_type_names(objects)
    halves = [f"{t}_{half}" for t in types for half in ("top", "bottom")]
    relations = [f"{t}_left_of_{types[(i + 1) % objects]}" for i, t in enumerate(types)]
    return halves + relations + [f"crowded_{q}" for q in QUADRANTS]


def segmentation_class_names(objects: int) -> list[str]:
    """What the mask's values mean: ["background", *layout_type_names(objects)]."""
    return ["background", *layout_type_names(objects)]


def _layout_labels(objects: int, types: list[int], centres: list[tuple[int, int]], width: int, height: int):
    """Labels of objects of `types` whose doubled centres (2 cx, 2 cy) are `centres`; doubled so that a
    centre on a half-pixel compares exactly. On a dividing line counts as bottom / right."""
    labels = set()
    quadrant_counts = [0] * len(QUADRANTS)
    for t, (cx2, cy2) in zip(types, centres):
        top, left = cy2 < height, cx2 < width
        labels.add(2 * t + (0 if top else 1))
        quadrant_counts[(0 if top else 2) + (0 if left else 1)] += 1
    for t, (cx2, _) in zip(types, centres):
        u = (t + 1) % objects
        if any(v == u and cx2 < ux2 for v, (ux2, _) in zip(types, centres)):
            labels.add(2 * objects + t)
    labels.update(3 * objects + q for q, n in enumerate(quadrant_counts) if n >= 2)
    return sorted(labels)


def _place(s: int, spots, centres: list[tuple[int, int]], width: int, height: int) -> tuple[int, int] | None:
    """The first of `spots` (fractions of the free range, in [0, 1)^2) where an object of side `s`
    covers none of the doubled `centres`; None if each would."""
    for u, v in spots:
        x, y = int(u * (width - s + 1)), int(v * (height - s + 1))  # uniform in 0..width - s
        # The box [x, x + s] x [y, y + s] holds every pixel the shape paints.
        if not any(x <= cx2 // 2 <= x + s and y <= cy2 // 2 <= y + s for cx2, cy2 in centres):
            return x, y
    return None


def render_layout(index: int, seed: int, objects: int, width: int, height: int):
    """(RGB image, "L" object mask, labels) of layout image `index`. Labels come from the objects whose
    centre pixel shows their type in the mask: all of them, since no object is placed over an earlier
    centre (after `_PLACEMENT_TRIES` positions that all would, the object is left out). The image and
    the mask are painted with the same shapes, so the mask is exactly what shows."""
    return render_layout_objects(index, seed, objects, width, height)[:3]


def render_layout_objects(index: int, seed: int, objects: int, width: int, height: int):
    """`render_layout` and the objects' boxes: (image, mask, labels, boxes), boxes a list of (type, [x, y, w, h])
    in pixels, COCO-style, one per labelled object in drawing order: the whole shape's extent (a shape of
    side s at (x, y) paints pixels x..x + s, so w = h = s + 1 inside the image), also where a later object
    covers part of it."""
    check_layout(objects, width, height)
    rng = np.random.default_rng([seed, index])
    # Drawn in a few vectorised calls: per-object scalar draws cost more than the pixels of a small image.
    n = int(rng.integers(2, 5))
    types = rng.integers(0, objects, size=n).tolist()
    shorter = min(width, height)
    sizes = rng.integers(shorter // 5, shorter // 3 + 1, size=n).tolist()
    spots = rng.random((n, _FIRST_TRIES, 2)).tolist()  # [n, tries, (x, y)] candidate positions
    base = rng.integers(0, 90, size=3, dtype=np.uint8)
    noise = rng.integers(0, 40, size=(height, width, 1), dtype=np.uint8)
    img = Image.fromarray(noise + base)  # [H, W, 3] uint8; at most 39 + 89: no overflow
    mask = Image.new("L", (width, height), 0)  # painted with the same shapes: 1 + type where one shows
    draw_img, draw_mask = ImageDraw.Draw(img), ImageDraw.Draw(mask)
    placed: list[tuple[int, int, int]] = []  # (type, 2 cx, 2 cy): centres doubled, (2 x + s, 2 y + s)
    placed_sides: list[int] = []
    for t, s, first in zip(types, sizes, spots):
        centres = [(cx2, cy2) for _, cx2, cy2 in placed]
        at = _place(s, first, centres, width, height)
        if at is None:  # rare: crowded by earlier centres; a few more tries, from the same generator
            at = _place(s, rng.random((_PLACEMENT_TRIES - _FIRST_TRIES, 2)).tolist(), centres, width, height)
        if at is None:
            continue
        x, y = at
        shape, colour = _layout_style(t)
        _draw(draw_img, shape, (x, y, x + s, y + s), PALETTE[colour])
        _draw(draw_mask, shape, (x, y, x + s, y + s), 1 + t)
        placed.append((t, 2 * x + s, 2 * y + s))
        placed_sides.append(s)
    # An object counts where its centre pixel shows its type (always, as placed; checked, not assumed).
    kept = [(t, cx2, cy2) for t, cx2, cy2 in placed if mask.getpixel((cx2 // 2, cy2 // 2)) == 1 + t]
    labels = _layout_labels(
        objects, [t for t, _, _ in kept], [(cx2, cy2) for _, cx2, cy2 in kept], width, height
    )
    boxes = []
    for (t, cx2, cy2), s in zip(placed, placed_sides):
        if (t, cx2, cy2) in kept:
            x, y = (cx2 - s) // 2, (cy2 - s) // 2  # centre (2 x + s, 2 y + s) -> corner (x, y)
            boxes.append(
                (t, [x, y, min(s + 1, width - x), min(s + 1, height - y)])
            )  # pixel x + s may be off it
    return img, mask, labels, boxes


def synthetic_samples(
    num: int,
    num_classes: int,
    seed: int = 0,
    labels_per_image: float = 1.3,
    width: int = 500,
    height: int = 375,
    val_fraction: float = 0.0,
    quality: int = 90,
    layout: bool = False,
    objects: int = 6,
) -> Iterator[Sample]:
    """Samples 0..num-1 of the corpus. `layout`: the layout corpus of `objects` types, each sample with its
    mask in `extra["seg.png"]` and its objects' boxes in `extra["boxes.json"]` (classes: `layout_type_names`); `num_classes` and `labels_per_image` do not apply to it (it has
    3 * objects + 4 classes, `layout_class_names`)."""
    if layout:
        check_layout(objects, width, height)
    for i in range(num):
        key = synthetic_key(seed, i)
        split = split_for(key, val_fraction)  # the same split `vitpipe shard synthetic` gives
        if layout:
            img, mask, labels, boxes = render_layout_objects(i, seed, objects, width, height)
            # The same encoding as `vitpipe shard synthetic --layout` (sources/synthetic.py): the same bytes.
            p = prepare_generated(img, "jpg", None, quality, tuple(labels), {MASK_EXT: mask}, boxes, objects)
            yield Sample(key, p.data, p.ext, labels, width, height, split, f"synthetic:{i}", dict(p.extra))
            continue
        img, labels = render(i, seed, num_classes, labels_per_image, width, height)
        buf = io.BytesIO()
        img.save(buf, format="JPEG", quality=quality)
        yield Sample(key, buf.getvalue(), "jpg", labels, width, height, split, f"synthetic:{i}")
