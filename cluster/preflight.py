"""Before a stage starts on Ray: every node that may host one of its workers sees what the stage needs.

On a GPU cluster each node has its own local disk; only object storage and an MLflow server are shared.
A stage that writes its checkpoints to a `run_dir` that is not shared, or reads a dataset the driver
generated on its own disk, would fail on the other nodes only once training starts, and Ray would retry
that failure `max_failures` times. Checked here instead, in seconds, with one task per node:
- `run_dir` without `checkpoint.uri` (or the experiment's `storage`): a marker the driver writes there
  must be visible on every node;
- a SQLite `tracking.uri`: likewise its folder (rank 0 writes the stage's metrics, the driver reads them);
- local inputs (`data.train`, `model.init_from`, `objective.teacher.weights`): must exist on every node.

Inside a Ray job that uploaded a working directory (`ray job submit --working-dir`), a relative path
resolves inside that job's temporary copy, which Ray deletes with the job and no other node writes to:
`check_not_in_job_copy` refuses a `run_dir` or SQLite store there.
"""

from __future__ import annotations

import json
import logging
import os
import uuid
from pathlib import Path

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from pipeline.config import ConfigError, StageConfig
from pipeline.data.sources import expand_urls

# Set by Ray's job supervisor for the job's driver: the job's runtime environment, working_dir included.
JOB_CONFIG_ENV = "RAY_JOB_CONFIG_JSON_ENV_VAR"
ANSWER_TIMEOUT_S = 300  # for each node's check task: a worker process start, minutes on loaded cores
log = logging.getLogger(__name__)


def _sqlite_dir(uri: str) -> Path | None:
    return Path(uri.removeprefix("sqlite:///")).parent if uri.startswith("sqlite:///") else None


def local_paths(path: str | None) -> list[str]:
    """The local files or folders `path` names (a folder, a file, shard patterns `{000..009}` and
    `::` lists expanded); none for URIs."""
    if not path:
        return []
    return [
        u.removeprefix("file:") for u in expand_urls(path) if "://" not in u and not u.startswith("pipe:")
    ]


def job_working_dir() -> Path | None:
    """This job's copy of its uploaded working directory (the driver's CWD), or None outside such a job."""
    raw = os.environ.get(JOB_CONFIG_ENV)
    if not raw:
        return None
    try:
        runtime_env = json.loads(raw).get("runtime_env") or {}
    except (json.JSONDecodeError, AttributeError):
        return None
    return Path.cwd() if runtime_env.get("working_dir") else None


def check_not_in_job_copy(stages: list[tuple[str, StageConfig]], copy: Path | None) -> None:
    """Refuse a run_dir or SQLite store inside the job's temporary working-directory copy."""
    if copy is None:
        return
    for name, cfg in stages:
        for setting, path in (("run_dir", cfg.run_path), ("tracking.uri", _sqlite_dir(cfg.tracking_uri))):
            if path is not None and Path(path).is_relative_to(copy):
                raise ConfigError(
                    f"stage {name}: {setting} {path} is inside this job's copy of its working directory "
                    f"({copy}), which Ray deletes when the job ends and which no other node shares (a "
                    f"relative path in the config resolves there). Give an absolute path: a shared "
                    f"filesystem, or node-local scratch with `storage: s3://...` and an MLflow server"
                )


@ray.remote(num_cpus=0)
def _missing(paths: list[str]) -> list[str]:
    return [p for p in paths if not os.path.exists(p)]


def _worker_nodes(cfg: StageConfig) -> list[dict]:
    need = {"CPU": cfg.cluster.cpus_per_worker, **({"GPU": 1} if cfg.cluster.use_gpu else {})}
    return [
        n for n in ray.nodes() if n["Alive"] and all(n["Resources"].get(k, 0) >= v for k, v in need.items())
    ]


def check_nodes_see(cfg: StageConfig) -> None:
    """Refuse the stage, naming the node, path and setting, if a node that may host one of its workers does
    not see what it needs (the module docstring). Call after ray.init, before the stage's trainer starts."""
    token = uuid.uuid4().hex
    folders = {}  # folder the workers write -> its setting
    if not cfg.checkpoint.uri:
        folders[cfg.run_path] = "run_dir"
    sqlite = _sqlite_dir(cfg.tracking_uri)
    if sqlite is not None:
        folders.setdefault(sqlite, "tracking.uri")
    markers = {
        str(folder / f".vitpipe-visible-{token}"): (setting, str(folder))
        for folder, setting in folders.items()
    }
    teacher = cfg.objective.teacher.weights if cfg.objective.teacher else None
    inputs = {
        "data.train": cfg.data.train,
        "model.init_from": cfg.model.init_from,
        "objective.teacher.weights": teacher,
    }
    wanted = {**markers, **{p: (k, p) for k, v in inputs.items() for p in local_paths(v)}}
    for marker in markers:
        Path(marker).parent.mkdir(parents=True, exist_ok=True)
        Path(marker).write_text(
            "written by the job driver: every node that runs a worker must see this file\n"
        )
    try:
        nodes = _worker_nodes(cfg)
        strategy = [NodeAffinitySchedulingStrategy(n["NodeID"], soft=False) for n in nodes]
        refs = [_missing.options(scheduling_strategy=s).remote(list(wanted)) for s in strategy]
        # Bounded: a node that cannot start the task (dying, out of memory) must not hang the job; it is
        # reported and the stage goes on, as it would have without the check.
        ready, _ = ray.wait(refs, num_returns=len(refs), timeout=ANSWER_TIMEOUT_S)
        found = [ray.get(r) if r in ready else None for r in refs]
    finally:
        for marker in markers:
            Path(marker).unlink(missing_ok=True)
    for node, missing in zip(nodes, found):
        if missing is None:
            log.warning(
                "node %s (%s) did not answer the pre-flight check within %d s; not checked",
                node["NodeManagerAddress"],
                node["NodeID"][:8],
                ANSWER_TIMEOUT_S,
            )
    problems = [
        f"node {node['NodeManagerAddress']} ({node['NodeID'][:8]}) does not see {wanted[p][0]} {wanted[p][1]}"
        for node, missing in zip(nodes, found)
        for p in missing or []
    ]
    if problems:
        raise ConfigError(
            f"stage {cfg.name}: " + "; ".join(problems) + ". Nodes that share no disk need the stage's "
            "checkpoints in object storage (the experiment's `storage: s3://...`, or checkpoint.uri), an "
            "MLflow server (tracking.uri: http://...), and inputs every node can read (data.train: "
            "s3://..., or a shared filesystem)"
        )
