"""Asynchronous checkpoint saves (pipeline/train/saving.py): the step waits for a host copy only, the tag
is complete only once every rank's files are written and uploaded, and a failure or a kill leaves the
previous checkpoint the newest."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from collections import OrderedDict, namedtuple

import pytest
import torch
from conftest import ROOT, torchrun

from data_prep.storage import Store
from pipeline.train.saving import host_copy


@pytest.mark.unit
def test_a_host_copy_is_its_own_and_keeps_the_containers():
    base = torch.arange(12, dtype=torch.float32)
    Pair = namedtuple("Pair", "a b")
    state = OrderedDict(
        view=base[4:8],
        nested={"list": [base[:2], 3], "pair": Pair(base[8:], "x"), "bf16": base.to(torch.bfloat16)},
        step=7,
        shapes={"w": torch.Size([3, 4])},  # ZeRO-3's param_shapes: zero_to_fp32 calls .numel() on them
    )
    copy = host_copy(state)
    base.add_(100)  # training goes on in place: the copy must not see it
    state["nested"]["list"].append("later")
    assert type(copy) is OrderedDict and list(copy) == ["view", "nested", "step", "shapes"]
    assert type(copy["shapes"]["w"]) is torch.Size and copy["shapes"]["w"].numel() == 12
    assert copy["view"].tolist() == [4, 5, 6, 7]
    assert copy["view"].untyped_storage().nbytes() == 4 * 4  # its own storage, not the whole base's
    assert copy["nested"]["list"][0].tolist() == [0, 1] and copy["nested"]["list"][1:] == [3]
    assert isinstance(copy["nested"]["pair"], Pair) and copy["nested"]["pair"].a.tolist() == [8, 9, 10, 11]
    assert copy["nested"]["bf16"].dtype == torch.bfloat16 and copy["nested"]["bf16"][0].item() == 0
    assert copy["step"] == 7


@pytest.mark.unit
def test_files_still_being_written_are_no_ranks_own(tmp_path):
    """Which rank lists (hashes, records, uploads) which file of a tag on a disk the ranks share. Another
    rank's write in progress is nobody's: rank 0 took safetensors' temporary of rank 1's EMA for its own and
    the save failed when it was renamed away (seen: FileNotFoundError on step_00000004/.tmpAmNrJx)."""
    from safetensors.torch import save_file

    from pipeline.train.tag import owned_by

    with pytest.raises(Exception, match=r"/\.tmp\w{6}"):  # where safetensors writes before its rename
        save_file({"w": torch.zeros(2)}, str(tmp_path / "missing" / "ema_rank_1_fp32.safetensors"))
    owners = {
        "mp_rank_00_model_states.pt": [0],
        "zero_pp_rank_0_mp_rank_00_optim_states.pt": [0],
        "zero_pp_rank_2_mp_rank_00_optim_states.pt": [2],
        "rank_3.pt": [3],
        "ema_rank_1_fp32.safetensors": [1],
        ".tmpAmNrJx": [],
        "ema_rank_1_fp32.safetensors.tmp": [],
        "rank_0.pt.tmp": [],
    }
    for name, expected in owners.items():
        assert [r for r in range(4) if owned_by(name, r, world_size=4)] == expected, name


@pytest.mark.unit
@pytest.mark.parametrize(
    "record, why",
    [
        (b"\xff\xfe torn", "not readable JSON (UnicodeDecodeError)"),  # not even UTF-8: it raised before
        (b'{"step": 4', "not readable JSON (JSONDecodeError)"),
        (b"[1, 2]", "no file list"),  # JSON, but not a record: it raised (a list has no "files")
    ],
)
def test_a_corrupted_complete_record_makes_its_tag_unloadable_not_the_resume_fail(tmp_path, record, why):
    """A COMPLETE.json that a failing disk or a torn copy corrupted: the tag is skipped (its reason given, an
    older tag tried), where a record that was not UTF-8 or not an object raised on that node instead."""
    from pipeline.train.checkpoint import verify
    from pipeline.train.tag import COMPLETE, read_record

    tag = tmp_path / "step_00000004"
    tag.mkdir()
    (tag / COMPLETE).write_bytes(record)
    assert why in verify(tag, rank=0, world_size=2)
    if not record.startswith(b"["):
        assert read_record(tag) is None


@pytest.mark.dist
@pytest.mark.slow
def test_a_save_runs_beside_training_and_only_a_complete_one_is_resumed(s3, tmp_path):
    """The real ZeRO-3 bf16 engine on 2 ranks, saving through a local S3 server: while a save's upload is
    held, `save` has returned, nothing is marked complete and training goes on; released, the checkpoint
    holds the weights of the step it was taken at. A refused upload on one rank fails that save on both
    ranks and leaves `latest` where it was; ranks killed during an upload resume from the save before."""
    uri = s3("async")
    out = tmp_path / "go"
    torchrun("tests/scripts/async_save.py", "go", str(out), uri)
    for rank in (0, 1):
        seen = json.loads((out / f"{rank}-go.json").read_text())
        assert seen["in_flight"] is True
        assert seen["complete_while_held"] == {"local": False, "stored": False}
        assert seen["moved"] is (True if rank == 0 else None)  # two steps ran while the save was held
        assert seen["complete_after"] == {"local": True, "stored": True}
        assert "step_00000003" in seen["failure"] and "rank 1: OSError" in seen["failure"], seen["failure"]
        assert seen["complete_failed"] == {"local": False, "stored": False}
        assert seen["latest"] == ["step_00000001", "step_00000001"]
        assert seen["restored"] == [1, {"step": 1}]
        assert seen["restored_is_step_1"] is (
            True if rank == 0 else None
        )  # the consolidated weights: rank 0's

    out, uri = tmp_path / "crash", s3("crash")
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node=2"]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(
        [*cmd, "tests/scripts/async_save.py", "crash", str(out), uri],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=600,
    )
    assert proc.returncode != 0 and "SIGKILL" in proc.stderr, proc.stderr[-3000:]
    held = out / "checkpoints" / "step_00000002"
    assert any(held.glob("zero_pp_rank_*")) and not (held / "COMPLETE.json").exists()  # written, cut short
    store = Store(uri)
    assert store.read_text("latest") == "step_00000001" and not store.exists("step_00000002/COMPLETE.json")
    torchrun("tests/scripts/async_save.py", "resume", str(out), uri)
    for rank in (0, 1):
        assert json.loads((out / f"{rank}-resume.json").read_text())["restored"] == [1, {"step": 1}]
