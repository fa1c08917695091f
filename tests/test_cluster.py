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
from conftest import _RayClusters, vitpipe_shard
from mlflow.tracking import MlflowClient
from safetensors.torch import load

from cluster import local, submit
from data_prep.storage import Store, child
from pipeline.train.tag import tag_for as checkpoint_tag

ROOT = Path(__file__).parents[1]
# A worker's progress line as the job log shows it: "(RayTrainWorker pid=N) step 3/8 loss ..." (ANSI inside).
PROGRESS_LINE = re.compile(r"RayTrainWorker pid=\d+.* step \d+/\d+ loss")
TWO_STAGE = ROOT / "configs/experiments/two_stage_tiny.yaml"
MULTINODE = ROOT / "configs/experiments/multinode_tiny.yaml"
SMOKE = ROOT / "configs/experiments/smoke.yaml"
pytestmark = [pytest.mark.ray, pytest.mark.slow]
# How long a stage or job may take before the test calls it hung. A guard only: under the suite's full load
# (five xdist workers on two cores) a 16-step stage with a node kill has taken 15 minutes.
HANG_S = 1800


def cli(
    *args: str, env: dict | None = None, timeout: int = HANG_S, check: bool = True
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
    # Ray Train's placement-group cleaner found every local cluster on this machine and died (the suite
    # runs several); cluster.local gives each node RAY_ADDRESS.
    assert "multiple active Ray instances" not in log, log[-3000:]


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


def _train_across_nodes(ray_cluster, run_dir: Path, data: Path, uri: str, db: Path, *extra: str) -> list[str]:
    """`vitpipe train` of the smoke stage with one rank per node (SPREAD), checkpoints and export in a bucket,
    MLflow in a SQLite file every node sees; 16 steps made to last about 8 s (`debug.step_delay_s`)."""
    return [
        sys.executable, "-m", "vitpipe", "train", str(SMOKE), f"cluster.address={ray_cluster.address}",
        f"run_dir={run_dir}", f"data.train={data}", f"checkpoint.uri={uri}", f"tracking.uri=sqlite:///{db}",
        "cluster.placement_strategy=SPREAD", "optim.steps=16", "checkpoint.every_steps=2",
        "debug.step_delay_s=0.5", "tracking.system_metrics=false", "model.overrides.drop_path_rate=0.1", *extra,
    ]  # fmt: skip


def _kill_node_mid_stage(cmd: list[str], stored: Store, kill) -> str:
    """Run `cmd`, kill the second node once the stage has a checkpoint at step 4 or later in the bucket
    (and before its last), and return the command's output once it ends: it must succeed, and have resumed
    after the kill."""
    proc = subprocess.Popen(cmd, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline, killed_at = time.time() + HANG_S, None
    while time.time() < deadline and proc.poll() is None:
        latest = stored.read_text("latest") if stored.exists("latest") else ""
        if latest >= "step_00000004":
            kill()
            killed_at = latest
            break
        time.sleep(0.5)
    out = proc.communicate(timeout=max(60, deadline - time.time()))[0]
    assert proc.returncode == 0, out[-5000:]
    assert killed_at is not None and killed_at < "step_00000016", (killed_at, out[-3000:])
    assert "(resumed from step_" in out, out[-5000:]  # the stage started again after the kill
    return out


def _losses(db: Path) -> dict[int, float]:
    client = MlflowClient(f"sqlite:///{db}")
    (run,) = client.search_runs([e.experiment_id for e in client.search_experiments()])
    assert run.info.status == "FINISHED"
    return {m.step: m.value for m in client.get_metric_history(run.info.run_id, "train/loss")}


@pytest.mark.timeout(2 * HANG_S + 600)
def test_a_killed_node_recovers_with_the_weights_of_an_uninterrupted_run(
    ray_cluster, node_disks, kill_worker_node, s3, tmp_path, smoke_dataset
):
    """One rank per node, the second node's disk its own; the whole second node dies mid-stage (every process
    of it, not one worker). Ray Train restarts the worker group (max_failures) on the head, whose two CPUs
    take both ranks; they resume from the bucket and end with the uninterrupted run's weights."""
    head_disk, worker_disk = node_disks
    for name in ("straight", "killed"):
        (tmp_path / name).mkdir()
    straight = s3("nodekill/straight")
    proc = cli(
        *_train_across_nodes(
            ray_cluster, head_disk / "straight", smoke_dataset, straight, tmp_path / "straight/m.db"
        )
    )
    # Ray Train's Result.checkpoint: with storage, in the bucket (the nodes share no disk), pointing at the export
    found = re.search(r"Ray Train checkpoint: s3://ckpt/nodekill/straight/(ray/smoke/\S+)", proc.stdout)
    assert found, proc.stdout[-2000:]
    pointer = json.loads(Store(straight).read_bytes(f"{found.group(1)}/export.json"))
    assert pointer["export_uri"] == child(straight, "export") and pointer["step"] == 16
    killed = s3("nodekill/killed")
    cmd = _train_across_nodes(
        ray_cluster,
        head_disk / "killed",
        smoke_dataset,
        killed,
        tmp_path / "killed/m.db",
        "cluster.max_failures=1",
    )
    _kill_node_mid_stage(cmd, Store(killed), kill_worker_node)
    # The second node held a rank: its ZeRO-2 shard was on its own disk (the node died with it).
    assert list((worker_disk / "killed/checkpoints").glob("step_*/zero_pp_rank_*"))
    a = load(Store(straight).read_bytes("export/model.safetensors"))
    b = load(Store(killed).read_bytes("export/model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    loss, expected = _losses(tmp_path / "killed/m.db"), _losses(tmp_path / "straight/m.db")
    assert sorted(loss) == list(range(1, 17)) and loss[16] == expected[16]


@pytest.mark.timeout(2 * HANG_S + 600)
def test_an_elastic_stage_that_loses_a_node_goes_on_on_the_rest(
    ray_cluster, node_disks, kill_worker_node, s3, tmp_path, smoke_dataset
):
    """cluster.num_workers [1, 2] with 2 CPUs per worker: one rank per node. The second node dies for good;
    Ray Train restarts the stage on the one worker that fits, which reshards the newest checkpoint from the
    bucket and keeps the global batch (grad_accum 1 -> 2)."""
    head_disk, worker_disk = node_disks
    _RayClusters.wait_for_cpus(4)  # both nodes free: the stage starts on two workers
    uri = s3("elastic/job")
    cmd = _train_across_nodes(
        ray_cluster, head_disk / "elastic", smoke_dataset, uri, tmp_path / "m.db",
        "cluster.num_workers=[1,2]", "cluster.cpus_per_worker=2", "cluster.max_failures=3",
    )  # fmt: skip
    out = _kill_node_mid_stage(cmd, Store(uri), kill_worker_node)
    assert list((worker_disk / "elastic/checkpoints").glob("step_*/zero_pp_rank_*")), out[
        -5000:
    ]  # it had a rank
    assert "saved by 2 ranks; resharding it for 1" in out and "grad_accum 1 -> 2" in out, out[-5000:]
    record = json.loads(Store(uri).read_text(f"{checkpoint_tag(16)}/COMPLETE.json"))
    assert (record["world_size"], record["grad_accum"], record["global_batch"]) == (1, 2, 32)
    assert sorted(_losses(tmp_path / "m.db")) == list(range(1, 17))


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


def test_submit_refuses_a_dataset_a_worker_node_does_not_see_before_uploading(
    ray_cluster, node_disks, tmp_path, smoke_dataset, monkeypatch
):
    """vitpipe submit asks every node, in one small job that uploads only the probe, whether it sees each
    stage's local dataset: one on the head's own disk is refused, naming the node, path and stages, before
    the project is uploaded; one every node sees passes."""

    def no_upload(*args, **kwargs):
        raise AssertionError("the project was submitted")

    monkeypatch.setattr(submit, "submit_job", no_upload)
    head_disk, _ = node_disks
    only_head = head_disk / f"data-{tmp_path.name}"  # the second node sees its own folder at this path
    shutil.copytree(smoke_dataset, only_head)
    common = [f"run_dir={tmp_path}", "defaults.data.synthetic=null"]
    with pytest.raises(submit.SubmitError) as refused:
        submit.submit(
            str(TWO_STAGE),
            [*common, f"defaults.data.train={only_head}"],
            ray_cluster.dashboard_url,
            sys.executable,
        )
    message = str(refused.value)
    node = r"node 127\.0\.0\.1 \(\w{8}\)"
    assert re.search(rf"{node} does not see {only_head} \(data.train of pretrain, finetune\)", message), (
        message
    )
    assert message.count("does not see") == 1 and "s3://BUCKET" in message  # the head sees it
    with pytest.raises(AssertionError, match="the project was submitted"):  # every node sees this one
        submit.submit(
            str(TWO_STAGE),
            [*common, f"defaults.data.train={smoke_dataset}"],
            ray_cluster.dashboard_url,
            sys.executable,
        )
    jobs = cli(sys.executable, "-m", "vitpipe", "jobs", "--address", ray_cluster.dashboard_url).stdout
    assert jobs.count("vitpipe-path-probe-") >= 2 and "SUCCEEDED" in jobs
    shutil.rmtree(only_head)


def test_local_cluster_is_two_nodes_with_the_dashboard_on_loopback(ray_cluster):
    # `ray status` reports what the autoscaler last saw: a node that joined a second ago may be missing.
    for _ in range(30):
        proc = cli(ray_bin(), "status", "--address", ray_cluster.address, env=local.auth_env())
        active = proc.stdout.split("Active:")[1].split("Pending:")[0]
        if active.count("node_") == 2:
            break
        time.sleep(2)
    assert active.count("node_") == 2, proc.stdout
    assert ray_cluster.dashboard_url.startswith("http://127.0.0.1:")
    nodes = cli(ray_bin(), "list", "nodes", "--address", ray_cluster.address, env=local.auth_env())
    # Both nodes on loopback (tests/test_security.py lists their sockets); told apart by their node IDs.
    assert nodes.stdout.count("127.0.0.1") >= 2 and "127.0.0.2" not in nodes.stdout, nodes.stdout


def test_workers_on_every_node_run_at_nice_0_and_know_their_cluster(ray_cluster):
    """A task on each node reports its niceness and RAY_ADDRESS: 0 (the suite's setting; Ray's own 15
    starved the Ray tests against the torchrun ones) and this cluster's address (cluster.local gives it to
    each node, so that Ray's address-less state-API lookups find this cluster among the suite's several)."""
    probe = (
        "import json, os, ray\n"
        "from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy as On\n"
        f"ray.init(address='{ray_cluster.address}', logging_level='ERROR')\n"
        "f = ray.remote(num_cpus=0)(lambda: (os.nice(0), os.environ.get('RAY_ADDRESS')))\n"
        "nodes = [n['NodeID'] for n in ray.nodes() if n['Alive']]\n"
        "print(json.dumps(ray.get([f.options(scheduling_strategy=On(n, soft=False)).remote() for n in nodes])))"
    )
    out = cli(sys.executable, "-c", probe, env=local.auth_env()).stdout.strip().splitlines()[-1]
    assert json.loads(out) == [[0, ray_cluster.address]] * 2, out


def test_a_second_node_on_this_machine_offers_no_gpu():
    """cluster.local's head offers this machine's GPUs and a node beside it none: each raylet counts every
    GPU it sees, so both would offer the same devices and a stage's workers on the two nodes would each be
    given "GPU 0" (NCCL: duplicate GPU). Ray finds no GPU on this machine, so the node's command is read."""
    cluster = local.LocalCluster("127.0.0.1:6379", "http://127.0.0.1:8265", "/tmp/vitpipe-ray")
    for disk in (None, ("/data", "/data.worker1")):
        cmd = local._worker_command(cluster, 2, "worker1", disk, "127.0.0.1")
        assert cmd[cmd.index("--num-gpus") + 1] == "0", cmd


def test_a_failed_local_start_leaves_no_process_behind(monkeypatch):
    """`ray start --head` that fails after starting its GCS server (here: the dashboard port is taken)
    raises, and stops what it had started: a GCS server left running makes the next start time out."""
    busy = socket.socket()
    busy.bind(("127.0.0.1", 0))
    busy.listen()
    free = local.free_ports

    def ports(n: int) -> list[int]:  # the GCS port, then the dashboard's (taken), then the agents'
        chosen = free(n)
        return [chosen[0], busy.getsockname()[1], *chosen[2:]]

    monkeypatch.setattr(local, "free_ports", ports)
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


def test_a_start_that_times_out_waiting_for_its_raylet_is_made_again(tmp_path):
    """`ray start` waits a fixed 30 s for its raylet to register with the GCS; a busy machine passes that
    (seen on CI) and the same start a moment later succeeds. Stand-ins for `ray start` (processes that fail
    with Ray's message, or another) count the attempts: a timeout is tried again, up to 3 times in all;
    any other failure raises at once."""
    timeout = "Exception: The current node timed out during startup. This could happen because ..."
    calls: list[list[str]] = []

    def command(failures: int, message: str):
        def make() -> tuple[list[str], None]:
            code = f"import sys; print({message!r}); sys.exit(1)" if len(calls) < failures else "pass"
            calls.append([sys.executable, "-c", code])
            return calls[-1], None

        return make

    local._start(command(2, timeout), str(tmp_path))
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="attempt 3 of 3"):
        local._start(command(5, timeout), str(tmp_path))
    assert len(calls) == 3
    calls.clear()
    with pytest.raises(RuntimeError, match="already occupied") as err:
        local._start(command(5, "port 6379 is already occupied"), str(tmp_path))
    assert len(calls) == 1 and "attempt" not in str(err.value)


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


def _tags_on(disk: Path, stage: str) -> list[str]:
    return sorted(p.name for p in (disk / "exp" / stage / "checkpoints").glob("step_*"))


@pytest.mark.timeout(2 * HANG_S + 600)
def test_nodes_that_share_only_the_bucket_and_mlflow_run_stop_and_resume_an_experiment(
    ray_cluster, node_disks, s3, mlflow_server, tmp_path
):
    """The rehearsal of docs/cluster.md: the second node has its own disk at the run root, and a bucket (S3
    protocol) and an MLflow server are all the nodes share. The shards stream from the bucket; each stage
    runs one rank per node (STRICT_SPREAD). A run_dir without storage is refused before any worker starts;
    with storage the 3-stage experiment, stopped mid-stage through `ray job submit`/`vitpipe stop`, then
    every node's disk wiped, resumes from the bucket when resubmitted with `vitpipe submit` and finishes."""
    head_disk, worker_disk = node_disks
    data = s3("rehearsal/corpus")
    vitpipe_shard(
        "synthetic", data, "--num", 320, "--classes", 8, "--width", 48, "--height", 40,
        "--max-count", 40, "--val-fraction", 0.2, "--workers", 1, "--no-progress",
    )  # fmt: skip
    run_dir = head_disk / "exp"
    creds = {k: os.environ[k] for k in ("AWS_ACCESS_KEY_ID", "AWS_SECRET_ACCESS_KEY", "AWS_DEFAULT_REGION")}
    common = [f"run_dir={run_dir}", f"defaults.data.train={data}", f"tracking.uri={mlflow_server}"]

    # No storage: the second node does not see the driver's run_dir; refused in seconds, naming both.
    proc = cli(
        sys.executable, "-m", "cluster.run", str(MULTINODE), *common, f"cluster.address={ray_cluster.address}",
        env=creds, check=False,
    )  # fmt: skip
    assert proc.returncode == 1, proc.stdout[-3000:] + proc.stderr[-3000:]
    assert f"does not see run_dir {run_dir / 'pretrain'}" in proc.stderr, proc.stderr[-3000:]
    assert "storage" in proc.stderr and re.search(r"node 127\.0\.0\.1 \([0-9a-f]{8}\)", proc.stderr)

    storage = s3("rehearsal/runs/{name}")
    first = [*common, f"storage={storage}", "stages.pretrain.optim.steps=400"]
    sid = f"rehearsal-{int(time.time())}"
    # Ray's default grace between `ray job stop`'s SIGTERM and its SIGKILL is 3 s: too short for a stage to
    # reach its next step and checkpoint on loaded cores (vitpipe submit sets 300 s).
    env_vars = {**creds, "RAY_JOB_STOP_WAIT_TIME_S": "300"}
    submit_cmd = [
        ray_bin(), "job", "submit", "--no-wait", "--submission-id", sid,
        "--address", ray_cluster.dashboard_url, "--working-dir", str(ROOT),
        "--runtime-env-json", json.dumps({"excludes": [".git", ".venv", "data", "runs"], "env_vars": env_vars}),
        "--", sys.executable, "-m", "cluster.run", str(MULTINODE), *first,
    ]  # fmt: skip
    cli(*submit_cmd)
    stored = Store(child(storage.format(name="multinode_tiny"), "pretrain"))  # the stage's checkpoints
    # Ray Train start-up takes minutes when the suite's other workers load the cores.
    deadline = time.time() + HANG_S
    while not stored.exists("latest") and time.time() < deadline:
        time.sleep(1)
    assert stored.exists("latest"), "the stage never checkpointed to the bucket"
    cli(sys.executable, "-m", "vitpipe", "stop", sid, "--address", ray_cluster.dashboard_url)
    # Polled in this process (the Jobs API's client): a `ray job status` a second costs 2 CPU-s of import.
    jobs = submit.client(ray_cluster.dashboard_url)
    status = str(jobs.get_job_status(sid).value)
    while status not in submit.DONE_STATUSES and time.time() < deadline:
        time.sleep(1)
        status = str(jobs.get_job_status(sid).value)
    logs = cli(ray_bin(), "job", "logs", sid, "--address", ray_cluster.dashboard_url).stdout
    assert status == "STOPPED", status + logs[-3000:]
    assert_readable_job_log(logs)
    assert "stopped at step" in logs, logs[-3000:]
    stopped = int(logs.split("stopped at step ")[1].split(":")[0])
    assert stored.read_text("latest") == f"step_{stopped:08d}" and stopped < 400
    assert stored.exists(f"step_{stopped:08d}/COMPLETE.json")
    # Both nodes held a rank: each wrote its own ZeRO shard on its own disk, and kept at most keep_last tags.
    for disk in (head_disk, worker_disk):
        tags = _tags_on(disk, "pretrain")
        assert 1 <= len(tags) <= 2, (disk, tags)
    shards = [
        {
            int(f.name.split("rank_")[1].split("_")[0])
            for f in (d / "exp/pretrain/checkpoints").glob("step_*/zero_pp_rank_*")
        }
        for d in (head_disk, worker_disk)
    ]
    assert sorted(shards[0] | shards[1]) == [0, 1] and not (shards[0] & shards[1]), shards

    # The whole cluster torn down: every node's disk is gone (checkpoints, run-id files, the driver's
    # records). Resubmitted (a shorter pretraining, to finish soon): resumes from the bucket, continues
    # the MLflow runs found by their storage tags, then runs the other stages.
    shutil.rmtree(head_disk / "exp")
    shutil.rmtree(worker_disk / "exp")
    proc = cli(
        sys.executable, "-m", "vitpipe", "submit", str(MULTINODE), *common, f"storage={storage}",
        f"stages.pretrain.optim.steps={stopped + 2}", "--address", ray_cluster.dashboard_url, "--follow",
        "--python", sys.executable, *[f"--env={k}={v}" for k, v in creds.items()], timeout=HANG_S,
    )  # fmt: skip
    out = proc.stdout + proc.stderr
    assert "SUCCEEDED" in out and f"resumed from step_{stopped:08d}" in out, out[-4000:]
    runs = runs_by_name(mlflow_server)
    parent = runs["multinode_tiny"]
    assert parent.info.status == "FINISHED"
    # One parent and one run per stage: found again through their storage tags after the disks were gone.
    assert len(MlflowClient(mlflow_server).search_runs([parent.info.experiment_id])) == 4
    for stage in ("pretrain", "finetune", "evaluate"):
        assert runs[stage].info.status == "FINISHED", stage
        assert runs[stage].data.tags["mlflow.parentRunId"] == parent.info.run_id
        assert (run_dir / stage / "DONE.json").is_file()  # the driver's record, on the head
    assert {"evaluate/map", "pretrain/loss"} <= set(parent.data.metrics), sorted(parent.data.metrics)
    # One MLflow run per stage: the resumed pretraining continued its run (steps 1..stopped+2, once each).
    history = MlflowClient(mlflow_server).get_metric_history(runs["pretrain"].info.run_id, "train/loss")
    assert sorted(m.step for m in history) == list(range(1, stopped + 3))
    # The fine-tuning read the pretraining's export from the bucket.
    assert runs["finetune"].data.params["model.init_from"].startswith("s3://")
    jobs = cli(sys.executable, "-m", "vitpipe", "jobs", "--address", ray_cluster.dashboard_url).stdout
    assert "multinode_tiny-" in jobs and "SUCCEEDED" in jobs

    # Torn down once more after it finished: resubmitted, every stage is found finished in the bucket.
    shutil.rmtree(head_disk / "exp")
    shutil.rmtree(worker_disk / "exp", ignore_errors=True)
    proc = cli(
        sys.executable, "-m", "cluster.run", str(MULTINODE), *common, f"storage={storage}",
        f"stages.pretrain.optim.steps={stopped + 2}", f"cluster.address={ray_cluster.address}", env=creds,
    )  # fmt: skip
    assert proc.stdout.count("already finished (s3://") == 3, proc.stdout[-3000:]
    for disk in (head_disk, worker_disk):
        for stage in ("pretrain", "finetune"):
            assert len(_tags_on(disk, stage)) <= 2, (disk, stage, _tags_on(disk, stage))


def test_the_detection_experiment_runs_as_ray_stages_in_a_tiny_variant(ray_cluster, tmp_path):
    """configs/experiments/detection.yaml itself, one seed and a few steps per stage on a small corpus: MAE
    pretraining, DETR from its encoder and its eval stage as Ray Train runs, the box AP logged and the figure
    written. The from-scratch pair is dropped (`stages.NAME=null`): the same stage kinds with init_from unset,
    the path every other Ray stage here takes; tests/test_config.py checks the whole file resolves."""
    run_dir = tmp_path / "exp"
    tiny = [
        f"run_dir={run_dir}",
        f"cluster.address={ray_cluster.address}",
        "cluster.cpus_per_worker=1",
        "seeds=[0]",
        "stages.det_scratch=null",
        "stages.eval_det_scratch=null",
        f"defaults.data.train={tmp_path / 'layout'}",
        "defaults.data.synthetic.num=96",
        "defaults.data.synthetic.max_count=24",
        "defaults.tracking.log_every=1",
        *[f"stages.{s}.optim.steps=3" for s in ("pretrain", "det_mae")],
        *[f"stages.{s}.optim.warmup_steps=1" for s in ("pretrain", "det_mae")],
    ]
    cli(sys.executable, "-m", "vitpipe", "run", str(ROOT / "configs/experiments/detection.yaml"), *tiny)
    runs = runs_by_name(f"sqlite:///{run_dir / 'mlflow.db'}")
    assert set(runs) == {"detection", "pretrain_s0", "det_mae_s0", "eval_det_mae_s0"}, sorted(runs)
    assert (
        runs["det_mae_s0"].info.status == "FINISHED" and "train/loss_giou" in runs["det_mae_s0"].data.metrics
    )
    assert runs["det_mae_s0"].data.params["model.init_from"].endswith("pretrain_s0/export")
    assert {"eval/box_map", "eval/box_ap50", "eval/box_ap75"} <= set(runs["eval_det_mae_s0"].data.metrics)
    assert (run_dir / "eval_det_mae_s0" / "figures" / "detection_boxes.png").is_file()
