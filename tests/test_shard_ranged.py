"""A Parquet manifest planned in parallel (data_prep/ranged.py): the serial planner's output, the same bytes
whatever the workers, ranges and buckets, resumable part by part, and the driver handed no item. And the
index and errors written from parts (data_prep/finish.py): the same files however many parts.

Ranges and buckets are made small (RANGE_ROWS, BUCKET_ROWS patched on the driver, where they are read) so a
manifest of a few hundred rows has many of each.
"""

import hashlib
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from PIL import Image

from data_prep import build as build_module
from data_prep import finish, ranged
from data_prep.build import BuildOptions, build_dataset
from data_prep.layout import read_manifest
from data_prep.sources.table import ManifestSource

pytestmark = pytest.mark.unit
ROWS = 300


@pytest.fixture(scope="module")
def inputs(tmp_path_factory) -> tuple[Path, Path]:
    """(manifest.parquet in row groups of 32 rows, the same rows as manifest.csv): 300 rows over 40 small
    images (many paths twice, with distinct keys), an explicit split on some rows, and bad rows of each
    kind the listing finds: no path, a missing file, an empty label, a duplicate key."""
    root = tmp_path_factory.mktemp("ranged")
    rng = np.random.default_rng(0)
    for i in range(40):
        img = Image.fromarray(rng.integers(0, 255, (24 + i % 5, 32, 3), dtype=np.uint8))
        img.save(root / f"img{i}.png")
    paths, labels, keys, splits = [], [], [], []
    for r in range(ROWS):
        paths.append(f"img{r % 40}.png")
        labels.append(["cat", "dog", "bird"][r % 3])
        keys.append(f"k{r:04d}")
        splits.append("test" if r % 17 == 0 else None)
    paths[5], paths[9], labels[11] = "", "missing.png", ""
    keys[20] = keys[7]  # a duplicate key: row 21 is dropped, row 8 kept
    table = pa.table({"path": paths, "label": labels, "key": keys, "split": splits})
    pq.write_table(table, root / "manifest.parquet", row_group_size=32)
    csv = root / "manifest.csv"
    lines = ["path,label,key,split"] + [
        f"{p},{lab},{k},{s or ''}" for p, lab, k, s in zip(paths, labels, keys, splits)
    ]
    csv.write_text("\n".join(lines) + "\n")
    return root / "manifest.parquet", csv


def build(manifest: Path, out: Path, workers: int = 1, **opts):
    options = BuildOptions(workers=workers, progress=False, max_errors=0.5, val_fraction=0.2, **opts)
    return build_dataset(ManifestSource(manifest), out, options)


def shard_bytes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob("*/*.tar"))
    }


def keys_in_order(root: Path, split: str) -> list[str]:
    shards = [str(root / s.path) for s in read_manifest(root).split_shards(split)]
    return [s["__key__"] for s in wds.WebDataset(shards, shardshuffle=False)]


def test_one_bucket_gives_the_serial_planners_dataset(inputs, tmp_path, monkeypatch):
    """With one bucket, the Parquet manifest in 10 ranges (row groups of 32, two per range) gives the CSV's
    dataset, which the serial planner makes: the same shard bytes, index, error rows and manifest."""
    parquet, csv = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    serial = build(csv, tmp_path / "serial", max_count=16)
    parallel = build(parquet, tmp_path / "ranged", max_count=16)
    assert ranged.supports(ManifestSource(parquet)) and not ranged.supports(ManifestSource(csv))
    assert (
        shard_bytes(tmp_path / "ranged") == shard_bytes(tmp_path / "serial")
        and len(shard_bytes(tmp_path / "serial")) > 10
    )
    for name in ("index.parquet", "errors.parquet"):
        a, b = pq.read_table(tmp_path / "serial" / name), pq.read_table(tmp_path / "ranged" / name)
        named = [
            {**r, "source": r["source"].replace("manifest.parquet", "manifest.csv")} for r in b.to_pylist()
        ]
        assert a.to_pylist() == named, name  # a row names its manifest: "manifest.csv row 6"
    errors = pq.read_table(tmp_path / "ranged" / "errors.parquet").to_pylist()
    assert [e["reason"].split(" (")[0].split(":")[0] for e in errors] == [
        "no path", "cannot read", "no label", "duplicate key 'k0007'",
    ]  # fmt: skip
    a, b = read_manifest(tmp_path / "serial"), read_manifest(tmp_path / "ranged")
    assert (a.shards, a.classes, a.num_inputs, a.num_errors) == (
        b.shards,
        b.classes,
        b.num_inputs,
        b.num_errors,
    )
    assert b.num_inputs == ROWS and b.classes == ["bird", "cat", "dog"]  # tallied from the ranges
    assert (serial.num_written, serial.reasons) == (parallel.num_written, parallel.reasons)


def test_many_buckets_keep_the_order_and_the_bytes_whatever_the_workers_and_ranges(
    inputs, tmp_path, monkeypatch
):
    """Seven buckets: every listed sample once, each split in the serial planner's order, shards cut at
    bucket ends too (never past --max-count); the same bytes with 1 or 2 worker processes and with 3 or 10
    ranges."""
    parquet, csv = inputs
    build(csv, tmp_path / "serial", max_count=16)
    monkeypatch.setattr(ranged, "BUCKET_ROWS", 45)  # ceil(300 / 45) = 7 buckets
    monkeypatch.setattr(ranged, "RANGE_ROWS", 100)
    build(parquet, tmp_path / "a", workers=1, max_count=16)
    monkeypatch.setattr(ranged, "RANGE_ROWS", 30)
    build(parquet, tmp_path / "b", workers=2, max_count=16)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    for split in ("train", "val", "test"):
        assert keys_in_order(tmp_path / "a", split) == keys_in_order(tmp_path / "serial", split), split
    shards = read_manifest(tmp_path / "a").shards
    assert all(s.count <= 16 for s in shards)
    assert len(shards) > len(read_manifest(tmp_path / "serial").shards)  # shorter shards at bucket ends
    assert (tmp_path / "a" / "index.parquet").read_bytes() == (tmp_path / "b" / "index.parquet").read_bytes()


def test_max_size_cuts_shards_as_the_serial_planner_does(inputs, tmp_path, monkeypatch):
    parquet, csv = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    build(csv, tmp_path / "serial", max_count=1000, max_size=20_000)
    build(parquet, tmp_path / "ranged", max_count=1000, max_size=20_000)
    assert shard_bytes(tmp_path / "ranged") == shard_bytes(tmp_path / "serial")
    assert len(read_manifest(tmp_path / "ranged").shards) > 3


def test_a_failed_build_resumes_without_redoing_finished_ranges_and_buckets(inputs, tmp_path, monkeypatch):
    """A build dies writing its third shard. Re-run with another --max-count, every range and bucket is
    redone (the plan's fingerprint changed); that build dies too. Re-run as it was, no range is listed and
    no bucket sorted again (their markers hold this plan's fingerprint), the two shards written are kept, and
    the bytes are an uninterrupted build's."""
    parquet, _ = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    monkeypatch.setattr(ranged, "BUCKET_ROWS", 100)
    whole, out = tmp_path / "whole", tmp_path / "out"
    build(parquet, whole, max_count=16)
    real_write = build_module.write_slice
    written = []

    def dies_at_third(task, shared):
        if len(written) == 2:
            raise OSError("disk gone")
        written.append(task)
        return real_write(task, shared)

    calls = {"list": 0, "sort": 0}
    for name, fn, rel in (
        ("list", "list_range", ranged.range_rel),
        ("sort", "sort_bucket", ranged.bucket_rel),
    ):
        real = getattr(ranged, fn)

        def counted(task, plan, real=real, name=name, rel=rel):
            calls[name] += plan.marker(rel(task.index, "json")) is None  # work done, not a marker read
            return real(task, plan)

        monkeypatch.setattr(ranged, fn, counted)
    monkeypatch.setattr(build_module, "write_slice", dies_at_third)
    for max_count in (12, 16):
        written.clear()
        with pytest.raises(OSError, match="disk gone"):
            build(parquet, out, max_count=max_count)
        assert calls == {"list": 5, "sort": 3}, max_count  # 300 rows / 64 per range; ceil(300 / 100) buckets
        calls.update(list=0, sort=0)
    monkeypatch.setattr(build_module, "write_slice", real_write)
    report = build(parquet, out, max_count=16)
    assert calls == {"list": 0, "sort": 0}
    assert report.resumed_shards == 2 and shard_bytes(out) == shard_bytes(whole)
    assert (out / "index.parquet").read_bytes() == (whole / "index.parquet").read_bytes()
    assert not list((out / ".work").glob("plan_*"))  # the plan's parts go once the dataset is complete


def test_the_driver_hands_out_only_numbers(inputs, tmp_path, monkeypatch):
    """Every task a build hands a worker is a range, a bucket, a slice or a run of shards to index: a few
    integers (and shard paths), never an item; what comes back is a marker of numbers or a shard's result."""
    parquet, _ = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    monkeypatch.setattr(ranged, "BUCKET_ROWS", 100)
    seen = []
    real_map = build_module.Executor.map

    def recording(self, fn, tasks, shared):
        for task in tasks:
            seen.append(task)
            yield from real_map(self, fn, [task], shared)

    monkeypatch.setattr(build_module.Executor, "map", recording)
    build(parquet, tmp_path / "out", max_count=16)
    kinds = {type(t).__name__ for t in seen}
    assert kinds == {"Range", "BucketTask", "SliceTask", "IndexPart"}, kinds
    for task in seen:
        size = len(repr(task))
        assert size < 200 or (type(task).__name__ == "IndexPart" and size < 60 * len(task.shards)), task


def test_index_and_errors_are_the_same_files_from_one_part_or_one_per_shard(inputs, tmp_path, monkeypatch):
    """index.parquet and errors.parquet copied from index parts: byte for byte the same with one part for
    the whole dataset and with one per shard, with rejected inputs from the listing and from the shards'
    sidecars (a truncated image: stage "decode") in the serial planner's order."""
    _, csv = inputs
    bad = csv.parent / "truncated.png"
    bad.write_bytes((csv.parent / "img0.png").read_bytes()[:60])
    rows = csv.read_text().splitlines()
    manifest = csv.parent / "with_bad.csv"  # beside the images its relative paths name
    manifest.write_text("\n".join([*rows, "truncated.png,cat,kbad,"]) + "\n")
    one = build(manifest, tmp_path / "one", max_count=16)
    monkeypatch.setattr(finish, "PART_ROWS", 1)
    per_shard = build(manifest, tmp_path / "per_shard", max_count=16)
    for name in ("index.parquet", "errors.parquet"):
        assert (tmp_path / "one" / name).read_bytes() == (tmp_path / "per_shard" / name).read_bytes(), name
    errors = pq.read_table(tmp_path / "per_shard" / "errors.parquet").to_pylist()
    assert [e["stage"] for e in errors] == ["listing"] * 4 + ["decode"] and errors[-1]["key"] == "kbad"
    assert errors[-1]["shard"].startswith("train/") or errors[-1]["shard"].startswith("val/")
    assert one.reasons == per_shard.reasons and sum(per_shard.reasons.values()) == 5
    assert not list((tmp_path / "per_shard" / ".work").glob("*_part_*"))  # the parts are gone


def test_a_node_without_the_manifest_on_its_disk_reads_the_copy_in_the_bucket(inputs, tmp_path, s3):
    """With --ray into a bucket the driver publishes the manifest beside the dataset; a task on a node whose
    disk lacks the manifest's path reads the tally and the rows from that copy, the same ones."""
    import shutil

    from data_prep.dataset_dir import DatasetDir

    parquet, _ = inputs
    local = tmp_path / "manifest.parquet"
    shutil.copy(parquet, local)
    source = ManifestSource(local)
    root = DatasetDir(s3("ranged-copy/ds"))
    planner = ranged.RangedPlanner.make(source, root, "", "job", BuildOptions(use_ray=True, max_count=16))
    (whole,) = planner.ranges
    expected = list(source.list_rows(whole.groups, whole.first_row))
    tally = source.tally_rows(whole.groups)[0]
    local.unlink()  # the task's node: not on its disk
    assert source.copy == (root.location, ranged.MANIFEST_COPY)
    assert list(source.list_rows(whole.groups, whole.first_row)) == expected and len(expected) == ROWS
    assert source.tally_rows(whole.groups)[0].names == tally.names == {"bird", "cat", "dog"}
    planner.clean()
    assert root.size(ranged.MANIFEST_COPY) is None  # gone with the plan's parts
