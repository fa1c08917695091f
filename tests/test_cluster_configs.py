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
    # The GPU nodes: one cluster placement group, EFA on all 32 network cards of a p5.48xlarge, and NCCL on
    # EFA in the environment the training workers inherit from their raylet.
    gpu = cfg["available_node_types"]["gpu_worker"]["node_config"]
    assert gpu["InstanceType"] == "p5.48xlarge" and gpu["Placement"]["GroupName"]
    cards = gpu["NetworkInterfaces"]
    assert [c["NetworkCardIndex"] for c in cards] == list(range(32)) and {
        c["InterfaceType"] for c in cards
    } == {"efa"}
    assert [c["DeviceIndex"] for c in cards] == [0] + [1] * 31
    worker_start = cfg["worker_start_ray_commands"][-1]
    assert (
        "FI_PROVIDER=efa" in worker_start
        and "ofi-nccl" in worker_start
        and "RAY_AUTH_MODE=token" in worker_start
    )


SCHEMA = Path(__file__).parent / "data" / "kuberay-v1.6.2-rayjob.schema.json.gz"


def _strict(schema):
    """The CRD's schema with unknown fields refused (the API server prunes them silently, `kubectl apply`
    refuses them): every object that lists its properties and does not keep unknown fields."""
    if isinstance(schema, dict):
        out = {k: _strict(v) for k, v in schema.items()}
        if "properties" in out and "additionalProperties" not in out:
            if not out.get("x-kubernetes-preserve-unknown-fields"):
                out["additionalProperties"] = False
        return out
    if isinstance(schema, list):
        return [_strict(v) for v in schema]
    return schema


def _manifests() -> dict[str, dict]:
    docs = list(yaml.safe_load_all((CONFIGS / "kuberay-rayjob.yaml").read_text()))
    return {d["kind"]: d for d in docs}


def test_kuberay_rayjob_validates_against_the_operators_crd():
    """The RayJob against KubeRay v1.6.2's CRD schema (tests/data: its openAPIV3Schema), unknown fields
    refused; a field the operator does not know fails here, naming its path."""
    import gzip
    import json

    import jsonschema

    vendored = json.loads(gzip.decompress(SCHEMA.read_bytes()))
    assert (
        "kuberay v1.6.2" in vendored["source"]
        and "operator v1.6.2" in (CONFIGS / "kuberay-rayjob.yaml").read_text()
    )
    validator = jsonschema.Draft7Validator(_strict(vendored["schema"]))
    job = _manifests()["RayJob"]
    errors = [f"{'.'.join(map(str, e.absolute_path))}: {e.message}" for e in validator.iter_errors(job)]
    assert not errors, errors
    broken = json.loads(json.dumps(job))
    broken["spec"]["rayClusterSpec"]["authOptions"]["mode"] = "tokens"
    broken["spec"]["rayClusterSpec"]["headGroupSpec"]["rayStartParam"] = {}
    found = " | ".join(e.message for e in validator.iter_errors(broken))
    assert "'tokens' is not one of" in found and "'rayStartParam' was unexpected" in found, found


def test_kuberay_manifests_keep_token_auth_and_the_network_closed():
    m = _manifests()
    assert set(m) == {"PersistentVolumeClaim", "RayJob", "Deployment", "Service", "NetworkPolicy"}
    job = m["RayJob"]
    assert job["kind"] == "RayJob" and job["apiVersion"] == "ray.io/v1"
    assert job["spec"]["entrypoint"].startswith("python -m cluster.run configs/experiments/")
    assert (Path(__file__).parents[1] / job["spec"]["entrypoint"].split()[3]).is_file()
    spec = job["spec"]["rayClusterSpec"]
    assert spec["authOptions"] == {"mode": "token", "secretName": "ray-auth-token"}
    assert job["spec"]["submissionMode"] == "SidecarMode"
    groups = [spec["headGroupSpec"], *spec["workerGroupSpecs"]]
    label = {"app.kubernetes.io/part-of": "vitpipe"}
    for group in groups:  # every Ray pod is one the NetworkPolicy selects, and mounts the shared volume
        pod = group["template"]
        assert pod["metadata"]["labels"] == label
        claims = {
            v["persistentVolumeClaim"]["claimName"]
            for v in pod["spec"]["volumes"]
            if "persistentVolumeClaim" in v
        }
        assert claims == {m["PersistentVolumeClaim"]["metadata"]["name"]}
        for container in pod["spec"]["containers"]:  # the token comes from authOptions, never inline
            assert not any(
                e.get("name") == "RAY_AUTH_TOKEN" and "value" in e for e in container.get("env", [])
            )
    assert m["PersistentVolumeClaim"]["spec"]["accessModes"] == ["ReadWriteMany"]
    for worker in spec["workerGroupSpecs"]:
        volumes = {v["name"]: v for v in worker["template"]["spec"]["volumes"]}
        mounts = {
            v["mountPath"]: v["name"]
            for c in worker["template"]["spec"]["containers"]
            for v in c["volumeMounts"]
        }
        assert volumes[mounts["/dev/shm"]]["emptyDir"]["medium"] == "Memory"  # loader workers' shared memory
    policy = m["NetworkPolicy"]["spec"]
    assert policy["podSelector"]["matchLabels"] == label and policy["policyTypes"] == ["Ingress"]
    for rule in policy["ingress"]:
        source = rule["from"][0]
        assert source.get("podSelector", {}).get("matchLabels") == label or rule["ports"] == [{"port": 8265}]
    assert m["Service"]["spec"]["type"] == "ClusterIP"  # nothing published outside the cluster
    assert m["Deployment"]["spec"]["template"]["metadata"]["labels"]["app.kubernetes.io/part-of"] == "vitpipe"


# ---------------------------------------------------------------------- one dependency list

ROOT = Path(__file__).parents[1]


def _pip_installs() -> list[tuple[str, list[str]]]:
    """(where, the arguments after `pip install`) of every install the cluster set-ups run: the launcher's
    setup_commands and the KubeRay image's RUN lines."""
    found = []
    launcher = yaml.safe_load((CONFIGS / "aws-gpu.yaml").read_text())
    for command in launcher["setup_commands"]:
        found += [("aws-gpu.yaml", part) for part in _installs_in(command)]
    dockerfile = (CONFIGS / "Dockerfile").read_text().replace("\\\n", " ")
    for line in dockerfile.splitlines():
        if line.startswith("RUN "):
            found += [("Dockerfile", part) for part in _installs_in(line.removeprefix("RUN "))]
    return found


def _installs_in(command: str) -> list[list[str]]:
    import shlex

    return [
        shlex.split(part.split("pip install", 1)[1]) for part in command.split("&&") if "pip install" in part
    ]


def _requirements(args: list[str]) -> list[str]:
    """The requirement arguments of `pip install ARGS` (options and their values dropped)."""
    out, skip = [], False
    for a in args:
        if skip:
            skip = False
        elif a in ("--index-url", "--extra-index-url", "-i"):
            skip = True
        elif not a.startswith("-"):
            out.append(a)
    return out


def _make_spec(name: str) -> str:
    import re

    return re.search(rf"^{name}_SPEC \?= (\S+)", (ROOT / "Makefile").read_text(), re.M).group(1)


def test_cluster_setups_install_from_the_projects_own_list():
    """Nothing hand-copied: torch and deepspeed pinned as the Makefile pins them (installed first, for the
    build order), everything else from this project's pyproject.toml, with extras it defines."""
    import tomllib

    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    extras = set(project["optional-dependencies"])
    pins = {_make_spec("TORCH"), _make_spec("DEEPSPEED")}
    installs = _pip_installs()
    assert {w for w, _ in installs} == {"aws-gpu.yaml", "Dockerfile"}
    projects = []
    for where, args in installs:
        for req in _requirements(args):
            if req in pins or req in ("--upgrade", "pip"):
                continue
            path, _, extra = req.partition("[")
            assert path.startswith("/") and not extra or set(extra.rstrip("]").split(",")) <= extras, (
                where,
                req,
            )
            assert path in ("/home/ubuntu/vitpipe", "/app"), f"{where}: installs {req!r}, not the project"
            projects.append((where, req))
    assert {w for w, _ in projects} == {"aws-gpu.yaml", "Dockerfile"}, projects
    launcher = yaml.safe_load((CONFIGS / "aws-gpu.yaml").read_text())
    assert launcher["file_mounts"]["/home/ubuntu/vitpipe"] == "."  # the copy setup_commands install
    ray = next(r for r in project["dependencies"] if r.startswith("ray["))
    assert "rayproject/ray:2.60.0-py311" in (CONFIGS / "Dockerfile").read_text() and ">=2.60,<2.61" in ray


@pytest.mark.slow
@pytest.mark.timeout(900)
def test_the_setup_steps_install_into_a_fresh_venv_and_every_module_imports(tmp_path):
    """The launcher's set-up replayed into a new venv: the CPU torch the Makefile pins in place of the CUDA
    build, deepspeed, then the project (without the `gpu` extra: torchvision has no build matching the CPU
    torch here); then every module of the three packages and the dispatcher imports."""
    import os
    import subprocess
    import sys

    venv = tmp_path / "venv"
    py = venv / "bin" / "python"
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "DS_BUILD_OPS": "0", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}

    def run(*args: str) -> None:
        done = subprocess.run(args, cwd=ROOT, env=env, capture_output=True, text=True, timeout=800)
        assert done.returncode == 0, f"{' '.join(args)}:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"

    run(sys.executable, "-m", "venv", str(venv))
    for _, args in _pip_installs():
        reqs = _requirements(args)
        if reqs == ["pip"]:
            continue
        swapped = [
            str(ROOT) if r.split("[")[0] in ("/home/ubuntu/vitpipe", "/app") else r for r in reqs
        ]  # the project here; `gpu` dropped (above)
        flags = [a for a in args if a == "--no-build-isolation"]
        run(str(py), "-m", "pip", "install", "-q", "--no-compile", *flags, *swapped)
        if any(r.startswith(str(ROOT)) for r in swapped):
            break  # the launcher's steps are done; the image repeats them
    modules = sorted(
        ".".join(p.relative_to(ROOT).with_suffix("").parts)
        for pkg in ("pipeline", "data_prep", "cluster")
        for p in (ROOT / pkg).rglob("*.py")
    )
    modules = [m.removesuffix(".__init__") for m in modules] + ["vitpipe"]
    script = "import importlib, sys\nfor m in sys.argv[1:]:\n    importlib.import_module(m)\nprint(len(sys.argv) - 1)"
    done = subprocess.run(
        [str(py), "-c", script, *modules], cwd=tmp_path, env={**env, "PYTHONPATH": ""}, capture_output=True,
        text=True, timeout=600,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == str(len(modules)) and len(modules) > 60
