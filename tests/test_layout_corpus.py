"""The layout corpus (`data_prep.synthetic`, `vitpipe shard synthetic --layout`): labels that depend on
where objects are, per-pixel masks stored as `KEY.seg.png`, checked by `vitpipe shard verify`.

.venv/bin/python -m pytest tests/test_layout_corpus.py -q
"""

from __future__ import annotations

import hashlib
import io
import json
import tarfile
from pathlib import Path

import numpy as np
import pytest
from conftest import vitpipe_shard as shard
from PIL import Image

from data_prep.images import fitted_size
from data_prep.layout import BOXES_EXT, MASK_EXT, parse_boxes, read_manifest
from data_prep.sources.synthetic import SyntheticSource
from data_prep.synthetic import (
    LAYOUT_COLOURS,
    PALETTE,
    PALETTE_NAMES,
    SHAPES,
    layout_class_names,
    layout_type_names,
    render_layout,
    render_layout_objects,
    segmentation_class_names,
    synthetic_samples,
)
from data_prep.verify import verify_dataset
from data_prep.writer import write_dataset
from pipeline.config import ConfigError, load_config
from pipeline.train.launch import prepare_data

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


def decode(data: bytes) -> Image.Image:
    img = Image.open(io.BytesIO(data))
    img.load()
    return img


def tar_members(path: Path) -> list[tuple[str, bytes]]:
    with tarfile.open(path) as tar:
        return [(m.name, tar.extractfile(m).read()) for m in tar.getmembers()]


def rewrite_tar(path: Path, members: list[tuple[str, bytes]]) -> None:
    with tarfile.open(path, "w") as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))


def png(mask: np.ndarray) -> bytes:
    buf = io.BytesIO()
    Image.fromarray(mask.astype(np.uint8), mode="L").save(buf, format="PNG")
    return buf.getvalue()


# ---------------------------------------------------------------- the generator


def test_the_default_generator_is_byte_identical_to_before():
    # sha256 of these images computed from the generator before the layout corpus was added.
    s = list(synthetic_samples(3, 8, seed=0, width=48, height=40))[2]
    assert s.labels == [2] and not s.extra
    assert (
        hashlib.sha256(s.image).hexdigest()
        == "9b996094836a731834e05111bac413a4f93519375bf3c15d7d5836620fba38e2"
    )
    s = list(synthetic_samples(2, 100, seed=7, width=500, height=375))[1]
    assert s.labels == [18, 25]
    assert (
        hashlib.sha256(s.image).hexdigest()
        == "de7b1c0c51e60609a52a38d112c46763911535bc716c5e30c4a517b3920f343a"
    )


def test_layout_is_deterministic_in_seed_and_index():
    a = list(synthetic_samples(12, 0, seed=3, width=48, height=40, layout=True))
    b = list(synthetic_samples(12, 0, seed=3, width=48, height=40, layout=True))
    assert [(s.key, s.image, s.labels, s.extra) for s in a] == [
        (s.key, s.image, s.labels, s.extra) for s in b
    ]
    assert all(set(s.extra) == {MASK_EXT, BOXES_EXT} for s in a)
    # image i does not depend on what else is generated, and differs from its neighbours and other seeds
    img, mask, labels = render_layout(7, 3, 6, 48, 40)
    assert labels == a[7].labels
    assert np.array_equal(np.asarray(mask), np.asarray(decode(a[7].extra[MASK_EXT])))
    assert len({s.image for s in a}) == 12 and len({s.extra[MASK_EXT] for s in a}) > 6
    other = next(iter(synthetic_samples(1, 0, seed=4, width=48, height=40, layout=True)))
    assert other.image != a[0].image


def test_class_names_and_count():
    for objects in (2, 6, 10):
        names = layout_class_names(objects)
        assert len(names) == 3 * objects + 4 == len(set(names))
        types = layout_type_names(objects)
        assert segmentation_class_names(objects) == ["background", *types]
        assert len(set(types)) == objects
    assert layout_class_names(6)[:3] == ["yellow_ellipse_top", "yellow_ellipse_bottom", "cyan_rectangle_top"]
    assert layout_class_names(6)[12:] == [
        "yellow_ellipse_left_of_cyan_rectangle",
        "cyan_rectangle_left_of_red_triangle",
        "red_triangle_left_of_green_cross",
        "green_cross_left_of_magenta_ellipse",
        "magenta_ellipse_left_of_blue_rectangle",
        "blue_rectangle_left_of_yellow_ellipse",
        "crowded_tl",
        "crowded_tr",
        "crowded_bl",
        "crowded_br",
    ]
    # every type a distinct colour, none of them reachable by the background (every channel <= 128)
    colours = [PALETTE[c] for c in LAYOUT_COLOURS]
    assert len(set(colours)) == len(colours) and all(max(c) >= 180 for c in colours)
    assert all(
        name.split("_")[0] == PALETTE_NAMES[c] for name, c in zip(layout_type_names(10), LAYOUT_COLOURS)
    )
    assert all(name.split("_")[1] in SHAPES for name in layout_type_names(10))
    source = SyntheticSource(10, None, width=48, height=40, layout=True, objects=4)
    assert source.classes == layout_class_names(
        4
    ) and source.segmentation_classes == segmentation_class_names(4)
    for bad in ({"objects": 1}, {"objects": 11}, {"width": 15}):
        with pytest.raises(ValueError, match="layout corpus"):
            render_layout(0, 0, **{"objects": 6, "width": 48, "height": 40, **bad})


def _check_against_mask(mask: np.ndarray, labels: list[int], objects: int, seen: dict[str, int]) -> None:
    """Each label is witnessed by the mask, and what the mask rules out is not labelled."""
    h, w = mask.shape
    names = layout_class_names(objects)
    label_names = {names[c] for c in labels}
    types = layout_type_names(objects)
    present = {int(v) - 1 for v in np.unique(mask) if v}
    labelled = {t for t in range(objects) if {f"{types[t]}_top", f"{types[t]}_bottom"} & label_names}
    assert present == labelled and present, (present, sorted(label_names))
    seen["types_compared"] += len(present)
    seen["types_absent"] += objects - len(present)
    rows = {t: np.nonzero((mask == t + 1).any(axis=1))[0] for t in present}
    cols = {t: np.nonzero((mask == t + 1).any(axis=0))[0] for t in present}
    for t in present:
        top, bottom = f"{types[t]}_top", f"{types[t]}_bottom"
        if top in label_names:  # an object's centre pixel, in the top half, shows its type
            assert (mask[: (h + 1) // 2] == t + 1).any()
            seen["top"] += 1
        if bottom in label_names:
            assert (mask[h // 2 :] == t + 1).any()
            seen["bottom"] += 1
        if 2 * (rows[t].max() + 1) <= h:  # all of type t above the middle: no object of t is at the bottom
            assert bottom not in label_names and top in label_names
            seen["only_top"] += 1
        if 2 * rows[t].min() >= h:
            assert top not in label_names and bottom in label_names
            seen["only_bottom"] += 1
    for t in range(objects):
        u = (t + 1) % objects
        relation = f"{types[t]}_left_of_{types[u]}"
        if relation in label_names:
            assert t in present and u in present and cols[t].min() <= cols[u].max()
            seen["left_of"] += 1
        elif t in present and u in present and cols[t].max() < cols[u].min():
            raise AssertionError(f"{relation} missing: every {types[t]} pixel is left of every {types[u]}")
        if t in present and u in present and cols[t].min() > cols[u].max():
            assert relation not in label_names
            seen["not_left_of"] += 1
    quadrants = {
        "tl": mask[: (h + 1) // 2, : (w + 1) // 2],
        "tr": mask[: (h + 1) // 2, w // 2 :],
        "bl": mask[h // 2 :, : (w + 1) // 2],
        "br": mask[h // 2 :, w // 2 :],
    }
    for q, part in quadrants.items():
        if f"crowded_{q}" in label_names:
            assert part.any()
            seen["crowded"] += 1
    # at most 4 objects: at most 2 crowded quadrants
    assert sum(name.startswith("crowded_") for name in label_names) <= 2
    # two types wholly inside one quadrant: their centres are there, so it is crowded
    inside = {
        "tl": lambda t: 2 * (rows[t].max() + 1) <= h and 2 * (cols[t].max() + 1) <= w,
        "tr": lambda t: 2 * (rows[t].max() + 1) <= h and 2 * cols[t].min() >= w,
        "bl": lambda t: 2 * rows[t].min() >= h and 2 * (cols[t].max() + 1) <= w,
        "br": lambda t: 2 * rows[t].min() >= h and 2 * cols[t].min() >= w,
    }
    for q, holds in inside.items():
        if sum(holds(t) for t in present) >= 2:
            assert f"crowded_{q}" in label_names
            seen["crowded_implied"] += 1


@pytest.mark.parametrize("size,num", [((48, 40), 300), ((500, 375), 12)])
def test_labels_agree_with_the_stored_mask(size, num):
    width, height = size
    seen = dict.fromkeys(
        ["types_compared", "types_absent", "top", "bottom", "only_top", "only_bottom"]
        + ["left_of", "not_left_of", "crowded", "crowded_implied"],
        0,
    )
    for s in synthetic_samples(num, 0, seed=11, width=width, height=height, layout=True):
        mask_img = decode(s.extra[MASK_EXT])
        assert mask_img.mode == "L" and mask_img.size == decode(s.image).size == (width, height)
        mask = np.asarray(mask_img)
        assert mask.max() <= 6
        _check_against_mask(mask, s.labels, 6, seen)
    # the checks above ran on many labels of each kind, not on none
    least = 5 if num < 50 else 60
    assert all(n >= (1 if num < 50 else 10) for n in seen.values()), seen
    assert seen["top"] >= least and seen["bottom"] >= least and seen["types_absent"] >= least, seen


def test_the_mask_is_exactly_what_is_painted():
    """Before JPEG: wherever the mask says type t the pixel is t's colour, elsewhere the dark background."""
    for i in range(40):
        img, mask, labels = render_layout(i, 5, 10, 64, 48)
        pixels, m = np.asarray(img), np.asarray(mask)
        assert img.mode == "RGB" and mask.mode == "L" and m.shape == pixels.shape[:2] and m.max() <= 10
        for v in np.unique(m):
            if v:
                assert (pixels[m == v] == PALETTE[LAYOUT_COLOURS[v - 1]]).all()
        assert pixels[m == 0].max() <= 128 and labels


def test_config_takes_layout_and_checks_its_sizes(tmp_path):
    smoke = REPO / "configs/experiments/smoke.yaml"
    overrides = [f"data.train={tmp_path / 'syn'}", "data.synthetic.num=20", "data.synthetic.layout=true"]
    cfg = load_config(smoke, [*overrides, "data.synthetic.objects=3"])
    prepare_data(cfg)
    m = read_manifest(tmp_path / "syn")
    assert m.classes == layout_class_names(3) and m.segmentation_classes == segmentation_class_names(3)
    member_names = [n for n, _ in tar_members(tmp_path / "syn" / m.shards[0].path)]
    assert m.detection_classes == layout_type_names(3)
    assert member_names[:4] == [f"syn0000_000000000.{e}" for e in ("jpg", MASK_EXT, BOXES_EXT, "json")]
    prepare_data(cfg)  # present, and as configured: kept
    # Generated earlier with other settings: refused, not trained on silently.
    with pytest.raises(ConfigError, match=r"other data.synthetic settings \(objects 3 there, 4 configured\)"):
        prepare_data(load_config(smoke, [*overrides, "data.synthetic.objects=4"]))
    with pytest.raises(ConfigError, match="at least 16"):
        load_config(smoke, [*overrides, "data.synthetic.width=12"])
    with pytest.raises(ConfigError, match="objects"):
        load_config(smoke, [*overrides, "data.synthetic.objects=11"])


# ---------------------------------------------------------------- shards: the CLI, resize, verify


def test_shard_cli_writes_masks_and_segmentation_classes(tmp_path):
    out = tmp_path / "layout"
    args = ["--num", 25, "--layout", "--objects", 5, "--width", 48, "--height", 40, "--max-count", 10]
    shard("synthetic", out, *args, "--workers", 1, "--val-fraction", 0.2, "--no-progress")
    m = read_manifest(out)
    assert m.classes == layout_class_names(5) and m.segmentation_classes == segmentation_class_names(5)
    assert json.loads((out / "manifest.json").read_text())["segmentation_classes"][0] == "background"
    expected = {
        s.key: s
        for s in synthetic_samples(25, 0, width=48, height=40, val_fraction=0.2, layout=True, objects=5)
    }
    assert m.detection_classes == layout_type_names(5)
    keys = []
    for info in m.shards:
        members = tar_members(out / info.path)
        assert len(members) == 4 * info.count
        for (image, data), (seg, mask), (boxes, bj), (label, js) in zip(*[iter(members)] * 4):
            key = image.removesuffix(".jpg")
            # image, mask, boxes, label, in that order
            assert (seg, boxes, label) == (f"{key}.{MASK_EXT}", f"{key}.{BOXES_EXT}", f"{key}.json")
            # the same bytes as the in-process generator (`data.synthetic` in a training config)
            assert data == expected[key].image and mask == expected[key].extra[MASK_EXT]
            assert bj == expected[key].extra[BOXES_EXT] and parse_boxes(bj, (48, 40), 5)[0]
            assert json.loads(js)["labels"] == expected[key].labels
            assert decode(mask).mode == "L"
            keys.append(key)
    assert sorted(keys) == sorted(expected) and set(m.totals) == {"train", "val"}
    shard("verify", out, "--workers", 1)
    # --classes belongs to the other corpus
    proc = shard("synthetic", tmp_path / "x", "--num", 5, "--layout", "--classes", 8, expect=2)
    assert "--classes does not apply with --layout" in proc.stderr


def test_a_corpus_without_masks_has_no_segmentation_classes(tmp_path):
    out = tmp_path / "plain"
    shard("synthetic", out, "--num", 6, "--classes", 4, "--width", 32, "--height", 24, "--workers", 1)
    assert "segmentation_classes" not in json.loads((out / "manifest.json").read_text())
    assert read_manifest(out).segmentation_classes is None
    assert all(not n.endswith(MASK_EXT) for n, _ in tar_members(out / read_manifest(out).shards[0].path))
    # the shard fingerprint of the default corpus is as before; the layout corpus's differs
    plain = SyntheticSource(6, 4, width=32, height=24).describe()
    assert set(plain) == {"kind", "seed", "num_classes", "labels_per_image", "width", "height", "quality"}
    layout = SyntheticSource(6, None, width=32, height=24, layout=True).describe()
    assert layout["layout"] is True and layout["objects"] == 6


def test_resize_max_resizes_the_mask_to_the_image_with_nearest(tmp_path):
    out = tmp_path / "small"
    shard("synthetic", out, "--num", 12, "--layout", "--width", 150, "--height", 110, "--resize-max", 41)
    m = read_manifest(out)
    target = fitted_size(150, 110, 41)
    assert target == (41, 30)
    checked = 0
    for info in m.shards:
        members = dict(tar_members(out / info.path))
        for name, data in members.items():
            if not name.endswith(".jpg"):
                continue
            key = name.removesuffix(".jpg")
            image, mask = decode(data), decode(members[f"{key}.{MASK_EXT}"])
            assert image.size == mask.size == target and mask.mode == "L"
            _, original, _, objects = render_layout_objects(int(key.rsplit("_", 1)[1]), 0, 6, 150, 110)
            # boxes scaled with the image: 41/150 across, 30/110 down, to 1/100 px
            boxes, classes = parse_boxes(members[f"{key}.{BOXES_EXT}"], target, 6)
            assert classes == [t for t, _ in objects]
            for (x, y, w, h), (_, (x0, y0, w0, h0)) in zip(boxes, objects):
                sx, sy = 41 / 150, 30 / 110
                assert [x, y, w, h] == pytest.approx([x0 * sx, y0 * sy, w0 * sx, h0 * sy], abs=0.006)
            values = set(np.unique(np.asarray(mask)).tolist())
            assert values <= set(np.unique(np.asarray(original)).tolist())  # never interpolated
            assert len(values) >= 2
            checked += 1
    assert checked == 12
    shard("verify", out, "--workers", 1)


@pytest.fixture
def layout_dataset(tmp_path) -> Path:
    root = tmp_path / "ds"
    samples = synthetic_samples(30, 0, seed=2, width=48, height=40, layout=True, objects=4)
    write_dataset(
        root,
        samples,
        layout_class_names(4),
        True,
        max_count=10,
        segmentation_classes=segmentation_class_names(4),
    )
    return root


def _problems(root: Path) -> list[str]:
    return [str(p) for c in verify_dataset(root) for p in c.problems]


def test_verify_passes_a_good_dataset_and_names_a_missing_mask(layout_dataset):
    assert _problems(layout_dataset) == []
    path = layout_dataset / "train" / "shard-000001.tar"
    members = tar_members(path)
    key = members[4][0].removesuffix(".jpg")  # the second sample: image, mask, boxes, labels each
    rewrite_tar(path, [(n, d) for n, d in members if n != f"{key}.{MASK_EXT}"])
    proc = shard("verify", layout_dataset, "--workers", 1, expect=1)
    assert f"bad shard train/shard-000001.tar key {key}: no .seg.png mask member" in proc.stderr
    assert "shard-000000" not in proc.stderr and "shard-000002" not in proc.stderr


def test_verify_names_a_mask_of_the_wrong_size_or_values(layout_dataset):
    path = layout_dataset / "train" / "shard-000002.tar"
    members = tar_members(path)
    small, high = members[0][0].removesuffix(".jpg"), members[8][0].removesuffix(".jpg")
    wrong = {
        f"{small}.{MASK_EXT}": png(np.zeros((20, 24))),
        f"{high}.{MASK_EXT}": png(np.full((40, 48), 5)),  # 4 types: values 0..4
    }
    rewrite_tar(path, [(n, wrong.get(n, d)) for n, d in members])
    problems = _problems(layout_dataset)
    assert f"bad shard train/shard-000002.tar key {small}: mask seg.png is 24x20, the image 48x40" in problems
    assert (
        f"bad shard train/shard-000002.tar key {high}: mask seg.png has value 5, manifest.json lists 5 "
        "segmentation_classes (255 marks ignored pixels)" in problems
    )
