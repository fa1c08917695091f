"""Datasets on object storage, against a real S3 protocol server (moto on 127.0.0.1): `vitpipe shard` into
a bucket (the same bytes as into a folder, resumable after SIGKILL), `vitpipe shard verify s3://...`, the
loader streaming the train split from the bucket with the manifest's exact counts, shards that cannot be
read, and a manifest whose image paths are s3:// URIs.

    .venv/bin/python -m pytest tests/test_dataset_storage.py -q
"""

import io
import logging
import os
import re
import signal
import subprocess
import sys
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from urllib.parse import quote

import boto3  # the test's own view of the bucket (installed with moto)
import numpy as np
import pyarrow as pa
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from conftest import vitpipe_shard as shard
from PIL import Image

from data_prep.dataset_dir import DatasetDir
from data_prep.index import Table
from data_prep.layout import DatasetError, read_manifest
from data_prep.storage import Store
from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset
from pipeline.config import DataConfig, input_problems, load_config
from pipeline.data.loader import make_train_loader
from pipeline.data.sources import DatasetInfo, dataset_info

pytestmark = pytest.mark.unit
REPO = Path(__file__).resolve().parents[1]
SYNTHETIC = [
    "--num",
    240,
    "--classes",
    10,
    "--max-count",
    20,
    "--width",
    320,
    "--height",
    240,
    "--workers",
    1,
]


def bucket_files(uri: str) -> dict[str, int]:
    """Every object under the prefix: relative path -> size."""
    store = Store(uri)
    infos = store.fs.get_file_info(pafs.FileSelector(store.root, recursive=True, allow_not_found=True))
    return {i.path[len(store.root) + 1 :]: i.size for i in infos if i.type == pafs.FileType.File}


@pytest.fixture(scope="module")
def images(tmp_path_factory) -> Path:
    """cat/ and dog/, 12 images each in three formats, and two inputs that must be rejected."""
    root = tmp_path_factory.mktemp("images")
    rng = np.random.default_rng(0)
    for c in ("cat", "dog"):
        (root / c).mkdir()
        for i in range(12):
            fmt, ext = [("JPEG", "jpg"), ("PNG", "png"), ("WEBP", "webp")][i % 3]
            pixels = rng.integers(
                0, 255, (int(rng.integers(30, 60)), int(rng.integers(30, 60)), 3), dtype=np.uint8
            )
            Image.fromarray(pixels).save(root / c / f"img {i}.{ext}", fmt)
    (root / "cat" / "notes.jpg").write_text("not an image")
    good = (root / "dog" / "img 0.jpg").read_bytes()
    (root / "dog" / "cut.jpg").write_bytes(good[: len(good) // 2])
    return root


def test_shard_into_a_bucket_writes_what_a_folder_gets_and_verify_reads_it(s3, images, tmp_path):
    uri = s3("folder-ds")
    args = ["--max-count", 6, "--val-fraction", 0.25, "--no-progress"]
    shard("folder", images, tmp_path / "local", *args)
    out = shard("folder", images, uri, *args, "--scratch", tmp_path / "scratch")
    assert "s3://ckpt/folder-ds" in out.stdout and "endpoint_override" not in out.stdout
    remote, local = read_manifest(uri), read_manifest(tmp_path / "local")
    assert remote.shards == local.shards and len(remote.shards) >= 4  # same paths, counts, sizes, sha256
    assert set(remote.totals) == {"train", "val"} and remote.num_errors == 2
    files = bucket_files(uri)
    for name in ("manifest.json", "index.parquet/_metadata", "errors.parquet/_metadata"):
        assert name in files
    assert not [f for f in files if f.endswith(".tmp") or "staging" in f]
    remote_dir, store = DatasetDir(uri), Store(uri)
    for table in ("index.parquet", "errors.parquet"):
        assert Table(remote_dir, table).read().equals(pq.read_table(tmp_path / "local" / table))
        parts = sorted(f for f in files if f.startswith(f"{table}/"))
        assert parts == sorted(f"{table}/{p.name}" for p in (tmp_path / "local" / table).iterdir())
    assert not list((tmp_path / "scratch").rglob("*.tar")), "staged shards are removed once uploaded"
    endpoint = uri.split("endpoint_override=")[1].split("&")[0]
    keys = [
        o["Key"]
        for o in boto3.client("s3", endpoint_url=f"http://{endpoint}")
        .list_objects_v2(Bucket="ckpt", Prefix="folder-ds")
        .get("Contents", [])
    ]
    assert keys and not [k for k in keys if k.endswith("/")], "no empty folder-marker objects"

    missing = shard("folder", images, uri.replace("s3://ckpt/", "s3://nobucket/"), *args, expect=2)
    assert "s3://nobucket/folder-ds: cannot write the dataset there" in missing.stderr
    assert (
        "bucket does not exist" in missing.stderr and len(missing.stderr.splitlines()) == 1
    )  # before any work

    ok = shard("verify", uri, "--workers", 2)
    assert "all OK" in ok.stdout
    # a flipped byte in one shard object: verify names the shard and the key
    target = remote.shards[1].path
    data = bytearray(store.read_bytes(target))
    data[len(data) // 3] ^= 0xFF
    store.write_bytes(target, bytes(data))
    bad = shard("verify", uri, expect=1)
    assert target in bad.stdout + bad.stderr and "sha256" in bad.stdout + bad.stderr


def test_killed_shard_into_a_bucket_resumes_to_the_same_shards(s3, tmp_path):
    uri = s3("killed")
    shard("synthetic", tmp_path / "whole", *SYNTHETIC, "--no-progress")
    proc = subprocess.Popen(
        [sys.executable, "-m", "vitpipe", "shard", "synthetic", uri, *map(str, SYNTHETIC)],
        cwd=REPO,
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
        start_new_session=True,
    )
    deadline = time.monotonic() + 120
    shards = lambda: [f for f in bucket_files(uri) if f.startswith("train/")]  # noqa: E731
    while len(shards()) < 2 and proc.poll() is None and time.monotonic() < deadline:
        time.sleep(0.05)
    os.killpg(proc.pid, signal.SIGKILL)
    proc.wait()
    files = bucket_files(uri)
    assert "manifest.json" not in files, "the run finished before it was killed"
    whole = {s.path: s for s in read_manifest(tmp_path / "whole").shards}
    done = [f for f in files if f.startswith("train/")]
    assert 2 <= len(done) < len(whole)
    for f in done:  # a shard under its name is whole: uploads appear only once complete
        assert files[f] == whole[f].bytes, f
    out = shard("synthetic", uri, *SYNTHETIC, "--no-progress")
    assert "already complete, kept" in out.stdout
    assert read_manifest(uri).shards == list(whole.values())
    assert "all OK" in shard("verify", uri).stdout


def test_loader_streams_the_train_split_from_a_bucket_with_exact_counts(s3):
    uri = s3("stream")
    samples = list(synthetic_samples(64, 6, seed=1, width=24, height=20))
    write_dataset(uri, samples, class_names(6), multi_label=True, max_count=8)
    info = dataset_info(uri, "train")
    assert info.num_samples == 64 and info.shard_counts == [8] * 8
    assert all(u.startswith("s3://ckpt/stream/train/") and "endpoint_override" in u for u in info.urls)
    data = DataConfig(train=uri, batch_size=4, num_workers=1, shuffle_buffer=8)
    per_rank = []
    for rank in range(2):
        loader = make_train_loader(info, data, rank=rank, world_size=2, img_size=16, seed=0, epochs=1)
        per_rank.append([k for b in loader for k in b["key"]])
    assert len(per_rank[0]) == len(per_rank[1]) == 32  # equal batches per rank, the whole epoch
    assert sorted(per_rank[0] + per_rank[1]) == sorted(s.key for s in samples)  # every key once


def test_unreadable_shards_are_counted_then_named(s3, tmp_path):
    uri = s3("holes")
    samples = list(synthetic_samples(120, 6, seed=2, width=24, height=20))
    write_dataset(uri, samples, class_names(6), multi_label=True, max_count=20)
    info = dataset_info(uri, "train")
    Store(uri).delete_file("train/shard-000002.tar")  # listed by the manifest, gone from the bucket
    data = DataConfig(train=uri, batch_size=4, num_workers=0, shuffle_buffer=0, max_skip_fraction=0.5)
    batches = list(make_train_loader(info, data, rank=0, world_size=1, img_size=16, seed=0, epochs=1))
    assert len(batches) == 120 // 4  # no silent short epoch: the rest of the round is read again
    assert batches[-1]["skipped"] >= 20  # the missing shard's samples, counted
    with pytest.raises(DatasetError, match=r"max_skip_fraction.*shard-000002\.tar"):
        strict = data.model_copy(update={"max_skip_fraction": 0.01})
        list(make_train_loader(info, strict, rank=0, world_size=1, img_size=16, seed=0, epochs=1))

    # an endpoint that is not there: a clear error, in seconds, never a hang
    dead = uri.replace(uri.split("endpoint_override=")[1].split("&")[0], "127.0.0.1:9")
    t0 = time.monotonic()
    with pytest.raises(DatasetError, match=r"s3://ckpt/holes/manifest\.json: cannot read"):
        dataset_info(dead, "train")
    assert time.monotonic() - t0 < 60
    # one shard behind it: read, retried by the S3 client (about 6 s), read again for the epoch's quota, named
    dead_url = info.urls[0].replace(uri.split("?")[1], dead.split("?")[1])
    dead_info = DatasetInfo([dead_url], info.num_classes, True, 20, [20])
    t0 = time.monotonic()
    with pytest.raises(DatasetError, match=r"no readable sample in .*shard-000000\.tar"):
        list(make_train_loader(dead_info, data, rank=0, world_size=1, img_size=16, seed=0, epochs=1))
    assert time.monotonic() - t0 < 120


def test_stage_config_checks_a_bucket_dataset_before_starting(s3, tmp_path):
    uri = s3("checked")
    write_dataset(uri, list(synthetic_samples(16, 4, seed=0, width=24, height=20)), class_names(4), True, 8)
    cfg = load_config(
        REPO / "configs" / "experiments" / "smoke.yaml", [f"data.train={uri}", "data.synthetic=null"]
    )
    assert input_problems(cfg) == []
    missing = load_config(
        REPO / "configs" / "experiments" / "smoke.yaml",
        [f"data.train={s3('nothing-here')}", "data.synthetic=null"],
    )
    (problem,) = input_problems(missing)
    assert (
        "s3://ckpt/nothing-here/manifest.json: no manifest" in problem and "endpoint_override" not in problem
    )


def test_manifest_of_s3_images_shards_them_and_names_the_missing(s3, tmp_path, monkeypatch):
    uri = s3("inputs")
    endpoint = uri.split("endpoint_override=")[1].split("&")[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{endpoint}")  # plain s3:// URIs in the table, as on AWS
    store = Store(uri)
    rng = np.random.default_rng(3)
    rows = []
    for i in range(40):
        buf = io.BytesIO()
        Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
        store.write_bytes(f"img/{i:03d}.jpg", buf.getvalue())
        # every fourth with the endpoint in the URI's query instead of the environment
        path = s3(f"inputs/img/{i:03d}.jpg") if i % 4 == 0 else f"s3://ckpt/inputs/img/{i:03d}.jpg"
        rows.append({"path": path, "label": ["a", "b"][i % 2]})
    rows.append({"path": "s3://ckpt/inputs/img/missing.jpg", "label": "a"})
    store.write_bytes("img/notes.jpg", b"not an image")
    rows.append({"path": "s3://ckpt/inputs/img/notes.jpg", "label": "b"})
    pq.write_table(pa.Table.from_pylist(rows), tmp_path / "photos.parquet")

    out = s3("photos")
    shard("manifest", tmp_path / "photos.parquet", out, "--max-count", 16, "--workers", 2, "--no-progress")
    m = read_manifest(out)
    assert m.totals == {"train": 40} and m.num_errors == 2 and m.classes == ["a", "b"]
    errors = Table(DatasetDir(out), "errors.parquet").read().to_pylist()
    reasons = {e["source"].rsplit("/", 1)[1]: (e["stage"], e["reason"]) for e in errors}
    assert reasons["missing.jpg"][0] == "read" and "no such file or object" in reasons["missing.jpg"][1]
    assert reasons["notes.jpg"][0] == "decode"
    index = Table(DatasetDir(out), "index.parquet").read().to_pylist()
    assert sorted(r["key"] for r in index) == [f"ckpt/inputs/img/{i:03d}" for i in range(40)]
    assert all(r["source"].startswith("s3://ckpt/inputs/img/") for r in index)
    assert "all OK" in shard("verify", out).stdout

    # The missing object appears: a re-run reads again only the shard whose input could not be read.
    buf = io.BytesIO()
    Image.fromarray(rng.integers(0, 255, (24, 32, 3), dtype=np.uint8)).save(buf, "JPEG")
    store.write_bytes("img/missing.jpg", buf.getvalue())
    again = shard(
        "manifest", tmp_path / "photos.parquet", out, "--max-count", 16, "--workers", 2, "--no-progress"
    )
    assert f"{len(m.shards) - 1} shards already complete, kept" in again.stdout
    m = read_manifest(out)
    assert m.totals == {"train": 41} and m.num_errors == 1


def _object_requests(records, prefix: str) -> list[str]:
    """The methods of the requests the S3 server logged for objects under /ckpt/PREFIX/."""
    lines = [r.getMessage() for r in records if r.name == "werkzeug"]
    found = (re.search(r'"(?:\x1b\[[\d;]*m)*([A-Z]+) (\S+)', line) for line in lines)  # colour codes first
    return [m[1] for m in found if m and m[2].startswith(f"/ckpt/{prefix}/")]


def test_s3_inputs_are_read_with_one_get_each_and_through_pyarrow_where_obstore_cannot(
    s3, tmp_path, monkeypatch, caplog
):
    """s3:// inputs go through obstore (one GET per object; pyarrow sends a HEAD before each GET); a bucket
    obstore cannot read as pyarrow would (credentials in a shared profile, or a failing read that pyarrow
    then makes) is read through pyarrow, the same bytes."""
    from data_prep import storage

    store = Store(s3("one-get"))
    names = ["plain.jpg", "with space.jpg", "ü#1.jpg"]
    for name in names:
        store.write_bytes(f"img/{name}", name.encode())
    endpoint = s3("x").split("endpoint_override=")[1].split("&")[0]
    monkeypatch.setenv("AWS_ENDPOINT_URL", f"http://{endpoint}")
    monkeypatch.setenv("HOME", str(tmp_path))  # no ~/.aws profile of the machine's
    monkeypatch.setattr(storage, "_FAST", {})
    plain = [f"s3://ckpt/one-get/img/{quote(n)}" for n in names]

    def read_all(uris: list[str]) -> tuple[list[bytes], list[str]]:
        caplog.clear()
        with caplog.at_level(logging.INFO, logger="werkzeug"):
            got = [storage.read_object(u) for u in uris]
        return got, _object_requests(caplog.records, "one-get")

    # the endpoint from the environment, or in the URI's query: one GET per object, nothing else
    for uris in (plain, [s3(f"one-get/img/{quote(n)}") for n in names]):
        got, requests = read_all(uris)
        assert got == [n.encode() for n in names] and requests == ["GET"] * 3
    with pytest.raises(FileNotFoundError):
        storage.read_object("s3://ckpt/one-get/img/missing.jpg")

    # credentials in a shared profile file: object_store does not read those, so pyarrow does (HEAD + GET)
    (tmp_path / "credentials").write_text(
        "[default]\naws_access_key_id = testing\naws_secret_access_key = testing\n"
    )
    monkeypatch.delenv("AWS_ACCESS_KEY_ID")
    monkeypatch.delenv("AWS_SECRET_ACCESS_KEY")
    monkeypatch.setenv("AWS_SHARED_CREDENTIALS_FILE", str(tmp_path / "credentials"))
    monkeypatch.setattr(storage, "_FAST", {})
    got, requests = read_all(plain)
    assert got == [n.encode() for n in names] and requests == ["HEAD", "GET"] * 3

    # no credentials obstore can find (its instance-metadata endpoint refuses): the first reads (three at
    # once, as a worker's read-ahead makes them) fail there, pyarrow makes them, and the bucket is read
    # through pyarrow from then on, with one warning
    monkeypatch.delenv("AWS_SHARED_CREDENTIALS_FILE")
    monkeypatch.setenv("AWS_METADATA_ENDPOINT", "http://127.0.0.1:1")  # object_store's IMDS address
    monkeypatch.setenv("AWS_EC2_METADATA_DISABLED", "true")  # the AWS SDK's
    monkeypatch.setattr(storage, "_FAST", {})
    storage._bucket_filesystem.cache_clear()
    caplog.clear()
    with caplog.at_level(logging.WARNING, logger="data_prep.storage"), ThreadPoolExecutor(3) as pool:
        got = list(pool.map(storage.read_object, plain))
        assert storage._FAST == {(os.getpid(), "s3://ckpt"): None}
        assert storage.read_object(plain[0]) == got[0]
    assert got == [n.encode() for n in names]
    warnings = [r.getMessage() for r in caplog.records if r.name == "data_prep.storage"]
    assert len(warnings) == 1 and "s3://ckpt: obstore could not read one-get/img/" in warnings[0]
    assert "reading this bucket through pyarrow instead" in warnings[0]
    storage._bucket_filesystem.cache_clear()


def test_any_fsspec_filesystem_holds_a_dataset():
    """The generic path: a scheme pyarrow lacks goes through fsspec (here its in-process memory://)."""
    from data_prep.verify import verify_dataset

    samples = list(synthetic_samples(24, 4, seed=5, width=24, height=20))
    write_dataset("memory://fsspec-ds", samples, class_names(4), multi_label=True, max_count=8)
    assert [c.problems for c in verify_dataset("memory://fsspec-ds")] == [[]] * 4  # 3 shards and the index
    info = dataset_info("memory://fsspec-ds", "train")
    assert info.num_samples == 24
    data = DataConfig(train="memory://fsspec-ds", batch_size=4, num_workers=0, shuffle_buffer=0)
    keys = [
        k
        for b in make_train_loader(info, data, rank=0, world_size=1, img_size=16, seed=0, epochs=1)
        for k in b["key"]
    ]
    assert sorted(keys) == sorted(s.key for s in samples)


def test_uris_with_credentials_or_misspelt_options_are_refused_without_echoing_secrets(tmp_path):
    from data_prep.dataset_dir import DatasetDir
    from data_prep.storage import read_object

    for call in (
        lambda: Store("s3://AKIAKEY:S3CRET@bucket/p"),
        lambda: read_object("s3://AKIAKEY:S3CRET@b/x.jpg"),
    ):
        with pytest.raises(ValueError, match="carries credentials") as err:
            call()
        assert "S3CRET" not in str(err.value) and "AKIAKEY" not in str(err.value)
    with pytest.raises(ValueError, match="endpoint_overide"):  # never a silent fallback to another client
        Store("s3://bucket/p?endpoint_overide=127.0.0.1:9")
    local = DatasetDir(f"file://{tmp_path}/ds")
    assert not local.remote and local.root == tmp_path / "ds"  # rename-into-place, fsync: the local path


def test_a_file_staged_where_a_folder_is_now_wanted_is_replaced(tmp_path, s3):
    """A dataset in a bucket stages its files on scratch: a killed run of the code before left
    staging/index.parquet (one file); the index's parts now stage under staging/index.parquet/."""
    uri = s3("staged")
    out = DatasetDir(uri, tmp_path / "scratch")
    old = out.scratch / "staging" / "index.parquet"
    old.parent.mkdir(parents=True)
    old.write_bytes(b"half an index")
    with out.writing("index.parquet/part-000000.parquet") as staged:
        staged.write_bytes(b"part")
    assert Store(uri).read_bytes("index.parquet/part-000000.parquet") == b"part"
    assert not old.is_file()
