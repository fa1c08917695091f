import os
import shutil
import tempfile

import pytest

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "token")


@pytest.fixture(scope="session")
def ray_cluster():
    """A local Ray head plus a second node (token auth on, 127.0.0.1), shared by every Ray test."""
    from cluster import local

    temp_dir = tempfile.mkdtemp(prefix="vpray", dir="/tmp")  # short: Ray's socket paths have a length limit
    cluster = local.start_head(temp_dir, num_cpus=2)
    local.add_worker_node(cluster, num_cpus=2)
    yield cluster
    local.stop(cluster)
    shutil.rmtree(temp_dir, ignore_errors=True)
    shutil.rmtree(f"{temp_dir}-worker1", ignore_errors=True)


@pytest.fixture(scope="session")
def smoke_dataset(tmp_path_factory):
    """The smoke corpus (320 multi-label images, 8 shards), written once per session."""
    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset

    root = tmp_path_factory.mktemp("smoke_dataset")
    write_dataset(root, synthetic_samples(320, 8, seed=0, width=48, height=40), class_names(8), True, 40)
    return root
