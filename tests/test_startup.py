"""A stage's start-up without all-to-all (#27): the dataset's manifest is read by rank 0 alone and handed to
the others as compact arrays; the newest checkpoint is agreed by gathering tag names and broadcasting the
chosen record.

    .venv/bin/python -m pytest tests/test_startup.py -q
"""

from __future__ import annotations

import json
import os
import pickle
import socket
from datetime import timedelta
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from data_prep.layout import DatasetError
from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset
from pipeline.config import validate_config
from pipeline.data.sources import DatasetInfo, dataset_info
from pipeline.distributed import DistContext, shutdown_distributed
from pipeline.stage import Stage
from pipeline.train import checkpoint
from pipeline.train.tag import COMPLETE, tag_for


@pytest.fixture(scope="module")
def dataset(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("startup") / "data"
    write_dataset(root, synthetic_samples(48, 5, seed=2, width=16, height=16), class_names(5), False, 8)
    return root


@pytest.mark.unit
def test_a_dataset_info_packs_into_a_template_and_int32_counts_and_back(dataset):
    info = dataset_info(dataset, "train")
    packed = info.packed()
    assert isinstance(packed["urls"], tuple) and packed["urls"][2] == len(info.urls)  # numbered template
    assert DatasetInfo.unpacked(pickle.loads(pickle.dumps(packed))) == info

    # At the scale of the corpus: 100k shards on a bucket with an endpoint in each URL's query.
    urls = [
        f"s3://corpus/jft/train/shard-{i:06d}.tar?endpoint_override=http://127.0.0.1:9000"
        for i in range(100_000)
    ]
    big = DatasetInfo(urls, 18291, True, 300_000_000, [3000 + i % 7 for i in range(100_000)])
    wire = pickle.dumps(big.packed())
    assert len(wire) < 420_000  # the counts' 400 kB and a template; the manifest itself is about 21 MB
    assert DatasetInfo.unpacked(pickle.loads(wire)) == big

    # URLs that follow no template (a gap, a list of anything): one compressed text; no counts: None.
    odd = DatasetInfo([*urls[:10], *urls[11:20], "pipe:cat /x/a.tar"], 5, False, None, None)
    assert isinstance(odd.packed()["urls"], bytes)
    assert DatasetInfo.unpacked(odd.packed()) == odd
    one = DatasetInfo(urls[:1], 5, False, 3000, [3000])
    assert DatasetInfo.unpacked(one.packed()) == one


def _rank(rank: int, store: str, root: str, ckpts: str, out: str, refused: int) -> None:
    dist.init_process_group(
        "gloo", init_method=f"file://{store}", rank=rank, world_size=2, timeout=timedelta(seconds=60)
    )
    result = _on_rank(rank, root, ckpts)
    result["tracking"] = _open_tracking(rank, f"http://127.0.0.1:{refused}", out)
    Path(out, f"rank{rank}.json").write_text(json.dumps(result))
    shutdown_distributed()  # with nothing left holding the group, so its threads end before the exit


def _on_rank(rank: int, root: str, ckpts: str) -> dict:
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), dist.group.WORLD)
    result: dict = {}
    # Rank 1's data.train names a folder its node lacks: the stage works all the same, as rank 1 never reads it.
    train = root if rank == 0 else f"{root}-not-on-this-node"
    info = Stage(validate_config({"name": "s", "data": {"train": train}}), ctx).dataset("train")
    result["info"] = [info.urls, info.shard_counts, info.num_classes, info.multi_label, info.num_samples]
    # A dataset rank 0 cannot read: an error on every rank, none waiting.
    try:
        Stage(validate_config({"name": "s", "data": {"train": f"{root}-absent"}}), ctx).dataset("train")
    except DatasetError as exc:
        result["error"] = str(exc)
    # Each rank's disk holds another newest complete tag; every rank gets the newest of all, rank 1's.
    result["record"] = checkpoint.newest_record(Path(ckpts, f"node{rank}"), None, rank, dist.group.WORLD)
    result["none"] = checkpoint.newest_record(Path(ckpts, "nowhere"), None, rank, dist.group.WORLD)
    return result


def _open_tracking(rank: int, uri: str, run_dir: str) -> str:
    """What a stage whose MLflow server refuses connections does on this rank when opening its run."""
    os.environ["MLFLOW_HTTP_REQUEST_MAX_RETRIES"] = "0"  # refused at once, not after minutes of retries
    ctx = DistContext(rank, 2, rank, torch.device("cpu"), dist.group.WORLD)
    cfg = validate_config(
        {"name": "s", "run_dir": run_dir, "data": {"train": run_dir}, "tracking": {"uri": uri}}
    )
    try:
        with Stage(cfg, ctx).tracking({}):
            return "opened"
    except Exception as exc:
        return f"{type(exc).__name__}: {exc}"


@pytest.mark.dist
@pytest.mark.timeout(180)  # generous: spawning two torch processes on a loaded 2-core machine
def test_rank_zero_reads_the_manifest_and_the_newest_record_for_both_ranks(dataset, tmp_path):
    ckpts = tmp_path / "ckpts"
    for node, tags in (("node0", {10: True, 5: True}), ("node1", {20: True, 30: False})):
        for step, complete in tags.items():
            tag = ckpts / node / tag_for(step)
            tag.mkdir(parents=True)
            if complete:  # step 30 on node 1 was cut short: no COMPLETE.json
                (tag / COMPLETE).write_text(json.dumps({"step": step, "world_size": 2, "files": {}}))
    with socket.socket() as refusing:  # bound, never listening: a connection to it is refused
        refusing.bind(("127.0.0.1", 0))
        port = refusing.getsockname()[1]
        args = (str(tmp_path / "store"), str(dataset), str(ckpts), str(tmp_path), port)
        mp.spawn(_rank, args=args, nprocs=2, join=True)
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in range(2)]
    info = dataset_info(dataset, "train")
    expected = [info.urls, info.shard_counts, info.num_classes, info.multi_label, info.num_samples]
    assert [r["info"] for r in ranks] == [expected, expected]
    assert "data-absent" in ranks[0]["error"] and "manifest" in ranks[0]["error"]
    assert ranks[1]["error"].startswith("rank 1: rank 0 could not read split 'train'")
    assert "data-absent" in ranks[1]["error"]
    assert [r["record"] for r in ranks] == [{"step": 20, "world_size": 2, "files": {}}] * 2
    assert [r["none"] for r in ranks] == [None, None]
    # An MLflow server out of reach when the stage opens its run: rank 0's error on rank 0, and on rank 1 an
    # error naming it (before, rank 1 went on into training and waited in its first collective).
    assert (
        ranks[0]["tracking"].startswith("MlflowException: API request to")
        and str(port) in ranks[0]["tracking"]
    )
    assert ranks[1]["tracking"].startswith(
        f"RuntimeError: rank 1: rank 0 could not open the stage's MLflow run at http://127.0.0.1:{port}: "
        "MlflowException: API request to"
    )
