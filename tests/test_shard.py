"""`vitpipe shard`: every source through the real CLI, bad inputs, resume after SIGKILL, verify, bounds.

.venv/bin/python -m pytest tests/test_shard.py -q
"""

import hashlib
import io
import json
import os
import signal
import subprocess
import sys
import tarfile
import time
from pathlib import Path

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import pytest
import webdataset as wds
from conftest import ROOT, table_files
from conftest import vitpipe_shard as shard
from PIL import Image

from data_prep.dataset_dir import DatasetDir
from data_prep.index import (
    ROW_GROUP_ROWS,
    Table,
    part_name,
    read_shard_rows,
    write_index,
    write_index_file,
    write_summary,
)
from data_prep.layout import read_manifest

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]


def shard_hashes(root: Path) -> dict[str, str]:
    return {
        p.relative_to(root).as_posix(): hashlib.sha256(p.read_bytes()).hexdigest()
        for p in sorted(root.glob("*/*.tar"))
    }


def save(img: Image.Image, path: Path, fmt: str) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    img.save(path, fmt)


def noise(rng, w: int, h: int) -> Image.Image:
    return Image.fromarray(rng.integers(0, 255, (h, w, 3), dtype=np.uint8))


@pytest.fixture(scope="module")
def class_folder(tmp_path_factory) -> Path:
    """cat/ and dog/ with 10 good images each (jpg, png, webp), plus one of every kind of bad input."""
    root = tmp_path_factory.mktemp("folder") / "in"
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        for i in range(10):
            fmt, ext = [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")][i % 3]
            save(
                noise(rng, int(rng.integers(40, 90)), int(rng.integers(40, 90))),
                root / c / f"img {i}.{ext}",
                fmt,
            )
    (root / "cat" / "empty.jpg").write_bytes(b"")
    (root / "cat" / "notes.txt").write_text("not an image")
    good = (root / "dog" / "img 0.jpg").read_bytes()
    (root / "dog" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (root / "dog" / "img 1.jpeg").write_bytes(good)  # key dog/img_1 again: a duplicate
    return root


BAD_FOLDER_KEYS = {"cat/empty", "cat/notes", "dog/truncated", "dog/img_1"}


def test_folder_source_skips_and_lists_bad_inputs(class_folder, tmp_path):
    out = tmp_path / "out"
    proc = shard("folder", class_folder, out, "--max-count", 6, "--workers", 1, "--max-errors", 0.5)
    assert "rejected 4 of 24 inputs" in proc.stdout
    errors = pq.read_table(out / "errors.parquet").to_pylist()
    assert {e["key"] for e in errors} == BAD_FOLDER_KEYS
    # The listing's rejections in the first part, the shards' in their index task's; one summary for both.
    parts = sorted(p.name for p in (out / "errors.parquet").iterdir())
    assert parts == ["_metadata", "part-000000.parquet", "part-000001.parquet"], parts
    assert [e["stage"] for e in errors] == ["listing"] * 2 + ["decode"] * 2, errors
    reasons = {e["key"]: e["reason"] for e in errors}
    assert reasons["cat/empty"].startswith("empty file")
    assert reasons["cat/notes"].startswith("not an image")
    assert "truncated" in reasons["dog/truncated"]
    assert reasons["dog/img_1"].startswith("duplicate key")

    m = read_manifest(out)
    assert m.classes == ["cat", "dog"] and not m.multi_label
    assert m.totals == {"train": 20} and m.num_inputs == 24 and m.num_errors == 4
    assert all(s.count <= 6 for s in m.shards)
    urls = [str(out / s.path) for s in m.shards]
    listing = subprocess.run(
        ["tar", "-tf", urls[0]], capture_output=True, text=True, check=True
    ).stdout.split()
    assert listing[0].rsplit(".", 1)[1] in ("jpg", "png", "webp") and listing[1].endswith(".cls")
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))
    assert len(samples) == 20
    classes = {s["__key__"].split("/")[0]: s["cls"] for s in samples}
    assert classes == {"cat": 0, "dog": 1}
    # The hash order mixes classes into every shard (a class-sorted listing would not).
    first = [k for k in listing if k.endswith(".cls")]
    assert len({k.split("/")[0] for k in first}) == 2

    index = pq.read_table(out / "index.parquet").to_pylist()
    assert len(index) == 20 and {
        "key",
        "split",
        "shard",
        "label",
        "width",
        "height",
        "bytes",
        "sha256",
    } <= set(index[0])
    row = next(r for r in index if r["key"] == "cat/img_1")  # stored as is: the file's own bytes
    assert row["sha256"] == hashlib.sha256((class_folder / "cat" / "img 1.png").read_bytes()).hexdigest()
    shard("verify", out)


def test_max_errors_exceeded_fails_without_manifest(class_folder, tmp_path):
    out = tmp_path / "out"
    proc = shard("folder", class_folder, out, "--workers", 1, "--max-errors", 0.1, expect=1)
    assert "4 of 24 inputs rejected" in proc.stderr and "--max-errors 0.1" in proc.stderr
    assert not (out / "manifest.json").exists() and (out / "errors.parquet" / "_metadata").is_file()
    # Accepting them re-uses the complete shards.
    proc = shard("folder", class_folder, out, "--workers", 1, "--max-errors", 0.5)
    assert "already complete" in proc.stdout and (out / "manifest.json").is_file()


def test_flat_folder_with_labels_file_rejects_unknown_and_unlabelled(tmp_path):
    rng = np.random.default_rng(1)
    src = tmp_path / "flat"
    for i in range(6):
        save(noise(rng, 32, 24), src / f"p{i}.jpg", "JPEG")
    rows = [
        "file,label",
        "p0.jpg,cat",
        "p1.jpg,dog",
        "p2.jpg,cat",
        "p3.jpg,bird",
        "p4.jpg,dog",
        "gone.jpg,cat",
    ]
    (src / "labels.csv").write_text("\n".join(rows) + "\n")  # p5 has no label; gone.jpg no file
    out = tmp_path / "out"
    shard(
        "folder",
        src,
        out,
        "--labels",
        src / "labels.csv",
        "--classes",
        "cat,dog",
        "--max-errors",
        1,
        "--workers",
        1,
    )
    reasons = {e["key"]: e["reason"] for e in pq.read_table(out / "errors.parquet").to_pylist()}
    assert reasons["p3"] == "unknown label 'bird'"
    assert reasons["p5"].startswith("no label in")
    assert "but no such file" in reasons["gone"]
    index = {r["key"]: r["label"] for r in pq.read_table(out / "index.parquet").to_pylist()}
    assert index == {"p0": 0, "p1": 1, "p2": 0, "p4": 1}


def test_cli_errors_name_the_file_and_what_was_expected(tmp_path):
    proc = shard("folder", tmp_path / "nope", tmp_path / "out", expect=2)
    assert f"{tmp_path / 'nope'}: no such folder" in proc.stderr
    bad = tmp_path / "bad.csv"
    bad.write_text("filename,category\na.jpg,cat\n")
    proc = shard("manifest", bad, tmp_path / "out", expect=2)
    assert (
        str(bad) in proc.stderr and "expected a 'path' column and a 'label' or 'labels' column" in proc.stderr
    )
    assert "found: filename, category" in proc.stderr


def test_manifest_multi_label_with_splits_writes_json_labels(tmp_path):
    rng = np.random.default_rng(2)
    for i in range(8):
        save(noise(rng, 40, 30), tmp_path / "imgs" / f"m{i}.png", "PNG")
    table = pa.table(
        {
            "path": [f"imgs/m{i}.png" for i in range(8)] + [str(tmp_path / "imgs" / "m0.png")],
            "labels": [
                ["sky"],
                ["sea", "sky"],
                ["tree"],
                [],
                ["sea"],
                ["tree", "sky"],
                ["sea"],
                ["sky"],
                ["sky"],
            ],
            "split": ["train"] * 6 + ["test", "test", None],
        }
    )
    pq.write_table(table, tmp_path / "manifest.parquet")
    out = tmp_path / "out"
    shard("manifest", tmp_path / "manifest.parquet", out, "--workers", 1, "--max-errors", 0.5)
    m = read_manifest(out)
    assert m.multi_label and m.classes == ["sea", "sky", "tree"]
    assert m.totals == {"train": 6, "test": 2}  # the absolute-path row is a duplicate of m0
    samples = list(wds.WebDataset([str(out / s.path) for s in m.split_shards("train")], shardshuffle=False))
    labels = {s["__key__"]: json.loads(s["json"])["labels"] for s in samples}
    assert labels["imgs/m1"] == [0, 1] and labels["imgs/m3"] == [] and all("png" in s for s in samples)


def test_digits_source(tmp_path):
    out = tmp_path / "digits"
    proc = shard("digits", out, "--size", 16, "--val-fraction", 0.2, "--workers", 2)
    assert "1797 images" in proc.stdout
    m = read_manifest(out)
    assert m.classes == [str(d) for d in range(10)] and not m.multi_label
    assert sum(m.totals.values()) == 1797 and 250 < m.totals["val"] < 470
    sample = next(iter(wds.WebDataset(str(out / m.shards[0].path), shardshuffle=False).decode("pil")))
    assert sample["png"].size == (16, 16) and 0 <= sample["cls"] < 10


def test_synthetic_labels_per_image_and_two_workers_match_one(tmp_path):
    args = [
        "--num",
        60,
        "--classes",
        12,
        "--labels-per-image",
        2.5,
        "--width",
        48,
        "--height",
        36,
        "--max-count",
        8,
    ]
    shard("synthetic", tmp_path / "w1", *args, "--workers", 1, "--val-fraction", 0.2)
    shard("synthetic", tmp_path / "w2", *args, "--workers", 2, "--val-fraction", 0.2)
    one, two = shard_hashes(tmp_path / "w1"), shard_hashes(tmp_path / "w2")
    assert one == two and len(one) >= 8
    assert table_files(tmp_path / "w1" / "index.parquet") == table_files(tmp_path / "w2" / "index.parquet")
    labels = pq.read_table(tmp_path / "w1" / "index.parquet").column("labels").to_pylist()
    assert 2.0 < np.mean([len(x) for x in labels]) < 3.0
    assert pq.read_table(tmp_path / "w1" / "index.parquet").column("width").to_pylist()[0] == 48
    # One row group for the whole index, not one per shard (8+ shards here), and its summary says so.
    assert pq.read_metadata(tmp_path / "w1" / "index.parquet" / "_metadata").num_row_groups == 1


def test_killed_run_resumes_to_the_same_shards(tmp_path):
    args = ["--num", 240, "--classes", 10, "--max-count", 20, "--width", 320, "--height", 240, "--workers", 1]
    shard("synthetic", tmp_path / "whole", *args, "--no-progress")
    killed = tmp_path / "killed"
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitpipe", "shard", "synthetic", str(killed), *map(str, args)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    while len(list(killed.glob("train/*.tar"))) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.01)
    os.killpg(proc.pid, signal.SIGKILL)  # the whole group: nothing finishes the run behind our back
    proc.wait()
    assert not (killed / "manifest.json").exists(), "the run finished before it was killed"
    done_before = set(shard_hashes(killed))
    assert 2 <= len(done_before) < 12
    out = shard("synthetic", killed, *args, "--no-progress")
    assert "already complete" in out.stdout
    assert shard_hashes(killed) == shard_hashes(tmp_path / "whole")
    assert not list(killed.rglob("*.tmp"))
    assert read_manifest(killed).shards == read_manifest(tmp_path / "whole").shards


def _flip_byte_in(shard_path: Path, member_suffix: str) -> str:
    with tarfile.open(shard_path) as tar:
        member = next(m for m in tar.getmembers() if m.name.endswith(member_suffix))
    data = bytearray(shard_path.read_bytes())
    data[member.offset_data + member.size // 2] ^= 0xFF
    shard_path.write_bytes(bytes(data))
    return member.name.rsplit(".", 1)[0]


def test_verify_names_the_shard_and_key_of_a_flipped_byte(tmp_path):
    out = tmp_path / "syn"
    shard(
        "synthetic",
        out,
        "--num",
        30,
        "--classes",
        5,
        "--width",
        40,
        "--height",
        30,
        "--max-count",
        10,
        "--workers",
        1,
    )
    shard("verify", out, "--workers", 1)
    bad = out / "train" / "shard-000001.tar"
    key = _flip_byte_in(bad, ".jpg")
    proc = shard("verify", out, "--workers", 2, expect=1)
    assert "bad shard train/shard-000001.tar: sha256 differs" in proc.stderr
    assert f"bad shard train/shard-000001.tar key {key}: image bytes differ" in proc.stderr
    assert "shard-000000" not in proc.stderr and "shard-000002" not in proc.stderr


def test_naming_damaged_keys_from_the_index_starts_no_thread_that_could_abort_the_exit(tmp_path):
    """The index lookup behind "image bytes differ" reads on its own thread. pyarrow's dataset scan
    (`pq.read_table(filters=...)`, even with use_threads=False) starts an I/O thread that, left reading
    a Python file object at exit, made 9 of 100 `vitpipe shard verify` runs on a busy machine die of
    SIGABRT ("terminate called without an active exception"); counting the process's threads catches it
    every time, where the abort needs a race."""
    n = 4000
    table = {
        "key": [f"k{i:05d}" for i in range(n)],
        "sha256": ["0" * 64] * n,
        "labels": [[i % 7] for i in range(n)],
        "shard": [f"train/shard-{i // 100:06d}.tar" for i in range(n)],
    }
    pq.write_table(pa.table(table), tmp_path / "index.parquet", row_group_size=100)
    check = (
        "import os, sys; from data_prep.dataset_dir import DatasetDir; from data_prep.layout import ShardInfo; "
        "from data_prep.verify import _compare_with_index; import data_prep.index; "
        "threads = lambda: len(os.listdir('/proc/self/task')); before = threads(); "
        "seen = {f'k{i:05d}': ('0' * 64, [i % 7]) for i in range(301, 400)}; "
        "shard = ShardInfo('train', 'train/shard-000003.tar', 100, 0, ''); "
        "problems = _compare_with_index(DatasetDir(sys.argv[1]), shard, seen, True); "
        "print([p.key for p in problems], threads() - before)"
    )
    proc = subprocess.run([sys.executable, "-c", check, tmp_path], cwd=ROOT, capture_output=True, text=True)
    assert (proc.returncode, proc.stderr, proc.stdout) == (0, "", "['k00300'] 0\n")  # k00300: missing


def test_a_shards_index_rows_are_read_from_its_row_groups_only(tmp_path):
    """read_shard_rows skips the row groups whose statistics rule the shard out, finds a shard split
    across row groups, and gives an empty table of the asked columns for a shard the index lacks."""
    shards = ["train/a.tar"] * 5 + ["train/b.tar"] * 7 + ["val/c.tar"] * 3
    table = pa.table({"key": [f"k{i}" for i in range(15)], "label": list(range(15)), "shard": shards})
    pq.write_table(table, tmp_path / "index.parquet", row_group_size=4)  # b spans groups 1-2

    class Counting(io.FileIO):
        read_bytes = 0

        def read(self, n=-1):
            data = super().read(n)
            self.read_bytes += len(data)
            return data

    def rows(shard, columns):
        with Counting(tmp_path / "index.parquet") as f:
            return read_shard_rows(f, shard, columns), f.read_bytes

    (b, _), (none, _) = rows("train/b.tar", ["key", "label"]), rows("train/zz.tar", ["label"])
    assert b.column_names == ["key", "label"] and b["label"].to_pylist() == list(range(5, 12))
    assert none.num_rows == 0 and none.schema == pa.schema([pa.field("label", pa.int64())])
    (c, c_bytes), (a, a_bytes) = rows("val/c.tar", ["key"]), rows("train/a.tar", ["key"])
    footer_only = rows("train/zz.tar", ["key"])[1]
    assert c["key"].to_pylist() == ["k12", "k13", "k14"] and a["key"].to_pylist() == [
        f"k{i}" for i in range(5)
    ]
    assert c_bytes - footer_only < (a_bytes - footer_only) * 0.75  # one row group of four, not two


def test_the_index_has_row_groups_of_a_fixed_size_whatever_the_shards(tmp_path):
    """write_index puts shards' rows into 65,536-row groups (at JFT scale, 4,600 groups rather than a
    footer of 100k): a shard cut by a group boundary is still read whole, from the two groups only."""
    per_shard, shards = 700, 200  # 140,000 rows: groups of 65,536, 65,536 and 8,928
    rows = (
        {
            "key": [f"s{s}/{i}" for i in range(per_shard)],
            "split": ["train"] * per_shard,
            "shard": [f"train/shard-{s:06d}.tar"] * per_shard,
            "labels": [[i % 5] for i in range(per_shard)],
            "width": [8] * per_shard,
            "height": [8] * per_shard,
            "bytes": [100] * per_shard,
            "sha256": ["0" * 64] * per_shard,
            "source": [""] * per_shard,
        }
        for s in range(shards)
    )
    write_index(DatasetDir(tmp_path), rows, multi_label=False)
    meta = pq.read_metadata(tmp_path / "index.parquet" / "_metadata")
    sizes = [meta.row_group(i).num_rows for i in range(meta.num_row_groups)]
    assert (
        sizes
        == [ROW_GROUP_ROWS, ROW_GROUP_ROWS, per_shard * shards - 2 * ROW_GROUP_ROWS]
        == [65536, 65536, 8928]
    )
    cut = ROW_GROUP_ROWS // per_shard  # shard 93 holds rows 65,100-65,799: across the first boundary
    with open(tmp_path / "index.parquet" / part_name(0), "rb") as f:
        table = read_shard_rows(f, f"train/shard-{cut:06d}.tar", ["key", "label"])
    assert table == Table(DatasetDir(tmp_path), "index.parquet").shard_rows(
        f"train/shard-{cut:06d}.tar", ["key", "label"]
    )
    assert table["key"].to_pylist() == [f"s{cut}/{i}" for i in range(per_shard)]
    assert table["label"].to_pylist() == [i % 5 for i in range(per_shard)]


def test_resize_max_bounds_the_longer_side_and_keeps_the_format(tmp_path):
    rng = np.random.default_rng(3)
    src = tmp_path / "big"
    save(noise(rng, 300, 120), src / "a" / "wide.jpg", "JPEG")
    save(noise(rng, 90, 200), src / "a" / "tall.png", "PNG")
    save(noise(rng, 50, 40), src / "b" / "small.webp", "WEBP")
    out = tmp_path / "out"
    shard("folder", src, out, "--resize-max", 64, "--workers", 1)
    rows = {r["key"]: r for r in pq.read_table(out / "index.parquet").to_pylist()}
    assert (rows["a/wide"]["width"], rows["a/wide"]["height"]) == (64, 26)
    assert (rows["a/tall"]["width"], rows["a/tall"]["height"]) == (29, 64)
    assert (rows["b/small"]["width"], rows["b/small"]["height"]) == (50, 40)  # already small: as is
    names = tarfile.open(out / read_manifest(out).shards[0].path).getnames()
    assert {"a/wide.jpg", "a/tall.png", "b/small.webp"} <= set(names)
    samples = wds.WebDataset(str(out / read_manifest(out).shards[0].path), shardshuffle=False).decode("pil")
    assert all(max(next(v for k, v in s.items() if k in ("jpg", "png", "webp")).size) <= 64 for s in samples)


def test_max_size_bounds_shard_bytes(class_folder, tmp_path):
    out = tmp_path / "out"
    limit = 64 * 1024
    shard("folder", class_folder, out, "--max-size", "64K", "--workers", 1, "--max-errors", 0.5)
    m = read_manifest(out)
    assert len(m.shards) > 2 and all(s.bytes <= limit for s in m.shards)
    assert all((out / s.path).stat().st_size == s.bytes for s in m.shards)
    assert sum(m.totals.values()) == 20


@pytest.mark.ray
def test_ray_tasks_write_the_same_shards(ray_cluster, tmp_path):
    args = ["--num", 40, "--classes", 6, "--width", 32, "--height", 32, "--max-count", 10]
    shard("synthetic", tmp_path / "local", *args, "--workers", 1)
    env = {**os.environ, "RAY_ADDRESS": ray_cluster.address, "RAY_AUTH_MODE": "token"}  # as a user sets it
    shard("synthetic", tmp_path / "ray", *args, "--ray", env=env)
    assert shard_hashes(tmp_path / "ray") == shard_hashes(tmp_path / "local")
    assert read_manifest(tmp_path / "ray").shards == read_manifest(tmp_path / "local").shards

    # The Jobs API address, as `vitpipe submit` takes it (and as docs/cluster.md sets RAY_ADDRESS): the
    # command runs on the cluster as a Ray job, its log streamed here; the same shards.
    jobs = {**env, "RAY_ADDRESS": ray_cluster.dashboard_url}
    proc = shard("synthetic", tmp_path / "job", *args, "--ray", "--python", sys.executable, env=jobs)
    assert "submitted shard-" in proc.stdout and "SUCCEEDED" in proc.stdout, proc.stdout
    assert "wrote 40 images in 4 shards" in proc.stdout  # the job's own report, from its log
    assert shard_hashes(tmp_path / "job") == shard_hashes(tmp_path / "local")
    assert read_manifest(tmp_path / "job").command.endswith(
        f"{tmp_path / 'job'} {' '.join(map(str, args))} --ray"
    )
    # Refused before anything is uploaded: an output the job would write inside its copy of the directory.
    proc = shard(
        "synthetic", "data/rel", *args, "--ray", "--address", ray_cluster.dashboard_url, env=env, expect=2
    )
    assert "OUT 'data/rel': relative, so it would be written inside the job's temporary copy" in proc.stderr

    # A Parquet manifest is planned by Ray tasks too (data_prep/ranged.py): the same shards as in-process.
    rng = np.random.default_rng(4)
    for i in range(12):
        save(noise(rng, 32, 24), tmp_path / "imgs" / f"r{i}.png", "PNG")
    table = pa.table({"path": [f"imgs/r{i % 12}.png" for i in range(36)], "label": ["a", "b"] * 18})
    table = table.append_column("key", pa.array([f"k{i}" for i in range(36)]))
    pq.write_table(table, tmp_path / "list.parquet", row_group_size=8)
    shard("manifest", tmp_path / "list.parquet", tmp_path / "m-local", "--max-count", 8, "--workers", 1)
    shard("manifest", tmp_path / "list.parquet", tmp_path / "m-ray", "--max-count", 8, "--ray", env=env)
    assert shard_hashes(tmp_path / "m-ray") == shard_hashes(tmp_path / "m-local")
    assert sum(read_manifest(tmp_path / "m-ray").totals.values()) == 36

    # Two tasks lose their worker process (os._exit, as on a lost node): a list task halfway through its
    # range, and a shard task at its third item, its shard half written. Ray retries each; nothing the dead
    # tasks left is counted: the same shards, index and manifest as in-process.
    keys = [
        s["__key__"]
        for s in wds.WebDataset(str(tmp_path / "m-local" / "train" / "shard-000001.tar"), shardshuffle=False)
    ]
    flags = tmp_path / "flags"
    flags.mkdir()
    proc = subprocess.run(
        [sys.executable, str(ROOT / "tests/scripts/dying_shard_build.py"), str(tmp_path / "list.parquet")]
        + [str(tmp_path / "m-dies"), str(flags), keys[2]],
        env={**env, "PYTHONPATH": str(ROOT)},
        capture_output=True,
        text=True,
        timeout=300,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "wrote 36 of 36; died: ['list', 'shard']" in proc.stdout, proc.stdout
    assert shard_hashes(tmp_path / "m-dies") == shard_hashes(tmp_path / "m-local")
    for name in ("index.parquet", "errors.parquet"):
        assert pq.read_table(tmp_path / "m-dies" / name) == pq.read_table(tmp_path / "m-local" / name)
    assert read_manifest(tmp_path / "m-dies").shards == read_manifest(tmp_path / "m-local").shards
    assert not [p for p in (tmp_path / "m-dies").rglob("*") if ".tmp" in p.name]


def _index_rows(shards: range, per_shard: int) -> list[dict[str, list]]:
    return [
        {
            "key": [f"s{s}/{i}" for i in range(per_shard)],
            "split": ["train"] * per_shard,
            "shard": [f"train/shard-{s:06d}.tar"] * per_shard,
            "labels": [[s % 7, i % 3] for i in range(per_shard)],
            "width": [8] * per_shard,
            "height": [8] * per_shard,
            "bytes": [100 + i for i in range(per_shard)],
            "sha256": [f"{s:032x}{i:032x}" for i in range(per_shard)],
            "source": [f"s3://corpus/{s}/{i}.jpg" for i in range(per_shard)],
        }
        for s in shards
    ]


def test_a_table_of_parts_reads_as_one_with_pandas_and_pyarrow_and_by_shard(tmp_path):
    """index.parquet as a build leaves it: parts written by index tasks, joined by `_metadata` (the parts'
    footers, no row copied). pandas and pyarrow read the folder as one table in part order; a shard's rows
    come from the groups that hold it, in whichever part; a part left by a larger build before is removed;
    a one-file index of a dataset written before still reads."""
    out = DatasetDir(tmp_path)
    (tmp_path / "index.parquet").mkdir()
    for n, shards in enumerate((range(0, 30), range(30, 55), range(55, 90), range(90, 100))):
        write_index_file(
            out, f"index.parquet/{part_name(n)}", _index_rows(shards, 50), True, row_group_rows=400
        )
    (tmp_path / "index.parquet" / f"{part_name(4)}.tmp").write_bytes(b"PAR1 half")  # a killed task's
    write_summary(out, "index.parquet", [part_name(0), part_name(1), part_name(3)])  # part 2: a stale one
    assert sorted(p.name for p in (tmp_path / "index.parquet").iterdir()) == [
        "_metadata",
        part_name(0),
        part_name(1),
        part_name(3),
    ]
    keys = [k for s in [*range(0, 55), *range(90, 100)] for k in _index_rows(range(s, s + 1), 50)[0]["key"]]
    assert pq.read_table(tmp_path / "index.parquet").column("key").to_pylist() == keys
    import pandas as pd
    import pyarrow.dataset as ds

    assert pd.read_parquet(tmp_path / "index.parquet")["key"].tolist() == keys
    summary = ds.parquet_dataset(str(tmp_path / "index.parquet" / "_metadata"))
    assert summary.to_table().column("key").to_pylist() == keys
    table = Table(out, "index.parquet")
    assert table.num_rows == len(keys) == 3250 and table.files == [part_name(0), part_name(1), part_name(3)]
    assert table.read().column("key").to_pylist() == keys
    # Shard 37 is in part 1 (groups of 400 rows: rows 350-399 of that part, one group); 95 in part 3.
    for s in (0, 37, 54, 95):
        rows = table.shard_rows(f"train/shard-{s:06d}.tar", ["key", "labels"])
        assert rows["key"].to_pylist() == [f"s{s}/{i}" for i in range(50)], s
        assert rows["labels"].to_pylist() == [[s % 7, i % 3] for i in range(50)], s
    assert table.shard_rows("train/shard-000070.tar", ["key"]).num_rows == 0  # in the stale part only
    # A dataset written before: one file at the same path.
    old = tmp_path / "old"
    old.mkdir()
    pq.write_table(pq.read_table(tmp_path / "index.parquet"), old / "index.parquet", row_group_size=400)
    legacy = Table(DatasetDir(old), "index.parquet")
    assert legacy.num_rows == 3250 and legacy.shard_rows("train/shard-000037.tar", ["key"]).num_rows == 50
    # Writing the index over it replaces the file with the folder.
    write_index(DatasetDir(old), _index_rows(range(3), 10), multi_label=True)
    assert Table(DatasetDir(old), "index.parquet").num_rows == 30 and (old / "index.parquet").is_dir()
    with pytest.raises(FileNotFoundError, match="no such table"):
        Table(DatasetDir(tmp_path / "none"), "index.parquet")


def test_verify_names_a_missing_part_and_a_damaged_key_through_the_summary(tmp_path):
    """`verify` checks the index as a table: every part its `_metadata` names is there, the rows add up, and
    a damaged shard's keys are found from the groups that hold the shard."""
    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.verify import verify_dataset
    from data_prep.writer import write_dataset

    out = tmp_path / "ds"
    m = write_dataset(
        out, synthetic_samples(40, 4, width=32, height=24), class_names(4), multi_label=True, max_count=10
    )
    assert all(not c.problems for c in verify_dataset(out))
    target = m.shards[2]
    data = bytearray((out / target.path).read_bytes())
    data[len(data) // 3] ^= 0xFF
    (out / target.path).write_bytes(bytes(data))
    (out / "index.parquet" / part_name(0)).rename(tmp_path / "moved.parquet")
    problems = [p for c in verify_dataset(out) for p in c.problems]
    assert any(
        p.shard == f"index.parquet/{part_name(0)}" and "named by its _metadata but missing" in p.reason
        for p in problems
    ), problems
    assert any(p.shard == target.path and "sha256" in p.reason for p in problems), problems
    (tmp_path / "moved.parquet").rename(out / "index.parquet" / part_name(0))
    problems = [p for c in verify_dataset(out) for p in c.problems]
    named = [p.key for p in problems if p.key]  # the index's rows name the damaged sample
    assert named and all(p.shard == target.path for p in problems), problems
    # A file in the folder the summary does not name: pandas would read it as rows.
    stray = out / "index.parquet" / "part-000009.parquet"
    stray.write_bytes((out / "index.parquet" / part_name(0)).read_bytes())
    problems = [p for c in verify_dataset(out) for p in c.problems]
    assert any(p.shard == "index.parquet/part-000009.parquet" and "not named" in p.reason for p in problems)
    stray.unlink()
    # A damaged summary: verify says so and still names the damaged shard (it does not crash).
    summary = out / "index.parquet" / "_metadata"
    summary.write_bytes(summary.read_bytes()[: summary.stat().st_size // 2])
    for workers in (1, 2):
        problems = [p for c in verify_dataset(out, workers=workers) for p in c.problems]
        assert any(p.shard == "index.parquet" and "unreadable" in p.reason for p in problems), problems
        assert any(p.shard == target.path and "sha256" in p.reason for p in problems), problems
