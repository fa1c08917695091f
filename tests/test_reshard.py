"""Reading parts of a torch.save file in byte ranges (pipeline.train.reshard), on this node's disk and through a
real S3 protocol server (moto): what a rank resumed on another number of ranks reads of the saved optimizer
states. The whole path, bitwise, under every ZeRO stage: tests/test_world_size.py; the bytes a node reads from
the bucket: tests/test_multinode.py."""

import hashlib
import json

import pytest
import torch
from conftest import torchrun

from data_prep.storage import Store
from pipeline.train.reshard import (
    BLOCK,
    LayoutMismatch,
    Sources,
    TensorRef,
    TorchFile,
    _Piece,
    read_pieces,
    zero3_spans,
    zero12_spans,
)
from pipeline.train.tag import COMPLETE, tag_for


def _saved(tmp_path, store: Store | None, obj, name: str = "states.pt"):
    """`obj` torch.saved as a file of tag step_1, on this disk or only in the bucket; its Sources."""
    tag = tmp_path / "ckpt" / tag_for(1)
    tag.mkdir(parents=True)
    torch.save(obj, tag / name)
    data = (tag / name).read_bytes()
    record = {
        "world_size": 2,
        "files": {name: {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}},
    }
    if store is not None:
        store.upload(tag / name, f"{tag.name}/{name}")
        (tag / name).unlink()  # the node's disk lacks it: every byte comes from the bucket
    return Sources(tag, record, store)


@pytest.mark.unit
@pytest.mark.parametrize("where", ["disk", "bucket"])
def test_a_saved_tensor_is_read_in_parts_without_reading_the_rest(where, s3, tmp_path):
    torch.manual_seed(0)
    big, other = torch.randn(200_000), torch.randn(50_000, dtype=torch.float64)
    obj = {"optimizer_state_dict": {"state": {0: {"step": torch.tensor(7.0), "exp_avg": big}}, "x": [other]}}
    store = Store(s3("parts")) if where == "bucket" else None
    sources = _saved(tmp_path, store, obj)
    file = TorchFile(sources, "states.pt")
    state = file.obj["optimizer_state_dict"]
    ref = state["state"][0]["exp_avg"]
    assert isinstance(ref, TensorRef) and ref.shape == (200_000,) and ref.dtype == torch.float32
    assert state["x"][0].dtype == torch.float64 and state["x"][0].numel == 50_000
    assert torch.equal(file.tensor(state["state"][0]["step"]), torch.tensor(7.0))
    # Three ranges: two 200 elements apart (read as one), one far off (a request of its own).
    spans = [(1_000, 4_000), (4_200, 8_000), (150_000, 151_000)]
    dst = [torch.zeros(b - a) for a, b in spans]
    pieces = [_Piece(file, *file.byte_range(ref, a, b - a), d) for (a, b), d in zip(spans, dst)]
    metadata, requests = sources.bucket_bytes, sources.bucket_requests
    read_pieces(pieces)
    for (a, b), d in zip(spans, dst):
        assert torch.equal(d, big[a:b])
    if where == "bucket":
        # The metadata: the zip directory and the pickle (a block each), two local headers and the step.
        assert metadata <= 2 * BLOCK + 3 * 256 and requests == 5, (metadata, requests)
        # The data: the three ranges and the gap, in two requests; a tenth of the tensor's bytes at most.
        wanted = (8_000 - 1_000 + 151_000 - 150_000) * 4
        assert sources.bucket_bytes - metadata == wanted, sources.bucket_bytes - metadata
        assert sources.bucket_requests - requests == 2
    sources.close()


@pytest.mark.unit
def test_a_file_that_is_not_a_torch_save_is_a_layout_mismatch_naming_it(tmp_path):
    tag = tmp_path / tag_for(3)
    tag.mkdir()
    (tag / "zero_pp_rank_0_mp_rank_00_optim_states.pt").write_bytes(b"not a zip" * 100)
    record = {"world_size": 2, "files": {"zero_pp_rank_0_mp_rank_00_optim_states.pt": {"bytes": 900}}}
    with pytest.raises(
        LayoutMismatch, match=r"step_00000003/zero_pp_rank_0_mp_rank_00_optim_states.pt: not a"
    ):
        TorchFile(Sources(tag, record, None), "zero_pp_rank_0_mp_rank_00_optim_states.pt")
    with pytest.raises(LayoutMismatch, match=r"COMPLETE.json lists no rank_1.pt"):
        Sources(tag, record, None).size("rank_1.pt")


@pytest.mark.unit
def test_a_part_on_neither_this_disk_nor_a_bucket_says_what_to_set(tmp_path):
    record = {"world_size": 2, "files": {"zero_pp_rank_1_mp_rank_00_optim_states.pt": {"bytes": 10}}}
    sources = Sources(tmp_path / tag_for(2), record, None)
    with pytest.raises(
        FileNotFoundError, match=r"not on this node.s disk as COMPLETE.json lists it .* no checkpoint.uri"
    ):
        sources.read("zero_pp_rank_1_mp_rank_00_optim_states.pt", 0, 4)


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_layout_it_cannot_read_in_parts_falls_back_to_the_universal_conversion(smoke_dataset, tmp_path):
    """One rank finds the saved layout unknown (as under another DeepSpeed): every rank takes DeepSpeed's
    universal conversion instead, and the weights, moments and hyperparameters still load bit for bit."""
    from test_world_size import check, copy_stopped

    args = [str(tmp_path), str(smoke_dataset), "2"]
    torchrun("tests/scripts/world_size.py", "save", *args, "deepspeed.grad_accum=2", nproc=1)
    copy_stopped(tmp_path, (2,))
    out = torchrun("tests/scripts/reshard_fallback.py", "resume", *args)
    log = out.stdout + out.stderr
    assert "rank 1: checkpoint step_00000004 cannot be read in parts" in log, log[-3000:]
    assert "resharding it for 2 (universal checkpoint)" in log, log[-3000:]  # on every rank, not only 1
    check(tmp_path, 2, ranks_after=2, accum_after=1)
    record = json.loads((tmp_path / "zero2/switch/checkpoints/step_00000008" / COMPLETE).read_text())
    assert record["world_size"] == 2


@pytest.mark.dist
@pytest.mark.timeout(900)
def test_a_zero2_slice_saved_without_its_padding_loads_in_parts(smoke_dataset, tmp_path):
    """ZeRO-2 on 3 ranks pads each group to a multiple of 6 elements and saves the last rank's slice without
    its padding, shorter than the others: resumed on 1 rank, every rank still reads its part (no universal
    conversion), and the weights, moments, hyperparameters and step counts are the saved ones."""
    from test_world_size import adam_steps, copy_stopped, hyperparameters, moments

    args = [str(tmp_path), str(smoke_dataset), "2", "data.batch_size=8"]
    torchrun("tests/scripts/world_size.py", "save", *args, nproc=3)
    copy_stopped(tmp_path, (2,))
    saved = tmp_path / "zero2/switch/checkpoints/step_00000004"
    last = torch.load(saved / "zero_pp_rank_2_mp_rank_00_optim_states.pt", weights_only=False)
    assert any(last["optimizer_state_dict"]["group_paddings"]), "no padded slice: the case is not tested"
    before = moments(saved)
    out = torchrun("tests/scripts/world_size.py", "resume", *args, nproc=1)
    log = out.stdout + out.stderr
    assert log.count("saved by 3 ranks; resharding it for 1 (each rank reading its part)") == 2, log[-3000:]
    resaved = tmp_path / "zero2/at4/checkpoints/step_00000004"
    after = moments(resaved)
    assert before.keys() == after.keys() and all(torch.equal(before[k], after[k]) for k in before)
    assert hyperparameters(saved) == hyperparameters(resaved)
    final = tmp_path / "zero2/switch/checkpoints/step_00000008"
    record = json.loads((final / COMPLETE).read_text())
    assert (record["world_size"], record["grad_accum"], record["global_batch"]) == (1, 3, 24)
    assert set(adam_steps(final)) == {8.0}


@pytest.mark.unit
@pytest.mark.parametrize(("saved", "world"), [(4, 2), (2, 4), (1024, 1016), (3, 5), (7, 1)])
def test_the_ranks_parts_tile_the_saved_parts_exactly(saved, world):
    """Every element of a ZeRO-3 parameter (numels that divide by neither world size among them) and of a
    ZeRO-1/2 flat group is read by the one new rank that owns it, from the saved rank that held it, once."""
    for numel in (1, 5, 64, 1000, 12_289):
        old, new = -(-numel // saved), -(-numel // world)
        seen = []
        for rank in range(world):
            for span in zero3_spans(0, 100, numel, saved, world, rank):
                assert 0 <= span.at and span.at + span.count <= new
                first = span.saved * old + span.start - 100  # the element of the parameter it starts at
                assert first == rank * new + span.at and 0 <= span.start - 100 <= old - span.count
                seen += range(first, first + span.count)
        assert seen == list(range(numel)), numel
    old = 1_003  # a saved slice of a ZeRO-1/2 group; the new slices, padded, cover saved x old
    new = -(-saved * old // world)
    seen = []
    for rank in range(world):
        for span in zero12_spans(0, old, new, saved, rank):
            assert span.start + span.count <= old and span.at + span.count <= new
            assert span.saved * old + span.start == rank * new + span.at
            seen += range(rank * new + span.at, rank * new + span.at + span.count)
    assert seen == list(range(saved * old))


@pytest.mark.unit
def test_a_file_left_on_this_disk_by_another_save_is_read_from_the_bucket(s3, tmp_path):
    """A file of the listed size whose sha256 is not the listed one (left by a save that never completed) is
    not read: the bucket's is."""
    torch.manual_seed(1)
    obj = {"optimizer_state_dict": {"x": torch.randn(5_000)}}
    sources = _saved(tmp_path, Store(s3("stale")), obj)
    stale = sources.tag_dir / "states.pt"
    torch.save({"optimizer_state_dict": {"x": torch.randn(5_000)}}, stale)
    assert stale.stat().st_size == sources.size("states.pt")
    file = TorchFile(sources, "states.pt")
    ref = file.obj["optimizer_state_dict"]["x"]
    out = torch.zeros(100)
    read_pieces([_Piece(file, *file.byte_range(ref, 10, 100), out)])
    assert torch.equal(out, obj["optimizer_state_dict"]["x"][10:110]) and sources.bucket_requests > 0
    alone = Sources(sources.tag_dir, {"world_size": 2, "files": sources.files}, None)
    with pytest.raises(
        FileNotFoundError, match=r"states.pt: not on this node's disk as COMPLETE.json lists it"
    ):
        TorchFile(alone, "states.pt")
