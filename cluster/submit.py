"""`vitpipe submit / jobs / logs / stop` over the Ray Jobs SDK.

    vitpipe submit configs/experiments/NAME.yaml [KEY=VALUE ...] --address http://HEAD:8265 --follow
    vitpipe jobs | vitpipe logs ID [--follow] | vitpipe stop ID

The working directory (this project) is uploaded without .git, virtual environments, datasets, run
folders and MLflow stores, and refused before upload when it is still over the Jobs API limit.
Token authentication stays on: clients need RAY_AUTH_MODE=token and the cluster's token
(~/.ray/auth_token, RAY_AUTH_TOKEN or RAY_AUTH_TOKEN_PATH).
"""

from __future__ import annotations

import asyncio
import fnmatch
import json
import os
import shlex
import shutil
import sys
import tempfile
import time
import uuid
from pathlib import Path

from cluster.path_probe import PREFIX as PROBE_PREFIX
from pipeline.config import (
    datasets_written_relative,
    input_problems,
    load_experiment,
    raw_config,
    written_relative,
)

# Ray's limit on a job's uploaded working directory (ray issue 45602: .git is not excluded by default).
UPLOAD_LIMIT_BYTES = 100 * 1024**2
EXCLUDES = [
    ".git",
    ".venv",
    "venv",
    "data",
    "runs",
    "mlruns",
    "mlartifacts",
    "*.db",
    "__pycache__",
    ".pytest_cache",
    ".ruff_cache",
    "*.egg-info",
    ".whl",
    ".gl",
]
DEFAULT_ADDRESS = "http://127.0.0.1:8265"
PROBE = Path(__file__).with_name("path_probe.py")
PROBE_MAX_PATHS = 64  # paths one probe checks on every node
DONE_STATUSES = ("SUCCEEDED", "FAILED", "STOPPED")
STOP_WAIT_S = 300  # grace between `ray job stop`'s SIGTERM and its SIGKILL (the job supervisor reads it)


class SubmitError(RuntimeError):
    pass


def _excluded(rel: Path) -> bool:
    return any(fnmatch.fnmatch(part, pat) for part in rel.parts for pat in EXCLUDES)


def working_dir_size(root: Path) -> tuple[int, list[tuple[int, str]]]:
    """Bytes that would be uploaded, and the largest top-level entries (for the error message)."""
    total, per_top = 0, {}
    for dirpath, dirnames, filenames in os.walk(root):
        rel_dir = Path(dirpath).relative_to(root)
        dirnames[:] = [d for d in dirnames if not _excluded(rel_dir / d)]
        for f in filenames:
            rel = rel_dir / f
            if _excluded(rel):
                continue
            try:
                size = (root / rel).stat().st_size
            except OSError:
                continue
            total += size
            per_top[rel.parts[0]] = per_top.get(rel.parts[0], 0) + size
    return total, sorted(((s, n) for n, s in per_top.items()), reverse=True)[:5]


def check_upload(root: Path, limit: int = UPLOAD_LIMIT_BYTES) -> int:
    total, largest = working_dir_size(root)
    if total > limit:
        top = ", ".join(f"{n} ({s / 1024**2:.1f} MiB)" for s, n in largest)
        raise SubmitError(
            f"working directory {root} is {total / 1024**2:.1f} MiB after excludes, over the Jobs API limit of "
            f"{limit / 1024**2:.0f} MiB; largest: {top}. Move data to shared storage or out of the project."
        )
    return total


def check_paths_written(config: str, overrides: list[str]) -> None:
    """Refuse a run folder or SQLite store given by a relative path (the default `run_dir: runs/{name}`
    too): the job loads the config in Ray's temporary copy of the working directory, so the path would
    resolve there, on one node, deleted with the job (the job's pre-flight refuses it, after the upload)."""
    relative = written_relative(raw_config(config, overrides))
    if relative:
        named = " and ".join(f"{key} {value!r}" for key, value in relative)
        advice = {
            "run_dir": "run_dir=/shared/runs/{name} (plus storage=s3://BUCKET/runs/{name} where the nodes "
            "share no disk)",
            "tracking.uri": "an MLflow server (tracking.uri=http://HOST:5000) or an absolute path",
        }
        raise SubmitError(
            f"{config}: {named} {'is a relative path' if len(relative) == 1 else 'are relative paths'}: "
            "the job would resolve it inside its temporary copy of the working directory on the head node. "
            f"Give {'; and '.join(advice[key] for key, _ in relative)}"
        )


def check_token() -> None:
    """With token authentication (the default), refuse before anything is uploaded when no token is here:
    RAY_AUTH_TOKEN, the file RAY_AUTH_TOKEN_PATH names, or ~/.ray/auth_token."""
    if os.environ.get("RAY_AUTH_MODE", "token") != "token" or os.environ.get("RAY_AUTH_TOKEN"):
        return
    path = Path(os.environ.get("RAY_AUTH_TOKEN_PATH") or Path.home() / ".ray" / "auth_token")
    if not (path.is_file() and path.read_text().strip()):
        raise SubmitError(
            f"no Ray auth token: {path} is missing or empty and RAY_AUTH_TOKEN is not set. Copy the cluster's "
            "token (~/.ray/auth_token on its head node) to ~/.ray/auth_token here (chmod 600), or point "
            "RAY_AUTH_TOKEN_PATH at it"
        )


def check_datasets_written(config: str, overrides: list[str]) -> None:
    """Refuse a `data.train` given by a relative path: the job resolves it inside its copy of the working
    directory, which leaves out data/ and exists on the head node only."""
    relative = datasets_written_relative(raw_config(config, overrides))
    if relative:
        named = ", ".join(f"{key} {value!r}" for key, value in relative)
        raise SubmitError(
            f"{config}: {named}: relative, so the job would look for the dataset inside its temporary copy of "
            "the working directory on the head node (which leaves out data/). Give object storage "
            "(data.train=s3://BUCKET/data/NAME, written by `vitpipe shard ... s3://...`) or a path every node "
            "mounts (/shared/data/NAME)"
        )


def probe_paths(
    paths: list[str], address: str | None, python: str, timeout_s: float = 300, attempts: int = 2
) -> list[dict] | str:
    """Ask every live node of the cluster which of `paths` it lacks, in a Ray job of its own that uploads
    only `cluster/path_probe.py` and the list: its report (see there), or why there is none. A job that
    ended before its script printed anything (its runtime environment, its driver's start) is tried again."""
    c = client(address)
    why = ""
    for _ in range(attempts):
        sid = f"vitpipe-path-probe-{time.strftime('%Y%m%d-%H%M%S')}-{uuid.uuid4().hex[:6]}"
        with tempfile.TemporaryDirectory(prefix="vitpipe-probe-") as tmp:
            shutil.copy(PROBE, Path(tmp) / PROBE.name)
            (Path(tmp) / "paths.json").write_text(json.dumps(paths))
            c.submit_job(
                entrypoint=shlex.join([python, PROBE.name, "paths.json"]),
                submission_id=sid,
                runtime_env={"working_dir": tmp},
                metadata={"command": "path probe"},
            )  # the upload happens here; the folder may go after it
        deadline = time.monotonic() + timeout_s
        while (status := str(getattr(s := c.get_job_status(sid), "value", s))) not in DONE_STATUSES:
            if time.monotonic() > deadline:
                c.stop_job(sid)
                return f"the probe job {sid} did not finish within {timeout_s:.0f} s"
            time.sleep(1)
        log = c.get_job_logs(sid)
        line = next((ln for ln in log.splitlines() if ln.startswith(PROBE_PREFIX)), None)
        if status == "SUCCEEDED" and line is not None:
            return json.loads(line.removeprefix(PROBE_PREFIX))
        why = f"the probe job {sid} ended {status}: {(log.strip() or c.get_job_info(sid).message or 'no log')[-500:]}"
        if log.strip():  # the script ran and failed: the same again
            break
    return why


def _hosts_workers(resources: dict, cfg, gpus_in_cluster: bool) -> bool:
    """Whether a node with `resources` may host one of the stage's workers (cluster.preflight's rule)."""
    gpu = cfg.cluster.use_gpu is True or (cfg.cluster.use_gpu == "auto" and gpus_in_cluster)
    need = {"CPU": cfg.cluster.cpus_per_worker, **({"GPU": 1} if gpu else {})}
    return all(resources.get(k, 0) >= v for k, v in need.items())


def check_datasets_on_cluster(exp, address: str | None, python: str) -> None:
    """Refuse, before the upload, a stage whose local dataset (`data.train` a path, not a URI; a dataset
    the job generates is left to the job's own check) is missing on a node that may host its workers: a
    node's own disk is not another's. One probe job, a few seconds; a probe that cannot run is a warning
    (the job's pre-flight, cluster.preflight, checks every node again before the stage starts)."""
    from cluster.preflight import local_paths  # imports Ray: only here

    wanted: dict[str, list[tuple[str, object]]] = {}  # path -> (stage, config) that read it
    for name, cfg in exp.stages:
        if cfg.data.synthetic is None:
            paths = local_paths(cfg.data.train)
            if len(paths) > PROBE_MAX_PATHS:  # a long shard list: its folders, and its first and last shard
                paths = sorted({os.path.dirname(p) for p in paths}) + [paths[0], paths[-1]]
            for p in paths:
                wanted.setdefault(p, []).append((name, cfg))
    if not wanted:
        return
    report = probe_paths(sorted(wanted), address, python)
    if isinstance(report, str):
        print(f"warning: could not check the datasets on the cluster's nodes: {report}", file=sys.stderr)
        return
    gpus = any(n["resources"].get("GPU", 0) > 0 for n in report)
    problems = []
    for node in report:
        for path in node["missing"] or []:
            stages = [name for name, cfg in wanted[path] if _hosts_workers(node["resources"], cfg, gpus)]
            if stages:
                problems.append(
                    f"node {node['node']} ({node['id'][:8]}) does not see {path} (data.train of "
                    f"{', '.join(stages)})"
                )
    if problems:
        raise SubmitError(
            "; ".join(problems)
            + ". Every node that may run a worker reads the dataset: put it in object storage "
            "(`vitpipe shard ... s3://BUCKET/data/NAME`, data.train=s3://...) or on a filesystem every node mounts"
        )


def client(address: str | None):
    # Imported here: Ray takes seconds to import, and every vitpipe command imports this module.
    from ray.job_submission import JobSubmissionClient

    os.environ.setdefault("RAY_AUTH_MODE", "token")
    return JobSubmissionClient(address or os.environ.get("RAY_ADDRESS") or DEFAULT_ADDRESS)


def submission_id(experiment: str) -> str:
    return f"{experiment}-{time.strftime('%Y%m%d-%H%M%S')}"


def submit(
    config: str,
    overrides: list[str],
    address: str | None,
    python: str = "python",
    env: dict[str, str] | None = None,
    root: Path | None = None,
) -> str:
    """Validate the config here (fail before upload: its schema, relative run folders, the token, the upload
    size), submit; returns the id."""
    exp = load_experiment(config, overrides)  # a typo fails here, not after an upload
    check_paths_written(config, overrides)
    check_token()
    check_datasets_written(config, overrides)
    for problem in input_problems(exp):  # a warning: the data may live on the cluster, which checks again
        print(f"warning: {problem} (here; the job stops at start if the cluster lacks it)", file=sys.stderr)
    root = (root or Path.cwd()).resolve()
    check_upload(root)
    check_datasets_on_cluster(exp, address, python)
    cfg_path = Path(config).resolve()
    try:
        rel_config = cfg_path.relative_to(root).as_posix()
    except ValueError:  # only a cluster on this machine can read it: fine for local runs and tests
        print(
            f"warning: {config} is outside the uploaded working directory; passing its absolute path",
            file=sys.stderr,
        )
        rel_config = str(cfg_path)
    # No DS_ACCELERATOR: each rank sets DeepSpeed's from its own stage's device (pipeline.distributed).
    env_vars = {
        "PYTHONUNBUFFERED": "1",
        # `ray job stop` SIGKILLs the driver 3 s after SIGTERM by default: too short to checkpoint a stage.
        "RAY_JOB_STOP_WAIT_TIME_S": str(STOP_WAIT_S),
        **(env or {}),
    }
    entrypoint = [python, "-m", "cluster.run", rel_config, *overrides]
    return submit_job(
        entrypoint, exp.name, address, root, env_vars, {"experiment": exp.name, "config": rel_config}
    )


def submit_job(
    entrypoint: list[str],
    name: str,
    address: str | None,
    root: Path,
    env_vars: dict[str, str],
    metadata: dict[str, str],
) -> str:
    """Upload `root` (the checked working directory) and start `entrypoint` in it as a job named
    NAME-YYYYmmdd-HHMMSS; returns the id."""
    sid = submission_id(name)
    c = client(address)
    deadline = time.time() + 300
    while True:
        try:
            c.submit_job(
                entrypoint=shlex.join(entrypoint),
                submission_id=sid,
                runtime_env={"working_dir": str(root), "excludes": EXCLUDES, "env_vars": env_vars},
                metadata=metadata,
            )
            return sid
        except RuntimeError as exc:  # a cluster that just started has no job agent for a few seconds
            if "No available agent" not in str(exc) or time.time() > deadline:
                raise
            time.sleep(2)


def is_jobs_api(address: str | None) -> bool:
    """An address of the Jobs API (the dashboard, http://HEAD:8265), as `vitpipe submit` takes it; a GCS
    address (HOST:6379, ray://...) is one `ray.init` joins."""
    return bool(address) and address.startswith(("http://", "https://"))


def _not_uploaded(path: str, root: Path) -> bool:
    """A relative local path the job would not find in its copy of `root` (outside it, or left out)."""
    rel = Path(os.path.normpath(path))
    return rel.parts[:1] == ("..",) or _excluded(rel) or not (root / rel).exists()


def submit_shard(
    argv: list[str], outputs: dict[str, str | None], inputs: dict[str, str | None], address: str, python: str
) -> str:
    """`vitpipe shard ... --ray` against a Jobs API address: the same command runs as a job, whose driver
    is on the cluster with its Ray tasks; returns the id. `argv`: the command line after `vitpipe`, without
    --address and --python. The job resolves relative paths inside its temporary copy of this directory,
    so `outputs` (setting -> path) are refused when relative, and `inputs` when relative and not uploaded."""
    root = Path.cwd().resolve()
    local = {k: v for k, v in {**outputs, **inputs}.items() if v and "://" not in v and not os.path.isabs(v)}
    lost = [f"{k} {v!r}" for k, v in local.items() if k in outputs]
    missing = [f"{k} {v!r}" for k, v in local.items() if k in inputs and _not_uploaded(v, root)]
    if lost or missing:
        why = (
            [f"{', '.join(lost)}: relative, so it would be written inside the job's temporary copy"]
            if lost
            else []
        )
        why += (
            [f"{', '.join(missing)}: relative and not uploaded with the working directory"] if missing else []
        )
        raise SubmitError(
            "; ".join(why) + ". The job runs on the cluster: give object storage (s3://BUCKET/...) or a "
            "path every node sees (/shared/...)"
        )
    check_token()
    check_upload(root)
    entrypoint = [python, "-m", "vitpipe", *argv]
    return submit_job(entrypoint, "shard", address, root, {"PYTHONUNBUFFERED": "1"}, {"command": "shard"})


async def _tail(c, sid: str) -> None:
    async for lines in c.tail_job_logs(sid):
        print(lines, end="", flush=True)


def follow(sid: str, address: str | None) -> str:
    """Stream the job's logs until it ends; returns its final status."""
    c = client(address)
    asyncio.run(_tail(c, sid))
    status = c.get_job_status(sid)
    return str(getattr(status, "value", status))


def list_jobs(address: str | None) -> list[dict]:
    rows = []
    for j in client(address).list_jobs():
        rows.append(
            {
                "id": j.submission_id or j.job_id,
                "status": str(getattr(j.status, "value", j.status)),
                "start": time.strftime("%Y-%m-%d %H:%M:%S", time.localtime((j.start_time or 0) / 1000)),
                "entrypoint": j.entrypoint,
            }
        )
    return sorted(rows, key=lambda r: r["start"])


def logs(sid: str, address: str | None) -> str:
    return client(address).get_job_logs(sid)


def stop(sid: str, address: str | None) -> bool:
    return client(address).stop_job(sid)
