"""The shipped cluster configs parse and keep the security defaults (token auth, loopback dashboard)."""

from pathlib import Path

import pytest
import yaml

pytestmark = pytest.mark.unit
CONFIGS = Path(__file__).parents[1] / "configs" / "cluster"


def test_cluster_launcher_yaml():
    cfg = yaml.safe_load((CONFIGS / "aws-gpu.yaml").read_text())
    assert cfg["head_node_type"] in cfg["available_node_types"]
    assert "gpu_worker" in cfg["available_node_types"]
    start = " ".join(cfg["head_start_ray_commands"] + cfg["worker_start_ray_commands"])
    assert "RAY_AUTH_MODE=token" in start and "--dashboard-host=127.0.0.1" in start
    assert any("auth_token" in k for k in cfg["file_mounts"])


def test_kuberay_rayjob_manifest():
    job = yaml.safe_load((CONFIGS / "kuberay-rayjob.yaml").read_text())
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["entrypoint"].startswith("python -m cluster.run configs/experiments/")
    assert (Path(__file__).parents[1] / job["spec"]["entrypoint"].split()[3]).is_file()
    head = job["spec"]["rayClusterSpec"]["headGroupSpec"]
    assert head["rayStartParams"]["dashboard-host"] == "127.0.0.1"
    env = {e["name"]: e for e in head["template"]["spec"]["containers"][0]["env"]}
    assert env["RAY_AUTH_MODE"]["value"] == "token" and "secretKeyRef" in env["RAY_AUTH_TOKEN"]["valueFrom"]
