"""The one metric writer: MLflow on rank 0, a no-op on every other rank.

Every rank constructing its own MLflow run would make one run per GPU (mlflow issue 11782). A
resumed stage continues its MLflow run (`run_id`), and steps already logged before the restart are
not logged again, so no (metric, step) pair is written twice.

A run-id file names the MLflow run a run directory logged to: RUN_DIR/mlflow_run.json for a stage
(written by its rank 0, read by a resumed stage, the job driver and the eval stage's figures), and
the experiment's parent run file. `read_run_id` and `write_run_id` are the only code that touches one.
Nodes that share no disk do not share that file: a stage that checkpoints to object storage tags its run
with the checkpoint's URI, and `find_stage_run` finds the run by that tag through MLflow alone (a stage
resumed on another node, the job driver on the head).

MLflow is imported inside the functions that use it: it takes seconds to import, and every rank but
rank 0 (and the config and CLI paths) never needs it.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping
from pathlib import Path

from data_prep import atomic

log = logging.getLogger(__name__)

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
RUN_ID_FILE = "mlflow_run.json"  # in a stage's run directory
REPLICA_SUFFIX = "_s{seed}"  # under an experiment's `seeds:`, stage STAGE's run for seed K is STAGE_sK


def replica_name(stage: str, seed: int | str) -> str:
    """Stage `stage`'s replica for `seed` under `seeds:` (`pretrain` -> `pretrain_s0`): its name, run
    directory and MLflow run name (pipeline.config writes it, pipeline.compare reads it). A name ends in one
    suffix, so two (stage, seed) pairs never share one."""
    return stage + REPLICA_SUFFIX.format(seed=seed)


def read_run_id(path: Path) -> str | None:
    """The MLflow run id a run-id file holds, or None when there is no such file (nothing tracked yet)."""
    path = Path(path)
    return json.loads(path.read_text())["run_id"] if path.is_file() else None


def write_run_id(path: Path, run_id: str) -> None:
    """Record `run_id` in a run-id file, atomically (a reader never sees half of it)."""
    atomic.write_json(path, {"run_id": run_id})


CHECKPOINT_URI_TAG = "checkpoint_uri"  # a stage's checkpoint.uri: one stage's runs, wherever they ran
# On an experiment's parent run: its first stage's checkpoint.uri, which names the experiment's storage.
EXPERIMENT_URI_TAG = "experiment_checkpoint_uri"


def find_run_by_tag(uri: str, experiment: str, key: str, value: str) -> str | None:
    """The newest run of `experiment` whose tag `key` is `value`, or None."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    exp = client.get_experiment_by_name(experiment)
    if exp is None or "'" in value:  # a quote cannot be searched for in MLflow's filter syntax
        return None
    runs = client.search_runs(
        [exp.experiment_id],
        filter_string=f"tags.{key} = '{value}'",
        order_by=["attributes.start_time DESC"],
        max_results=1,
    )
    return runs[0].info.run_id if runs else None


def find_stage_run(uri: str, experiment: str, checkpoint_uri: str) -> str | None:
    """The newest run of `experiment` tagged with `checkpoint_uri`, or None: the stage's MLflow run, found
    from a node that never saw its run-id file."""
    return find_run_by_tag(uri, experiment, CHECKPOINT_URI_TAG, checkpoint_uri)


class Tracker:
    """`with Tracker(...) as t: t.log_metrics({...}, step=n)`; marks the run FAILED on an exception."""

    def __init__(
        self,
        uri: str,
        experiment: str,
        run_name: str,
        enabled: bool,
        tags: Mapping[str, str] | None = None,
        run_id: str | None = None,
        parent_run_id: str | None = None,
        system_metrics: bool = False,
    ):
        self.enabled = enabled
        self.run_id: str | None = None
        self.last_logged_step = 0
        self.status = "FINISHED"
        if not enabled:
            return
        import mlflow  # heavy, and rank 0 only: see the module docstring

        self._mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        exp = mlflow.set_experiment(experiment)
        all_tags = dict(tags or {})
        if parent_run_id:
            all_tags["mlflow.parentRunId"] = parent_run_id
        if run_id is None:
            run = mlflow.start_run(
                run_name=run_name,
                tags=all_tags,
                experiment_id=exp.experiment_id,
                log_system_metrics=system_metrics,
            )
        else:
            run = mlflow.start_run(run_id=run_id, log_system_metrics=system_metrics)
            history = mlflow.MlflowClient().get_metric_history(run_id, "train/loss")
            self.last_logged_step = max((m.step for m in history), default=0)
        self.run_id = run.info.run_id
        log.info("MLflow run %s in experiment %r at %s", self.run_id, experiment, uri)

    def log_params(self, params: Mapping[str, object]) -> None:
        if self.enabled:
            items = [(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per call
                self._mlflow.log_params(dict(items[i : i + 100]))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.enabled and step > self.last_logged_step:
            self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.enabled:
            self._mlflow.set_tags(dict(tags))

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._mlflow.log_artifact(path, artifact_path)

    def close(self, status: str | None = None) -> None:
        if self.enabled and self._mlflow.active_run() is not None:
            self._mlflow.end_run(status=status or self.status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        if exc_type is not None and not issubclass(exc_type, SystemExit):
            self.close("FAILED")
        else:
            self.close()


# ---------------------------------------------------------------- experiment (parent) runs


def open_parent_run(
    uri: str, experiment: str, run_name: str, run_id: str | None, tags: Mapping[str, str]
) -> str:
    """Create the experiment's parent run, or reopen it on resubmission; returns its id.

    Written by the job driver between stages only, so it never competes with a stage's rank-0 writer
    for the SQLite lock while the stage trains.
    """
    from mlflow import MlflowClient, set_tracking_uri

    set_tracking_uri(uri)
    client = MlflowClient(uri)
    if run_id is not None:
        client.update_run(run_id, status="RUNNING")
        for k, v in tags.items():  # this submission's: the config, the storage it checkpoints to
            client.set_tag(run_id, k, v)
        return run_id
    exp = client.get_experiment_by_name(experiment)
    exp_id = exp.experiment_id if exp else client.create_experiment(experiment)
    return client.create_run(exp_id, run_name=run_name, tags=dict(tags)).info.run_id


def log_to_run(
    uri: str,
    run_id: str,
    metrics: Mapping[str, float] | None = None,
    params: Mapping[str, object] | None = None,
    tags: Mapping[str, str] | None = None,
) -> None:
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    for k, v in (metrics or {}).items():
        client.log_metric(run_id, k, float(v))
    for k, v in (params or {}).items():
        client.log_param(run_id, k, str(v)[:MAX_PARAM_LEN])
    for k, v in (tags or {}).items():
        client.set_tag(run_id, k, v)


def end_run(uri: str, run_id: str, status: str) -> None:
    """Set a run's final status from outside it (the driver closing a stage whose rank 0 died)."""
    from mlflow import MlflowClient

    client = MlflowClient(uri)
    if client.get_run(run_id).info.status == "RUNNING" or status == "FINISHED":
        client.set_terminated(run_id, status=status)


def run_metrics(uri: str, run_id: str) -> dict[str, float]:
    from mlflow import MlflowClient

    return dict(MlflowClient(uri).get_run(run_id).data.metrics)
