"""Object storage for checkpoints and exports, against a real S3 protocol server (moto, on 127.0.0.1)."""

import json
import os
from pathlib import Path

import pytest
import torch

from data_prep.storage import Store, child, is_uri

SMOKE = Path(__file__).parents[1] / "configs/experiments/smoke.yaml"


@pytest.mark.unit
def test_store_round_trips_files_and_folders_on_s3(s3, tmp_path):
    store = Store(s3("unit"))
    src = tmp_path / "src"
    src.mkdir()
    (src / "a.pt").write_bytes(os.urandom(3000))
    (src / "b.json").write_text('{"x": 1}')
    for f in src.iterdir():
        store.upload(f, f"step_00000001/{f.name}")
    store.write_text("latest", "step_00000001")
    assert store.list_dirs() == ["step_00000001"]
    assert store.list_files("step_00000001") == ["a.pt", "b.json"]
    assert store.read_text("latest") == "step_00000001"
    got = store.download_dir("step_00000001", tmp_path / "dst" / "step_00000001")
    assert {p.name: p.read_bytes() for p in got.iterdir()} == {p.name: p.read_bytes() for p in src.iterdir()}
    # No temporary folder is left beside the download.
    assert [p.name for p in (tmp_path / "dst").iterdir()] == ["step_00000001"]
    store.delete_dir("step_00000001")
    assert store.list_dirs() == [] and not store.exists("step_00000001")
    assert store.list_dirs("nothing/here") == []


@pytest.mark.unit
def test_a_node_fetches_what_its_ranks_read_and_keeps_what_it_holds(s3, tmp_path):
    """transfer.fetch at the world size that saved the tag: ranks 2 and 3 of 4 get their own ZeRO
    partitions, RNG states and EMA shares and the model states, not ranks 0-1's; a file already held with
    the right bytes is not fetched again, a damaged one is; on another world size, the model states."""
    import hashlib

    from pipeline.train.tag import COMPLETE, files_read
    from pipeline.train.transfer import fetch

    store = Store(s3("fetch"))
    names = [f"zero_pp_rank_{r}_mp_rank_00_optim_states.pt" for r in range(4)]
    names += [f"rank_{r}.pt" for r in range(4)] + [f"ema_rank_{r}_fp32.safetensors" for r in range(4)]
    names += ["mp_rank_00_model_states.pt"]
    blobs = {n: os.urandom(1000 + 10 * i) for i, n in enumerate(names)}
    for n, data in blobs.items():
        store.write_bytes(f"step_00000005/{n}", data)
    files = {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in blobs.items()}
    record = {"step": 5, "world_size": 4, "files": files}
    store.write_text(f"step_00000005/{COMPLETE}", json.dumps(record))
    node = sorted(n for n in names if "rank_2" in n or "rank_3" in n or n.startswith("mp_"))
    assert sorted(files_read(record, [2, 3], 4)) == node
    # On another world size a node reads whole only the model states (and rank 0's state where it runs
    # rank 0): its ranks read their parts of the optimizer states in ranges (pipeline.train.reshard).
    assert files_read(record, [2, 3], 2) == ["mp_rank_00_model_states.pt"]
    assert files_read(record, [0], 2) == ["mp_rank_00_model_states.pt", "rank_0.pt"]
    assert sorted(files_read(record, [2, 3], 2, whole=True)) == sorted(names)  # DeepSpeed's conversion

    tag = tmp_path / "ckpt" / "step_00000005"
    tag.mkdir(parents=True)
    (tag / "rank_2.pt").write_bytes(blobs["rank_2.pt"])  # held already
    (tag / "rank_3.pt").write_bytes(b"x" * files["rank_3.pt"]["bytes"])  # the right size, damaged
    fetched, whole = fetch(store, tag, [2, 3], 4)
    assert whole == sum(len(d) for d in blobs.values())
    assert fetched == sum(len(blobs[n]) for n in node if n != "rank_2.pt")
    assert sorted(p.name for p in tag.iterdir()) == sorted([*node, COMPLETE])
    assert all((tag / n).read_bytes() == blobs[n] for n in node)
    assert json.loads((tag / COMPLETE).read_text()) == record


@pytest.mark.unit
def test_a_fetch_that_fails_is_logged_and_leaves_the_tag_unloadable_here(s3, tmp_path, caplog):
    """A stored tag whose COMPLETE.json lists an object the bucket no longer holds (a lifecycle rule, a
    partial delete): the node's fetch logs it and returns (it raised, and that rank left while the others
    waited at the barrier after the fetch); the tag stays without COMPLETE.json on this disk, so every rank
    agrees to try an older one."""
    import hashlib

    from pipeline.train.checkpoint import verify
    from pipeline.train.tag import COMPLETE
    from pipeline.train.transfer import fetch_or_log

    store = Store(s3("gone"))
    blobs = {"rank_0.pt": os.urandom(100), "mp_rank_00_model_states.pt": os.urandom(200)}
    files = {n: {"bytes": len(d), "sha256": hashlib.sha256(d).hexdigest()} for n, d in blobs.items()}
    store.write_bytes("step_00000005/rank_0.pt", blobs["rank_0.pt"])  # the model states are gone
    store.write_text(f"step_00000005/{COMPLETE}", json.dumps({"step": 5, "world_size": 1, "files": files}))
    tag = tmp_path / "ckpt" / "step_00000005"
    with caplog.at_level("WARNING", logger="pipeline.train.transfer"):
        assert not fetch_or_log(store, tag, 0, [0], 1)
    assert f"rank 0: could not fetch checkpoint {tag} from {store.describe()}" in caplog.text
    assert verify(tag, 0, 1) == "no COMPLETE.json (the save was cut short)"
    store.write_bytes("step_00000005/mp_rank_00_model_states.pt", blobs["mp_rank_00_model_states.pt"])
    assert fetch_or_log(store, tag, 0, [0], 1) and verify(tag, 0, 1) is None  # once whole, it loads


@pytest.mark.unit
def test_uri_helpers_keep_the_query_and_name_unknown_schemes():
    assert (
        child("s3://b/p?endpoint_override=h:1", "pretrain", "export")
        == "s3://b/p/pretrain/export?endpoint_override=h:1"
    )
    assert child("gs://b/p/", "x") == "gs://b/p/x"
    assert is_uri("s3://b/p") and is_uri("file:///tmp/x") and not is_uri("runs/demo") and not is_uri(None)
    with pytest.raises(ValueError, match="nosuchscheme://"):
        Store("nosuchscheme://bucket/x")


@pytest.mark.unit
def test_multi_stage_storage_sets_each_stage_uri_and_chains_exports(tmp_path):
    from pipeline.config import load_experiment

    cfg = tmp_path / "exp.yaml"
    cfg.write_text(
        "name: exp\nstorage: s3://bucket/runs/{name}?region=eu-west-1\n"
        "stages:\n  pretrain: {data: {train: d}}\n  finetune: {data: {train: d}, model: {init_from: pretrain}}\n"
    )
    exp = load_experiment(cfg)
    (_, pre), (_, fine) = exp.stages
    assert pre.checkpoint.uri == "s3://bucket/runs/exp/pretrain?region=eu-west-1"
    assert fine.model.init_from == "s3://bucket/runs/exp/pretrain/export?region=eu-west-1"


@pytest.mark.dist
@pytest.mark.slow
def test_checkpoints_on_s3_resume_a_run_whose_local_directory_is_gone(s3, tmp_path):
    from conftest import (  # the same launcher and readers as the resume tests
        ema_weights,
        history,
        torchrun,
        weights,
    )

    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset
    from pipeline import exported

    data = tmp_path / "data"
    write_dataset(data, synthetic_samples(320, 8, seed=0, width=48, height=40), class_names(8), True, 40)
    uri = s3("exp/remote")
    torchrun("tests/scripts/remote_resume.py", str(tmp_path / "out"), str(data), uri)
    out = tmp_path / "out"
    straight, remote = history(out / "straight"), history(out / "remote")
    assert [s for s, _ in remote] == list(range(1, 9))
    assert remote == straight, "the run resumed from storage differs from the uninterrupted one"
    w_straight, w_remote = weights(out / "straight"), weights(out / "remote")
    assert all(torch.equal(w_straight[k], w_remote[k]) for k in w_straight)
    # The weight EMA came back from the stored step 4 with the rest (both ranks' shares).
    e_straight, e_remote = ema_weights(out / "straight"), ema_weights(out / "remote")
    assert all(torch.equal(e_straight[k], e_remote[k]) for k in e_straight)

    store = Store(uri)
    assert store.list_dirs() == ["export", "step_00000004", "step_00000008"]
    assert store.read_text("latest") == "step_00000008"
    record = json.loads(store.read_text("step_00000004/COMPLETE.json"))
    files = set(record["files"])
    # Both ranks' ZeRO-2 optimizer shards and RNG states landed in the one place, with the model states.
    assert {"rank_0.pt", "rank_1.pt", "mp_rank_00_model_states.pt"} <= files
    assert {"ema_rank_0_fp32.safetensors", "ema_rank_1_fp32.safetensors"} <= files
    assert any("zero_pp_rank_0_" in f for f in files) and any("zero_pp_rank_1_" in f for f in files)
    assert set(store.list_files("step_00000004")) == files | {"COMPLETE.json"}
    # Step 4 exists on this machine again only because resume downloaded it (every_steps=0 saves 8 only).
    local = out / "remote" / "checkpoints" / "step_00000004" / "COMPLETE.json"
    assert json.loads(local.read_text()) == record
    # The export is on storage too, and loads from there.
    state, meta = exported.load_exported(child(uri, "export"))
    assert all(torch.equal(state[k], w_remote[k]) for k in w_remote)
    assert meta["step"] == 8 and meta["ema"] == {"weights": "model_ema.safetensors", "decay": 0.9}
    # ... and its EMA beside it, which an eval stage of the stored export finds.
    stored_ema = exported.ema_weights(child(uri, "export"))
    assert stored_ema == child(uri, "export", "model_ema.safetensors")
    state, meta = exported.load_exported(stored_ema)
    assert all(torch.equal(state[k], e_remote[k]) for k in e_remote) and meta["step"] == 8


def test_a_stop_request_reaches_rank_0_through_the_bucket_and_is_cleared_before_the_next_run(s3, tmp_path):
    """`ray job stop` -> the driver writes STOP into the stage's run directory and its bucket; rank 0 on a node
    that does not share the driver's disk sees the stored one; the next submission clears both first."""
    import signal

    from cluster.run import _StopOnSigterm, clear_stop
    from pipeline.config import load_config
    from pipeline.train.loop import STOP_FILE, StopRequest

    uri = s3("exp/stopped")
    cfg = load_config(SMOKE, [f"run_dir={tmp_path / 'driver'}", f"checkpoint.uri={uri}"])
    elsewhere = tmp_path / "other_node" / STOP_FILE  # rank 0's run directory on another node's disk
    assert not StopRequest(elsewhere, Store(uri)).requested
    previous = signal.getsignal(signal.SIGTERM)
    try:
        stopper = _StopOnSigterm()
        stopper.stage = cfg
        stopper._handle(signal.SIGTERM, None)  # what `ray job stop`'s SIGTERM runs
    finally:
        signal.signal(signal.SIGTERM, previous)
    assert stopper.stopping and (cfg.run_path / STOP_FILE).is_file() and Store(uri).exists(STOP_FILE)
    assert StopRequest(elsewhere, Store(uri)).requested  # the stored request, from any node
    assert not StopRequest(elsewhere, None).requested  # a rank without the store sees only its own disk
    clear_stop(cfg)
    assert not (cfg.run_path / STOP_FILE).exists() and not Store(uri).exists(STOP_FILE)
    assert not StopRequest(elsewhere, Store(uri)).requested


@pytest.mark.unit
@pytest.mark.slow  # waits out pyarrow's retries (about 7 s a request), which make-test-fast need not
def test_a_bucket_out_of_reach_neither_ends_a_run_nor_changes_its_inputs(tmp_path, caplog, monkeypatch):
    """A bucket that cannot be reached (here: an endpoint where nothing listens; pyarrow's own retries take
    seconds). Rank 0's poll for a stored stop request logs it and goes on (it raised, ending a long run at
    the next log step); reading model.init_from's input statistics raises, naming the file (it fell back to
    the family's, on that rank alone)."""
    from pipeline.exported import export_preprocessing
    from pipeline.train.loop import STOP_FILE, StopRequest

    for key in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY"):  # else the SDK looks for credentials first
        monkeypatch.setenv(key, "testing")
    away = "s3://bucket/runs/pretrain?endpoint_override=127.0.0.1:9&scheme=http&region=us-east-1"
    with caplog.at_level("WARNING", logger="pipeline.train.loop"):
        assert not StopRequest(tmp_path / STOP_FILE, Store(away)).requested
    assert "could not check s3://bucket/runs/pretrain/STOP for a stop request" in caplog.text
    with pytest.raises(OSError, match=r"model\.init_from s3://bucket/runs/pretrain/export\?.*model\.json"):
        export_preprocessing(child(away, "export"))


@pytest.mark.unit
def test_a_stage_that_ran_on_other_nodes_is_marked_finished_on_this_disk_and_in_the_bucket(s3, tmp_path):
    """With storage, every worker of a stage may run on other nodes: the driver's disk then has no folder for
    the stage (seen in CI: an eval stage whose ranks were both on the second node). Its finish is recorded
    anyway, on this disk and in the bucket, and a resubmission finds it in either."""
    from cluster.run import DONE, finished, mark_finished
    from pipeline.config import load_config

    uri = s3("exp/elsewhere")
    cfg = load_config(SMOKE, [f"run_dir={tmp_path / 'never_made' / 'stage'}", f"checkpoint.uri={uri}"])
    assert not cfg.run_path.exists()
    mark_finished(cfg, {"stage": "smoke"})
    assert json.loads((cfg.run_path / DONE).read_text()) == {"stage": "smoke"} and Store(uri).exists(DONE)
    assert finished(cfg) == str(cfg.run_path / DONE)
    (cfg.run_path / DONE).unlink()  # this node's disk lost: the bucket still says so
    assert finished(cfg) == child(uri, DONE)
