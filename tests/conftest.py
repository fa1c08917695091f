import os
import shutil
import tempfile

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "token")


@pytest.fixture(scope="session")
def ray_cluster():
    """One local Ray head (token auth on, 127.0.0.1) shared by every Ray test: a start costs ~10 s."""
    from cluster import local

    temp_dir = tempfile.mkdtemp(prefix="vpray", dir="/tmp")  # short: Ray's socket paths have a length limit
    cluster = local.start_head(temp_dir, num_cpus=4)
    yield cluster
    local.stop()
    shutil.rmtree(temp_dir, ignore_errors=True)
