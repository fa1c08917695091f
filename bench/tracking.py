"""What a log step costs the ranks on rank 0: MLflow's synchronous call against the Tracker's queue.

    .venv/bin/python bench/tracking.py --out bench/results/tracking.json [--steps 40] [--rounds 5]

At a log step rank 0 reads the losses, logs them and only then issues the next step's work; every other rank
waits for it at that step's first collective, so the time rank 0 spends logging is a stall of the whole job
(1,024 ranks at the scale the pipeline stands in for). Measured against a real `mlflow server` on 127.0.0.1
(SQLite behind it; what nodes that share no disk log to) and against a SQLite file (the local default), each
log step carrying the training loop's 14 values:

- sync: `mlflow.log_metrics` (how the Tracker logged before);
- queued: `Tracker.log_metrics` (`pipeline.tracking._Sender` sends from a thread), then the close's flush, timed
  apart: it happens once, at the stage's end.

Rounds alternate between the two; medians over every log step of every round. Goal: queued / sync <= 0.05. The
run also checks that the queued values all reached MLflow, in order.
"""

from __future__ import annotations

import argparse
import os
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import urllib.request
from pathlib import Path

from provenance import write_result  # bench/provenance.py, beside this file

from pipeline.tracking import Tracker

GOAL = 0.05
KEYS = [  # what the training loop logs at a log step (pipeline.train.loop.Loop.log), fourteen values
    "train/loss", "train/lr", "train/images_per_s", "data/skipped_samples", "data/epoch", "data/wait_fraction",
    "train/acc", "train/grad_norm", "perf/tflops_per_device", "perf/mfu", "perf/hfu", "checkpoint/stall_s",
    "checkpoint/save_s", "data/gpu_idle_fraction",
]  # fmt: skip


def start_server(root: Path) -> tuple[subprocess.Popen, str]:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "mlflow", "server", "--backend-store-uri", f"sqlite:///{root / 'server.db'}",
        "--artifacts-destination", str(root / "artifacts"), "--host", "127.0.0.1", "--port", str(port),
        "--workers", "1",
    ]  # fmt: skip
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    log = open(root / "server.log", "w")
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url, deadline = f"http://127.0.0.1:{port}", time.time() + 600
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5):
                return proc, url
        except OSError as exc:
            if proc.poll() is not None or time.time() > deadline:
                log_text = (root / "server.log").read_text()[-2000:]
                raise RuntimeError(f"mlflow server did not come up: {log_text}") from exc
            time.sleep(0.5)


def one_round(uri: str, mode: str, steps: int) -> tuple[list[float], float]:
    """Per log step seconds on the caller's thread, and the close's seconds."""
    import mlflow

    values = {k: 0.5 for k in KEYS}
    tracker = Tracker(uri, "bench", mode, enabled=True)
    times = []
    for step in range(1, steps + 1):
        t = time.perf_counter()
        if mode == "sync":
            mlflow.log_metrics(values, step=step)
        else:
            tracker.log_metrics(values, step=step)
        times.append(time.perf_counter() - t)
    t = time.perf_counter()
    tracker.close()
    closed = time.perf_counter() - t
    history = mlflow.MlflowClient(uri).get_metric_history(tracker.run_id, "train/loss")
    if [m.step for m in history] != list(range(1, steps + 1)):
        raise AssertionError(f"{uri} {mode}: MLflow holds steps {[m.step for m in history]}")
    return times, closed


def measure(uri: str, steps: int, rounds: int) -> dict:
    per = {"sync": [], "queued": []}
    closes = []
    for r in range(rounds):
        for mode in ("sync", "queued") if r % 2 == 0 else ("queued", "sync"):
            times, closed = one_round(uri, mode, steps)
            per[mode] += times
            if mode == "queued":
                closes.append(closed)
    sync, queued = statistics.median(per["sync"]), statistics.median(per["queued"])
    return {
        "log_step_ms": {"sync": round(sync * 1e3, 3), "queued": round(queued * 1e3, 4)},
        "ratio_queued_over_sync": round(queued / sync, 5),
        "close_flush_ms_median": round(statistics.median(closes) * 1e3, 1),
        "log_steps_timed_per_mode": len(per["sync"]),
        "met": queued / sync <= GOAL,
    }


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--steps", type=int, default=40, help="log steps per round")
    p.add_argument("--rounds", type=int, default=5)
    p.add_argument("--out")
    args = p.parse_args(argv)
    root = Path(tempfile.mkdtemp(prefix="bench-tracking-"))
    proc, url = start_server(root)
    try:
        backends = {
            "mlflow_server": measure(url, args.steps, args.rounds),
            "sqlite_file": measure(f"sqlite:///{root / 'local.db'}", args.steps, args.rounds),
        }
    finally:
        os.killpg(proc.pid, signal.SIGTERM)
        proc.wait(timeout=60)
    result = {
        "benchmark": "tracking",
        "what": "rank 0's time in a log step (every rank waits for it): MLflow's synchronous log_metrics "
        "against the Tracker's queue, 14 values a log step; the close's flush once per stage",
        "goal": f"queued / sync <= {GOAL}",
        "backends": backends,
        "met": all(b["met"] for b in backends.values()),
    }
    write_result(result, args.out)
    return 0 if result["met"] else 1


if __name__ == "__main__":
    sys.exit(main())
