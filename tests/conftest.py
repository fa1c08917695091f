"""Shared fixtures and the model selection every model test sweeps.

Model tests select registered models by what they are (`models_for`), never by name prefix, so a new
family or size is tested without anyone listing it; a test leaves a model out only through an
exclusion that gives the reason.
"""

import contextlib
import functools
import os
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest
import scheduling
import torch
from safetensors.torch import load_file
from torch.nn.attention import SDPBackend, sdpa_kernel
from torch.utils.flop_counter import FlopCounterMode

from data_prep.synthetic import class_names, synthetic_samples
from data_prep.writer import write_dataset
from pipeline.models import (
    DETR,
    SETR,
    MaskedAutoencoderViT,
    MaskedPatchPredictionViT,
    SimMIM,
    VisionTransformer,
    create_model,
    list_models,
)
from pipeline.tracking import RUN_ID_FILE, read_run_id

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.setdefault("RAY_AUTH_MODE", "token")
# Ray starts its worker processes (Ray Train workers and controllers, job drivers' tasks) at niceness 15,
# so that a node's own daemons stay responsive. On the suite's two shared cores that handed every Ray
# test's workers a few percent of a core against the nice-0 torchrun tests: on CI the Ray tests ran 3-6x
# slower than the rest and timed out. The local clusters' nodes (and everything they start) inherit this.
os.environ.setdefault("RAY_worker_niceness", "0")
if os.environ.get("PYTEST_XDIST_WORKER"):
    # `make test` runs several xdist workers on two cores: a second intra-op thread per process only
    # contends (measured: 8% more CPU for the same model test on an idle machine, more under load).
    # Children (torchrun, vitpipe, Ray nodes) inherit the setting.
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)

ROOT = Path(__file__).parents[1]


# ---------------------------------------------------------------------- model selection

KINDS = ("classifier", "vit", "masked_image", "mae", "masked_patch", "simmim", "segmentation", "detection")
# The masked-image wrappers by class: each has its own objective and its own tests.
WRAPPERS = {"mae": MaskedAutoencoderViT, "masked_patch": MaskedPatchPredictionViT, "simmim": SimMIM}


@functools.cache
def _meta(name: str) -> torch.nn.Module:
    with torch.device("meta"):  # shapes and types only: no memory, no initialisation
        return create_model(name)


def meta_model(name: str, **overrides) -> torch.nn.Module:
    """A fresh `create_model(name, **overrides)` on the meta device: shapes and counts, no weights."""
    with torch.device("meta"):
        return create_model(name, **overrides)


@functools.cache
def model_kinds(name: str) -> frozenset[str]:
    """What a registered model is, from the built model (not its name):
    "classifier"    an image classifier (`forward_features`, `forward_head`): every ViT, TNT, CvT, LeViT, Swin;
    "vit"           a VisionTransformer (every ViT size and the hybrid), also a classifier;
    "masked_image"  a pretraining wrapper that exports a classifier (`export_encoder`), and which one:
                    "mae", "masked_patch" (masked patch prediction) or "simmim";
    "segmentation"  a per-pixel classifier (SETR: test_segmentation.py);
    "detection"     a set-prediction detector (DETR: test_detection.py).
    """
    model = _meta(name)
    if isinstance(model, SETR):
        return frozenset({"segmentation"})
    if isinstance(model, DETR):
        return frozenset({"detection"})
    if hasattr(model, "export_encoder"):
        wrapper = [k for k, cls in WRAPPERS.items() if isinstance(model, cls)]
        if not wrapper:
            raise TypeError(f"{name}: a new masked-image wrapper {type(model).__name__}; add it to WRAPPERS")
        return frozenset({"masked_image", *wrapper})
    if hasattr(model, "forward_features") and hasattr(model, "forward_head"):
        return frozenset({"classifier", "vit"} if isinstance(model, VisionTransformer) else {"classifier"})
    raise TypeError(f"{name}: {type(model).__name__} is neither a classifier nor a masked-image wrapper")


def is_debug_size(name: str) -> bool:
    """The registry's tiny test size of a family (`*_debug`: 32 px, well under a million parameters)."""
    return name.endswith("_debug")


def models_for(kind: str, *, debug: bool | None = None, exclude: dict[str, str] | None = None) -> list[str]:
    """Registered names of one kind (see `model_kinds`); `debug=True` keeps only the debug sizes,
    `debug=False` drops them. `exclude` maps a name to the reason the calling test leaves it out; an
    exclusion that names no selected model is an error (it would hide nothing, and rot)."""
    if kind not in KINDS:
        raise ValueError(f"kind must be one of {KINDS}, got {kind!r}")
    names = [
        n for n in list_models() if kind in model_kinds(n) and (debug is None or is_debug_size(n) == debug)
    ]
    exclude = exclude or {}
    stale = sorted(set(exclude) - set(names))
    if stale:
        raise ValueError(f"exclusions name no selected {kind} model: {stale}")
    if not all(isinstance(r, str) and r.strip() for r in exclude.values()):
        raise ValueError("every exclusion needs a reason")
    return [n for n in names if n not in exclude]


def counted_flops(model: torch.nn.Module, x: torch.Tensor, **forward_kwargs) -> int:
    """FLOPs torch counts for one eval forward of `x` (math attention, so that QK^T and AV count)."""
    with sdpa_kernel(SDPBackend.MATH), FlopCounterMode(display=False) as counter, torch.no_grad():
        model.eval()(x, **forward_kwargs)
    return counter.get_total_flops()


def counted_macs(model: torch.nn.Module, img_size: int, device: str = "cpu") -> float:
    """Multiply-accumulates torch counts for one image (FLOPs / 2); on "meta" from shapes alone."""
    return counted_flops(model, torch.randn(1, 3, img_size, img_size, device=device)) / 2


# ---------------------------------------------------------------------- torchrun runs and what they logged


def table_files(path: Path) -> dict[str, bytes]:
    """The files of a table of the dataset layout (index.parquet, errors.parquet: a folder of parts and its
    `_metadata`), by name: what two builds that should agree byte for byte are compared by."""
    files = {p.name: p.read_bytes() for p in Path(path).iterdir()}
    assert "_metadata" in files and "part-000000.parquet" in files, sorted(files)
    return files


def vitpipe_shard(*args, env=None, expect=0) -> subprocess.CompletedProcess:
    """`vitpipe shard ARGS` from the repository root; asserts its exit status and that nothing crashed."""
    cmd = [sys.executable, "-m", "vitpipe", "shard", *map(str, args)]
    proc = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True, env=env, timeout=900)
    assert proc.returncode == expect, f"{cmd} -> {proc.returncode}\n{proc.stdout}\n{proc.stderr}"
    assert "Traceback" not in proc.stderr, proc.stderr
    return proc


_CURRENT: list[pytest.Item] = []  # the test running in this process (`_current_test`)


@pytest.fixture(autouse=True)
def _current_test(request):
    _CURRENT[:] = [request.node]
    yield
    _CURRENT.clear()


def torchrun(*args: str, nproc: int = 2, timeout: int = 900) -> subprocess.CompletedProcess:
    """A test script under torchrun on `nproc` gloo ranks (one intra-op thread each), from the repository root.
    The calling test must not be in the fast tier (mark it `dist`): `make test-fast` runs no launches."""
    if _CURRENT and scheduling.in_fast_tier(_CURRENT[0]):
        raise AssertionError(
            f"{_CURRENT[0].nodeid} launches torchrun: mark it `dist` (make test-fast skips those)"
        )
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", f"--nproc-per-node={nproc}", *args]
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    assert proc.returncode == 0, f"{' '.join(cmd)} failed:\n{proc.stdout[-3000:]}\n{proc.stderr[-6000:]}"
    return proc


def history(run_dir: Path, metric: str = "train/loss") -> list[tuple[int, float]]:
    """(step, value) of the MLflow run the stage in run_dir logged to (its run-id file names it), in the
    nearest mlflow.db at or above run_dir: the test scripts share one store (a new SQLite store costs
    about 4 s of migrations here)."""
    from mlflow.tracking import MlflowClient  # seconds to import: only sessions that read a run pay for it

    run_id = read_run_id(run_dir / RUN_ID_FILE)
    db = next(p / "mlflow.db" for p in (run_dir, *run_dir.parents) if (p / "mlflow.db").is_file())
    client = MlflowClient(f"sqlite:///{db}")
    return [(m.step, m.value) for m in client.get_metric_history(run_id, metric)]


def weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The consolidated export of the stage in run_dir."""
    return load_file(str(run_dir / "export" / "model.safetensors"))


def ema_weights(run_dir: Path) -> dict[str, torch.Tensor]:
    """The consolidated weight EMA (optim.ema_decay) the stage in run_dir exported."""
    return load_file(str(run_dir / "export" / "model_ema.safetensors"))


# ---------------------------------------------------------------------- training checks


def mean(values) -> float:
    values = list(values)
    return sum(values) / len(values)


def assert_loss_fell(losses: list[float], what: str, *, window: int = 5, ratio: float = 0.9) -> None:
    """The mean loss of the last `window` steps is below `ratio` x that of the first `window`.

    Per-step losses are of different batches: the windows average that noise. A run checked with this
    must fall far past the bar on any machine (tests/scripts/families.py: its settings ended at 0.45-0.75
    of the first window when replayed with perturbed weights and other seeds), while a run that does
    not learn (lr 0, labels that do not belong to their images, divergence) stays at 1.0 or above.
    """
    assert len(losses) >= 2 * window, f"{what}: {len(losses)} logged losses, need {2 * window}"
    first, last = mean(losses[:window]), mean(losses[-window:])
    assert last < ratio * first, (
        f"{what}: loss did not fall ({first:.4f} -> {last:.4f}, ratio {last / first:.3f}, bar {ratio}): {losses}"
    )


# ---------------------------------------------------------------------- fixtures


@pytest.fixture(scope="module")
def one_thread():
    """Tiny models: intra-op threads only contend (10-50x slower on a loaded 2-core machine); restored after."""
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(threads)


class _RayClusters:
    """This process's local Ray cluster (a head plus a second node, token auth on, 127.0.0.1), started
    by the first test that asks for one and stopped after the last of a run of such tests: an idle
    cluster costs about 4 s of CPU a minute (measured), which other tests on two cores would wait for.

    As root, the second node has its own disk at `disk` (a private mount namespace, cluster.local): the
    head and the tests see the real folder there, the node its own one (`disk_of_worker`). Elsewhere the
    two nodes share every path."""

    cluster = None
    temp_dir = ""
    disk = ""
    disk_of_worker = ""

    @classmethod
    def get(cls):
        if cls.cluster is None:
            from cluster import local  # imports Ray (seconds): only sessions that run a Ray test pay for it

            cls.temp_dir = tempfile.mkdtemp(
                prefix="vpray", dir="/tmp"
            )  # short: Ray's socket paths have a limit
            cls.cluster = local.start_head(cls.temp_dir, num_cpus=2)
            cls.disk, cls.disk_of_worker = f"{cls.temp_dir}-disk", f"{cls.temp_dir}-disk.worker1"
            own = (cls.disk, cls.disk_of_worker) if OWN_DISKS else None
            local.add_worker_node(cls.cluster, num_cpus=2, own_disk=own)
        return cls.cluster

    @classmethod
    def revive_worker(cls) -> None:
        """The second node again, as it was started, after a test killed it (`local.kill_node`)."""
        from cluster import local

        local.kill_node(cls.cluster)  # whatever of it is left
        own = (cls.disk, cls.disk_of_worker) if OWN_DISKS else None
        local.add_worker_node(cls.cluster, num_cpus=2, own_disk=own)
        cls.wait_for_cpus(4)

    @classmethod
    def wait_for_cpus(cls, cpus: int, timeout: float = 600) -> None:
        """Until `cpus` CPUs of the cluster are free (a revived node registered; a finished run's actors
        gone): an elastic stage starts on as many workers as fit at that moment."""
        from cluster import local

        wait = (
            f"import ray, time; ray.init(address='{cls.cluster.address}', logging_level='ERROR')\n"
            f"t = time.time() + {timeout}\n"
            f"while ray.available_resources().get('CPU', 0) < {cpus} and time.time() < t: time.sleep(0.5)\n"
            "print(ray.available_resources().get('CPU', 0))"
        )
        proc = subprocess.run(
            [sys.executable, "-c", wait],
            env={**os.environ, **local.auth_env()},
            capture_output=True,
            text=True,
            timeout=timeout + 120,
        )
        free = proc.stdout.strip().splitlines()[-1] if proc.stdout.strip() else "?"
        assert free != "?" and float(free) >= cpus, proc.stdout[-2000:] + proc.stderr[-2000:]

    @classmethod
    def stop(cls) -> None:
        """Stop the cluster and check that none of its processes, nor any they started, is left: the
        raylets' agents retitle themselves (`ray::DashboardAgent`) and were left running, orphaned, after
        every test cluster before `cluster.local` learned to stop descendants."""
        if cls.cluster is None:
            return
        import psutil

        from cluster import local

        started = {}
        for p in psutil.process_iter(["cmdline"]):
            if cls.temp_dir in " ".join(p.info["cmdline"] or []):
                with contextlib.suppress(psutil.Error):
                    started.update((q.pid, (q, " ".join(q.cmdline())[:80])) for q in (p, *p.children(True)))
        local.stop(cls.cluster)
        left = [title for q, title in started.values() if _running(q)]
        shutil.rmtree(cls.temp_dir, ignore_errors=True)
        shutil.rmtree(f"{cls.temp_dir}-worker1", ignore_errors=True)
        shutil.rmtree(cls.disk, ignore_errors=True)
        shutil.rmtree(cls.disk_of_worker, ignore_errors=True)
        cls.cluster = None
        assert any(t.startswith("ray::DashboardAgent") for _, t in started.values()), started  # seen, then
        assert not left, f"processes of the stopped local Ray cluster still running: {left}"


def _running(p) -> bool:
    import psutil

    try:
        return p.status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


# Nodes with their own disks need a private mount namespace per node: root and unshare (CI runs as root).
OWN_DISKS = os.geteuid() == 0 and shutil.which("unshare") is not None


@pytest.fixture
def ray_cluster():
    """The shared local Ray cluster (see `_RayClusters`); the Ray tests of a group run back to back on one
    worker (tests/scheduling.py), so they share one cluster."""
    return _RayClusters.get()


@pytest.fixture
def kill_worker_node(ray_cluster):
    """Yields a function that kills the shared cluster's second node (every process of it, at once); the node
    comes back after the test."""
    from cluster import local

    killed = []

    def kill() -> None:
        killed.append(True)
        local.kill_node(ray_cluster)

    yield kill
    if killed:
        _RayClusters.revive_worker()


@pytest.fixture
def node_disks(ray_cluster) -> tuple[Path, Path]:
    """(PATH, FOLDER): the shared cluster's second node sees FOLDER at PATH, the head and this test PATH."""
    if not OWN_DISKS:
        pytest.skip("nodes with their own disks need root and unshare (CI runs as root)")
    return Path(_RayClusters.disk), Path(_RayClusters.disk_of_worker)


@pytest.fixture(scope="module")
def mlflow_server(tmp_path_factory):
    """A real MLflow tracking server on 127.0.0.1 (SQLite behind it, artifacts proxied): what nodes that
    share no disk log to. Yields its URL."""
    import urllib.request

    root = tmp_path_factory.mktemp("mlflow_server")
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable, "-m", "mlflow", "server",
        "--backend-store-uri", f"sqlite:///{root / 'mlflow.db'}",
        "--artifacts-destination", str(root / "artifacts"),
        "--host", "127.0.0.1", "--port", str(port), "--workers", "1",
    ]  # fmt: skip
    log = open(root / "server.log", "w")
    # No job runner (its huey consumer processes cost 40 s of CPU in a suite run): nothing here submits jobs.
    env = {**os.environ, "MLFLOW_SERVER_ENABLE_JOB_EXECUTION": "false"}
    proc = subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, start_new_session=True, env=env)
    url = f"http://127.0.0.1:{port}"
    # A hang guard: under the suite's full load (five workers on two cores) the server has taken 3.5 minutes
    # to import and migrate its store before it listened.
    deadline = time.time() + 900
    while True:
        try:
            with urllib.request.urlopen(f"{url}/health", timeout=5) as r:
                if r.status == 200:
                    break
        except OSError:
            pass
        if proc.poll() is not None or time.time() > deadline:
            os.killpg(proc.pid, signal.SIGKILL)
            raise RuntimeError(f"mlflow server did not come up:\n{(root / 'server.log').read_text()[-3000:]}")
        time.sleep(1)
    yield url
    os.killpg(proc.pid, signal.SIGTERM)
    try:
        proc.wait(timeout=30)
    except subprocess.TimeoutExpired:
        os.killpg(proc.pid, signal.SIGKILL)
        proc.wait()
    log.close()


@pytest.hookimpl(trylast=True)  # after the test's own fixtures are finalized
def pytest_runtest_teardown(item, nextitem):
    if "ray_cluster" in item.fixturenames and (
        nextitem is None or "ray_cluster" not in nextitem.fixturenames
    ):
        _RayClusters.stop()


def pytest_sessionfinish(session):
    _RayClusters.stop()


@pytest.fixture(scope="module")
def s3():
    """A real S3 protocol server (moto) on 127.0.0.1 with the bucket `ckpt`; credentials in the environment,
    as on a real cluster. Yields prefix -> `s3://ckpt/PREFIX?endpoint_override=...` (the endpoint rides
    in the URI's query, so subprocesses reach it too)."""
    from moto.server import ThreadedMotoServer

    from data_prep.storage import Store

    env = {
        "AWS_ACCESS_KEY_ID": "testing",
        "AWS_SECRET_ACCESS_KEY": "testing",
        "AWS_DEFAULT_REGION": "us-east-1",
    }
    saved = {k: os.environ.get(k) for k in env}
    os.environ.update(env)
    server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
    server.start()
    host, port = server.get_host_and_port()
    query = f"endpoint_override={host}:{port}&scheme=http&region=us-east-1"
    Store(f"s3://ckpt?{query}&allow_bucket_creation=true").fs.create_dir("ckpt")  # the bucket
    yield lambda prefix: f"s3://ckpt/{prefix}?{query}"
    server.stop()
    for k, v in saved.items():
        if v is None:
            os.environ.pop(k, None)
        else:
            os.environ[k] = v


@pytest.fixture(scope="session")
def smoke_dataset(tmp_path_factory):
    """The smoke corpus (320 multi-label images, 8 shards), written once per session."""
    root = tmp_path_factory.mktemp("smoke_dataset")
    write_dataset(root, synthetic_samples(320, 8, seed=0, width=48, height=40), class_names(8), True, 40)
    return root


@pytest.fixture(scope="session")
def every_step_dataset(tmp_path_factory):
    """32 multi-label images in two shards of 16: on 2 ranks with batch 16 every step sees every image,
    so a model that learns shows it within a few dozen steps (the loss-falling runs use it)."""
    root = tmp_path_factory.mktemp("every_step_dataset")
    write_dataset(root, synthetic_samples(32, 8, seed=0, width=48, height=40), class_names(8), True, 16)
    return root


@pytest.hookimpl(tryfirst=True)  # before xdist reads the groups
def pytest_collection_modifyitems(items):
    scheduling.check_tiers(items)
    scheduling.order_and_group(items)


def pytest_collection_finish(session):
    scheduling.check_groups_applied(session.config, session.items)
