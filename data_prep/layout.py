"""The dataset layout, defined once: every writer produces it and the loader reads it through here.
OUT is a local folder or an object store prefix (s3://bucket/prefix; see dataset_dir.py).

OUT/manifest.json            format version, class names, per-shard counts and sha256, totals per split
OUT/index.parquet            one row per sample: the INDEX_COLUMNS below (schema: data_prep/index.py)
OUT/errors.parquet           one row per rejected input: key, source, stage, reason (`vitpipe shard` only)
OUT/{split}/{name}-{i:06d}.tar   plain WebDataset tar: KEY.jpg|png|webp [+ KEY.seg.png] + KEY.cls (single) or
                             KEY.json (multi); KEY.seg.png, in datasets whose manifest lists
                             `segmentation_classes`: the image's per-pixel class mask, lossless PNG
                             "L" at the image's size, value i = segmentation_classes[i]
OUT/.work/{split}/{name}-{i:06d}.json   per-shard sidecar: the plan's fingerprint, size, sha256, index rows;
                             how a re-run of `vitpipe shard` knows a shard is complete and skips it

The manifest is written last: its presence marks the dataset complete. Fields added after format
version 1 (`name`, `num_inputs`, `num_errors`, `segmentation_classes`) have defaults, so older manifests
still read; `segmentation_classes` is left out of manifest.json when a dataset has no masks.
"""

from __future__ import annotations

import json
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
        )
    except (KeyError, TypeError) as exc:
        raise DatasetError(f"{path}: manifest lacks or misshapes a field ({exc})") from None


def has_dataset(root: Root) -> bool:
    try:
        return dataset_dir(root).size(MANIFEST) is not None
    except (OSError, ValueError) as exc:
        shown = os.fspath(root.location if isinstance(root, DatasetDir) else root).split("?", 1)[0]
        raise DatasetError(f"{shown}: cannot look for a manifest there ({exc})") from None
