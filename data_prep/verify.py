"""`vitpipe shard verify OUT`: re-read every shard the manifest lists and say exactly what is wrong.

Per shard: present, size and sha256 as recorded in manifest.json, a readable tar whose samples are
(one image + one label) in WebDataset's key grouping, as many as recorded, every image decoding in
full and every label a known class. In a dataset whose manifest lists `segmentation_classes`, every
sample also has its mask `KEY.seg.png`: mode "L", the image's size, every value a listed class; in one
that lists `detection_classes`, its boxes `KEY.boxes.json`: inside the image, every class a listed one.
Where the shard's sha256 is off, each sample is compared with its index.parquet row (image sha256,
labels), which names the damaged keys.

vitpipe shard verify data/in1k --workers 8
vitpipe shard verify s3://corpus/jft --workers 32     # on object storage: each shard read once, hashed on the way
"""

from __future__ import annotations

import functools
import hashlib
import io
import json
import multiprocessing
import re
import tarfile
from concurrent.futures import ProcessPoolExecutor
from dataclasses import dataclass
from pathlib import Path

from PIL import Image

from data_prep.dataset_dir import DatasetDir
from data_prep.images import STORED_FORMATS
from data_prep.layout import BOXES_EXT, INDEX, MASK_EXT, ShardInfo, mask_problem, parse_boxes, read_manifest
from data_prep.tario import REGULAR_FILE, tar_entries

IMAGE_EXTS = set(STORED_FORMATS.values()) | {"jpeg"}
_MEMBER = re.compile(r"^((?:.*/|)[^./]+)\.([^/]*)$")  # webdataset's base_plus_ext: key up to the first dot


@dataclass(frozen=True)
class Problem:
    shard: str
    key: str | None
    reason: str

    def __str__(self) -> str:
        kind = "bad shard" if self.shard.endswith(".tar") else "bad file"
        where = f"{kind} {self.shard}" + (f" key {self.key}" if self.key else "")
        return f"{where}: {self.reason}"


@dataclass(frozen=True)
class ShardCheck:
    shard: str
    samples: int
    problems: list[Problem]


def _mask_problem(data: bytes, image_size: tuple[int, int] | None, num_segmentation: int) -> str | None:
    """Why `data` is not a valid KEY.seg.png for an image of `image_size` (None: unknown), else None."""
    try:
        with Image.open(io.BytesIO(data)) as mask:
            mask.load()
            return mask_problem(mask, image_size, num_segmentation)
    except Exception as exc:  # any decoder failure is this sample's problem, not the verifier's
        return f"mask {MASK_EXT} does not decode ({type(exc).__name__}: {exc})"


def _check_sample(
    shard: str,
    key: str,
    parts: dict[str, bytes],
    num_classes: int,
    multi_label: bool,
    num_segmentation: int | None = None,
    num_detection: int | None = None,
) -> list[Problem]:
    """`num_segmentation`: the manifest's segmentation classes, whose masks every sample must have;
    `num_detection`: its detection classes, whose boxes (KEY.boxes.json) every sample must have."""
    out = []
    images = [e for e in parts if e in IMAGE_EXTS]
    label_ext = "json" if multi_label else "cls"
    image_size = None
    if len(images) != 1:
        out.append(Problem(shard, key, f"expected one image member, found {sorted(parts)}"))
    else:
        try:
            with Image.open(io.BytesIO(parts[images[0]])) as img:
                img.load()
                image_size = img.size
        except Exception as exc:  # any decoder failure is this sample's problem, not the verifier's
            out.append(Problem(shard, key, f"image does not decode ({type(exc).__name__}: {exc})"))
    if num_segmentation is not None:
        if MASK_EXT not in parts:
            out.append(
                Problem(shard, key, f"no .{MASK_EXT} mask member (manifest.json lists segmentation_classes)")
            )
        else:
            problem = _mask_problem(parts[MASK_EXT], image_size, num_segmentation)
            if problem:
                out.append(Problem(shard, key, problem))
    if num_detection is not None:
        if BOXES_EXT not in parts:
            out.append(Problem(shard, key, f"no .{BOXES_EXT} member (manifest.json lists detection_classes)"))
        else:
            try:
                parse_boxes(parts[BOXES_EXT], image_size, num_detection)
            except ValueError as exc:
                out.append(Problem(shard, key, str(exc)))
    if label_ext not in parts:
        out.append(Problem(shard, key, f"no .{label_ext} label member"))
        return out
    try:
        labels = json.loads(parts["json"])["labels"] if multi_label else [int(parts["cls"])]
        if not all(isinstance(c, int) and 0 <= c < num_classes for c in labels):
            raise ValueError(f"labels {labels} outside 0..{num_classes - 1}")
    except (ValueError, KeyError, TypeError) as exc:
        out.append(Problem(shard, key, f"bad label ({exc})"))
    return out


class _HashingReader:
    """Reads a stream and hashes every byte that passes (one read of a shard for both checks)."""

    def __init__(self, f):
        self._f, self.sha256 = f, hashlib.sha256()

    def read(self, n: int = -1) -> bytes:
        data = self._f.read(n)
        self.sha256.update(data)
        return data

    def drain(self) -> str:
        while self.read(1 << 20):
            pass
        return self.sha256.hexdigest()


@functools.cache
def _index(location: str):
    """The dataset's index (its footer parsed once per process, however many shards are damaged), or None
    where it has none."""
    from data_prep.index import Table  # pyarrow, only on this rare path: workers stay light

    try:
        return Table(DatasetDir(location), INDEX)
    except (OSError, ValueError):
        return None  # none, or unreadable: the index's own check (`_check_index`) names it


def _compare_with_index(
    root: DatasetDir, shard: ShardInfo, seen: dict[str, tuple[str, list]], multi_label: bool
) -> list[Problem]:
    """Name the damaged samples of a shard whose sha256 is off, from their index.parquet rows."""
    index = _index(root.location)
    if index is None:
        return []
    label_col = "labels" if multi_label else "label"
    try:
        table = index.shard_rows(shard.path, ["key", "sha256", label_col])
    except (OSError, ValueError):
        return []  # an index part missing or unreadable: the index's own check names it
    out = []
    for key, sha, label in zip(*(table.column(c).to_pylist() for c in ("key", "sha256", label_col))):
        labels = label if multi_label else [label]
        if key not in seen:
            out.append(Problem(shard.path, key, "in index.parquet but missing from the shard"))
        elif seen[key][0] != sha:
            out.append(Problem(shard.path, key, "image bytes differ from index.parquet (sha256)"))
        elif seen[key][1] is not None and seen[key][1] != labels:
            out.append(Problem(shard.path, key, f"labels {seen[key][1]} differ from index.parquet {labels}"))
    return out


def verify_shard(
    root: str,
    shard: ShardInfo,
    num_classes: int,
    multi_label: bool,
    num_segmentation: int | None = None,
    num_detection: int | None = None,
) -> ShardCheck:
    try:
        out = DatasetDir(root)
        size = out.size(shard.path)
    except (OSError, ValueError) as exc:  # the storage, not the shard: still one line naming it
        return ShardCheck(shard.path, 0, [Problem(shard.path, None, f"cannot read ({exc})")])
    if size is None:
        return ShardCheck(shard.path, 0, [Problem(shard.path, None, "missing")])
    problems: list[Problem] = []
    if size != shard.bytes:
        problems.append(Problem(shard.path, None, f"{size} bytes, manifest.json says {shard.bytes}"))
    sha_at = len(problems)  # the sha256 verdict goes here once the shard has been read
    seen: dict[str, tuple[str, list | None]] = {}  # key -> (image sha256, labels)
    samples, last = 0, None

    def close(key: str, parts: dict[str, bytes]) -> None:
        nonlocal samples
        samples += 1
        problems.extend(
            _check_sample(shard.path, key, parts, num_classes, multi_label, num_segmentation, num_detection)
        )
        image = next((parts[e] for e in parts if e in IMAGE_EXTS), b"")
        try:
            labels = json.loads(parts["json"])["labels"] if multi_label else [int(parts["cls"])]
        except (ValueError, KeyError, TypeError):
            labels = None
        seen[key] = (hashlib.sha256(image).hexdigest(), labels)

    sha = None
    try:
        with out.open(shard.path) as f:
            reader = _HashingReader(f)
            key, parts = None, {}
            for name, kind, data in tar_entries(reader):
                m = _MEMBER.match(name)
                if kind not in REGULAR_FILE or m is None:
                    problems.append(Problem(shard.path, None, f"unexpected member {name!r}"))
                    continue
                if m.group(1) != key:
                    if key is not None:
                        close(key, parts)
                    key, parts = m.group(1), {}
                parts[m.group(2)] = data
                last = key
            if key is not None:
                close(key, parts)
            sha = reader.drain()
    except (tarfile.TarError, OSError) as exc:
        problems.append(Problem(shard.path, last, f"unreadable tar after this key ({exc})"))
    if samples != shard.count:
        problems.append(Problem(shard.path, None, f"{samples} samples, manifest.json says {shard.count}"))
    if sha != shard.sha256:
        problems.insert(sha_at, Problem(shard.path, None, "sha256 differs from manifest.json"))
        problems.extend(_compare_with_index(out, shard, seen, multi_label))
    return ShardCheck(shard.path, samples, problems)


def verify_dataset(root: str | Path, workers: int = 1) -> list[ShardCheck]:
    manifest = read_manifest(root)  # a missing or bad manifest is a DatasetError naming it
    _index.cache_clear()  # this dataset as it is now (the cache spares a re-parse per damaged shard)
    segmentation = manifest.segmentation_classes
    num_segmentation = None if segmentation is None else len(segmentation)
    detection = manifest.detection_classes
    num_detection = None if detection is None else len(detection)
    args = [
        (str(root), s, len(manifest.classes), manifest.multi_label, num_segmentation, num_detection)
        for s in manifest.shards
    ]
    if workers <= 1 or len(args) <= 1:
        checks = [verify_shard(*a) for a in args]
    else:
        ctx = multiprocessing.get_context("spawn")
        with ProcessPoolExecutor(min(workers, len(args)), mp_context=ctx) as pool:
            checks = list(pool.map(verify_shard, *zip(*args)))
    return checks + [_check_index(DatasetDir(root), sum(manifest.totals.values()))]


def _check_index(root: DatasetDir, expected_rows: int) -> ShardCheck:
    # pyarrow: heavy; the spawned shard-checking workers never need it
    from data_prep.index import SUMMARY, Table

    try:
        table = Table(root, INDEX)
    except (OSError, ValueError) as exc:
        return ShardCheck(INDEX, 0, [Problem(INDEX, None, f"unreadable ({exc})")])
    problems = [
        Problem(f"{INDEX}/{name}", None, "named by its _metadata but missing")
        for name in table.files
        if root.size(table.file_rel(name)) is None
    ]
    if table.parted:  # pandas and Spark read the folder by listing it, not through the summary
        problems += [
            Problem(f"{INDEX}/{name}", None, "not named by its _metadata (a folder reader would read it too)")
            for name in root.list_files(INDEX)
            if name != SUMMARY and name not in table.files
        ]
    if table.num_rows != expected_rows:
        problems.append(
            Problem(INDEX, None, f"{table.num_rows} rows, manifest.json counts {expected_rows} samples")
        )
    return ShardCheck(INDEX, 0, problems)
