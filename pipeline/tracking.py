"""The one metric writer: MLflow on rank 0, a no-op on every other rank.

Every rank constructing its own MLflow run would make one run per GPU (mlflow issue 11782).
"""

from __future__ import annotations

import logging
from collections.abc import Mapping

log = logging.getLogger(__name__)

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value


class Tracker:
    """`with Tracker(...) as t: t.log_metrics({...}, step=n)`; marks the run FAILED on an exception."""

    def __init__(
        self, uri: str, experiment: str, run_name: str, enabled: bool, tags: Mapping[str, str] | None = None
    ):
        self.enabled = enabled
        self.run_id: str | None = None
        if not enabled:
            return
        import mlflow

        self._mlflow = mlflow
        mlflow.set_tracking_uri(uri)
        mlflow.set_experiment(experiment)
        run = mlflow.start_run(run_name=run_name, tags=dict(tags or {}))
        self.run_id = run.info.run_id
        log.info("MLflow run %s in experiment %r at %s", self.run_id, experiment, uri)

    def log_params(self, params: Mapping[str, object]) -> None:
        if self.enabled:
            clean = {k: str(v)[:MAX_PARAM_LEN] for k, v in params.items()}
            items = list(clean.items())
            for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per batch
                self._mlflow.log_params(dict(items[i : i + 100]))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        if self.enabled:
            self._mlflow.log_metrics({k: float(v) for k, v in metrics.items()}, step=step)

    def set_tags(self, tags: Mapping[str, str]) -> None:
        if self.enabled:
            self._mlflow.set_tags(dict(tags))

    def log_artifact(self, path: str) -> None:
        if self.enabled:
            self._mlflow.log_artifact(path)

    def close(self, status: str = "FINISHED") -> None:
        if self.enabled and self._mlflow.active_run() is not None:
            self._mlflow.end_run(status=status)

    def __enter__(self) -> Tracker:
        return self

    def __exit__(self, exc_type, exc, tb) -> None:
        self.close("FAILED" if exc_type is not None else "FINISHED")
