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

A stage's metrics and tags go to MLflow from one background thread on rank 0 (`_Sender`), in the order
they were logged: a log step costs the ranks no round trip to the tracking server (every rank waits for
rank 0 at its next collective), and a server that is slow, restarting or unreachable mid-stage delays the
metrics instead of ending the training. What it could not send is held (up to MAX_PENDING values, the
oldest dropped past that) and sent once the server answers; a stage waits FLUSH_TIMEOUT_S for it at its
end. MLflow's own asynchronous logging does not serve here: it retries each queued batch in full, drops a
batch its retries did not deliver, and its exit handler waits for the whole queue. Opening the run (and
its params and config artifact) stays synchronous: a server that cannot be reached at a stage's start
fails the stage before it trains.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from collections.abc import Mapping
from pathlib import Path

from data_prep import atomic

log = logging.getLogger(__name__)

MAX_PARAM_LEN = 6000  # MLflow's limit on a param value
RUN_ID_FILE = "mlflow_run.json"  # in a stage's run directory
REPLICA_SUFFIX = "_s{seed}"  # under an experiment's `seeds:`, stage STAGE's run for seed K is STAGE_sK
# Metric values and tags held while MLflow does not answer: 300 B each in memory, 150 MB at most (the training
# loop's 14 values every 20 steps: 700k steps)
MAX_PENDING = 500_000
FLUSH_TIMEOUT_S = 60.0  # at a stage's end, the wait for what is still to be sent
RETRY_S = (1.0, 30.0)  # the wait after a failed send: doubling from the first to the second
# MLflow's limits on one log_batch request
BATCH_VALUES, BATCH_TAGS = 1000, 100


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


class _Sender:
    """One thread that sends a run's metric values and tags to MLflow in the order they were logged.

    `put` only queues (one call's values are one group, kept in one request where they fit). A failed send
    (the server down or restarting, MLflow's own retries exhausted, a locked SQLite file) is logged once per
    outage and tried again after RETRY_S, doubling, the values kept; more than `max_pending` held drops the
    oldest, counted. A batch MLflow refuses as a bad request (400: a name it does not accept), or that keeps
    failing, is sent one value per request: a refused value is dropped alone, and a value that keeps failing
    while the one after it goes through is dropped as refused too, so no single value holds up the queue.
    `close` waits up to `timeout` for the queue to empty and returns how many values it leaves unsent."""

    def __init__(self, client, run_id: str, max_pending: int):
        self._client, self._run_id, self._max_pending = client, run_id, max_pending
        self._pending: deque = deque()  # (sequence number, Metric | RunTag, the last of its group)
        self._seq = itertools.count()
        self._cond = threading.Condition()
        self._closing = self._stopped = self._woken = False
        self.dropped = self.refused = 0  # past max_pending; refused by MLflow
        self._singly_through = -1  # items up to this sequence number go one per request
        self._thread = threading.Thread(target=self._run, name=f"mlflow-sender-{run_id}", daemon=True)
        self._thread.start()

    def put(self, items: list) -> None:
        with self._cond:
            if self._stopped:
                raise RuntimeError(f"MLflow run {self._run_id}: logged to after the tracker was closed")
            self._pending.extend((next(self._seq), item, i == len(items) - 1) for i, item in enumerate(items))
            while len(self._pending) > self._max_pending:
                self._pending.popleft()  # if it is in flight and arrives, `_take` takes it off the count
                self.dropped += 1
                if self.dropped == 1:
                    log.warning(
                        "MLflow run %s: more than %d values wait to be sent; dropping the oldest",
                        self._run_id,
                        self._max_pending,
                    )
            self._cond.notify()

    def _batch(self) -> list:
        """The oldest pending items for one log_batch request: MLflow's limits, whole groups where one fits
        (a resume skips the steps MLflow holds a loss for: a step half sent and then lost to a crash would
        stay half sent), one item in the one-by-one stretch (called under the lock)."""
        from mlflow.entities import RunTag

        if self._pending[0][0] <= self._singly_through:
            return [self._pending[0]]
        batch, tags, whole = [], 0, 0
        for entry in self._pending:
            is_tag = isinstance(entry[1], RunTag)
            if len(batch) == BATCH_VALUES or (is_tag and tags == BATCH_TAGS):
                break
            batch.append(entry)
            tags += is_tag
            whole = len(batch) if entry[2] else whole
        return batch[:whole] if whole else batch

    def _send(self, batch: list) -> None:
        from mlflow.entities import RunTag

        items = [item for _, item, _ in batch]
        self._client.log_batch(
            self._run_id,
            metrics=[m for m in items if not isinstance(m, RunTag)],
            tags=[t for t in items if isinstance(t, RunTag)],
        )

    def _take(self, batch: list, refused: bool = False) -> None:
        """`batch` is done with: sent, or (`refused`) dropped. Under the lock."""
        last, before = batch[-1][0], len(self._pending)
        while self._pending and self._pending[0][0] <= last:
            self._pending.popleft()
        already = len(batch) - (before - len(self._pending))  # dropped by `put` while in flight
        if refused:
            self.refused += len(batch) - already
        else:
            self.dropped -= already

    def _refuse(self, batch: list, exc: BaseException, why: str) -> None:
        with self._cond:
            self._take(batch, refused=True)
        if self.refused <= 10 or self.refused % 1000 == 0:
            log.error(
                "MLflow run %s: dropped %r, which %s (%s: %s); %d values dropped so far, logging goes on",
                self._run_id,
                batch[0][1],
                why,
                type(exc).__name__,
                _first_line(exc),
                self.refused,
            )

    def _wait(self, seconds: float) -> None:
        """Sleep `seconds` before a retry, cut short by a close (not by `put`)."""
        until = time.monotonic() + seconds
        with self._cond:
            while not (self._woken or self._stopped) and (left := until - time.monotonic()) > 0:
                self._cond.wait(left)
            self._woken = False

    def _run(self) -> None:
        failing_since, wait, tries = None, RETRY_S[0], 0
        while True:
            with self._cond:
                while not self._pending and not self._closing:
                    self._cond.wait()
                if self._stopped or not self._pending:
                    return
                batch = self._batch()
                after = self._pending[1] if len(batch) == 1 and len(self._pending) > 1 else None
            try:
                self._send(batch)
            except Exception as exc:
                if _refused(exc) and len(batch) > 1:  # find the value it refuses: one per request
                    self._singly_through = batch[-1][0]
                    continue
                if _refused(exc):
                    self._refuse(batch, exc, "MLflow refused")
                    continue
                tries += 1
                if len(batch) > 1 and tries >= 3:  # an outage, or one value that always fails: find out
                    self._singly_through = batch[-1][0]
                elif after is not None and tries >= 3 and self._goes_through(after):
                    self._refuse(batch, exc, "keeps failing while the values after it go through")
                    tries = 0
                    continue
                if failing_since is None:
                    failing_since = time.monotonic()
                    log.warning(
                        "MLflow run %s: could not log (%s: %s); training goes on and the values are sent "
                        "once MLflow answers",
                        self._run_id,
                        type(exc).__name__,
                        _first_line(exc),
                    )
                self._wait(wait)
                wait = min(2 * wait, RETRY_S[1])
                continue
            with self._cond:
                self._take(batch)
                held = len(self._pending)
            tries = 0
            if failing_since is not None:
                log.warning(
                    "MLflow run %s: MLflow answers again after %.0f s; sending what it missed (%d values to go)",
                    self._run_id,
                    time.monotonic() - failing_since,
                    held,
                )
                failing_since, wait = None, RETRY_S[0]

    def _goes_through(self, entry: tuple) -> bool:
        """Send the value after a failing one ahead of it: True (and it is done with) if it goes through."""
        try:
            self._send([entry])
        except Exception:
            return False
        with self._cond:
            if entry in self._pending:
                self._pending.remove(entry)
            else:  # dropped by `put` meanwhile, and sent all the same
                self.dropped -= 1
        return True

    def close(self, timeout: float) -> int:
        """Send what is pending (waiting up to `timeout` s), stop the thread; returns the values left unsent
        (dropped ones included). A send in flight past the timeout is the thread's last."""
        with self._cond:
            self._closing = self._woken = True
            self._cond.notify()
        self._thread.join(timeout)
        with self._cond:
            self._stopped = True
            self._cond.notify()
            return len(self._pending) + self.dropped + self.refused


def _refused(exc: BaseException) -> bool:
    """MLflow refused the request as a bad one (400: a value or name it does not accept), which trying again
    cannot change. Anything else is an outage: connection errors and exhausted retries (500), a locked or
    unreadable SQLite file (503), and statuses a proxy or a restarting server gives (401, 403, 404, 409,
    499, 5xx)."""
    from mlflow.exceptions import MlflowException

    return isinstance(exc, MlflowException) and exc.get_http_status_code() == 400


def _first_line(exc: BaseException) -> str:
    text = str(exc).strip()
    return text.splitlines()[0][:300] if text else ""


class Tracker:
    """`with Tracker(...) as t: t.log_metrics({...}, step=n)`; marks the run FAILED on an exception.

    Metrics and tags are queued and sent by a background thread (see the module docstring); closing sends
    what is left, waiting up to FLUSH_TIMEOUT_S."""

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
        self._closed = False
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
        self._sender = _Sender(mlflow.MlflowClient(uri), self.run_id, MAX_PENDING)
        log.info("MLflow run %s in experiment %r at %s", self.run_id, experiment, uri)

    def log_params(self, params: Mapping[str, object]) -> None:
        if self.enabled:
            items = [(k, str(v)[:MAX_PARAM_LEN]) for k, v in params.items()]
            for i in range(0, len(items), 100):  # MLflow accepts at most 100 params per call
                self._mlflow.log_params(dict(items[i : i + 100]))

    def log_metrics(self, metrics: Mapping[str, float], step: int) -> None:
        """Queue `metrics` at `step` (timestamped now); returns at once."""
        if self.enabled and step > self.last_logged_step:
            from mlflow.entities import Metric

            now = int(time.time() * 1000)
            self._sender.put([Metric(k, float(v), now, step) for k, v in metrics.items()])

    def set_tags(self, tags: Mapping[str, str]) -> None:
        """Queue `tags`, sent after every metric logged before them; returns at once."""
        if self.enabled:
            from mlflow.entities import RunTag

            self._sender.put([RunTag(k, str(v)) for k, v in tags.items()])

    def log_artifact(self, path: str, artifact_path: str | None = None) -> None:
        if self.enabled:
            self._mlflow.log_artifact(path, artifact_path)

    def close(self, status: str | None = None) -> None:
        """Send what is queued (up to FLUSH_TIMEOUT_S) and end the run with `status` (MLflow's synchronous
        call, after its own retries: minutes against a server that does not answer). MLflow failing here is
        logged, not raised: the stage's checkpoint, export and eval.json are written by then."""
        if not self.enabled or self._closed:
            return
        self._closed = True
        unsent = self._sender.close(FLUSH_TIMEOUT_S)
        if self._mlflow.active_run() is None:  # closed before
            return
        if unsent:
            log.warning(
                "MLflow run %s: %d metric values and tags were not sent (refused by MLflow, more than %d "
                "waiting, or MLflow not answering within %.0f s of the stage's end); eval.json and the "
                "checkpoints keep the stage's results",
                self.run_id,
                unsent,
                MAX_PENDING,
                FLUSH_TIMEOUT_S,
            )
        try:
            self._mlflow.end_run(status=status or self.status)
        except Exception as exc:
            log.warning(
                "MLflow run %s: could not be marked %s (%s: %s); it shows RUNNING in MLflow",
                self.run_id,
                status or self.status,
                type(exc).__name__,
                _first_line(exc),
            )

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
