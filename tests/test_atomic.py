"""The one atomic-write helper (data_prep.atomic) and the run-id file functions built on it."""

import json
import threading

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
@pytest.mark.parametrize("shared", [False, True])
def test_two_writers_of_one_file_at_once(tmp_path, shared):
    """Two processes writing the same file at the same moment (the nodes on one shared disk fetching the same
    checkpoint file): with one NAME.tmp the second truncates the first's data and one rename fails; `shared`
    writers each have their own temporary, the last rename wins, and the file is one writer's, whole."""
    path, both_open = tmp_path / "mp_rank_00_model_states.pt", threading.Barrier(2)
    errors = []

    def write(data: bytes) -> None:
        try:
            with atomic.writing(path, shared=shared) as tmp:
                with open(tmp, "wb") as f:
                    f.write(data[:4])
                    both_open.wait(timeout=10)  # both mid-write
                    f.write(data[4:])
        except OSError as exc:
            errors.append(exc)

    writers = [threading.Thread(target=write, args=(c * 1000,)) for c in (b"a", b"b")]
    for t in writers:
        t.start()
    for t in writers:
        t.join()
    if not shared:
        assert errors and isinstance(errors[0], FileNotFoundError), errors
        return
    assert not errors and path.read_bytes() in (b"a" * 1000, b"b" * 1000)
    assert [p.name for p in tmp_path.iterdir()] == [path.name]  # no temporary left
    plain = tmp_path / "plain"
    atomic.write_text(plain, "x")
    assert path.stat().st_mode == plain.stat().st_mode  # the umask's mode, as any other write's


@pytest.mark.unit
def test_run_id_file_round_trip(tmp_path):
    path = tmp_path / RUN_ID_FILE
    assert read_run_id(path) is None  # nothing tracked yet
    write_run_id(path, "abc123")
    assert read_run_id(path) == "abc123"
    assert json.loads(path.read_text()) == {"run_id": "abc123"}  # the format older runs wrote
