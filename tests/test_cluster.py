"""Orchestration on a real local Ray cluster (token auth on): ray job submit, fault tolerance, stop."""

import json
import os
import re
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import psutil
import pytest
import torch
from mlflow.tracking import MlflowClient
from safetensors.torch import load_file

from cluster import local

ROOT = Path(__file__).parents[1]
# A worker's progress line as the job log shows it: "(RayTrainWorker pid=N) step 3/8 loss ..." (ANSI inside).
PROGRESS_LINE = re.compile(r"RayTrainWorker pid=\d+.* step \d+/\d+ loss")
TWO_STAGE = ROOT / "configs/experiments/two_stage_tiny.yaml"
SMOKE = ROOT / "configs/experiments/smoke.yaml"
pytestmark = [pytest.mark.ray, pytest.mark.slow]


def cli(
    *args: str, env: dict | None = None, timeout: int = 600, check: bool = True
) -> subprocess.CompletedProcess:
    proc = subprocess.run(
        args, cwd=ROOT, env={**os.environ, **(env or {})}, capture_output=True, text=True, timeout=timeout
    )
    if check:
        assert proc.returncode == 0, f"{' '.join(args)} failed:\n{proc.stdout[-4000:]}\n{proc.stderr[-4000:]}"
    return proc


def ray_bin() -> str:
    return str(Path(sys.executable).with_name("ray"))


def assert_readable_job_log(log: str) -> None:
    """Each worker line once (Ray Train's print patch doubled them) and no PreemptionWatcher error."""
    progress = [line for line in log.splitlines() if PROGRESS_LINE.search(line)]
    assert progress and len(progress) == len(set(progress)), "\n".join(progress)
    assert "PreemptionWatcher" not in log and "core_worker.cc" not in log, log[-3000:]


def runs_by_name(uri: str) -> dict:
    client = MlflowClient(uri)
    return {
        r.info.run_name: r for r in client.search_runs([e.experiment_id for e in client.search_experiments()])
    }


def ray_job_submit(
    ray_cluster, run_dir: Path, data: Path, *overrides: str, options=(), env_vars=None
) -> list[str]:
    """The plain `ray job submit` command line of the two-stage experiment, as a user types it."""
    runtime_env = {
        "excludes": [".git", ".venv", "data", "runs"],
        **({"env_vars": env_vars} if env_vars else {}),
    }
    return [
        ray_bin(),
        "job",
        "submit",
        *options,
        "--address",
        ray_cluster.dashboard_url,
        "--working-dir",
        str(ROOT),
        "--runtime-env-json",
        json.dumps(runtime_env),
        "--",
        sys.executable,
        "-m",
        "cluster.run",
        str(TWO_STAGE),
        f"run_dir={run_dir}",
        f"defaults.data.train={data}",
        *overrides,
    ]


def test_two_stage_experiment_through_ray_job_submit(ray_cluster, tmp_path, smoke_dataset):
    run_dir = tmp_path / "exp"
    proc = cli(*ray_job_submit(ray_cluster, run_dir, smoke_dataset))
    log = proc.stdout + proc.stderr
    assert "succeeded" in log.lower()
    assert_readable_job_log(log)
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    runs = runs_by_name(uri)
    parent = runs["two_stage_tiny"]
    assert parent.info.status == "FINISHED"
    for stage in ("pretrain", "finetune"):
        child = runs[stage]
        assert child.info.status == "FINISHED"
        assert child.data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert (run_dir / stage / "DONE.json").is_file()
        assert f"{stage}/loss" in parent.data.metrics  # the parent holds a summary of each stage
    # The fine-tuning stage started from the pretraining stage's exported encoder.
    assert runs["finetune"].data.params["model.init_from"] == str(run_dir / "pretrain" / "export")

    # Resubmitting is idempotent: finished stages are skipped (here through vitpipe submit --follow).
    proc = cli(
        sys.executable,
        "-m",
        "vitpipe",
        "submit",
        str(TWO_STAGE),
        f"run_dir={run_dir}",
        f"defaults.data.train={smoke_dataset}",
        "--address",
        ray_cluster.dashboard_url,
        "--follow",
        "--python",
        sys.executable,
    )
    out = proc.stdout + proc.stderr
    assert "stage pretrain: already finished" in out and "stage finetune: already finished" in out
    assert "SUCCEEDED" in out
    jobs = cli(sys.executable, "-m", "vitpipe", "jobs", "--address", ray_cluster.dashboard_url).stdout
    assert "two_stage_tiny-" in jobs and "SUCCEEDED" in jobs


def _train(ray_cluster, run_dir: Path, data: Path, *extra: str, check: bool = True):
    return cli(
        sys.executable,
        "-m",
        "vitpipe",
        "train",
        str(SMOKE),
        f"cluster.address={ray_cluster.address}",
        f"run_dir={run_dir}",
        f"data.train={data}",
        "optim.steps=8",
        "checkpoint.every_steps=2",
        "tracking.system_metrics=false",
        "model.overrides.drop_path_rate=0.1",
        *extra,
        check=check,
    )


def test_killed_worker_recovers_with_the_weights_of_an_uninterrupted_run(
    ray_cluster, tmp_path, smoke_dataset
):
    _train(ray_cluster, tmp_path / "straight", smoke_dataset)
    _train(
        ray_cluster,
        tmp_path / "killed",
        smoke_dataset,
        "cluster.max_failures=1",
        "debug.kill_rank=1",
        "debug.kill_at_step=5",
    )
    assert (tmp_path / "killed" / "debug_killed_rank1_step5").is_file()  # the fault really happened
    a = load_file(str(tmp_path / "straight" / "export" / "model.safetensors"))
    b = load_file(str(tmp_path / "killed" / "export" / "model.safetensors"))
    assert all(torch.equal(a[k], b[k]) for k in a)
    history = MlflowClient(f"sqlite:///{tmp_path / 'killed' / 'mlflow.db'}")
    (run,) = history.search_runs([e.experiment_id for e in history.search_experiments()])
    steps = [m.step for m in history.get_metric_history(run.info.run_id, "train/loss")]
    assert steps == list(range(1, 9)) and run.info.status == "FINISHED"


def test_retries_exhausted_fail_the_job_and_the_mlflow_runs(ray_cluster, tmp_path, smoke_dataset):
    run_dir = tmp_path / "exp"
    proc = cli(
        sys.executable,
        "-m",
        "vitpipe",
        "run",
        str(TWO_STAGE),
        f"run_dir={run_dir}",
        f"defaults.data.train={smoke_dataset}",
        f"cluster.address={ray_cluster.address}",
        "cluster.max_failures=0",
        "stages.pretrain.debug.kill_rank=1",
        "stages.pretrain.debug.kill_at_step=3",
        check=False,
    )
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert "stage pretrain failed" in proc.stderr
    runs = runs_by_name(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert runs["two_stage_tiny"].info.status == "FAILED"
    assert runs["pretrain"].info.status == "FAILED"
    assert "finetune" not in runs and not (run_dir / "pretrain" / "DONE.json").exists()


def test_ray_job_stop_checkpoints_the_running_stage(ray_cluster, tmp_path, smoke_dataset):
    run_dir = tmp_path / "exp"
    sid = f"stoptest-{int(time.time())}"
    cli(
        *ray_job_submit(
            ray_cluster,
            run_dir,
            smoke_dataset,
            "stages.pretrain.optim.steps=400",
            options=("--no-wait", "--submission-id", sid),
            env_vars={"RAY_JOB_STOP_WAIT_TIME_S": "120"},
        )
    )
    ckpts = run_dir / "pretrain" / "checkpoints"
    deadline = (
        time.time() + 600
    )  # Ray Train start-up takes minutes when the suite's other workers load the cores
    while not list(ckpts.glob("step_*/COMPLETE.json")) and time.time() < deadline:
        time.sleep(1)
    assert list(ckpts.glob("step_*/COMPLETE.json")), "the stage never checkpointed"
    cli(sys.executable, "-m", "vitpipe", "stop", sid, "--address", ray_cluster.dashboard_url)
    while time.time() < deadline:
        status = cli(ray_bin(), "job", "status", sid, "--address", ray_cluster.dashboard_url).stdout.lower()
        if any(word in status for word in ("was stopped", "failed", "succeeded")):
            break
        time.sleep(1)
    assert "was stopped" in status, status
    logs = cli(ray_bin(), "job", "logs", sid, "--address", ray_cluster.dashboard_url).stdout
    assert "stopped at step" in logs, logs[-3000:]
    stopped = int(logs.split("stopped at step ")[1].split(":")[0])
    assert (ckpts / "latest").read_text() == f"step_{stopped:08d}" and stopped < 400


def test_a_client_without_the_token_is_refused(ray_cluster, tmp_path):
    bad = tmp_path / "token"
    bad.write_text("not-the-token")
    env = {"RAY_AUTH_MODE": "token", "RAY_AUTH_TOKEN_PATH": str(bad), "RAY_AUTH_TOKEN": ""}
    proc = cli(ray_bin(), "job", "list", "--address", ray_cluster.dashboard_url, env=env, check=False)
    assert proc.returncode != 0
    assert (
        "401" in proc.stderr + proc.stdout
        or "nauthorized" in proc.stderr + proc.stdout
        or "uthenticat" in proc.stderr + proc.stdout
    )
    ok = cli(ray_bin(), "job", "list", "--address", ray_cluster.dashboard_url, env={"RAY_AUTH_MODE": "token"})
    assert ok.returncode == 0


def test_local_cluster_is_two_nodes_bound_to_loopback(ray_cluster):
    proc = cli(ray_bin(), "status", "--address", ray_cluster.address, env={"RAY_AUTH_MODE": "token"})
    active = proc.stdout.split("Active:")[1].split("Pending:")[0]
    assert active.count("node_") == 2, proc.stdout
    assert ray_cluster.dashboard_url.startswith("http://127.0.0.1:")


def test_a_failed_local_start_leaves_no_process_behind(monkeypatch):
    """`ray start --head` that fails after starting its GCS server (here: the dashboard port is taken)
    raises, and stops what it had started: a GCS server left running makes the next start time out."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    free = local._free_port
    ports = iter([free(), busy.getsockname()[1]])  # the GCS port, then the dashboard's, then any free ones
    monkeypatch.setattr(local, "_free_port", lambda: next(ports, None) or free())
    temp_dir = tempfile.mkdtemp(
        prefix="ray-failed-", dir="/tmp"
    )  # short: Ray's socket paths must fit 107 bytes
    try:
        with pytest.raises(RuntimeError, match="already occupied"):
            local.start_head(temp_dir, num_cpus=1)
    finally:
        busy.close()
        shutil.rmtree(temp_dir, ignore_errors=True)
    left = [
        p.info["name"]
        for p in psutil.process_iter(["name", "cmdline"])
        if f"{temp_dir}/" in " ".join(p.info["cmdline"] or [])
    ]
    assert not left, f"processes of the failed start still running: {left}"


def test_segmentation_stages_run_as_ray_stages(ray_cluster, tmp_path):
    """A SETR stage and its segmentation eval stage as Ray Train runs of an experiment (2 workers, ZeRO-2),
    the eval reading the train stage's export by stage name."""
    from data_prep.synthetic import layout_class_names, segmentation_class_names, synthetic_samples
    from data_prep.writer import write_dataset

    data = tmp_path / "layout"
    samples = synthetic_samples(96, 0, seed=0, width=48, height=40, val_fraction=0.25, layout=True, objects=3)
    write_dataset(
        data, samples, layout_class_names(3), True, 12, segmentation_classes=segmentation_class_names(3)
    )
    config = tmp_path / "segmentation.yaml"
    stages = {
        "seg": {"model": {"init_from": None}, "optim": {"steps": 4, "warmup_steps": 1}},
        "eval_seg": {"kind": "eval", "model": {"init_from": "seg", "init_head": True}},
    }
    defaults = {
        "model": {"name": "setr_naive_vit_debug", "img_size": 32},
        "objective": {"name": "segmentation"},
        "data": {"train": str(data), "batch_size": 8, "num_workers": 1},
        "deepspeed": {"zero_stage": 2},
        "tracking": {"system_metrics": False, "log_every": 1},
    }
    experiment = {"name": "seg_tiny", "cluster": {"num_workers": 2}, "defaults": defaults, "stages": stages}
    config.write_text(json.dumps(experiment))  # JSON is YAML
    run_dir = tmp_path / "exp"
    cli(
        sys.executable,
        "-m",
        "vitpipe",
        "run",
        str(config),
        f"run_dir={run_dir}",
        f"cluster.address={ray_cluster.address}",
    )
    runs = runs_by_name(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert runs["seg"].info.status == "FINISHED" and "train/pixel_accuracy" in runs["seg"].data.metrics
    metrics = runs["eval_seg"].data.metrics
    assert {"eval/miou", "eval/pixel_accuracy", "eval/mean_accuracy"} <= set(metrics)
    summary = json.loads((run_dir / "eval_seg" / "eval.json").read_text())
    assert summary["eval_samples"] == json.loads((data / "manifest.json").read_text())["totals"]["val"]
    assert summary["world_size"] == 2 and len(summary["iou_per_class"]) == 4
    assert (run_dir / "eval_seg" / "figures" / "segmentation_masks.png").is_file()
