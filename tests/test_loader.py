"""The streaming loader through the real DataLoader: coverage per epoch, equal batch counts per rank
(a 2-rank gloo run), corrupt data, resume in both modes, the eval loader, URL inputs, RandAugment.

    .venv/bin/python -m pytest tests/test_loader.py -q
"""

import io
import itertools
import json
import shutil
import subprocess
import sys
from collections import Counter
from datetime import timedelta
from pathlib import Path

import numpy as np
import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
from PIL import Image

from data_prep.layout import DatasetError, read_manifest
from data_prep.synthetic import class_names, render, synthetic_samples
from data_prep.writer import write_dataset
from pipeline.config import DataConfig
from pipeline.data import transforms
from pipeline.data.loader import make_eval_loader, make_train_loader
from pipeline.data.sources import dataset_info, epoch_batches
from pipeline.data.train_stream import ShardStream
from pipeline.distributed import shutdown_distributed

pytestmark = pytest.mark.unit
IMG = 16
CLASSES = 6


def write(root: Path, num: int, max_count: int, multi_label: bool = True, seed: int = 1, **kw) -> dict:
    """A small dataset; returns {key: labels}."""
    samples = list(synthetic_samples(num, CLASSES, seed=seed, width=24, height=20, **kw))
    write_dataset(root, samples, class_names(CLASSES), multi_label=multi_label, max_count=max_count)
    return {s.key: s.labels for s in samples}


@pytest.fixture(scope="module")
def even(tmp_path_factory):
    """64 multi-label samples in 8 shards of 8: 2 ranks x 2 workers x 2 shards, nothing dropped."""
    root = tmp_path_factory.mktemp("even")
    return root, write(root, 64, 8)


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """90 samples in 12 shards of 7 and one of 6."""
    root = tmp_path_factory.mktemp("uneven")
    return root, write(root, 90, 7)


def data_config(**kw) -> DataConfig:
    """The data section the tests run with; the factories do not read `train` (`info` names the shards)."""
    defaults = {"train": "-", "batch_size": 4, "num_workers": 0, "shuffle_buffer": 16, "min_scale": 0.08}
    return DataConfig(**{**defaults, **kw})


def train_loader(source, *, num_classes=None, multi_label=None, start_batch=0, epochs=None, **kw):
    """A train loader over `source`; kw: rank, world_size, seed, or any DataConfig field."""
    info = dataset_info(source, "train", num_classes=num_classes, multi_label=multi_label)
    rank, world_size, seed = kw.pop("rank", 0), kw.pop("world_size", 1), kw.pop("seed", 0)
    return make_train_loader(
        info,
        data_config(**kw),
        rank=rank,
        world_size=world_size,
        img_size=IMG,
        seed=seed,
        start_batch=start_batch,
        epochs=epochs,
    )


def take(loader, n: int | None = None) -> list[dict]:
    it = iter(loader)
    out = list(itertools.islice(it, n))
    del it  # shuts the workers of an endless stream down
    return out


def keys_of(batches: list[dict]) -> list[str]:
    return [k for b in batches for k in b["key"]]


def assert_same_batches(a: list[dict], b: list[dict]) -> None:
    assert len(a) == len(b)
    for x, y in zip(a, b):
        assert x["key"] == y["key"]
        assert torch.equal(x["image"], y["image"]) and torch.equal(x["target"], y["target"])


# -- epochs: coverage, equal counts, order


def test_every_key_once_per_epoch_over_2_ranks_x_2_workers_through_the_dataloader(even):
    root, labels = even
    per_rank = [take(train_loader(root, rank=r, world_size=2, num_workers=2, epochs=2)) for r in range(2)]
    e = train_loader(root, world_size=2, num_workers=2).dataset.epoch_batches
    assert e == 8 and [len(b) for b in per_rank] == [2 * e, 2 * e]
    for epoch in range(2):
        keys = [k for batches in per_rank for k in keys_of(batches[epoch * e : (epoch + 1) * e])]
        assert Counter(keys) == Counter(labels.keys())  # every key exactly once
    assert keys_of(per_rank[0][:e]) != keys_of(per_rank[0][e:])


def test_an_epoch_of_uneven_shards_uses_every_sample_but_fewer_than_ranks_x_batch(uneven):
    """90 samples in 12 shards of 7 and one of 6, 2 ranks x 2 workers, batch 4: every rank 90 // 8 = 11
    batches (its workers 6 and 5), 88 samples, the 2 left over a different pair every epoch. The whole-shard
    layout of before (`sources.epoch_batches`, still the quota of streams resumed from such checkpoints)
    owed every rank only the worst share's 10."""
    root, labels = uneven
    info = dataset_info(root)
    assert sorted(info.shard_counts) == [6] + [7] * 12
    # 4 slots: each gets at least 3 shards, at worst 6 + 7 + 7 = 20 samples -> 5 batches of 4.
    assert epoch_batches(info, 2, 4, num_workers=2) == 2 * 5 == info.epoch_batches(2, 4, 2)
    loaders = [train_loader(root, rank=r, world_size=2, num_workers=2, epochs=2) for r in range(2)]
    assert [loader.dataset.epoch_batches for loader in loaders] == [11, 11]
    per_rank = [take(loader) for loader in loaders]
    assert [len(b) for b in per_rank] == [22, 22]
    left = []
    for epoch in range(2):
        keys = [k for batches in per_rank for k in keys_of(batches[epoch * 11 : (epoch + 1) * 11])]
        assert len(keys) == len(set(keys)) == 88  # no sample twice
        left.append(set(labels) - set(keys))
    assert [len(x) for x in left] == [2, 2] and left[0] != left[1]


def _uneven_rank(rank: int, root: str, store: str, out: str) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    loader = make_train_loader(
        dataset_info(root),
        data_config(num_workers=2),
        rank=rank,
        world_size=2,
        img_size=IMG,
        seed=0,
        epochs=2,
    )
    steps, keys = 0, []
    for batch in loader:  # all-reduce every step: a rank that ran out early would hang the other
        total = torch.tensor([float(batch["image"].shape[0])])
        dist.all_reduce(total)
        steps += 1
        keys.append(batch["key"])
    dist.all_reduce(torch.zeros(1))  # both ranks got here
    e = loader.dataset.epoch_batches
    Path(out, f"rank{rank}.json").write_text(json.dumps({"steps": steps, "epoch_batches": e, "keys": keys}))
    shutdown_distributed()  # a caught cycle could hold the group: its threads would abort the exit


@pytest.mark.dist
@pytest.mark.timeout(180)  # generous: spawning two torch processes on a loaded 2-core machine
def test_uneven_shards_do_not_hang_two_gloo_ranks(uneven, tmp_path):
    root, labels = uneven
    mp.spawn(_uneven_rank, args=(str(root), str(tmp_path / "store"), str(tmp_path)), nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    e = ranks[0]["epoch_batches"]
    assert e == 11 and [r["steps"] for r in ranks] == [2 * e, 2 * e]  # 90 // (2 x 4)
    for epoch in range(2):  # within an epoch no sample twice, over both ranks
        keys = [k for r in ranks for b in r["keys"][epoch * e : (epoch + 1) * e] for k in b]
        assert len(keys) == len(set(keys)) == 2 * e * 4 and set(keys) <= set(labels)


def test_same_seed_same_order_other_epoch_or_seed_other_order(even):
    root, _ = even
    a, b = (
        take(train_loader(root, num_workers=2, epochs=2)),
        take(train_loader(root, num_workers=2, epochs=2)),
    )
    assert_same_batches(a, b)
    e = len(a) // 2
    assert sorted(keys_of(a[:e])) == sorted(keys_of(a[e:])) and keys_of(a[:e]) != keys_of(a[e:])
    c = take(train_loader(root, num_workers=2, epochs=1, seed=1))
    assert keys_of(c) != keys_of(a[:e])


def test_targets_are_multi_hot_or_class_indices(even, tmp_path):
    root, labels = even
    for batch in take(train_loader(root, epochs=1)):
        assert batch["image"].dtype == torch.uint8 and batch["image"].shape == (4, 3, IMG, IMG)
        assert batch["target"].dtype == torch.float32 and batch["target"].shape == (4, CLASSES)
        for key, row in zip(batch["key"], batch["target"]):
            assert row.nonzero().flatten().tolist() == labels[key]
    single = write(tmp_path, 24, 8, multi_label=False)
    for batch in take(train_loader(tmp_path, epochs=1)):
        assert batch["target"].dtype == torch.long and batch["target"].shape == (4,)
        assert batch["target"].tolist() == [single[k][0] for k in batch["key"]]


# -- resume


@pytest.mark.parametrize("start", [5, 8, 11])
def test_resume_at_start_batch_continues_exactly_with_2_workers(even, start):
    root, _ = even
    straight = take(train_loader(root, batch_size=8, num_workers=2), 14)  # 8 batches an epoch
    resumed = take(train_loader(root, batch_size=8, num_workers=2, start_batch=start), 14 - start)
    assert_same_batches(resumed, straight[start:])


def test_resampled_is_deterministic_by_seed_and_resumes_exactly(even):
    root, _ = even
    a = take(train_loader(root, num_workers=2, resampled=True), 27)
    assert_same_batches(a, take(train_loader(root, num_workers=2, resampled=True), 27))
    assert keys_of(take(train_loader(root, num_workers=2, resampled=True, seed=1), 27)) != keys_of(a)
    keys = Counter(keys_of(a))
    assert max(keys.values()) > 1 or len(keys) < 27 * 4  # drawn with replacement: no epochs
    # Worker 0 made 11 of the first 21 batches (44 samples): a whole round of 4 x 8 is skipped unread.
    resumed = take(train_loader(root, num_workers=2, resampled=True, start_batch=21), 6)
    assert_same_batches(resumed, a[21:])


def test_resampled_resumes_exactly_from_bare_urls_without_counts(even, tmp_path):
    root, _ = even
    bare = tmp_path / "bare"
    shutil.copytree(root / "train", bare)
    urls = f"pipe:cat {bare}/shard-{{000000..000007}}.tar"
    kw = dict(num_workers=2, resampled=True, num_classes=CLASSES, multi_label=True)
    a = take(train_loader(urls, **kw), 12)
    assert_same_batches(take(train_loader(urls, start_batch=7, **kw), 5), a[7:])


# -- corrupt data


@pytest.mark.parametrize("extra", [0, 100], ids=["cut-at-a-block-boundary", "cut-mid-member"])
def test_truncated_shard_and_corrupt_image_are_skipped_and_counted(tmp_path, extra):
    samples = list(synthetic_samples(30, CLASSES, seed=2, width=24, height=20))
    samples[3].image = b"not a jpeg"
    write_dataset(tmp_path, samples, class_names(CLASSES), multi_label=False, max_count=10)
    shard = tmp_path / read_manifest(tmp_path).shards[2].path
    shard.write_bytes(shard.read_bytes()[: shard.stat().st_size // 2 + extra])  # 15360: 30 blocks
    batches = take(train_loader(tmp_path, batch_size=2, epochs=1, max_skip_fraction=1.0))
    assert len(batches) == 15  # the epoch still yields every batch it owes (the rest read again)
    keys = set(keys_of(batches))
    assert samples[3].key not in keys and samples[29].key not in keys  # corrupt; after the cut
    readable = 30 - 1 - sum(s.key not in keys for s in samples[20:])
    assert batches[-1]["skipped"] >= 1 + (30 - 1 - readable) and readable >= 20


def test_too_many_bad_samples_raise_naming_the_shard(tmp_path):
    samples = list(synthetic_samples(120, CLASSES, seed=3, width=24, height=20))
    for s in samples[60:65]:
        s.image = b"\xff\xd8 broken"
    write_dataset(tmp_path, samples, class_names(CLASSES), multi_label=False, max_count=60)
    with pytest.raises(
        DatasetError, match=r"5 of 100 samples read.*max_skip_fraction 1\.0%.*shard-000001\.tar"
    ):
        take(train_loader(tmp_path, shuffle_buffer=0, max_skip_fraction=0.01), 40)
    # through a worker process too: the error crosses the process boundary intact
    with pytest.raises(DatasetError, match=r"shard-000001\.tar"):
        take(train_loader(tmp_path, shuffle_buffer=0, num_workers=1, max_skip_fraction=0.01), 40)
    assert len(take(train_loader(tmp_path, shuffle_buffer=0, max_skip_fraction=0.05), 28)) == 28  # 5 of 117


# -- evaluation


@pytest.mark.parametrize(("max_count", "assignment"), [(10, "shard"), (40, "index")])
def test_eval_every_sample_once_equal_batches_padding_masked(tmp_path, max_count, assignment):
    labels = write(tmp_path, 37, max_count, multi_label=False)  # 37: not a multiple of 2 ranks x 4
    runs = []
    for _ in range(2):
        per_rank = []
        for rank in range(2):
            loader = make_eval_loader(
                dataset_info(tmp_path, "train"),
                data_config(num_workers=2),
                rank=rank,
                world_size=2,
                batch_size=4,
                img_size=IMG,
            )
            assert loader.dataset.by_shard == (assignment == "shard")
            per_rank.append(take(loader))
        runs.append(per_rank)
    per_rank = runs[0]
    assert len(per_rank[0]) == len(per_rank[1]) == 5  # ceil(max(20, 17) / 4) or ceil(19 / 4)
    valid_keys = [k for batches in per_rank for b in batches for k, v in zip(b["key"], b["valid"]) if v]
    assert Counter(valid_keys) == Counter(labels.keys())
    padding = sum(int((~b["valid"]).sum()) for batches in per_rank for b in batches)
    assert padding == 2 * 5 * 4 - 37
    for batches in per_rank:
        for b in batches:
            assert b["image"].shape == (4, 3, IMG, IMG) and b["valid"].dtype == torch.bool
            assert b["target"][b["valid"]].tolist() == [
                labels[k][0] for k, v in zip(b["key"], b["valid"]) if v
            ]
            for slot in (~b["valid"]).nonzero().flatten().tolist():  # a repeat of a real sample
                assert any(
                    torch.equal(b["image"][slot], b["image"][i]) for i in b["valid"].nonzero().flatten()
                )
    for a, b in zip(runs[0], runs[1]):
        assert_same_batches(a, b)  # deterministic


def test_eval_pass_counts_a_missing_shard_and_a_corrupt_sample_then_names_them(tmp_path):
    samples = list(synthetic_samples(40, CLASSES, seed=4, width=24, height=20))
    samples[5].image = b"not a jpeg"
    write_dataset(tmp_path, samples, class_names(CLASSES), multi_label=False, max_count=10)
    info = dataset_info(tmp_path, "train")
    (tmp_path / read_manifest(tmp_path).shards[2].path).unlink()  # listed, but gone
    args = dict(rank=0, world_size=1, batch_size=4, img_size=IMG)
    batches = take(make_eval_loader(info, data_config(max_skip_fraction=1.0), **args))
    assert len(batches) == 10  # the same pass length as an intact dataset: every rank still in step
    valid = [k for b in batches for k, v in zip(b["key"], b["valid"]) if v]
    assert len(valid) == 40 - 1 - 10 and samples[5].key not in valid
    assert max(b["skipped"] for b in batches) == 11  # counted: the eval stage reports "N of M samples"
    with pytest.raises(DatasetError, match=r"shard-00000[02]\.tar"):
        take(make_eval_loader(info, data_config(max_skip_fraction=0.01), **args))


def _smooth(width: int, height: int) -> Image.Image:
    y, x = np.mgrid[0:height, 0:width] / 9.0
    rgb = np.stack([np.sin(x) + np.cos(y), np.sin(x + y), np.cos(x - 2 * y)], -1)
    return Image.fromarray(((rgb + 2) * 60).astype(np.uint8))


def test_eval_tensor_is_resize_and_centre_crop():
    # Shorter side 60 -> round(32 / 0.875) = 37: the kept box is the centred 60 * 32 / 37 square.
    side = 60 * 32 / 37
    box = transforms.center_crop_box(80, 60, 32)
    assert box == pytest.approx(((80 - side) / 2, (60 - side) / 2, (80 + side) / 2, (60 + side) / 2))
    img = _smooth(80, 60)
    out = transforms.eval_tensor(img, 32).numpy()
    ref = np.asarray(img.resize((32, 32), Image.BILINEAR, box=box)).transpose(2, 0, 1)  # PIL, same box
    assert out.shape == (3, 32, 32) and np.abs(out.astype(int) - ref.astype(int)).mean() < 1


# -- inputs


def test_brace_pattern_reads_the_manifest_counts_and_bare_urls_need_class_arguments(even, tmp_path):
    root, labels = even
    pattern = f"{root}/train/shard-{{000000..000007}}.tar"
    info = dataset_info(pattern)
    assert info.urls == dataset_info(root).urls and info.shard_counts == [8] * 8 and info.num_classes == 6
    assert_same_batches(take(train_loader(pattern, epochs=1)), take(train_loader(root, epochs=1)))
    bare = tmp_path / "bare"
    shutil.copytree(root / "train", bare)
    with pytest.raises(DatasetError, match="pass num_classes= and multi_label="):
        dataset_info(f"{bare}/shard-{{000000..000007}}.tar")
    with pytest.raises(DatasetError, match="num_classes=5 was given, but the manifest says 6"):
        dataset_info(pattern, num_classes=5)
    loader = train_loader([str(p) for p in sorted(bare.glob("*.tar"))], num_classes=6, multi_label=True)
    assert loader.dataset.epoch_batches is None and loader.dataset.info.num_samples is None
    keys = keys_of(take(loader, 16))  # without counts epochs flow on: 64 samples then the next epoch
    assert Counter(keys) == Counter(labels.keys())
    with pytest.raises(DatasetError, match="needs exact per-shard counts"):
        train_loader(f"{bare}/shard-{{000000..000007}}.tar", num_classes=6, multi_label=True, epochs=1)


def test_start_up_errors_are_clear(even):
    root, _ = even
    # 8 shards over 4 ranks x 4 workers: runs of samples, 64 // 16 = 4 batches per rank
    assert train_loader(root, world_size=4, num_workers=4).dataset.epoch_batches == 4
    info = dataset_info(root)  # resampled mode needs no split
    ShardStream(info, rank=0, world_size=4, batch_size=4, img_size=IMG, seed=0, num_workers=4, resampled=True)
    with pytest.raises(DatasetError, match="64 samples do not make one batch of 64 on each of 2 ranks"):
        train_loader(root, world_size=2, num_workers=2, batch_size=64)
    with pytest.raises(ValueError, match="resampled streams have no epochs"):
        train_loader(root, resampled=True, epochs=1)


# -- transforms


def _jpeg(width: int, height: int) -> Image.Image:
    buf = io.BytesIO()
    render(0, 0, CLASSES, 1.3, width, height)[0].save(buf, format="JPEG", quality=90)
    return Image.open(io.BytesIO(buf.getvalue()))


def test_rand_augment_changes_pixels_deterministically_per_rng():
    img = render(1, 0, CLASSES, 1.3, 32, 32)[0]
    before = np.asarray(img).copy()

    def run(seed: int, aug=(2, 9)) -> np.ndarray:
        return transforms.train_tensor(img, 24, np.random.default_rng(seed), randaugment=aug).numpy()

    assert np.array_equal(run(0), run(0)) and not np.array_equal(run(0), run(1))
    assert not np.array_equal(run(0), run(0, aug=None))
    assert np.array_equal(np.asarray(img), before)  # the input is untouched
    for op in transforms.RAND_AUGMENT_OPS:  # each op: a pure function of (img, magnitude, rng)
        a = op(img, 9, np.random.default_rng(5))
        assert a.size == img.size and a.mode == "RGB"
        assert np.array_equal(np.asarray(a), np.asarray(op(img, 9, np.random.default_rng(5)))), op.__name__
    changed = [
        op.__name__
        for op in transforms.RAND_AUGMENT_OPS
        if not np.array_equal(np.asarray(op(img, 9, np.random.default_rng(5))), before)
    ]
    assert len(changed) >= 11, changed


def test_jpeg_draft_only_where_the_crop_keeps_the_target_resolution():
    big = _jpeg(960, 720)
    img, box = transforms.draft_for_box(big, (0, 0, 960, 720), 224)  # the whole image -> 224: 1/2 scale
    assert img.size == (480, 360) and box == (0, 0, 480, 360)
    img, box = transforms.draft_for_box(_jpeg(960, 720), (100, 100, 400, 340), 224)  # 300 px crop: full
    assert img.size == (960, 720) and box == (100, 100, 400, 340)
    out = transforms.train_tensor(_jpeg(960, 720), 224, np.random.default_rng(0), min_scale=0.9).numpy()
    ref_img = _jpeg(960, 720)
    ref_img.load()  # decoded in full: no draft possible any more
    ref = transforms.train_tensor(ref_img, 224, np.random.default_rng(0), min_scale=0.9).numpy()
    assert out.shape == ref.shape == (3, 224, 224) and np.abs(out.astype(int) - ref.astype(int)).mean() < 4


# A rank that got SIGTERM (to its whole process group, as launchers send it) keeps reading batches until it has
# checkpointed; a process whose loader is left running after an error still exits, also while a worker is
# still starting (it hung forever: `pipeline.data.loader._stop_live_workers`).
_SIGNALS_SCRIPT = """
import os, signal, sys, time
from pipeline.config import DataConfig
from pipeline.data import loader as loader_module
from pipeline.data.loader import make_train_loader
from pipeline.data.sources import dataset_info
if sys.argv[2] == "error-while-a-worker-starts":  # worker 1 still starting, SIGTERM blocked, when the rank exits
    start = loader_module._own_process_group
    loader_module._own_process_group = lambda worker_id: (worker_id == 1 and time.sleep(3), start(worker_id))
info = dataset_info(sys.argv[1], "train")
loader = make_train_loader(info, DataConfig(train=sys.argv[1], batch_size=4, num_workers=2), rank=0, world_size=1,
                           img_size=16, seed=0)
signal.signal(signal.SIGTERM, lambda *a: print("rank got SIGTERM", flush=True))
batches = iter(loader)
if sys.argv[2] == "group-sigterm-at-start":  # while the workers may still be starting
    os.killpg(os.getpgrp(), signal.SIGTERM)
next(batches)
if sys.argv[2].startswith("group-sigterm"):
    os.killpg(os.getpgrp(), signal.SIGTERM)
    for _ in range(6):  # both workers still answer
        next(batches)
    print("batches after SIGTERM", flush=True)
else:
    raise RuntimeError("a stage failing with its loader still running")
"""


@pytest.mark.parametrize(
    "case", ["group-sigterm", "group-sigterm-at-start", "error", "error-while-a-worker-starts"]
)
def test_loader_workers_outlive_a_group_sigterm_and_never_hold_an_exiting_process(even, tmp_path, case):
    script = tmp_path / "signals.py"
    script.write_text(_SIGNALS_SCRIPT)
    # Its own session: the group-wide SIGTERM must not reach pytest.
    proc = subprocess.run(
        [sys.executable, str(script), str(even[0]), case],
        capture_output=True,
        text=True,
        timeout=60,  # an exit that waited on a worker ignoring SIGTERM hung here forever
        start_new_session=True,
        cwd=Path(__file__).parents[1],
    )
    if case.startswith("group-sigterm"):
        assert proc.returncode == 0, proc.stderr[-2000:]
        assert "rank got SIGTERM" in proc.stdout and "batches after SIGTERM" in proc.stdout
    else:
        assert proc.returncode == 1 and "a stage failing with its loader still running" in proc.stderr
