"""The dataset layout, defined once: every writer produces it and the loader reads it through here.
OUT is a local folder or an object store prefix (s3://bucket/prefix; see dataset_dir.py).

OUT/manifest.json            format version, class names, per-shard counts and sha256, totals per split
OUT/index.parquet/           one row per sample: the INDEX_COLUMNS below (schema: data_prep/index.py), as
                             part-NNNNNN.parquet in row order + _metadata (the parts' footers); one
                             Parquet file in datasets written before
OUT/errors.parquet/          one row per rejected input: key, source, stage, reason (`vitpipe shard` only),
                             parts and _metadata likewise
OUT/{split}/{name}-{i:06d}.tar   plain WebDataset tar: KEY.jpg|png|webp [+ KEY.seg.png] + KEY.cls (single) or
                             KEY.json (multi); KEY.seg.png, in datasets whose manifest lists
                             `segmentation_classes`: the image's per-pixel class mask, lossless PNG
                             "L" at the image's size, value i = segmentation_classes[i];
                             + KEY.boxes.json, in datasets whose manifest lists `detection_classes`:
                             the image's objects, {"boxes": [[x, y, w, h], ...], "classes": [i, ...]},
                             COCO-style boxes in the stored image's pixels (x, y its top-left corner),
                             class i = detection_classes[i]; [] for an image without objects
OUT/.work/{split}/{name}-{i:06d}.json   per-shard sidecar: the plan's fingerprint, size, sha256, index rows;
                             how a re-run of `vitpipe shard` knows a shard is complete and skips it

The manifest is written last: its presence marks the dataset complete. Fields added after format
version 1 (`name`, `num_inputs`, `num_errors`, `segmentation_classes`, `detection_classes`) have defaults, so
older manifests still read; `segmentation_classes` (`detection_classes`) is left out of manifest.json when a
dataset has no masks (boxes).
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import asdict, dataclass, field

from data_prep.dataset_dir import DatasetDir

FORMAT_VERSION = 1
MANIFEST = "manifest.json"
INDEX = "index.parquet"
ERRORS = "errors.parquet"
WORK = ".work"  # sidecars and scratch files of `vitpipe shard`; without it a re-run rewrites every shard
# index.parquet's columns, in order: one row per sample. A single-label dataset stores `label` (one int) in
# place of `labels` (a list); `bytes` and `sha256` are the stored image's; `source` is what the sample was
# made from, as a person reads it (a path, "synthetic:17"; "" where the writer was given bytes only).
INDEX_COLUMNS = ("key", "split", "shard", "labels", "width", "height", "bytes", "sha256", "source")
# A sample's per-pixel class mask: the tar member KEY.seg.png (manifest.json: segmentation_classes).
MASK_EXT = "seg.png"
MASK_IGNORE = 255  # a mask value that counts in no loss or metric (VOC's and ADE20K's "void" pixels)
MASK_MODES = ("L", "P")  # 8-bit class indices; a palette ("P") only colours them


def mask_problem(mask, image_size: tuple[int, int] | None, num_classes: int) -> str | None:
    """Why a decoded KEY.seg.png (a PIL image) cannot be the mask of an image of `image_size` (None: not
    checked) with `num_classes` segmentation classes, else None: its mode must be L or P, its size the image's,
    and every value a class index below num_classes or MASK_IGNORE. The one check of `vitpipe shard verify`
    and of the training and eval loaders."""
    if mask.mode not in MASK_MODES:
        return f"mask {MASK_EXT} is mode {mask.mode}, expected L or P (8-bit class indices)"
    if image_size is not None and mask.size != tuple(image_size):
        return f"mask {MASK_EXT} is {mask.width}x{mask.height}, the image {image_size[0]}x{image_size[1]}"
    counts = mask.histogram()  # 256 counts of the stored values (indices, in a palette image)
    outside = [v for v in range(num_classes, 256) if counts[v] and v != MASK_IGNORE]
    if outside:
        return (
            f"mask {MASK_EXT} has value {outside[-1]}, manifest.json lists {num_classes} segmentation_classes "
            f"({MASK_IGNORE} marks ignored pixels)"
        )
    return None


# A sample's objects: the tar member KEY.boxes.json (manifest.json: detection_classes).
BOXES_EXT = "boxes.json"
BOX_TOLERANCE = 0.5  # px a box may reach past the image's edge: rounding in a user's own annotations


def parse_boxes(data: bytes | str, image_size: tuple[int, int] | None, num_classes: int):
    """A KEY.boxes.json member -> (boxes [[x, y, w, h], ...] in pixels, classes [i, ...]), checked: a JSON
    object with "boxes" and "classes" lists of one length, every box 4 finite numbers with w, h > 0 inside
    the image of `image_size` (w, h; None: not checked, up to BOX_TOLERANCE px past an edge), every class
    below num_classes. Raises ValueError naming the box and what was expected. The one check of `vitpipe
    shard verify`, the writers and the training and eval loaders."""
    try:
        doc = json.loads(data)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise ValueError(f"{BOXES_EXT} is not valid JSON ({exc})") from None
    if (
        not isinstance(doc, dict)
        or not isinstance(doc.get("boxes"), list)
        or not isinstance(doc.get("classes"), list)
    ):
        raise ValueError(f'{BOXES_EXT} must be {{"boxes": [[x, y, w, h], ...], "classes": [i, ...]}}')
    boxes, classes = doc["boxes"], doc["classes"]
    if len(boxes) != len(classes):
        raise ValueError(
            f"box classes do not match the boxes ({BOXES_EXT} has {len(boxes)} boxes and {len(classes)} classes)"
        )
    out = []
    for i, (box, cls) in enumerate(zip(boxes, classes)):
        out.append(check_box(box, image_size, f"{BOXES_EXT} box {i}"))
        if isinstance(cls, bool) or not isinstance(cls, int) or not 0 <= cls < num_classes:
            raise ValueError(
                f"unknown box class ({BOXES_EXT} box {i} has class {cls!r}, manifest.json lists {num_classes} "
                "detection_classes)"
            )
    return out, [int(c) for c in classes]


def check_box(box, image_size: tuple[int, int] | None, what: str) -> list[float]:
    """One COCO-style [x, y, w, h] box in pixels, checked (see `parse_boxes`) -> 4 floats. A message starts
    with the kind of problem (what `vitpipe shard` counts), then names `what` and the values."""
    if not isinstance(box, list | tuple) or len(box) != 4:
        raise ValueError(f"malformed box ({what} is {box!r}, expected [x, y, w, h] in pixels)")
    try:
        x, y, w, h = (float(v) for v in box)
    except (TypeError, ValueError):
        raise ValueError(f"malformed box ({what} is {box!r}, expected 4 numbers [x, y, w, h])") from None
    if not all(math.isfinite(v) for v in (x, y, w, h)) or w <= 0 or h <= 0:
        raise ValueError(f"empty box ({what} is {box!r}: w and h must be > 0 and every value finite)")
    if image_size is not None:
        width, height = image_size
        t = BOX_TOLERANCE
        if x < -t or y < -t or x + w > width + t or y + h > height + t:
            raise ValueError(
                f"box outside the image ({what} [x={x:g}, y={y:g}, w={w:g}, h={h:g}] is not inside the "
                f"{width}x{height} image; COCO-style: x, y the top-left corner, in the image's pixels)"
            )
    return [x, y, w, h]


def boxes_json(boxes, classes) -> bytes:
    """The KEY.boxes.json member of `boxes` ([x, y, w, h] pixels) and their `classes`; values rounded to
    1/100 px, so a member's bytes do not depend on float noise."""
    rounded = [[round(float(v), 2) for v in b] for b in boxes]
    return json.dumps({"boxes": rounded, "classes": [int(c) for c in classes]}).encode()


class DatasetError(ValueError):
    """A dataset folder that does not hold what the layout promises; the message names the path."""


def shard_name(name: str, index: int) -> str:
    return f"{name}-{index:06d}.tar"


def shard_rel(split: str, name: str, index: int) -> str:
    """A shard's path inside the dataset root: "{split}/{name}-{index:06d}.tar"."""
    return f"{split}/{shard_name(name, index)}"


def sidecar_rel(split: str, name: str, index: int) -> str:
    """Where a shard's completion record lives (beside the data, never inside a split folder)."""
    return f"{WORK}/{split}/{name}-{index:06d}.json"


@dataclass
class ShardInfo:
    split: str
    path: str  # relative to the dataset root
    count: int
    bytes: int
    sha256: str


@dataclass
class Manifest:
    classes: list[str]
    multi_label: bool
    shards: list[ShardInfo] = field(default_factory=list)
    command: str = ""
    options: dict = field(default_factory=dict)
    format_version: int = FORMAT_VERSION
    name: str = "shard"  # shard file prefix
    num_inputs: int = 0  # inputs listed, accepted or not (0: unknown, older writers)
    num_errors: int = 0  # inputs rejected; listed in errors.parquet
    # The mask values' names (["background", ...]) where every sample has a KEY.seg.png mask, else None
    segmentation_classes: list[str] | None = None
    # The object classes of KEY.boxes.json where every sample has one (detection), else None
    detection_classes: list[str] | None = None

    @property
    def totals(self) -> dict[str, int]:
        out: dict[str, int] = {}
        for s in self.shards:
            out[s.split] = out.get(s.split, 0) + s.count
        return out

    def split_shards(self, split: str) -> list[ShardInfo]:
        return [s for s in self.shards if s.split == split]

    def to_json(self) -> str:
        d = asdict(self)
        if d["segmentation_classes"] is None:  # no masks: manifest.json as it was before masks existed
            del d["segmentation_classes"]
        if d["detection_classes"] is None:  # no boxes: likewise
            del d["detection_classes"]
        d["totals"] = self.totals
        return json.dumps(d, indent=2)


Root = str | os.PathLike | DatasetDir  # a local folder, an object store URI, or either opened


def dataset_dir(root: Root) -> DatasetDir:
    return root if isinstance(root, DatasetDir) else DatasetDir(root)


def write_manifest(root: Root, manifest: Manifest) -> str:
    """Atomic (one rename, or one PUT): a reader sees the old manifest or the new one, never half of one."""
    where = dataset_dir(root)
    where.write_bytes(MANIFEST, manifest.to_json().encode())
    return where.describe(MANIFEST)


def read_manifest(root: Root) -> Manifest:
    try:
        where = dataset_dir(root)  # an object store client may resolve the bucket's region here
        raw = where.read_bytes(MANIFEST)
    except (OSError, ValueError) as exc:  # an unreachable or refusing object store, a malformed URI
        shown = os.fspath(root.location if isinstance(root, DatasetDir) else root).split("?", 1)[0]
        raise DatasetError(f"{shown.rstrip('/')}/{MANIFEST}: cannot read the manifest ({exc})") from None
    path = where.describe(MANIFEST)
    if raw is None:
        raise DatasetError(
            f"{path}: no manifest; is {where.describe()} a dataset written by `vitpipe shard`?"
        )
    try:
        d = json.loads(raw)
    except json.JSONDecodeError as exc:
        raise DatasetError(f"{path}: manifest is not valid JSON ({exc})") from None
    version = d.get("format_version")
    if version != FORMAT_VERSION:
        raise DatasetError(f"{path}: format_version {version!r}, this vitpipe reads {FORMAT_VERSION}")
    try:
        shards = [ShardInfo(**s) for s in d["shards"]]
        segmentation = d.get("segmentation_classes")  # absent: a dataset without masks
        detection = d.get("detection_classes")  # absent: a dataset without boxes
        return Manifest(
            classes=list(d["classes"]),
            multi_label=bool(d["multi_label"]),
            shards=shards,
            command=d.get("command", ""),
            options=d.get("options", {}),
            name=d.get("name", "shard"),
            num_inputs=int(d.get("num_inputs", 0)),
            num_errors=int(d.get("num_errors", 0)),
            segmentation_classes=None if segmentation is None else [str(c) for c in segmentation],
            detection_classes=None if detection is None else [str(c) for c in detection],
        )
    except (KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: manifest lacks or misshapes a field ({exc})") from None


def has_dataset(root: Root) -> bool:
    try:
        return dataset_dir(root).size(MANIFEST) is not None
    except (OSError, ValueError) as exc:
        shown = os.fspath(root.location if isinstance(root, DatasetDir) else root).split("?", 1)[0]
        raise DatasetError(f"{shown}: cannot look for a manifest there ({exc})") from None
