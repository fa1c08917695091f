"""Where shard tasks run: this process, a pool of worker processes, or Ray tasks on a cluster.

All three call `shard_worker.write_planned_shard` on the same tasks, so they write the same bytes.
Tasks are pulled from the planner lazily and at most `2 x workers` are in flight: memory does not
grow with the number of shards.
"""

from __future__ import annotations

import logging
import multiprocessing
import os
import socket
from collections.abc import Iterable, Iterator
from concurrent.futures import FIRST_COMPLETED, ProcessPoolExecutor, wait

from data_prep.layout import DatasetError
from data_prep.plan import ShardTask
from data_prep.shard_worker import ShardJob, ShardResult, write_planned_shard


def default_workers() -> int:
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:  # not Linux
        return os.cpu_count() or 1


def run_local(tasks: Iterable[ShardTask], job: ShardJob) -> Iterator[ShardResult]:
    for task in tasks:
        yield write_planned_shard(task, job)


def run_pool(tasks: Iterable[ShardTask], job: ShardJob, workers: int) -> Iterator[ShardResult]:
    # spawn, not fork: the driver holds pyarrow's threads and open files a forked child must not inherit.
    ctx = multiprocessing.get_context("spawn")
    it = iter(tasks)
    with ProcessPoolExecutor(max_workers=workers, mp_context=ctx) as pool:
        pending = set()
        try:
            while True:
                while len(pending) < 2 * workers:
                    task = next(it, None)
                    if task is None:
                        break
                    pending.add(pool.submit(write_planned_shard, task, job))
                if not pending:
                    return
                done, pending = wait(pending, return_when=FIRST_COMPLETED)
                for fut in done:
                    yield fut.result()
        except BaseException:
            for fut in pending:
                fut.cancel()
            raise


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


def run_on_ray(tasks: Iterable[ShardTask], job: ShardJob) -> Iterator[ShardResult]:
    """One Ray task per shard on the cluster at RAY_ADDRESS (or the one `ray start` left running).

    Each task writes its shard where the dataset lives itself, so that must be a place every node sees:
    an object store URI (s3://...; the shard is staged on the node's own scratch) or a shared folder.
    """
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
    try:
        remote = ray.remote(num_cpus=1, max_retries=2)(write_planned_shard)
        job_ref = ray.put(job)
        slots = 2 * max(1, int(ray.cluster_resources().get("CPU", 1)))
        it = iter(tasks)
        pending: list = []
        while True:
            while len(pending) < slots:
                task = next(it, None)
                if task is None:
                    break
                pending.append(remote.remote(task, job_ref))
            if not pending:
                return
            done, pending = ray.wait(pending, num_returns=1)
            for ref in done:
                yield ray.get(ref)
    finally:
        ray.shutdown()


def run_shards(
    tasks: Iterable[ShardTask], job: ShardJob, workers: int, use_ray: bool
) -> Iterator[ShardResult]:
    if use_ray:
        return run_on_ray(tasks, job)
    if workers <= 1:
        return run_local(tasks, job)
    return run_pool(tasks, job, workers)
