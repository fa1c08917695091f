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
