"""Manifests (Parquet and CSV) and class folders (on disk and under a bucket prefix) planned in parallel
(data_prep/ranged.py): the serial planner's output, the same bytes whatever the workers, ranges and buckets,
resumable part by part, and the driver handed no item. And the index and errors written from parts
(data_prep/finish.py): the same files however many parts.

Ranges and buckets are made small (RANGE_ROWS, BUCKET_ROWS, CSV_ROW_BYTES, SURVEY_FOLDERS patched on the
driver, where they are read) so a few hundred inputs make many of each. The serial planner (`plan.py`), the
reference, is forced by turning ranged planning off (`serial=True`).
"""

import hashlib
from dataclasses import replace
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import table_files
from PIL import Image

from data_prep import build as build_module
from data_prep import finish, ranged
from data_prep.build import BuildOptions, build_dataset
from data_prep.dataset_dir import DatasetDir
from data_prep.executors import Executor
from data_prep.layout import DatasetError, read_manifest
from data_prep.sources import folder as folder_module
from data_prep.sources import table as table_module
from data_prep.sources.folder import FolderSource
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


def build(manifest, out: Path, workers: int = 1, serial: bool = False, source=None, **opts):
    """A build of `manifest` (or of `source`); `serial`: planned on this process (`plan.py`), the reference."""
    options = BuildOptions(workers=workers, progress=False, max_errors=0.5, val_fraction=0.2, **opts)
    with pytest.MonkeyPatch.context() as mp:
        if serial:
            mp.setattr(build_module, "supports_ranges", lambda source: False)
        return build_dataset(source or ManifestSource(manifest), out, options)


def same_dataset(a: Path, b: Path) -> None:
    """The same shard bytes, index, errors and manifest (but the command)."""
    assert shard_bytes(a) == shard_bytes(b) and len(shard_bytes(a)) > 1
    for name in ("index.parquet", "errors.parquet"):
        assert pq.read_table(a / name).to_pylist() == pq.read_table(b / name).to_pylist(), name
    ma, mb = read_manifest(a), read_manifest(b)
    assert (ma.shards, ma.classes, ma.num_inputs, ma.num_errors) == (
        mb.shards,
        mb.classes,
        mb.num_inputs,
        mb.num_errors,
    )


def shard_bytes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob("*/*.tar"))
    }


def keys_in_order(root: Path, split: str) -> list[str]:
    shards = [str(root / s.path) for s in read_manifest(root).split_shards(split)]
    return [s["__key__"] for s in wds.WebDataset(shards, shardshuffle=False)]


def test_one_bucket_gives_the_serial_planners_dataset(inputs, tmp_path, monkeypatch):
    """With one bucket, the Parquet manifest in 5 ranges (row groups of 32, two per range) and the CSV in
    byte spans of about 64 x 8 bytes give the dataset the serial planner makes of the CSV: the same shard
    bytes, index, error rows and manifest."""
    parquet, csv = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    monkeypatch.setattr(table_module, "CSV_ROW_BYTES", 8)
    serial = build(csv, tmp_path / "serial", max_count=16, serial=True)
    parallel = build(parquet, tmp_path / "ranged", max_count=16)
    build(csv, tmp_path / "ranged_csv", max_count=16)
    same_dataset(
        tmp_path / "ranged_csv", tmp_path / "serial"
    )  # a row names its manifest: "manifest.csv row 6"
    assert len(ManifestSource(csv).range_specs(64)) > 10
    assert ranged.supports(ManifestSource(parquet)) and ranged.supports(ManifestSource(csv))
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
    build(csv, tmp_path / "serial", max_count=16, serial=True)
    monkeypatch.setattr(ranged, "BUCKET_ROWS", 45)  # ceil(300 / 45) = 7 buckets
    monkeypatch.setattr(ranged, "RANGE_ROWS", 100)
    build(parquet, tmp_path / "a", workers=1, max_count=16)
    monkeypatch.setattr(ranged, "RANGE_ROWS", 30)
    build(parquet, tmp_path / "b", workers=2, max_count=16)
    monkeypatch.setattr(table_module, "CSV_ROW_BYTES", 4)
    build(csv, tmp_path / "c", workers=2, max_count=16)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b") == shard_bytes(tmp_path / "c")
    for split in ("train", "val", "test"):
        assert keys_in_order(tmp_path / "a", split) == keys_in_order(tmp_path / "serial", split), split
    shards = read_manifest(tmp_path / "a").shards
    assert all(s.count <= 16 for s in shards)
    assert len(shards) > len(read_manifest(tmp_path / "serial").shards)  # shorter shards at bucket ends
    assert table_files(tmp_path / "a" / "index.parquet") == table_files(tmp_path / "b" / "index.parquet")


def test_max_size_cuts_shards_as_the_serial_planner_does(inputs, tmp_path, monkeypatch):
    parquet, csv = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    build(csv, tmp_path / "serial", max_count=1000, max_size=20_000, serial=True)
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
    assert table_files(out / "index.parquet") == table_files(whole / "index.parquet")
    assert not list((out / ".work").glob("plan_*"))  # the plan's parts go once the dataset is complete


def test_a_bucket_reads_only_its_own_piece_of_each_range_file(inputs, tmp_path, monkeypatch):
    """Each range file holds one piece per bucket, an Arrow IPC stream of its own at the offset its marker
    names: a bucket task reads those bytes and no others (not a footer describing every bucket: at 300M,
    300 ranges x 300 buckets). A part cut short is refused, naming the file and what is missing."""
    parquet, _ = inputs
    monkeypatch.setattr(ranged, "RANGE_ROWS", 64)
    monkeypatch.setattr(ranged, "BUCKET_ROWS", 45)  # 7 buckets: each range file holds up to 7 pieces
    reads: list[tuple[str, int, int]] = []
    real_open = DatasetDir.open_file

    class Counted:
        def __init__(self, f, rel):
            self.f, self.rel = f, rel

        def __enter__(self):
            return self

        def __exit__(self, *exc):
            self.f.close()

        def seek(self, offset):
            self.at = offset
            return self.f.seek(offset)

        def read(self, n):
            data = self.f.read(n)
            reads.append((self.rel, self.at, len(data)))
            return data

    monkeypatch.setattr(DatasetDir, "open_file", lambda self, rel: Counted(real_open(self, rel), rel))
    source = ManifestSource(parquet)
    opts = BuildOptions(workers=1, progress=False, max_count=16, val_fraction=0.2)
    root = DatasetDir(str(tmp_path / "out"))
    root.make()
    planner = ranged.RangedPlanner.make(source, root, "", build_module.job_fingerprint(source, opts), opts)
    with Executor(1) as executor:
        planner.survey(executor)
        planner.seal()
        planner.list(executor)
        reads.clear()
        planner.sort(executor)
    pieces = [
        (ranged.range_rel(r, "arrows"), int(offset), int(length))
        for r, m in planner.range_markers.items()
        for _, offset, length in m["pieces"]
    ]
    assert len(planner.range_markers) == 5 and planner.plan.buckets == 7 and len(pieces) > 20
    assert sorted(reads) == sorted(pieces)  # each piece read once, whole, and nothing else
    part = tmp_path / "out" / ranged.range_rel(2, "arrows")
    assert sum(n for rel, _, n in reads if rel.endswith(part.name)) == part.stat().st_size
    part.write_bytes(part.read_bytes()[:-10])
    last_bucket = int(planner.range_markers[2]["pieces"][-1][0])
    task = ranged.BucketTask(last_bucket, dict(ranged._invert(planner.range_markers))[last_bucket])
    with pytest.raises(DatasetError, match=rf"{part.name}: \d+ bytes at offset \d+ where its marker names a"):
        ranged.sort_bucket(task, replace(planner.plan, fingerprint="another"))  # not resumed: read again


class _Counted:
    """A task's shared object that counts how often this (the driver's) process pickles it."""

    pickled = 0

    def __init__(self, value: int):
        self.value = value

    def __getstate__(self):
        type(self).pickled += 1
        return self.__dict__


def _add(task: int, shared: _Counted) -> int:
    return task + shared.value


def test_a_pool_ships_a_maps_shared_object_once_not_per_task():
    """A plan is shared by every task of a phase and carries the label space (18k class names for JFT: ~300
    KB pickled, 2 ms each way): the worker processes load it once per map, not once per task (300,000 shard
    tasks at 300M inputs). A later map's object replaces the earlier one in every worker."""
    with Executor(2) as executor:
        for value in (10, 1000):
            _Counted.pickled = 0
            results = sorted(executor.map(_add, range(40), _Counted(value)))
            assert results == [t + value for t in range(40)] and _Counted.pickled == 1


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
    assert kinds == {"SurveyTask", "Range", "BucketTask", "SliceTask", "IndexPart"}, kinds  # labels tallied
    for task in seen:
        size = len(repr(task))
        assert size < 200 or (type(task).__name__ == "IndexPart" and size < 60 * len(task.shards)), task
    _, csv = (
        inputs  # a CSV is surveyed even with --classes (its spans' rows are not known before they are read)
    )
    monkeypatch.setattr(table_module, "CSV_ROW_BYTES", 8)
    seen.clear()
    source = ManifestSource(csv, classes=["bird", "cat", "dog"])
    build(csv, tmp_path / "csv", max_count=16, source=source)
    assert {type(t).__name__ for t in seen} == kinds
    assert all(len(repr(t)) < 200 for t in seen if type(t).__name__ in ("SurveyTask", "Range"))


def test_the_survey_holds_each_label_name_once_however_many_ranges_name_it(tmp_path, monkeypatch):
    """Labels inferred from a manifest: every range tallies its label names, and the driver merges each tally
    as it arrives. Holding them all until the last (300 ranges x 18k names at 300M) would grow with ranges x
    names; here 64 ranges of the same 200 names peak as 8 ranges do (Python allocations, tracemalloc)."""
    import tracemalloc

    from data_prep.build import job_fingerprint

    rows, names = 12_800, 200
    labels = [f"a-label-name-long-enough-to-count-{i % names:05d}" for i in range(rows)]
    manifest = tmp_path / "manifest.parquet"
    table = pa.table({"path": [f"x{i}.png" for i in range(rows)], "label": labels})
    pq.write_table(table, manifest, row_group_size=200)

    def survey_peak(range_rows: int) -> tuple[int, int]:
        monkeypatch.setattr(ranged, "RANGE_ROWS", range_rows)
        source, opts = ManifestSource(manifest), BuildOptions(workers=1, progress=False)
        root = DatasetDir(str(tmp_path / f"out{range_rows}"))
        root.make()
        planner = ranged.RangedPlanner.make(source, root, "", job_fingerprint(source, opts), opts)
        with Executor(1) as executor:
            tracemalloc.start()
            try:
                planner.survey(executor)
                peak = tracemalloc.get_traced_memory()[1]
            finally:
                tracemalloc.stop()
        assert len(source.classes) == names
        return len(planner.ranges), peak

    survey_peak(rows)  # imports and caches made before anything is measured
    (few, few_peak), (many, many_peak) = survey_peak(1600), survey_peak(200)
    assert (few, many) == (8, 64)
    # Holding every tally until the last: 64 x 200 names against 8 x 200, measured 4.8x the peak (1.72 MB
    # against 0.36); merged as they come, 0.48x (0.11 against 0.23).
    assert many_peak < 1.5 * few_peak, (few_peak, many_peak)


def test_index_and_errors_read_the_same_from_one_part_or_one_per_shard(inputs, tmp_path, monkeypatch):
    """index.parquet and errors.parquet as the index tasks' parts: the same rows with one part for the
    whole dataset and with one per shard, with rejected inputs from the listing (the first part) and from
    the shards' sidecars (a truncated image: stage "decode") in the serial planner's order."""
    _, csv = inputs
    bad = csv.parent / "truncated.png"
    bad.write_bytes((csv.parent / "img0.png").read_bytes()[:60])
    rows = csv.read_text().splitlines()
    manifest = csv.parent / "with_bad.csv"  # beside the images its relative paths name
    manifest.write_text("\n".join([*rows, "truncated.png,cat,kbad,"]) + "\n")
    one = build(manifest, tmp_path / "one", max_count=16, serial=True)
    monkeypatch.setattr(finish, "PART_ROWS", 1)
    per_shard = build(manifest, tmp_path / "per_shard", max_count=16, serial=True)
    ranged_csv = build(manifest, tmp_path / "ranged", max_count=16)  # listing errors from the range parts
    rows = [pq.read_table(tmp_path / d / "errors.parquet").to_pylist() for d in ("ranged", "one")]
    assert rows[0] == rows[1] and len(rows[0]) == 5
    assert ranged_csv.reasons == one.reasons
    for name in ("index.parquet", "errors.parquet"):
        a, b = tmp_path / "one" / name, tmp_path / "per_shard" / name
        assert pq.read_table(a).to_pylist() == pq.read_table(b).to_pylist(), name
    assert len(table_files(tmp_path / "one" / "index.parquet")) == 2  # one part and the summary
    assert len(table_files(tmp_path / "per_shard" / "index.parquet")) == 1 + len(
        read_manifest(tmp_path / "per_shard").shards
    )
    errors = pq.read_table(tmp_path / "per_shard" / "errors.parquet").to_pylist()
    assert [e["stage"] for e in errors] == ["listing"] * 4 + ["decode"] and errors[-1]["key"] == "kbad"
    assert errors[-1]["shard"].startswith("train/") or errors[-1]["shard"].startswith("val/")
    assert one.reasons == per_shard.reasons and sum(per_shard.reasons.values()) == 5
    assert not list((tmp_path / "per_shard" / ".work").glob("*part*"))  # no part in the work folder


def test_a_node_without_the_manifest_on_its_disk_reads_the_copy_in_the_bucket(inputs, tmp_path, s3):
    """With --ray into a bucket the driver publishes the manifest beside the dataset; a task on a node whose
    disk lacks the manifest's path reads the tally and the rows from that copy, the same ones."""
    import shutil

    parquet, _ = inputs
    local = tmp_path / "manifest.parquet"
    shutil.copy(parquet, local)
    source = ManifestSource(local)
    root = DatasetDir(s3("ranged-copy/ds"))
    planner = ranged.RangedPlanner.make(source, root, "", "job", BuildOptions(use_ray=True, max_count=16))
    ((whole, _),) = planner.specs
    expected = list(source.list_rows(whole, 0))
    tally = source.survey(whole, True).labels
    local.unlink()  # the task's node: not on its disk
    assert source.copy == (root.location, ranged.MANIFEST_COPY)
    assert list(source.list_rows(whole, 0)) == expected and len(expected) == ROWS
    assert source.survey(whole, True).labels.names == tally.names == {"bird", "cat", "dog"}
    planner.clean()
    assert root.size(ranged.MANIFEST_COPY) is None  # gone with the plan's parts

    # A CSV manifest: its byte spans are read from the copy the same way.
    _, csv = inputs
    local = tmp_path / "manifest.csv"
    shutil.copy(csv, local)
    source = ManifestSource(local)
    planner = ranged.RangedPlanner.make(source, root, "", "job", BuildOptions(use_ray=True, max_count=16))
    spans = [spec for spec, _ in source.range_specs(10)]
    expected = [list(source.list_rows(spec, 0)) for spec in spans]
    local.unlink()
    assert [list(source.list_rows(spec, 0)) for spec in spans] == expected and len(spans) > 1
    assert sum(source.survey(spec, False).rows for spec in spans) == ROWS
    planner.clean()


def test_csv_spans_start_at_line_starts_and_tile_the_file(tmp_path):
    """A CSV's byte spans: each begins a line, together they are every byte after the header, and listed
    span by span (rows numbered from the survey's counts) they give the whole file's listing, with CRLF
    line ends, quoted commas and no newline at the end."""
    lines = ["path,label,key"] + [f's3://b/img{i}.png,"c,{i % 3}",k{i}' + "x" * (i % 7) for i in range(40)]
    path = tmp_path / "list.csv"
    path.write_bytes("\r\n".join(lines).encode())
    source = ManifestSource(path)
    data = path.read_bytes()
    whole = list(source.listing())
    for span_bytes in (1, 9, 64, 1 << 20):
        spans = source.csv.spans(span_bytes)
        assert spans[0][0] == len(lines[0]) + 2 and spans[-1][1] == len(data)
        assert all(a[1] == b[0] for a, b in zip(spans, spans[1:]))
        assert all(data[a - 1 : a] == b"\n" for a, _ in spans)
        listed, first = [], 0
        for a, b in spans:
            listed += source.list_rows(("bytes", a, b), first)
            first += source.survey(("bytes", a, b), False).rows
        assert listed == whole and first == 40, span_bytes
    assert len(source.csv.spans(1)) == 40
    assert whole[3].labels == (source.classes.index("c,0"),) and whole[3].key == "k3xxx"


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory) -> Path:
    """12 class folders of 2-13 images (some in nested folders), with what the listing rejects: a file beside
    the class folders, an empty file, a duplicate key in one folder (img0.png and img0.jpg) and one across
    two (class folders "a b" and "a_b" give the same keys); hidden files and folders are not inputs."""
    root = tmp_path_factory.mktemp("folder") / "imgs"
    rng = np.random.default_rng(1)
    for i, name in enumerate([f"c{i:02d}" for i in range(10)] + ["a b", "a_b"]):
        for j in range(2 + i):
            sub = root / name / ("nested" if j % 4 == 3 else "")
            sub.mkdir(parents=True, exist_ok=True)
            Image.fromarray(rng.integers(0, 255, (20 + j % 3, 24, 3), dtype=np.uint8)).save(
                sub / f"img{j}.png"
            )
    one = (root / "c00" / "img0.png").read_bytes()
    (root / "loose.png").write_bytes(one)
    (root / "c01" / "empty.png").write_bytes(b"")
    (root / "c02" / "img0.jpg").write_bytes(one)
    (root / ".cache").mkdir()
    (root / ".cache" / "x.png").write_bytes(one)
    (root / "c03" / ".DS_Store").write_bytes(b"x")
    return root


def folder_build(root, out: Path, **opts):
    return build(None, out, source=FolderSource(root), max_count=8, **opts)


def test_a_class_folder_is_planned_in_ranges_as_the_serial_planner_plans_it(
    class_folder, tmp_path, monkeypatch
):
    """Class folders surveyed 3 at a time and listed in ranges of about 10 files: the serial planner's
    dataset (same bytes, index, errors, manifest); with 3 buckets, the same bytes with 1 or 2 workers and
    other ranges, each split in the serial order."""
    monkeypatch.setattr(ranged, "RANGE_ROWS", 10)
    monkeypatch.setattr(folder_module, "SURVEY_FOLDERS", 3)
    serial = folder_build(class_folder, tmp_path / "serial", serial=True)
    report = folder_build(class_folder, tmp_path / "ranged")
    same_dataset(tmp_path / "ranged", tmp_path / "serial")
    assert report.num_inputs == serial.num_inputs == sum(range(2, 14)) + 3  # + loose, empty, img0.jpg
    # "a b" and "a_b": 12 keys twice; c02: img0 twice
    assert report.reasons == {"not inside a class folder": 1, "empty file": 1, "duplicate key": 13}
    source = FolderSource(class_folder)
    surveyed = [(spec, source.survey(spec, False)) for spec, _ in source.range_specs(10)]
    ranges = source.regroup(surveyed, 10)
    assert len(surveyed) == 5 and len(ranges) > 6  # ".", then the 12 class folders in name order
    assert [n for spec, _ in ranges for n in spec[1:]] == [
        ".",
        "a b",
        "a_b",
        *(f"c{i:02d}" for i in range(10)),
    ]

    monkeypatch.setattr(ranged, "BUCKET_ROWS", 30)  # 3 buckets
    folder_build(class_folder, tmp_path / "a")
    monkeypatch.setattr(ranged, "RANGE_ROWS", 40)
    folder_build(class_folder, tmp_path / "b", workers=2)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    for split in ("train", "val"):
        assert keys_in_order(tmp_path / "a", split) == keys_in_order(tmp_path / "serial", split), split


def test_a_bucket_prefix_is_a_class_folder_too(class_folder, tmp_path, s3, monkeypatch):
    """The folder uploaded under a bucket prefix (hidden objects too) gives the same dataset as on disk: the
    same shard bytes, the same index rows and errors but for the sources (URIs), listed in ranges."""
    from data_prep.storage import Store

    monkeypatch.setattr(ranged, "RANGE_ROWS", 10)
    store = Store(s3("imgs"))
    for path in sorted(p for p in class_folder.rglob("*") if p.is_file()):
        store.upload(path, path.relative_to(class_folder).as_posix())
    local = folder_build(class_folder, tmp_path / "local")
    remote = folder_build(s3("imgs"), tmp_path / "remote")
    assert shard_bytes(tmp_path / "remote") == shard_bytes(tmp_path / "local")
    assert (remote.num_inputs, remote.reasons) == (local.num_inputs, local.reasons)
    query = "?" + s3("").split("?", 1)[1]

    def on_disk(row: dict) -> dict:  # an object's URI (with the endpoint's query) as the file's path
        uri = {k: v.replace(query, "") if isinstance(v, str) else v for k, v in row.items()}
        return {
            k: v.replace(store.describe(), str(class_folder)) if isinstance(v, str) else v
            for k, v in uri.items()
        }

    for name in ("index.parquet", "errors.parquet"):
        a = pq.read_table(tmp_path / "local" / name).to_pylist()
        b = pq.read_table(tmp_path / "remote" / name).to_pylist()
        assert len(a) == len(b) > 0 and all(r["source"].startswith("s3://ckpt/imgs/") for r in b)
        assert a == [on_disk(r) for r in b], name
    assert read_manifest(tmp_path / "remote").classes == read_manifest(tmp_path / "local").classes
    with pytest.raises(DatasetError, match="--labels goes with a folder on this machine"):
        FolderSource(s3("imgs"), labels_file=class_folder / "labels.csv")
    with pytest.raises(DatasetError, match="no class sub-folders"):
        FolderSource(s3("nothing-here"))


def test_a_folder_that_changes_while_it_is_planned_is_refused(class_folder, tmp_path):
    """A file added between the survey and the listing: the range's count no longer holds, and the build
    stops naming the folder and the range rather than numbering rows wrongly."""
    import shutil

    from data_prep.executors import Executor

    root = tmp_path / "imgs"
    shutil.copytree(class_folder / "c04", root / "c04")
    shutil.copytree(class_folder / "c05", root / "c05")
    out = DatasetDir(tmp_path / "out")
    out.make()
    planner = ranged.RangedPlanner.make(FolderSource(root), out, "", "job", BuildOptions(max_count=8))
    with Executor() as executor:
        planner.survey(executor)
        planner.seal()
        shutil.copy(root / "c05" / "img0.png", root / "c05" / "new.png")
        with pytest.raises(
            DatasetError, match=r"changed while it was planned: range 0 \(folders 'c04'..'c05'\)"
        ):
            planner.list(executor)


def test_a_malformed_csv_line_is_an_error_row_wherever_the_spans_fall(inputs, tmp_path, monkeypatch):
    """A CSV line with too few or too many fields is an error row naming the manifest's row, never a failed
    range or build: the serial planner, one span, spans of a few lines and 2 workers agree on the shards,
    the index, the error rows and the row numbers of the rows after it."""
    _, csv = inputs
    lines = csv.read_text().splitlines()
    lines[3:3] = ["img1.png,cat"]  # data row 3: too few fields
    lines[101:101] = ["img2.png,dog,kx,,extra"]  # data row 101: too many
    lines.append("img3.png")  # the last row: one field
    manifest = csv.parent / "malformed.csv"
    manifest.write_text("\n".join(lines) + "\n")
    serial = build(manifest, tmp_path / "serial", max_count=16, serial=True)
    ranged_one = build(manifest, tmp_path / "one", max_count=16)
    monkeypatch.setattr(table_module, "CSV_ROW_BYTES", 4)  # spans of a few lines, many of them
    assert len(ManifestSource(manifest).range_specs(2)) > 100
    ranged_many = build(manifest, tmp_path / "many", workers=2, max_count=16)
    same_dataset(tmp_path / "serial", tmp_path / "one")
    same_dataset(tmp_path / "serial", tmp_path / "many")
    errors = pq.read_table(tmp_path / "many" / "errors.parquet").to_pylist()
    malformed = {e["source"]: e["reason"] for e in errors if e["reason"].startswith("malformed CSV line")}
    assert malformed == {
        "malformed.csv row 3": "malformed CSV line: 2 fields where the header has 4 ('img1.png,cat')",
        "malformed.csv row 101": "malformed CSV line: 5 fields where the header has 4 ('img2.png,dog,kx,,extra')",
        f"malformed.csv row {ROWS + 3}": "malformed CSV line: 1 fields where the header has 4 ('img3.png')",
    }
    # The rows after them keep their numbers: the manifest's "no path" row (data row 6 of the input,
    # now 7) is named as it stands in the file.
    assert any(e["source"] == "malformed.csv row 7" and e["reason"] == "no path" for e in errors), errors
    for report in (serial, ranged_one, ranged_many):
        m = report.manifest
        assert m.num_inputs == ROWS + 3 and sum(m.totals.values()) + m.num_errors == ROWS + 3
        assert report.reasons.get("malformed CSV line") == 3, report.reasons


def test_skipped_lines_go_back_where_they_stood_across_batches():
    """`_with_malformed` on batches as the reader gives them: lines skipped at the start, at a batch's end
    (recorded while the next block was parsed), twice in a row and at the very end come back in line
    order, with their reasons, and the parsed rows keep their order."""
    from types import SimpleNamespace

    from data_prep.sources.table import MALFORMED, _with_malformed

    def bad(number: int) -> SimpleNamespace:
        return SimpleNamespace(number=number, expected_columns=2, actual_columns=1, text=f"line{number}")

    # Data rows 1..12 with a header line (numbers count it): 1, 5, 6, 9 and 12 malformed.
    skipped: list = []
    plan = [([bad(2)], ["r2", "r3", "r4"]), ([bad(6), bad(7)], ["r7", "r8"]), ([bad(10)], ["r10", "r11"])]

    def batches():
        for found, rows in plan:
            skipped.extend(found)  # the handler runs while the reader parses the batch
            yield {"path": rows}
        skipped.append(bad(13))  # the last line, found after the last batch

    rows = []
    for b in _with_malformed(batches(), skipped, header=1):
        n = len(b[MALFORMED] if MALFORMED in b else b["path"])
        rows += zip(b.get("path", [None] * n), b.get(MALFORMED, [None] * n))
    assert [p or reason.rsplit("(", 1)[1] for p, reason in rows] == [
        "'line2')",
        "r2",
        "r3",
        "r4",
        "'line6')",
        "'line7')",
        "r7",
        "r8",
        "'line10')",
        "r10",
        "r11",
        "'line13')",
    ]


def test_blank_lines_before_a_csv_header_number_the_rows_alike(inputs, tmp_path, monkeypatch):
    """The reader skips blank lines before the header; the spans start after the header it found, so a
    ranged build reads no header as a row and numbers the rows as the serial planner does."""
    _, csv = inputs
    manifest = csv.parent / "blank_first.csv"
    manifest.write_text("\n\n" + csv.read_text())
    build(manifest, tmp_path / "serial", max_count=16, serial=True)
    monkeypatch.setattr(table_module, "CSV_ROW_BYTES", 8)
    build(manifest, tmp_path / "ranged", workers=2, max_count=16)
    same_dataset(tmp_path / "serial", tmp_path / "ranged")
    sources = [e["source"] for e in pq.read_table(tmp_path / "ranged" / "errors.parquet").to_pylist()]
    assert "blank_first.csv row 6" in sources  # the row without a path, as numbered in the manifest


@pytest.fixture(scope="module")
def flat_folder(tmp_path_factory) -> Path:
    """A flat folder (labels from a file): 4 files directly in it, then top-level folders b (with b/deep), d,
    f and h, with an empty file, a duplicate key (f/dup.png and f/dup.jpg) and hidden entries."""
    root = tmp_path_factory.mktemp("flat") / "photos"
    rng = np.random.default_rng(2)
    names = [f"r{i}.png" for i in range(4)] + [f"b/img{i}.png" for i in range(5)]
    names += ["b/deep/x0.png", "b/deep/x1.png"] + [f"d/p{i}.png" for i in range(4)]
    names += ["f/a.png", "f/dup.png", "f/dup.jpg"] + [f"h/u{i}.png" for i in range(6)]
    for j, name in enumerate(names):
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        img = Image.fromarray(rng.integers(0, 255, (20 + j % 3, 24, 3), dtype=np.uint8))
        img.save(root / name, format="PNG")
    (root / "d" / "empty.png").write_bytes(b"")
    (root / ".cache").mkdir()
    (root / ".cache" / "x.png").write_bytes((root / "r0.png").read_bytes())
    (root / "d" / ".DS_Store").write_bytes(b"x")
    return root


def flat_labels(root: Path, multi: bool) -> Path:
    """labels.csv inside the folder (not an input), its rows shuffled so that every span holds rows of many
    ranges: a label for most files ("b/img0.png" twice: the last row, the file's last line, counts), none for h/u0.png and
    b/img1.png (its line has a field too many: an error row), an empty label (d/p3.png), a line without a
    file name, and names with no such file: beside the folders (gone.png), under folders that do not exist
    (aa/, c/ between b and d, zz/ after h) and in d."""
    files = sorted(p.relative_to(root).as_posix() for p in root.rglob("*") if p.is_file())
    files = [f for f in files if not f.startswith(".") and "/." not in f and f != "labels.csv"]
    classes = ["cat", "dog", "bird"]
    rows = []
    for i, name in enumerate(files):
        if name in ("h/u0.png", "b/img1.png"):
            continue
        label = "" if name == "d/p3.png" else classes[i % 3]
        if multi and label:
            label = f"{label}|{classes[(i + 1) % 3]}" if i % 2 else f'"[""{label}""]"'
        rows.append(f"{name},{label}")
    rows += ["gone.png,cat", "aa/x.png,dog", "c/x.png,cat", "d/none.png,bird", "zz/x.png,dog"]
    order = np.random.default_rng(3).permutation(len(rows))
    lines = [rows[i] for i in order] + ["b/img0.png,cat|dog" if multi else "b/img0.png,cat"]
    if multi:
        lines += ["f/a.png,[oops"]  # the last row for f/a.png: not a JSON list, an error row for the file
    lines.insert(3, "b/img1.png,cat,extra")
    lines.insert(7, ",dog")
    path = root / "labels.csv"
    path.write_text(("file,labels\n" if multi else "file,label\n") + "\n".join(lines) + "\n")
    return path


@pytest.mark.parametrize("multi", [False, True], ids=["label", "labels"])
def test_a_flat_folder_with_a_labels_file_is_planned_in_ranges_as_the_serial_planner_plans_it(
    flat_folder, tmp_path, monkeypatch, multi
):
    """The labels file joined to the files by range tasks, never read on the driver: the serial planner's
    dataset (same bytes, index, errors in the same order, manifest with the inferred classes), with spans
    of two or three lines and ranges of about 5 files; with 3 buckets, the same bytes with 1 or 2 workers and
    other ranges and spans. A build that dies listing resumes without partitioning the labels again."""
    from data_prep.executors import Executor

    labels = flat_labels(flat_folder, multi)
    monkeypatch.setattr(ranged, "RANGE_ROWS", 5)
    monkeypatch.setattr(folder_module, "SURVEY_FOLDERS", 2)
    monkeypatch.setattr(folder_module, "CSV_ROW_BYTES", 6)  # spans of about 30 bytes: two or three lines
    monkeypatch.setattr(ranged, "BATCH_ROWS", 2)  # a task's rows reach Arrow in many batches

    def flat_build(out: Path, **opts):
        return build(None, out, source=FolderSource(flat_folder, labels), max_count=6, **opts)

    serial = flat_build(tmp_path / "serial", serial=True)
    specs = []  # every read of the labels file: a span, never the whole file on the driver
    real_read = FolderSource._label_batches
    monkeypatch.setattr(
        FolderSource,
        "_label_batches",
        lambda self, columns, spec: specs.append(spec) or real_read(self, columns, spec),
    )
    report = flat_build(tmp_path / "ranged")
    same_dataset(tmp_path / "ranged", tmp_path / "serial")
    assert specs and None not in specs and len(specs) > 10
    assert report.num_inputs == serial.num_inputs == 4 + 7 + 5 + 3 + 6 + 2 + 5  # files, bad lines, unlisted
    expected = {"malformed CSV line": 1, "no file name": 1, "no label in": 2, "empty file": 1}
    expected |= {"duplicate key": 1, "listed in but no such file": 5}
    # d/p3.png's empty label: no label; with labels, no class (f/a.png's last row is not a list)
    expected |= {"labels are not a JSON list": 1} if multi else {"no label": 1}
    assert report.reasons == expected, report.reasons
    errors = pq.read_table(tmp_path / "ranged" / "errors.parquet").to_pylist()
    assert [e["source"] for e in errors[:2]] == ["labels.csv row 4", "labels.csv row 8"]
    unlisted = [e["key"] for e in errors if "but no such file" in e["reason"]]
    assert unlisted == ["gone", "aa/x", "c/x", "d/none", "zz/x"]  # after every file, in the listing's order
    assert errors[-1]["reason"].startswith("duplicate key 'f/dup'")
    index = {r["key"]: r for r in pq.read_table(tmp_path / "ranged" / "index.parquet").to_pylist()}
    classes = read_manifest(tmp_path / "ranged").classes
    assert classes == ["bird", "cat", "dog"]  # tallied from the spans
    img0 = index["b/img0"]["labels" if multi else "label"]
    assert img0 == ([1, 2] if multi else 1)  # its last row: cat (and dog), not its first (bird)
    planner = ranged.RangedPlanner.make(
        FolderSource(flat_folder, labels), DatasetDir(tmp_path / "plan"), "", "job", BuildOptions()
    )
    with Executor() as executor:
        planner.survey(executor)
    assert [r.spec for r in planner.ranges] == [
        ("folders", ".", "b"),
        ("folders", "d"),
        ("folders", "f", "h"),
    ]
    finder = planner.plan.finder  # a name goes to the range whose run of folders its folder falls in
    assert [finder(n) for n in ("gone.png", "aa/x.png", "c/x.png", "d/p0.png", "e/x", "zz/x.png")] == [
        0,
        0,
        0,
        1,
        1,
        2,
    ]

    monkeypatch.setattr(ranged, "BUCKET_ROWS", 10)  # 3 buckets
    real_list, calls = ranged.list_range, {"partition": 0, "list": 0}
    real_partition = ranged.partition_labels

    def partition(task, plan):
        calls["partition"] += plan.marker(ranged.labels_rel(task.index, "json")) is None
        return real_partition(task, plan)

    def dies_at_third(rng, plan):
        calls["list"] += 1
        if calls["list"] == 3:
            raise OSError("node lost")
        return real_list(rng, plan)

    monkeypatch.setattr(ranged, "partition_labels", partition)
    monkeypatch.setattr(ranged, "list_range", dies_at_third)
    with pytest.raises(OSError, match="node lost"):
        flat_build(tmp_path / "a")
    assert calls["partition"] > 10
    (tmp_path / "a" / ".work" / "plan_labels_999999.json").write_text("{}")  # an earlier plan's part
    calls["partition"] = 0
    flat_build(tmp_path / "a")
    assert calls["partition"] == 0  # every span's part was kept
    monkeypatch.setattr(ranged, "partition_labels", real_partition)  # worker processes import their own
    monkeypatch.setattr(ranged, "list_range", real_list)
    monkeypatch.setattr(ranged, "RANGE_ROWS", 12)
    monkeypatch.setattr(folder_module, "CSV_ROW_BYTES", 40)
    flat_build(tmp_path / "b", workers=2)
    assert shard_bytes(tmp_path / "a") == shard_bytes(tmp_path / "b")
    for split in ("train", "val"):
        assert keys_in_order(tmp_path / "a", split) == keys_in_order(tmp_path / "serial", split), split
    assert not list((tmp_path / "a" / ".work").glob("plan_*"))  # the earlier plan's part too


def test_a_flat_folders_names_with_no_file_are_error_rows_even_without_files(tmp_path):
    """A flat folder holding only its labels file: one empty range lists its names as error rows, as the
    serial listing does; a JSON labels file is read whole and listed serially."""
    from data_prep.executors import Executor

    root = tmp_path / "empty"
    root.mkdir()
    (root / "labels.csv").write_text("file,label\nz.png,cat\na/b.png,dog\n")
    source = FolderSource(root, root / "labels.csv")
    planner = ranged.RangedPlanner.make(source, DatasetDir(tmp_path / "out", None), "", "job", BuildOptions())
    with Executor() as executor:
        planner.survey(executor)
        planner.seal()
        planner.list(executor)
    assert [r.rows for r in planner.ranges] == [0] and planner.num_inputs == 2
    rows = pa.concat_tables(planner.error_tables()).to_pylist()
    assert rows == [
        {"key": k, "source": str(root / n), "reason": f"listed in {root / 'labels.csv'} but no such file"}
        for k, n in (("z", "z.png"), ("a/b", "a/b.png"))
    ]
    assert [(e.key, e.reason) for e in FolderSource(root, root / "labels.csv").listing()] == [
        (r["key"], r["reason"]) for r in rows
    ]
    (root / "labels.json").write_text(
        '[{"file": "z.png", "label": "dog"}, {"file": "z.png", "label": "ant"}]'
    )
    # The classes are every label the file names, a row a later one replaces too: in JSON as in CSV.
    assert FolderSource(root, root / "labels.json").classes == ["ant", "dog"]
    (root / "dup.csv").write_text("file,label\nz.png,dog\nz.png,ant\n")
    assert FolderSource(root, root / "dup.csv").classes == ["ant", "dog"]
    for name in ("cr.csv", "cr_manifest.csv"):  # lines cut at a lone CR: refused, named (spans cut at LF)
        (root / name).write_bytes(b"file,label,path\rz.png,cat,z.png\r")
    with pytest.raises(DatasetError, match=r"cr.csv: its lines end in a lone carriage return"):
        FolderSource(root, root / "cr.csv")
    with pytest.raises(DatasetError, match=r"cr_manifest.csv: its lines end in a lone carriage return"):
        ManifestSource(root / "cr_manifest.csv")
    for name in ("cr.csv", "cr_manifest.csv", "dup.csv"):
        (root / name).unlink()
    (root / "labels.json").write_text('{"z.png": "cat", "a/b.png": "dog"}')
    json_source = FolderSource(root, root / "labels.json")
    assert not ranged.supports(json_source) and json_source.classes == ["cat", "dog"]
    listed = [(e.key, e.reason.split(" in ")[0]) for e in json_source.listing()]
    assert listed == [("labels", "no label"), ("z", "listed"), ("a/b", "listed")]  # labels.csv: a file now


def test_a_csv_header_longer_than_the_first_read_is_read_whole(inputs, monkeypatch):
    """The header is looked for in a small first block (the driver's memory); one that does not fit is
    read with the default block, and the manifest lists the same."""
    _, csv = inputs
    whole = list(ManifestSource(csv).listing())
    monkeypatch.setattr(table_module, "HEADER_BLOCK", 8)  # "path,lab": no whole line
    source = ManifestSource(csv)
    assert source.read_cols == ["path", "label", "split", "key"] and list(source.listing()) == whole


def test_a_killed_driver_leaves_no_worker_process_behind(tmp_path):
    """A driver killed mid-build (SIGKILL here; SIGTERM from `timeout` or a scheduler does the same) never
    shuts its pool down: its worker processes notice it is gone and exit, instead of waiting on the task
    queue for good (as they did, reparented to init, for 40 minutes in a stopped bench)."""
    import os
    import signal
    import subprocess
    import sys
    import time

    import psutil

    script = tmp_path / "driver.py"
    script.write_text(
        "import os, time\n"
        "from data_prep.executors import Executor\n"
        "def _pid(task, shared):\n"
        "    time.sleep(0.2)\n"
        "    return os.getpid()\n"
        "if __name__ == '__main__':\n"
        "    with Executor(2) as ex:\n"
        "        pids = set(ex.map(_pid, range(8), None))\n"
        "        print(' '.join(map(str, sorted(pids))), flush=True)\n"
        "        time.sleep(600)\n"
    )
    env = {**os.environ, "PYTHONPATH": str(Path(__file__).parents[1])}
    proc = subprocess.Popen(
        [sys.executable, str(script)], stdout=subprocess.PIPE, text=True, cwd=tmp_path, env=env
    )
    try:
        workers = [psutil.Process(int(p)) for p in proc.stdout.readline().split()]
        assert workers and all(w.is_running() for w in workers)
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait()
    deadline = time.time() + 30
    while time.time() < deadline and any(w.is_running() and w.status() != "zombie" for w in workers):
        time.sleep(0.2)
    alive = [w.pid for w in workers if w.is_running() and w.status() != "zombie"]
    assert not alive, f"worker processes {alive} outlived their killed driver"
