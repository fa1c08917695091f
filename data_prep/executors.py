"""Where shard tasks run: this process, a pool of worker processes, or Ray tasks on a cluster.

All three run the same functions on the same tasks (planning parts, `shard_worker.write_planned_shard`),
so they write the same bytes. Tasks are pulled lazily and at most `2 x workers` are in flight: memory does
not grow with the number of shards.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import pickle
import shutil
import socket
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from data_prep.layout import DatasetError


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


# Ray's switch for multi-node clusters on Windows and macOS. Off ("0"), it also stops Ray from replacing a
# loopback address with the machine's: a client of a cluster whose nodes are all at 127.0.0.1 (cluster.local,
# every socket on loopback) must keep that address to reach it.
RAY_MULTI_NODE_SWITCH = "RAY_ENABLE_WINDOWS_OR_OSX_CLUSTER"
LOOPBACK_HOSTS = ("127.0.0.1", "localhost", "::1", "[::1]")


def keep_loopback_address(address: str) -> None:
    """Before this process joins the Ray cluster at `address` (or RAY_ADDRESS): when its host is loopback,
    turn the replacement off here (Ray read the switch when it was imported) and for the processes this one
    starts. A cluster at a network address is left as Ray finds it."""
    host = address.removeprefix("ray://").removeprefix("http://").rpartition(":")[0]
    if host in LOOPBACK_HOSTS:
        keep_loopback()


def keep_loopback() -> None:
    """Ray's replacement of 127.0.0.1 off, in this process and in the processes it starts from here on."""
    os.environ[RAY_MULTI_NODE_SWITCH] = "0"
    from ray._private import ray_constants  # optional (`--ray` and clusters only)

    ray_constants.ENABLE_RAY_CLUSTER = False  # read once, when Ray was imported


def _check_reachable(address: str, timeout_s: float = 5.0) -> None:
    """Fail fast on a wrong RAY_ADDRESS: ray.init would retry an unreachable GCS for minutes."""
    host, _, port = address.removeprefix("ray://").rpartition(":")
    if not host or not port.isdigit():
        return  # "auto", "local" or unset: Ray looks for a cluster started on this machine
    with socket.create_connection((host, int(port)), timeout=timeout_s):
        pass


class Executor:
    """Runs a picklable `fn(task, shared)` over tasks: in this process, in a pool of worker processes, or as
    Ray tasks on the cluster at RAY_ADDRESS; open once (`with`) for every phase of a build. `map` pulls tasks
    lazily, keeps at most 2 x workers in flight (memory does not grow with the number of tasks) and yields
    results as they complete.

    With Ray each task writes where the dataset lives itself, so that must be a place every node sees: an
    object store URI (s3://...; files are staged on the node's own scratch) or a shared folder. A task whose
    worker dies is retried (twice); whatever it left half-written is never published (`atomic`).
    """

    def __init__(self, workers: int = 1, use_ray: bool = False):
        self.workers, self.use_ray = max(1, workers), use_ray
        self._pool: ProcessPoolExecutor | None = None
        self._shared_dir: str | None = None
        self._ray = None
        self._remote: dict = {}
        self._maps = 0

    def __enter__(self) -> Executor:
        if self.use_ray:
            self._ray = _join_ray()
            self.workers = max(1, int(self._ray.cluster_resources().get("CPU", 1)))
        elif self.workers > 1:
            # spawn, not fork: the driver holds pyarrow's threads and open files a forked child must not inherit.
            self._pool = ProcessPoolExecutor(
                self.workers,
                mp_context=multiprocessing.get_context("spawn"),
                initializer=_exit_with_parent,
                initargs=(os.getpid(),),
            )
            self._shared_dir = tempfile.mkdtemp(prefix="vitpipe-shared-")
        return self

    def __exit__(self, *exc) -> None:
        if self._pool is not None:
            self._pool.shutdown(cancel_futures=True)
            shutil.rmtree(self._shared_dir, ignore_errors=True)
        if self._ray is not None:
            self._ray.shutdown()

    def map(self, fn: Callable, tasks: Iterable, shared) -> Iterator:
        if self._ray is not None:
            return self._map_ray(fn, tasks, shared)
        if self._pool is None:
            return (fn(task, shared) for task in tasks)
        return self._map_pool(fn, tasks, shared)

    def _map_pool(self, fn: Callable, tasks: Iterable, shared) -> Iterator:
        # `shared` pickled once per map into a file each worker process loads once (`_with_shared`), not once
        # per task: a plan carries the label space (18k class names for JFT, ~300 KB pickled, 2 ms each way),
        # which per task cost the driver O(tasks x classes) (300,000 shard tasks at 300M inputs).
        self._maps += 1
        path = os.path.join(self._shared_dir, f"shared-{self._maps}.pickle")
        with open(path, "wb") as f:
            pickle.dump(shared, f, protocol=pickle.HIGHEST_PROTOCOL)
        it, pending = iter(tasks), set()
        try:
            while True:
                while len(pending) < 2 * self.workers:
                    task = next(it, None)
                    if task is None:
                        break
                    pending.add(self._pool.submit(_with_shared, fn, task, path))
                if not pending:
                    return
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise

    def _map_ray(self, fn: Callable, tasks: Iterable, shared) -> Iterator:
        ray = self._ray
        if fn not in self._remote:
            self._remote[fn] = ray.remote(num_cpus=1, max_retries=2)(fn)
        remote, shared_ref = self._remote[fn], ray.put(shared)
        it, pending = iter(tasks), []
        while True:
            while len(pending) < 2 * self.workers:
                task = next(it, None)
                if task is None:
                    break
                pending.append(remote.remote(task, shared_ref))
            if not pending:
                return
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield ray.get(ref)


def _exit_with_parent(parent: int, poll_s: float = 1.0) -> None:
    """In a pool's worker process: exit once the driver is gone. A driver killed (SIGTERM from `timeout`, a
    scheduler or `ray job stop`; SIGKILL) never shuts its pool down, and its workers, blocked on the task
    queue, would otherwise wait for good, each holding its imports and last task's memory."""

    def watch() -> None:
        while os.getppid() == parent:
            time.sleep(poll_s)
        os._exit(1)

    threading.Thread(target=watch, name="exit-with-parent", daemon=True).start()


_loaded: dict[str, object] = {}  # in a pool's worker process: the shared object of the map it works for


def _with_shared(fn: Callable, task, path: str):
    """In a pool's worker process: `fn(task, shared)`, the map's shared object loaded from `path` once."""
    if path not in _loaded:
        _loaded.clear()  # one map's at a time: an earlier phase's plan goes
        with open(path, "rb") as f:
            _loaded[path] = pickle.load(f)
    return fn(task, _loaded[path])


def _join_ray():
    """The Ray cluster at RAY_ADDRESS (or the one `ray start` left running), joined; the module."""
    if os.environ.get("RAY_ADDRESS", "").startswith(("http://", "https://")):
        raise DatasetError(
            f"--ray: RAY_ADDRESS {os.environ['RAY_ADDRESS']} is a Jobs API address, which runs jobs but is not "
            "one this process can join: run `vitpipe shard ... --ray --address URL` (it runs as a Ray job "
            "there), or give the cluster's GCS address (HEAD:6379)"
        )
    try:
        _check_reachable(os.environ.get("RAY_ADDRESS", ""))
        import ray  # optional (`--ray` only), and slow to import: only on this path

        keep_loopback_address(os.environ.get("RAY_ADDRESS", ""))
        ray.init(address="auto", logging_level=logging.WARNING, log_to_driver=False)
    except (ImportError, ConnectionError, RuntimeError, OSError) as exc:
        raise DatasetError(
            f"--ray: cannot join a Ray cluster ({exc}); start one (python -m cluster.local start) "
            "and set RAY_ADDRESS, or drop --ray to use local worker processes"
        ) from None
    return ray
