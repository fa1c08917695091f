"""Rank 0's MLflow writes during a stage (`pipeline.tracking.Tracker`): queued, sent in order by one thread,
held through an outage of the store and sent when it answers; a log step never raises or waits for MLflow.

The outage is MLflow's real SQLite store failing every write of a metric or tag: a trigger calls a
function that does not exist, which SQLite reports as an OperationalError at once, as it reports a locked
or unreadable database (MLflow: TEMPORARILY_UNAVAILABLE, what a tracking server that does not answer
gives too).
"""

from __future__ import annotations

import logging
import sqlite3
import threading
import time
from contextlib import contextmanager
from pathlib import Path

import pytest
from mlflow.tracking import MlflowClient

from pipeline import tracking
from pipeline.tracking import Tracker

pytestmark = pytest.mark.unit


@contextmanager
def outage(db: Path):
    """Every insert or update of a metric or tag in MLflow's SQLite store `db` fails while inside."""
    triggers = [(t, op) for t in ("metrics", "latest_metrics", "tags") for op in ("INSERT", "UPDATE")]
    with sqlite3.connect(db) as con:
        for table, op in triggers:
            con.execute(
                f"CREATE TRIGGER outage_{table}_{op} BEFORE {op} ON {table} BEGIN SELECT outage_injected(); END"
            )
    try:
        yield
    finally:
        with sqlite3.connect(db) as con:
            for table, op in triggers:
                con.execute(f"DROP TRIGGER outage_{table}_{op}")


def wait_for(condition, what: str, timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.05)


def losses(uri: str, run_id: str, key: str = "train/loss") -> list[tuple[int, float]]:
    return [(m.step, m.value) for m in MlflowClient(uri).get_metric_history(run_id, key)]


def sender_of(tracker: Tracker) -> list[threading.Thread]:
    """The tracker's sending thread while it runs (its name ends with the run id)."""
    return [t for t in threading.enumerate() if t.name == f"mlflow-sender-{tracker.run_id}"]


@pytest.fixture
def store(tmp_path):
    db = tmp_path / "mlflow.db"
    return db, f"sqlite:///{db}"


def counted_sends(monkeypatch) -> list[int]:
    """MlflowClient.log_batch as it is, each call's number of values recorded."""
    calls, send = [], MlflowClient.log_batch

    def counting(self, run_id, metrics=(), params=(), tags=(), synchronous=None):
        calls.append(len(metrics) + len(tags))
        return send(self, run_id, metrics, params, tags, synchronous)

    monkeypatch.setattr(MlflowClient, "log_batch", counting)
    return calls


def test_metrics_logged_while_mlflow_fails_are_sent_in_order_once_it_answers(store, caplog, monkeypatch):
    db, uri = store
    caplog.set_level(logging.WARNING, logger="pipeline.tracking")
    sends = counted_sends(monkeypatch)
    tracker = Tracker(uri, "exp", "stage", enabled=True)
    assert sender_of(tracker)
    tracker.log_metrics({"train/loss": 1.0}, step=1)
    wait_for(lambda: sends, "the first send")
    steps = range(2, 42)
    with outage(db):
        # A synchronous MLflow call raises at each of these (and waits first, against a server, minutes).
        for step in steps:
            tracker.log_metrics({"train/loss": float(step), "train/lr": 0.1 * step}, step=step)
            time.sleep(0.05)
        tracker.set_tags({"export": "/runs/stage/export/model.safetensors"})
        wait_for(lambda: "could not log" in caplog.text, "the sender to meet the outage")
        tried = len(sends) - 1
    tracker.close()
    # Tried again 1 s after a failure, then 2 s (RETRY_S), over the outage's two seconds and more; not at each
    # log step (40 here).
    assert 1 <= tried <= 5, sends
    assert losses(uri, tracker.run_id) == [(1, 1.0)] + [(s, float(s)) for s in steps]
    assert [s for s, _ in losses(uri, tracker.run_id, "train/lr")] == list(steps)
    run = MlflowClient(uri).get_run(tracker.run_id)
    assert run.info.status == "FINISHED" and run.data.tags["export"].endswith("model.safetensors")
    assert "MLflow answers again" in caplog.text and "were not sent" not in caplog.text
    wait_for(lambda: not sender_of(tracker), "the sender thread to end")


def test_a_stage_that_ends_during_an_outage_is_not_held_and_says_what_was_lost(store, caplog, monkeypatch):
    db, uri = store
    monkeypatch.setattr(tracking, "FLUSH_TIMEOUT_S", 0.5)
    monkeypatch.setattr(tracking, "MAX_PENDING", 4)  # values held while MLflow does not answer
    caplog.set_level(logging.WARNING, logger="pipeline.tracking")
    tracker = Tracker(uri, "exp", "stage", enabled=True)
    with outage(db):
        for step in (1, 2, 3):  # six values: the two oldest dropped
            tracker.log_metrics({"train/loss": float(step), "train/lr": 0.1}, step=step)
        assert "more than 4 values wait to be sent" in caplog.text
        tracker.close()  # the run's status is not a metric or tag: it is written
        assert "6 metric values and tags were not sent" in caplog.text
        wait_for(lambda: not sender_of(tracker), "the sender thread to stop at the close")
    # Nothing arrives after the close, even once the store answers again.
    assert (
        losses(uri, tracker.run_id) == []
        and MlflowClient(uri).get_run(tracker.run_id).info.status == "FINISHED"
    )
    with pytest.raises(RuntimeError, match="after the tracker was closed"):
        tracker.log_metrics({"train/loss": 4.0}, step=4)


def test_a_value_mlflow_refuses_is_dropped_alone_and_logging_goes_on(store, caplog):
    _, uri = store
    caplog.set_level(logging.WARNING, logger="pipeline.tracking")
    with Tracker(uri, "exp", "stage", enabled=True) as tracker:
        for step in range(1, 6):  # at step 3, beside a good value, a name MLflow rejects (400)
            tracker.log_metrics(
                {"train/loss": float(step), **({"bad name?!": 1.0} if step == 3 else {})}, step
            )
    assert losses(uri, tracker.run_id) == [(s, float(s)) for s in range(1, 6)]
    assert "refused" in caplog.text and "bad name?!" in caplog.text
    assert MlflowClient(uri).get_run(tracker.run_id).info.status == "FINISHED"


def test_a_value_that_keeps_failing_while_the_next_goes_through_is_dropped_alone(store, caplog, monkeypatch):
    """Not refused as a bad request, yet never stored (a server-side error on that value alone): retried as an
    outage, then sent on its own, and dropped once the value after it goes through."""
    db, uri = store
    monkeypatch.setattr(tracking, "RETRY_S", (0.05, 0.1))
    caplog.set_level(logging.WARNING, logger="pipeline.tracking")
    with Tracker(uri, "exp", "stage", enabled=True) as tracker:
        with sqlite3.connect(db) as con:
            con.execute(  # an error at run time (integer overflow, an OperationalError), for this key alone
                "CREATE TRIGGER poison BEFORE INSERT ON metrics WHEN NEW.key = 'poison' "
                "BEGIN SELECT abs(-9223372036854775807 - 1); END"
            )
        for step in range(1, 6):
            tracker.log_metrics({"train/loss": float(step), **({"poison": 1.0} if step == 2 else {})}, step)
    assert losses(uri, tracker.run_id) == [(s, float(s)) for s in range(1, 6)]
    assert losses(uri, tracker.run_id, "poison") == []
    assert "keeps failing while the values after it go through" in caplog.text
    assert "1 metric values and tags were not sent" in caplog.text
