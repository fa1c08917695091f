"""The one atomic-write helper (data_prep.atomic) and the run-id file functions built on it."""

import json

import pytest

from data_prep import atomic
from pipeline.tracking import RUN_ID_FILE, read_run_id, write_run_id


@pytest.mark.unit
def test_writes_replace_the_file_whole_and_leave_no_tmp(tmp_path):
    path = tmp_path / "a.json"
    atomic.write_json(path, {"x": 1}, indent=2)
    assert json.loads(path.read_text()) == {"x": 1}
    atomic.write_text(path, "new")
    assert path.read_text() == "new"
    atomic.write_bytes(path, b"\x00\x01")
    assert path.read_bytes() == b"\x00\x01"
    assert [p.name for p in tmp_path.iterdir()] == ["a.json"]


@pytest.mark.unit
def test_a_failed_write_keeps_the_old_file_and_removes_its_tmp(tmp_path):
    path = tmp_path / "model.safetensors"
    path.write_bytes(b"old")
    with pytest.raises(RuntimeError, match="writer died"):
        with atomic.writing(path) as tmp:
            tmp.write_bytes(b"half of the new")
            raise RuntimeError("writer died")
    assert path.read_bytes() == b"old"
    assert not atomic.tmp_path(path).exists()
    with pytest.raises(TypeError):  # not JSON-serialisable: nothing is written
        atomic.write_json(path, {"x": object()})
    assert path.read_bytes() == b"old"


@pytest.mark.unit
def test_run_id_file_round_trip(tmp_path):
    path = tmp_path / RUN_ID_FILE
    assert read_run_id(path) is None  # nothing tracked yet
    write_run_id(path, "abc123")
    assert read_run_id(path) == "abc123"
    assert json.loads(path.read_text()) == {"run_id": "abc123"}  # the format older runs wrote
