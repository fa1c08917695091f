"""vitpipe submit's pre-upload checks (no cluster needed)."""

import sys
from pathlib import Path

import pytest

from cluster import submit

pytestmark = pytest.mark.unit


def test_excluded_folders_do_not_count_and_an_oversized_working_dir_is_refused(tmp_path):
    (tmp_path / "pipeline").mkdir()
    (tmp_path / "pipeline" / "code.py").write_text("x = 1\n")
    for excluded in (".git", ".venv", "data", "runs"):
        (tmp_path / excluded).mkdir()
        (tmp_path / excluded / "big.bin").write_bytes(b"\0" * 4096)
    (tmp_path / "mlflow.db").write_bytes(b"\0" * 4096)
    assert submit.check_upload(tmp_path) == len("x = 1\n")
    (tmp_path / "notes").mkdir()
    (tmp_path / "notes" / "huge.bin").write_bytes(b"\0" * 3000)
    with pytest.raises(submit.SubmitError, match=r"over the Jobs API limit.*largest: notes"):
        submit.check_upload(tmp_path, limit=2048)


def test_a_bad_config_fails_before_any_upload(tmp_path, monkeypatch):
    def no_client(address):  # submit must not reach the cluster with a broken config
        raise AssertionError("contacted the cluster")

    monkeypatch.setattr(submit, "client", no_client)
    from pipeline.config import ConfigError

    root = Path(__file__).parents[1]
    with pytest.raises(ConfigError, match=r"optim\.lrr: unknown key"):
        submit.submit(
            str(root / "configs/experiments/smoke.yaml"),
            ["optim.lrr=1"],
            None,
            python=sys.executable,
            root=root,
        )
    assert submit.submission_id("demo").startswith("demo-")
