"""The job entry point: an experiment's stages in order, each a Ray Train run with DeepSpeed inside.

    ray job submit --working-dir . -- python -m cluster.run configs/experiments/NAME.yaml [KEY=VALUE ...]
    vitpipe run configs/experiments/NAME.yaml          # the same, from this shell (starts or joins Ray)

Idempotent: a finished stage leaves RUN_DIR/STAGE/DONE.json (and DONE.json in its storage) and is
skipped when the experiment is submitted again; an unfinished one resumes from its newest complete checkpoint. One MLflow parent run
per experiment (reopened on resubmission) holds a nested run per stage and a summary of each.
A worker process that dies mid-stage makes Ray Train restart the worker group (cluster.max_failures
times); the loop then resumes from the newest checkpoint. `ray job stop` sends this driver SIGTERM:
it writes RUN_DIR/STAGE/STOP (and STOP beside the stage's stored checkpoints, for workers on nodes that do
not share the driver's disk), the loop checkpoints at its next log step and ends, and the job exits 143.
"""

from __future__ import annotations

import json
import os
import shutil
import signal
import sys
import tempfile
import time
from pathlib import Path

import ray
import ray.train
from ray.train import FailureConfig, RunConfig, ScalingConfig
from ray.train.torch import TorchTrainer
from ray.train.v2._internal.constants import is_v2_enabled

from cluster.local import free_ports
from cluster.preflight import check_nodes_see, check_not_in_job_copy, job_working_dir
from cluster.process_group import NodeAddressTorchConfig
from data_prep import atomic
from data_prep.executors import RAY_MULTI_NODE_SWITCH, keep_loopback, keep_loopback_address
from data_prep.layout import DatasetError
from data_prep.storage import Store, child
from pipeline.config import (
    ConfigError,
    Experiment,
    StageConfig,
    check_inputs,
    load_experiment,
    validate_config,
)
from pipeline.stage import STOP_FILE
from pipeline.tracking import (
    EXPERIMENT_URI_TAG,
    RUN_ID_FILE,
    end_run,
    find_run_by_tag,
    find_stage_run,
    log_to_run,
    open_parent_run,
    read_run_id,
    run_metrics,
    write_run_id,
)
from pipeline.train.launch import prepare_data, run_rank  # imports neither the training loop nor DeepSpeed

DONE = "DONE.json"

# Ray Train settings that keep a job's log readable; the driver passes them to the Ray Train controller
# and workers (Ray Train propagates these variables), and a value already in the environment wins.
RAY_TRAIN_LOG_ENV = {
    # Ray Train v2 sends a worker's print() to a logger whose console handler writes stderr, and also
    # prints it to stdout when sys.stdout is not sys.__stdout__, which is always so in a Ray worker
    # (Ray wraps it): each printed line reached the job log twice. With this off, print writes once.
    "RAY_TRAIN_ENABLE_PRINT_PATCH": "0",
    # The preemption watcher reports node drains to ray.train.get_preemption_info(), which the loop does
    # not read (a drained node's workers die; Ray Train restarts the group from the newest checkpoint).
    # Its actor's start-up printed a core_worker.cc error ("has constructor arguments in the object
    # store and max_restarts > 0", ray issue 53727) at every stage of a healthy run.
    "RAY_TRAIN_ENABLE_PREEMPTION_WATCHER": "0",
}


EXPORT_POINTER = "export.json"  # in the stage's Ray Train checkpoint: where its export is


def report(metrics: dict, pointer: dict | None = None) -> None:
    """ray.train.report for the loop (every rank, the same number of times). With `pointer` (rank 0 at the
    end of a training stage that exported) it also reports a checkpoint holding EXPORT_POINTER (the
    export's path and storage URI) and the export's model.json: Ray's pointer checkpoint, so that
    `Result.checkpoint` leads to the weights without Ray copying gigabytes into its own storage."""
    if pointer is None:
        ray.train.report(metrics)
        return
    with tempfile.TemporaryDirectory(prefix="vitpipe-pointer-") as tmp:
        (Path(tmp) / EXPORT_POINTER).write_text(json.dumps(pointer, indent=1))
        description = Path(pointer["export"]) / "model.json"
        if description.is_file():
            shutil.copy(description, tmp)
        ray.train.report(metrics, checkpoint=ray.train.Checkpoint.from_directory(tmp))


def _worker(config: dict) -> None:
    # Runs in every Ray Train worker; TorchTrainer has already joined the process group.
    cfg = validate_config(config["cfg"], source="<ray worker>")
    run_rank(cfg, report=report, parent_run_id=config["parent_run_id"])


def connect(address: str | None) -> None:
    """Join the cluster (`address`, RAY_ADDRESS, or inside a Ray job), else start a private local Ray.

    No runtime_env here: inside a job it would conflict with the job's own, and workers need none
    (each rank sets DeepSpeed's accelerator from its stage: pipeline.distributed.use_accelerator).
    """
    if ray.is_initialized():
        return
    address = address or os.environ.get("RAY_ADDRESS")
    if address:
        keep_loopback_address(address)  # a cluster.local cluster: every node at 127.0.0.1
        ray.init(address=address)
    else:
        _start_private_ray()


def _start_private_ray() -> None:
    """A private one-node Ray whose every listening socket is on 127.0.0.1 (docs/security.md).

    Ray's C++ servers (GCS, raylet, every worker's gRPC server) listen on 127.0.0.1 only when the node IP
    is exactly 127.0.0.1, and elsewhere on every interface; on Linux Ray replaces `_node_ip_address=
    "127.0.0.1"` with the machine's address unless multi-node clusters are off. So they are, for this
    instance: the processes ray.init starts read the switch from their environment (the raylet hands it
    on to the workers it starts), this driver from ray_constants, which read it at import. The variable
    is taken out of this process's environment again afterwards: a `ray start` this process later runs
    for a real cluster must not inherit it (it refuses to join one).
    """
    before = os.environ.get(RAY_MULTI_NODE_SWITCH)
    keep_loopback()  # the driver's own node-IP lookup, and the processes ray.init starts
    try:
        # The dashboard serves the State API, which Ray Train's placement-group cleaner polls: without it
        # the cleaner logs "Failed to query Ray Train Controller actor state" every few seconds.
        (port,) = free_ports(1)
        ray.init(dashboard_host="127.0.0.1", dashboard_port=port, _node_ip_address="127.0.0.1")
    finally:
        if before is None:
            os.environ.pop(RAY_MULTI_NODE_SWITCH, None)
        else:
            os.environ[RAY_MULTI_NODE_SWITCH] = before


def _ray_storage(cfg: StageConfig) -> dict:
    """Where Ray Train keeps its run state and the stage's pointer checkpoint (`report`): every node writes
    there. The stage's object storage when it has one (nodes that may share no disk), else RUN_DIR/ray, which
    every node sees (check_nodes_see refuses a run_dir one lacks)."""
    if not cfg.checkpoint.uri:
        return {"storage_path": str(cfg.run_path / "ray")}
    store = Store(cfg.checkpoint.uri)
    return {"storage_path": f"{store.root}/ray", "storage_filesystem": store.fs}


def run_stage(cfg: StageConfig, parent_run_id: str | None = None):
    """One stage on Ray Train workers. Returns ray.train.Result.

    Workers may start in other directories: the config's local paths (run_dir, data, init weights,
    teacher) are already absolute, resolved once when it was loaded (pipeline.config).
    """
    prepare_data(cfg)
    connect(cfg.cluster.address)
    # cluster.use_gpu: auto -> GPU workers when the cluster has GPUs (the driver's own node may have none)
    cfg = cfg.on_device(ray.cluster_resources().get("GPU", 0) >= 1)
    check_nodes_see(cfg)  # a run_dir or dataset one node lacks: refused now, not after max_failures retries
    for key, value in RAY_TRAIN_LOG_ENV.items():
        os.environ.setdefault(key, value)  # read by TorchTrainer.fit() and passed on to its actors
    c = cfg.cluster
    if c.elastic and not is_v2_enabled():
        raise ConfigError(
            f"cluster.num_workers: {list(c.num_workers)} (elastic) needs Ray Train v2 (unset RAY_TRAIN_V2_ENABLED=0)"
        )
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json"), "parent_run_id": parent_run_id},
        scaling_config=ScalingConfig(
            num_workers=c.num_workers,  # (min, max): elastic (Ray Train v2)
            use_gpu=c.use_gpu,
            resources_per_worker={"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})},
            placement_strategy=c.placement_strategy,
        ),
        # the store listens on rank 0's node address, not on every interface (cluster.process_group)
        torch_config=NodeAddressTorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.name, failure_config=FailureConfig(max_failures=c.max_failures), **_ray_storage(cfg)
        ),
    )
    return trainer.fit()


def _stage_run_id(cfg: StageConfig) -> str | None:
    """The stage's MLflow run: from its run-id file, or through MLflow by its checkpoint URI where rank 0
    wrote that file on another node's disk."""
    found = read_run_id(cfg.run_path / RUN_ID_FILE)
    if found is None and cfg.checkpoint.uri:
        found = find_stage_run(cfg.tracking_uri, cfg.tracking.experiment or cfg.name, cfg.checkpoint.uri)
    return found


def finished(cfg: StageConfig) -> str | None:
    """Where the record of the stage's finish is (RUN_DIR/STAGE/DONE.json, or DONE.json beside its stored
    checkpoints when this node's disk lost it), or None if the stage has not finished."""
    local = cfg.run_path / DONE
    if local.is_file():
        return str(local)
    if cfg.checkpoint.uri and Store(cfg.checkpoint.uri).exists(DONE):
        return child(cfg.checkpoint.uri, DONE)
    return None


def mark_finished(cfg: StageConfig, record: dict) -> None:
    """The stage's finish, recorded on this disk and, with storage, beside its stored checkpoints: a
    resubmission after every node's disk is gone skips it too (its export is in storage as well). The
    stage's folder may not exist on this disk: with storage, its workers may all have run on other nodes."""
    cfg.run_path.mkdir(parents=True, exist_ok=True)
    atomic.write_json(
        cfg.run_path / DONE, record
    )  # its presence marks the stage finished: never half written
    if cfg.checkpoint.uri:
        try:
            Store(cfg.checkpoint.uri).write_text(DONE, json.dumps(record, indent=1))
        except Exception as exc:  # the stage did finish: a resubmission re-saves it at worst
            print(f"[{cfg.name}] could not record the finish in {cfg.checkpoint.uri}: {exc}", file=sys.stderr)


def _stop_places(cfg: StageConfig) -> tuple[Path, Store | None]:
    """Where a stop request for the stage goes: its run directory (the workers on this node, or every node
    on a shared disk) and its object storage (every node)."""
    return cfg.run_path / STOP_FILE, Store(cfg.checkpoint.uri) if cfg.checkpoint.uri else None


def clear_stop(cfg: StageConfig) -> None:
    """Remove a stop request left by an earlier submission, before the stage's workers start (the loop
    does not: a request written while they start up must not be lost)."""
    path, store = _stop_places(cfg)
    path.unlink(missing_ok=True)
    if store is not None:
        store.delete_file(STOP_FILE)


class _StopOnSigterm:
    """`ray job stop` -> SIGTERM here -> a STOP file (and object) the running stage's loop sees at its next
    log step."""

    def __init__(self) -> None:
        self.stage: StageConfig | None = None
        self.stopping = False
        signal.signal(signal.SIGTERM, self._handle)

    def _handle(self, signum, frame) -> None:
        self.stopping = True
        if self.stage is not None:
            path, store = _stop_places(self.stage)
            text = f"stop requested at {time.time()}\n"
            path.parent.mkdir(parents=True, exist_ok=True)
            path.write_text(text)
            if store is not None:
                try:
                    store.write_text(STOP_FILE, text)
                except Exception as exc:  # raised here it would end the driver mid-stage, unstopped
                    print(f"SIGTERM: could not write {STOP_FILE} to {store}: {exc}", flush=True)
            print(f"SIGTERM: asked stage {self.stage.name} to checkpoint and stop", flush=True)


def run_experiment(exp: Experiment) -> int:
    """Run every unfinished stage in order; returns the process exit status."""
    exp.run_path.mkdir(parents=True, exist_ok=True)
    first = exp.stages[0][1].cluster
    connect(first.address)
    stopper = _StopOnSigterm()  # after ray.init, which installs a SIGTERM handler of its own
    parent_file = exp.parent_run_file
    previous = read_run_id(parent_file)
    # With storage, the experiment outlives every node's disk: its parent run is found through MLflow
    # by the first stage's checkpoint URI when this node's disk lost (or never held) the run-id file.
    anchor = exp.stages[0][1].checkpoint.uri
    if previous is None and anchor:
        previous = find_run_by_tag(exp.tracking_uri, exp.name, EXPERIMENT_URI_TAG, anchor)
    parent = open_parent_run(
        exp.tracking_uri,
        exp.name,
        exp.name,
        previous,
        tags={
            "stages": ",".join(n for n, _ in exp.stages),
            "config": exp.source,
            **({EXPERIMENT_URI_TAG: anchor} if anchor else {}),
        },
    )
    write_run_id(parent_file, parent)
    print(f"[{exp.name}] MLflow parent run {parent} at {exp.tracking_uri}", flush=True)
    for name, cfg in exp.stages:
        done = finished(cfg)
        if done:
            print(f"[{exp.name}] stage {name}: already finished ({done}), skipping", flush=True)
            continue
        print(f"[{exp.name}] stage {name}: starting ({cfg.cluster.num_workers} workers)", flush=True)
        clear_stop(cfg)
        stopper.stage = cfg
        try:
            result = run_stage(cfg, parent)
            error, metrics = result.error, result.metrics or {}
        except Exception as exc:  # Ray Train v2 raises TrainingFailedError once retries are exhausted
            error, metrics = exc, {}
        stopper.stage = None
        stage_run = _stage_run_id(cfg)
        stopped = bool(metrics.get("stopped_early"))
        if error is not None or stopped or stopper.stopping:
            status = "KILLED" if (stopped or stopper.stopping) else "FAILED"
            if stage_run:
                end_run(exp.tracking_uri, stage_run, status)
            end_run(exp.tracking_uri, parent, status)
            why = "stopped; resubmit to resume" if status == "KILLED" else f"failed: {error}"
            print(f"[{exp.name}] stage {name} {why}", file=sys.stderr, flush=True)
            return 128 + signal.SIGTERM if status == "KILLED" else 1
        summary = (
            {
                f"{name}/{k.split('/')[-1]}": v
                for k, v in run_metrics(exp.tracking_uri, stage_run).items()
                if not k.startswith("system/")
            }
            if stage_run
            else {}
        )
        log_to_run(exp.tracking_uri, parent, metrics=summary, tags={f"stage.{name}.run_id": stage_run or ""})
        export = str(cfg.run_path / "export") if cfg.kind == "train" else None
        record = {"stage": name, "mlflow_run_id": stage_run, "finished_at": time.time(), "export": export}
        mark_finished(cfg, record)
        print(f"[{exp.name}] stage {name}: done", flush=True)
    end_run(exp.tracking_uri, parent, "FINISHED")
    print(f"[{exp.name}] all {len(exp.stages)} stages finished; MLflow: {exp.tracking_uri}", flush=True)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] in ("-h", "--help"):
        print("usage: python -m cluster.run CONFIG [KEY=VALUE ...]", file=sys.stderr)
        return 2
    try:
        exp = load_experiment(argv[0], argv[1:])
        check_not_in_job_copy(exp.stages, job_working_dir())  # a relative run_dir inside a Ray job
        check_inputs(exp)  # every stage's dataset, before Ray or any worker starts
        return run_experiment(exp)
    except (ConfigError, DatasetError) as exc:
        print(f"cluster.run: {exc}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
