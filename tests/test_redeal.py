"""The training stream continued on another world size (pipeline/data/deal.py), through the real
DataLoader with 2 workers per rank: per-sample key accounting across the switch, both ways and twice.

    .venv/bin/python -m pytest tests/test_redeal.py -q
"""

import dataclasses
import itertools
import json
from collections import Counter

import pytest
import torch

from data_prep.layout import DatasetError
from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset
from pipeline.config import DataConfig
from pipeline.data import deal as deal_module
from pipeline.data.deal import SHARDS, Deal, continue_deal
from pipeline.data.loader import make_train_loader
from pipeline.data.sources import DatasetInfo, dataset_info

pytestmark = pytest.mark.unit
SEED, BATCH, WORKERS = 3, 8, 2


@pytest.fixture(scope="module")
def info(tmp_path_factory):
    """320 samples in 8 shards of 40: on 2 ranks x 2 workers each slot reads 2 shards (10 batches of 8) per
    epoch, on 1 rank x 2 workers 4 shards (20 batches): nothing is dropped by design, so every epoch is
    every sample once."""
    root = tmp_path_factory.mktemp("redeal")
    write_dataset(root, synthetic_samples(320, 6, seed=1, width=24, height=20), class_names(6), True, 40)
    return dataset_info(root, "train")


def batches(info, deal: Deal, rank: int, start_batch: int, n: int) -> list[dict]:
    data = DataConfig(train="-", batch_size=BATCH, num_workers=WORKERS, shuffle_buffer=16)
    loader = make_train_loader(
        info,
        data,
        rank=rank,
        world_size=deal.world_size,
        img_size=16,
        seed=SEED,
        start_batch=start_batch,
        deal=deal,
    )
    return [
        {"epoch": b["epoch"], "key": list(b["key"]), "image": b["image"].clone()}
        for b in itertools.islice(loader, n)
    ]


def samples(bs: list[dict], epoch: int) -> dict[str, torch.Tensor]:
    """{key: image} of the batches' samples of `epoch`; a key read twice fails."""
    out: dict[str, torch.Tensor] = {}
    for b in bs:
        if b["epoch"] != epoch:
            continue
        for key, image in zip(b["key"], b["image"]):
            assert key not in out, f"{key} read twice in epoch {epoch}"
            out[key] = image
    return out


def run(info, deal: Deal, start_step: int, steps: int) -> list[list[dict]]:
    """Every rank's batches of steps [start_step, start_step + steps) under `deal`."""
    first = deal.rank_batches(start_step)
    return [batches(info, deal, r, first, steps * deal.grad_accum) for r in range(deal.world_size)]


def merged(*runs: list[list[dict]]) -> list[dict]:
    return [b for r in runs for rank in r for b in rank]


def test_two_ranks_to_one_and_back_read_every_sample_of_each_epoch_once(info):
    two = Deal(2, WORKERS, BATCH, 1)  # global batch 16
    straight = run(info, two, 0, 20)  # epoch 0 is 20 batches per rank
    epoch0 = samples(merged(straight), 0)
    assert len(epoch0) == 320

    before = run(info, two, 0, 7)  # stopped at step 7: workers 0 and 1 made 4 and 3 batches of epoch 0
    one = continue_deal(two, 7, (1, WORKERS, BATCH, 2), info, SEED)  # one rank, grad_accum 2: batch 16
    assert (one.base_step, one.first_epoch) == (7, 1)
    assert [sum(p.take for p in slot) for slot in one.carry] == [104, 104]  # 26 batches left, 13 per worker
    after = run(info, one, 7, 33)  # 66 batches: the carry's 26, then epoch 1's 40

    assert [b["epoch"] for b in after[0]] == [0] * 26 + [1] * 40
    seen0 = samples(merged(before, after), 0)
    assert seen0.keys() == epoch0.keys()
    for key, image in seen0.items():  # the same crop and flip the uninterrupted run gave each sample
        assert torch.equal(image, epoch0[key]), key
    assert len(samples(merged(after), 1)) == 320

    # Resuming within the re-dealt stream on its own shape continues it exactly (mid-carry and in epoch 1).
    for step in (11, 20):
        again = run(info, one, step, 40 - step)
        tail = after[0][(step - 7) * 2 :]
        assert [b["key"] for b in again[0]] == [b["key"] for b in tail]
        assert all(torch.equal(a["image"], b["image"]) for a, b in zip(again[0], tail))

    # And back to two ranks mid-carry (step 12: 10 of the 26 carried batches made): epoch 0 still whole.
    two_again = continue_deal(one, 12, (2, WORKERS, BATCH, 1), info, SEED)
    mid = [[b for b in after[0][:10]]]
    later = run(info, two_again, 12, 20)
    assert samples(merged(before, mid, later), 0).keys() == epoch0.keys()
    assert continue_deal(two_again, 30, two_again.shape(), info, SEED) is two_again


@pytest.fixture(scope="module")
def uneven(tmp_path_factory):
    """300 samples in 8 shards of 37 and one of 4: every slot's run of samples begins or ends inside a shard."""
    root = tmp_path_factory.mktemp("uneven")
    write_dataset(root, synthetic_samples(300, 6, seed=2, width=24, height=20), class_names(6), True, 37)
    return dataset_info(root, "train")


def test_runs_that_cut_shards_redeal_and_read_every_sample_of_the_epoch_once(uneven):
    """2 ranks x 2 workers, batch 8: 300 // 16 = 18 batches per rank (9 per worker), 288 samples an epoch,
    12 left to no one; runs start and end inside shards. Re-dealt on one rank at step 5, epoch 0 is the
    uninterrupted run's 288 samples with their crops; back on two ranks mid-carry, still."""
    assert uneven.shard_counts == [37] * 8 + [4]
    two = Deal(2, WORKERS, BATCH, 1)
    ranges = [
        deal_module.slot_range(uneven.shard_counts, SEED, 0, 2, WORKERS, r, w, BATCH)
        for r in (0, 1)
        for w in (0, 1)
    ]
    assert [n for _, _, n in ranges] == [72] * 4 and any(passed for _, passed, _ in ranges)
    straight = run(uneven, two, 0, 18)
    epoch0 = samples(merged(straight), 0)
    assert len(epoch0) == 288

    before = run(uneven, two, 0, 5)
    one = continue_deal(two, 5, (1, WORKERS, BATCH, 2), uneven, SEED)
    assert [p.batch for slot in one.carry for p in slot] and all(
        p.batch == BATCH for slot in one.carry for p in slot
    )
    assert sum(p.take for slot in one.carry for p in slot) == 288 - 5 * 16
    one = continue_deal(
        Deal.from_dict(json.loads(json.dumps(two.to_dict()))), 5, (1, WORKERS, BATCH, 2), uneven, SEED
    )
    after = run(uneven, one, 5, 13)  # the carry's 26 batches
    seen0 = samples(merged(before, after), 0)
    assert seen0.keys() == epoch0.keys()
    for key, image in seen0.items():
        assert torch.equal(image, epoch0[key]), key

    two_again = continue_deal(one, 9, (2, WORKERS, BATCH, 1), uneven, SEED)  # 8 of the carry's 26 made
    later = run(uneven, two_again, 9, 9)
    assert samples(merged(before, [after[0][:8]], later), 0).keys() == epoch0.keys()


def test_one_rank_to_two_continues_the_epoch_on_both(info):
    one = Deal(1, WORKERS, BATCH, 2)
    straight = run(info, one, 0, 20)
    epoch0 = samples(merged(straight), 0)
    before = run(info, one, 0, 3)  # 6 of epoch 0's 40 batches
    two = continue_deal(one, 3, (2, WORKERS, BATCH, 1), info, SEED)
    after = run(info, two, 3, 20)  # 20 batches per rank
    per_rank = [Counter(b["epoch"] for b in rank) for rank in after]
    assert per_rank == [Counter({0: 17, 1: 3}), Counter({0: 17, 1: 3})]  # 34 carried batches, split evenly
    assert samples(merged(before, after), 0).keys() == epoch0.keys()
    samples(merged(after), 1)  # no sample twice in the new epoch either

    # Back to one rank at step 21 (18 batches per rank since the switch, 9 per worker): the first workers
    # (9 carried batches) stand at the start of epoch 1, the second ones (8) are one batch into it. So
    # epoch 1 has begun: its rest on every slot is carried too, and epoch 0 and epoch 1 stay whole.
    assert [sum(p.take for p in slot) // BATCH for slot in two.carry] == [9, 8, 9, 8]
    one_again = continue_deal(two, 21, (1, WORKERS, BATCH, 2), info, SEED)
    assert one_again.first_epoch == 2
    mid = [rank[:18] for rank in after]
    later = run(info, one_again, 21, 40)
    assert samples(merged(before, mid, later), 0).keys() == epoch0.keys()
    assert len(samples(merged(mid, later), 1)) == 320


def test_a_new_micro_batch_leaves_out_less_than_one_batch(info):
    two = Deal(2, WORKERS, BATCH, 1)
    before = run(info, two, 0, 7)
    other = continue_deal(two, 7, (1, WORKERS, 12, 1), info, SEED)  # 208 carried: 17 batches of 12, 4 out
    assert sum(p.take for slot in other.carry for p in slot) == 17 * 12
    data = DataConfig(train="-", batch_size=12, num_workers=WORKERS, shuffle_buffer=16)
    after = list(
        itertools.islice(
            make_train_loader(info, data, rank=0, world_size=1, img_size=16, seed=SEED, deal=other), 17
        )
    )
    keys = [k for b in merged(before) for k in b["key"]] + [k for b in after for k in b["key"]]
    assert len(keys) == len(set(keys)) == 320 - 4
    assert all(b["epoch"] == 0 for b in after)


def test_a_deal_survives_json_and_an_uncounted_stream_cannot_redeal(info):
    one = continue_deal(Deal(2, WORKERS, BATCH, 1), 7, (1, WORKERS, BATCH, 2), info, SEED)
    assert Deal.from_dict(json.loads(json.dumps(one.to_dict()))) == one
    bare = dataclasses.replace(info, shard_counts=None)  # shards without a manifest: no exact counts
    with pytest.raises(DatasetError, match=r"2 ranks x 2 workers .* 1 x 2 .*manifest"):
        continue_deal(Deal(2, WORKERS, BATCH, 1), 7, (1, WORKERS, BATCH, 2), bare, SEED)
    fresh = continue_deal(Deal(2, WORKERS, BATCH, 1), 7, (1, WORKERS, BATCH, 2), bare, SEED, resampled=True)
    assert (fresh.base_step, fresh.carry) == (7, ())


def test_a_deal_saved_with_shard_urls_reads_as_the_same_stream(info):
    """A checkpoint of before pieces named their slot-epoch listed each piece's shard URLs and keys (and
    dealt its epochs in whole shards: a record without `epochs` goes on so)."""
    two = Deal(2, WORKERS, BATCH, 1, epochs=SHARDS)
    one = dataclasses.replace(continue_deal(two, 7, (1, WORKERS, BATCH, 2), info, SEED), epochs=SHARDS)
    old = {
        **{k: v for k, v in one.to_dict().items() if k not in ("carry", "epochs")},
        "carry": [
            [
                {
                    "urls": [info.urls[i] for i in p.extent(info)[0]],
                    "shuffle_key": list(p.shuffle_key),
                    "augment_key": list(p.augment_key),
                    "epoch": p.epoch,
                    "skip": p.skip,
                    "take": p.take,
                }
                for p in slot
            ]
            for slot in one.carry
        ],
    }
    read = Deal.from_dict(json.loads(json.dumps(old)), info.urls)
    assert [[p.extent(info) for p in slot] for slot in read.carry] == [
        [p.extent(info) for p in slot] for slot in one.carry
    ]
    assert read.epochs == SHARDS
    a, b = run(info, read, 7, 14), run(info, one, 7, 14)  # the carry's 26 batches and two of epoch 1
    assert [x["key"] for x in a[0]] == [x["key"] for x in b[0]]
    assert all(torch.equal(x["image"], y["image"]) for x, y in zip(a[0], b[0]))
    assert Deal.from_dict(json.loads(json.dumps(read.to_dict()))) == read  # and saved again as a table

    # the table of before sample-exact epochs: 8 columns, no batch
    v1 = {k: v for k, v in one.to_dict().items() if k != "epochs"}
    table = deal_module._unpack(v1["carry"]["pieces"], 9)
    assert (table[:, 8] == 0).all()
    v1["carry"] = {
        **v1["carry"],
        "format": "slot-epochs/1",
        "columns": v1["carry"]["columns"][:8],
        "pieces": deal_module._pack(table[:, :8]),
    }
    assert Deal.from_dict(json.loads(json.dumps(v1))) == one

    with pytest.raises(ValueError, match="shard_urls"):
        Deal.from_dict(old)
    moved = [u.replace("redeal", "elsewhere") for u in info.urls]
    with pytest.raises(DatasetError, match=r"names shard .*redeal.* does not list"):
        Deal.from_dict(old, moved)


def test_the_deal_record_is_small_whatever_the_number_of_shards():
    """1,024 ranks x 8 workers re-dealt on 1,016 (a node lost): the record names slot-epochs, not shards, so
    it grows with the slots (a piece per old slot, cut at most once per new slot), not with the shards: far
    under 1 MB at 100k shards."""
    for shards in (10_000, 100_000):
        counts = [2900 + (i * 7919) % 200 for i in range(shards)]
        big = DatasetInfo(
            [f"s3://corpus/train/shard-{i:06d}.tar" for i in range(shards)], 18291, True, sum(counts), counts
        )
        deal = continue_deal(Deal(1024, 8, 16, 1), 1000, (1016, 8, 16, 1), big, SEED)
        record = json.dumps(deal.to_dict())
        assert Deal.from_dict(json.loads(record)) == deal
        pieces = sum(len(slot) for slot in deal.carry)
        assert len(deal.carry) == 1016 * 8 and pieces <= 1024 * 8 * 2 + 1016 * 8
        assert len(record) < 16 * pieces < 1_000_000, (shards, len(record), pieces)
