import io
import json
import tarfile
from collections import Counter

import pytest
import torch
import webdataset as wds

from data_prep.layout import DatasetError, read_manifest
from data_prep.synthetic import class_names, synthetic_samples
from data_prep.tario import tar_members, tar_samples
from data_prep.writer import write_dataset
from pipeline.data.sources import DatasetInfo, dataset_info
from pipeline.data.train_stream import ShardStream

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = tmp_path_factory.mktemp("ds")
    samples = synthetic_samples(90, 6, seed=1, width=40, height=30, val_fraction=0.2)
    write_dataset(root, samples, class_names(6), multi_label=True, max_count=10)
    return root


def test_layout_manifest_and_plain_webdataset_reads_it(dataset):
    m = read_manifest(dataset)
    assert sum(m.totals.values()) == 90 and set(m.totals) == {"train", "val"}
    assert all(s.count <= 10 and len(s.sha256) == 64 for s in m.shards)
    assert (dataset / "index.parquet" / "_metadata").is_file()
    assert not list(dataset.rglob("*.tmp"))  # no partial files left behind
    urls = [str(dataset / s.path) for s in m.split_shards("train")]
    with tarfile.open(urls[0]) as tar:
        names = tar.getnames()
    assert names[0].endswith(".jpg") and names[1].endswith(".json")
    samples = list(wds.WebDataset(urls, shardshuffle=False).decode("pil"))
    assert len(samples) == m.totals["train"]
    labels = samples[0]["json"]["labels"]
    assert labels and all(0 <= c < 6 for c in labels)
    assert samples[0]["jpg"].size == (40, 30)


def test_synthetic_is_deterministic_and_multilabel():
    a = [(s.key, s.labels, s.image) for s in synthetic_samples(20, 10, seed=3, width=32, height=32)]
    b = [(s.key, s.labels, s.image) for s in synthetic_samples(20, 10, seed=3, width=32, height=32)]
    assert a == b
    mean_labels = sum(len(s.labels) for s in synthetic_samples(400, 50, seed=0, width=16, height=16)) / 400
    assert 1.15 < mean_labels < 1.45


def _keys_of(stream: ShardStream, epoch: int, num_workers: int) -> list[str]:
    """The keys of a rank's runs in `epoch`, read with plain webdataset: each worker's shards, less the
    samples of its first shard that are the run before's, up to its run's length."""
    keys = []
    for w in range(num_workers):
        urls, passed, n = stream.slot_run(epoch, w, num_workers)
        samples = [s["__key__"] for s in wds.WebDataset(urls, shardshuffle=False)]
        assert len(samples) >= passed + n
        keys += samples[passed : passed + n]
    return keys


def _all_keys(info) -> list[str]:
    return [s["__key__"] for s in wds.WebDataset(info.urls, shardshuffle=False)]


def test_every_key_read_once_per_epoch_across_ranks_and_workers(dataset):
    """81 training samples in 8 shards of 10 and one of 1, over 2 ranks x 2 workers, batch 4: 10 batches
    per rank (81 // 8), 5 per worker; 80 samples once each, the one left over and the cut other each epoch."""
    info = dataset_info(dataset)
    assert info.shard_counts == [10] * 8 + [1]
    streams = [
        ShardStream(info, rank=r, world_size=2, batch_size=4, img_size=16, seed=0, num_workers=2)
        for r in range(2)
    ]
    assert [s.epoch_batches for s in streams] == [10, 10]
    runs, left = {}, []
    for epoch in (0, 1):
        runs[epoch] = [_keys_of(s, epoch, 2) for s in streams]
        counts = Counter(k for keys in runs[epoch] for k in keys)
        assert len(counts) == 80 and set(counts.values()) == {1}
        assert [len(k) for k in runs[epoch]] == [40, 40]
        left.append(set(_all_keys(info)) - set(counts))
    assert len(left[0]) == len(left[1]) == 1 and left[0] != left[1]
    assert runs[0] != runs[1]


def test_fewer_shards_than_slots_need_counts(dataset):
    """With the manifest's counts an epoch is cut in runs of samples, so 4 ranks x 4 workers read 7
    shards; bare URLs (no counts) deal whole shards, at least one per slot."""
    info = dataset_info(dataset)
    assert len(info.urls) < 16
    stream = ShardStream(info, rank=3, world_size=4, batch_size=4, img_size=16, seed=0, num_workers=4)
    assert stream.epoch_batches == 81 // 16 and len(_keys_of(stream, 0, 4)) == 5 * 4
    bare = DatasetInfo(info.urls, 6, True, None, None)
    with pytest.raises(DatasetError, match=r"cannot be split over 4 ranks x 4 loader workers"):
        ShardStream(bare, rank=0, world_size=4, batch_size=4, img_size=16, seed=0, num_workers=4)


def test_batches_are_uint8_multi_hot_and_seeded(dataset):
    info = dataset_info(dataset)

    def first_batches(seed):
        s = ShardStream(info, rank=0, world_size=1, batch_size=8, img_size=16, seed=seed, num_workers=1)
        it = iter(s)
        return [next(it) for _ in range(3)]

    a, b, c = first_batches(0), first_batches(0), first_batches(1)
    assert a[0]["image"].dtype == torch.uint8 and a[0]["image"].shape == (8, 3, 16, 16)
    assert a[0]["target"].shape == (8, 6) and set(a[0]["target"].unique().tolist()) <= {0.0, 1.0}
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a, b))
    assert not all(torch.equal(x["image"], y["image"]) for x, y in zip(a, c))


def test_corrupt_image_is_skipped_and_counted(tmp_path):
    good = list(synthetic_samples(12, 4, seed=0, width=20, height=20))
    good[3].image = b"not a jpeg"
    write_dataset(tmp_path, good, class_names(4), multi_label=True, max_count=12)
    info = dataset_info(tmp_path)
    stream = ShardStream(info, rank=0, world_size=1, batch_size=11, img_size=16, seed=0, num_workers=0)
    batch = next(iter(stream))
    assert batch["skipped"] == 1 and batch["image"].shape[0] == 11


def test_missing_manifest_names_the_folder(tmp_path):
    with pytest.raises(DatasetError, match=f"{tmp_path}/manifest.json: no manifest"):
        dataset_info(tmp_path)
    (tmp_path / "manifest.json").write_text(json.dumps({"format_version": 99}))
    with pytest.raises(DatasetError, match="format_version 99"):
        dataset_info(tmp_path)


def _archive(fmt: int, members: list[tuple[str, bytes]], with_dir: bool = True) -> bytes:
    buf = io.BytesIO()
    with tarfile.open(fileobj=buf, mode="w", format=fmt) as tar:
        if with_dir:
            d = tarfile.TarInfo("a_dir")
            d.type = tarfile.DIRTYPE
            tar.addfile(d)
        for name, data in members:
            tar.addfile(_info(name, len(data)), io.BytesIO(data))
    return buf.getvalue()


def _info(name: str, size: int) -> tarfile.TarInfo:
    info = tarfile.TarInfo(name)
    info.size = size
    return info


@pytest.mark.parametrize("fmt", [tarfile.USTAR_FORMAT, tarfile.PAX_FORMAT, tarfile.GNU_FORMAT])
def test_tar_reader_matches_tarfile_for_long_and_unicode_names(fmt):
    long_dir = "d" * 120 if fmt != tarfile.USTAR_FORMAT else "d" * 60  # USTAR: a 155-byte prefix field
    names = ["k1.jpg", "k1.cls", f"{long_dir}/k2.jpg", f"{long_dir}/k2.cls"]
    if fmt != tarfile.USTAR_FORMAT:
        names += ["chat/ünï.jpg", "chat/ünï.cls", "x" * 150 + ".jpg", "x" * 150 + ".cls"]
    members = [(n, bytes([i]) * (i * 300 + 1)) for i, n in enumerate(names)]
    data = _archive(fmt, members)
    with tarfile.open(fileobj=io.BytesIO(data)) as tar:
        expected = [(m.name, tar.extractfile(m).read()) for m in tar if m.isfile()]
    assert list(tar_members(io.BytesIO(data))) == expected == members  # the directory is skipped
    samples = list(tar_samples(io.BytesIO(data), "u"))
    assert [s["__key__"] for s in samples] == [n.rsplit(".", 1)[0] for n, _ in members[::2]]
    assert all(set(s) == {"__key__", "__url__", "jpg", "cls"} for s in samples)


def test_tar_reader_raises_on_a_cut_or_damaged_stream():
    data = _archive(tarfile.USTAR_FORMAT, [("a.jpg", b"x" * 2000), ("a.cls", b"1")], with_dir=False)
    for cut in (1000, 512 * 5):  # mid-member; after the first member, without the end marker
        with pytest.raises(tarfile.ReadError, match="unexpected end of data"):
            list(tar_members(io.BytesIO(data[:cut])))
    bad = bytearray(data)
    bad[10] ^= 0xFF  # in the first header's name: its checksum no longer holds
    with pytest.raises(tarfile.ReadError, match="bad checksum"):
        list(tar_members(io.BytesIO(bytes(bad))))
