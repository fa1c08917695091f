"""What listens where: the local runs open sockets on loopback only (docs/security.md).

    .venv/bin/python -m pytest tests/test_security.py -q

The tests run the real things (a private Ray, a training run, the suite's two-node local cluster with a Ray
Train group on it, the MLflow and S3 servers) and list with psutil the listening TCP sockets of each process
and of every process it started (Ray's GCS, raylets, agents and workers are all descendants of a node's
`ray start`); a child process prints its findings as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import psutil
import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

# listeners(roots=None) -> {"name pid": [[ip, port], ...]}: the listening sockets of the root processes (this
# one by default) and of all their descendants. Run in the test scripts' processes and in this one.
LISTENERS = textwrap.dedent(
    """
    import json, psutil

    def listeners(roots=None):
        found = {}
        procs = {}
        for root in roots or [psutil.Process()]:
            try:
                procs.update((p.pid, p) for p in [root, *root.children(recursive=True)])
            except psutil.NoSuchProcess:
                continue
        for proc in procs.values():
            try:
                conns = proc.net_connections(kind="inet")
                name = proc.name()
            except (psutil.NoSuchProcess, psutil.AccessDenied):
                continue
            socks = sorted({(c.laddr.ip, c.laddr.port) for c in conns if c.status == psutil.CONN_LISTEN})
            if socks:
                found[f"{name} {proc.pid}"] = socks
        return found
    """
)
_namespace: dict = {}
exec(LISTENERS, _namespace)
listeners = _namespace["listeners"]


def processes_of(marker: str) -> list[psutil.Process]:
    """The processes whose command line names `marker` (a local cluster's temp dir names its nodes')."""
    found = []
    for p in psutil.process_iter(["cmdline"]):
        try:
            if marker in " ".join(p.info["cmdline"] or []):
                found.append(p)
        except (psutil.NoSuchProcess, psutil.AccessDenied):
            continue
    return found


def listening_on(port: int) -> psutil.Process:
    """The process listening on `port`."""
    for c in psutil.net_connections(kind="inet"):
        if c.status == psutil.CONN_LISTEN and c.laddr.port == port and c.pid:
            return psutil.Process(c.pid)
    raise AssertionError(f"nothing listens on port {port}")


def _run(script: str, timeout: float) -> dict[str, list[list]]:
    env = {**os.environ, "DS_ACCELERATOR": "cpu"}
    env.pop("RAY_ADDRESS", None)  # a private instance, not a cluster the environment names
    proc = subprocess.run(
        [sys.executable, "-c", LISTENERS + textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=timeout,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    line = next(x for x in reversed(proc.stdout.splitlines()) if x.startswith("LISTENERS "))
    return json.loads(line.removeprefix("LISTENERS "))


def _outside_loopback(found: dict[str, list[list]]) -> dict[str, list[list]]:
    return {who: socks for who, socks in found.items() if {ip for ip, _ in socks} - LOOPBACK}


@pytest.mark.ray
@pytest.mark.slow
def test_a_private_local_ray_and_its_train_workers_listen_only_on_loopback(tmp_path):
    """`vitpipe run` without an address starts a private Ray (cluster.run.connect): its GCS, raylet,
    dashboard agents, runtime-env agent and workers all listen, and only on loopback; so does the store of
    a 2-worker Ray Train process group set up as the stages set it up (cluster.process_group). The
    dashboard runs (on loopback) and serves the State API, which Ray Train's placement-group cleaner polls
    (without it the cleaner logs a failed query every few seconds of every stage)."""
    found = _run(
        f"""
        import os
        from pathlib import Path

        import ray
        import torch
        import torch.distributed as dist
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from cluster.process_group import NodeAddressTorchConfig
        from cluster.run import connect

        connect(None)

        @ray.remote
        class Probe:
            def ip(self):
                return ray.util.get_node_ip_address()

        probe = Probe.remote()
        assert ray.get(probe.ip.remote()) == "127.0.0.1"
        assert ray.get(ray.remote(lambda: 1).remote()) == 1
        from ray.util.state import list_actors  # the State API: served by the dashboard

        gcs = ray.get_runtime_context().gcs_address  # other Ray instances may run on this machine
        assert "Probe" in {{a.class_name for a in list_actors(address=gcs)}}

        def loop(config):
            t = torch.ones(1)
            dist.all_reduce(t)
            assert t.item() == 2
            if dist.get_rank() == 0:  # the store is served from rank 0's process
                store = [os.environ["MASTER_ADDR"], int(os.environ["MASTER_PORT"])]
                Path(config["out"]).write_text(json.dumps({{"store": store, "rank0": listeners()}}))
            dist.barrier()

        TorchTrainer(
            loop,
            train_loop_config={{"out": "{tmp_path / "rank0.json"}"}},
            scaling_config=ScalingConfig(num_workers=2, resources_per_worker={{"CPU": 1}}),
            torch_config=NodeAddressTorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path="{tmp_path / "ray"}"),
        ).fit()
        print("LISTENERS " + json.dumps(listeners()), flush=True)
        ray.shutdown()
        """,
        timeout=300,
    )
    rank0 = json.loads((tmp_path / "rank0.json").read_text())
    store_addr, store_port = rank0["store"]
    rank0_sockets = [tuple(s) for socks in rank0["rank0"].values() for s in socks]
    assert store_addr == "127.0.0.1" and any(port == store_port for _, port in rank0_sockets), rank0
    assert not _outside_loopback(rank0["rank0"]), f"rank 0 listening outside loopback: {rank0['rank0']}"
    names = " ".join(found)
    # The check cannot pass on an empty list: Ray's servers and a worker must be among the listeners.
    assert "gcs_server" in names and "raylet" in names and "ray::" in names, found
    assert len(found) >= 5, found
    assert not _outside_loopback(found), f"listening outside loopback: {_outside_loopback(found)}"


@pytest.mark.slow
def test_a_single_process_training_run_listens_only_on_loopback(smoke_dataset, tmp_path):
    """`vitpipe train ... cluster.launcher=local` in one process: no TCP store (its store is in memory) and
    gloo on loopback, sampled throughout a real run of the smoke config."""
    found = _run(
        f"""
        import threading, time
        from pipeline.config import load_config
        from pipeline.train.launch import launch_local

        seen, done = {{}}, threading.Event()

        def sample():
            while not done.is_set():
                for who, ips in listeners().items():
                    seen.setdefault(who, set()).update(ips)
                time.sleep(0.1)

        sampler = threading.Thread(target=sample, daemon=True)
        sampler.start()
        cfg = load_config(
            "configs/experiments/smoke.yaml",
            ["cluster.launcher=local", "run_dir={tmp_path / "run"}", "data.train={smoke_dataset}",
             "optim.steps=6", "data.num_workers=1"],
        )
        result = launch_local(cfg)
        done.set()
        sampler.join()
        import torch.distributed as dist
        assert dist.get_world_size() == 1 and result.steps == 6, result
        print("LISTENERS " + json.dumps({{k: sorted(v) for k, v in seen.items()}}), flush=True)
        """,
        timeout=300,
    )
    assert found, "gloo's own listening socket was not seen: the sampler saw nothing"
    assert not _outside_loopback(found), f"listening outside loopback: {_outside_loopback(found)}"


@pytest.mark.ray
@pytest.mark.slow
def test_a_local_cluster_of_two_nodes_listens_only_on_loopback(ray_cluster, tmp_path):
    """The suite's local cluster (cluster.local: a head and a second node, token auth on) and a 2-worker
    Ray Train process group spread over its two nodes as the stages set it up: every daemon, agent, worker
    and the store listen on loopback only. Both nodes have the address 127.0.0.1, so each worker is the
    first local rank of its own node by Ray node ID (cluster.process_group), as on two real machines."""
    found = _run(
        f"""
        import os
        from pathlib import Path

        import ray
        import torch.distributed as dist
        from ray.train import RunConfig, ScalingConfig
        from ray.train.torch import TorchTrainer

        from cluster.process_group import NodeAddressTorchConfig

        from data_prep.executors import keep_loopback_address

        os.environ["RAY_AUTH_MODE"] = "token"
        keep_loopback_address("{ray_cluster.address}")  # as cluster.run.connect does
        ray.init(address="{ray_cluster.address}", logging_level="ERROR")

        def loop(config):
            dist.barrier()
            env = {{k: os.environ[k] for k in ("LOCAL_RANK", "LOCAL_WORLD_SIZE", "NODE_RANK", "MASTER_ADDR")}}
            me = {{"node": ray.get_runtime_context().get_node_id(), "env": env, "listeners": listeners()}}
            Path(config["out"], f"rank{{dist.get_rank()}}.json").write_text(json.dumps(me))
            dist.barrier()

        TorchTrainer(
            loop,
            train_loop_config={{"out": "{tmp_path}"}},
            scaling_config=ScalingConfig(
                num_workers=2, resources_per_worker={{"CPU": 1}}, placement_strategy="STRICT_SPREAD"
            ),
            torch_config=NodeAddressTorchConfig(backend="gloo"),
            run_config=RunConfig(storage_path="{tmp_path / "ray"}"),
        ).fit()
        print("LISTENERS " + json.dumps(listeners()), flush=True)  # the driver's own
        ray.shutdown()
        """,
        timeout=600,
    )
    ranks = [json.loads((tmp_path / f"rank{r}.json").read_text()) for r in (0, 1)]
    assert ranks[0]["node"] != ranks[1]["node"], ranks  # STRICT_SPREAD: one worker per node
    assert [r["env"]["LOCAL_RANK"] for r in ranks] == ["0", "0"], ranks
    assert [r["env"]["LOCAL_WORLD_SIZE"] for r in ranks] == ["1", "1"], ranks
    assert [r["env"]["NODE_RANK"] for r in ranks] == ["0", "1"], ranks
    assert {r["env"]["MASTER_ADDR"] for r in ranks} == {"127.0.0.1"}, ranks
    for r in ranks:
        assert r["listeners"], "a worker that joined a gloo group listens on something"
        assert not _outside_loopback(r["listeners"]), f"a worker listening outside loopback: {r['listeners']}"
    assert not _outside_loopback(found), f"the driver listening outside loopback: {found}"

    # Every process of both nodes (their temp dirs are the head's and the head's with "-worker1"), and all
    # they started: GCS, two raylets, dashboard, agents, idle workers.
    cluster = listeners(processes_of(ray_cluster.temp_dir))
    names = " ".join(cluster)
    assert names.count("raylet") == 2 and "gcs_server" in names and "ray::" in names, cluster
    assert not _outside_loopback(cluster), (
        f"the cluster listening outside loopback: {_outside_loopback(cluster)}"
    )


def test_the_mlflow_and_s3_servers_that_nodes_share_listen_only_on_loopback(mlflow_server, s3):
    """The multi-node rehearsal's shared services: the MLflow server (and every process it starts) and moto,
    the S3 protocol server (a thread of this process)."""
    port = int(mlflow_server.rpartition(":")[2])
    server = listeners([listening_on(port)])
    assert any(p == port for socks in server.values() for _, p in socks), server
    assert not _outside_loopback(server), f"the MLflow server listening outside loopback: {server}"

    moto_port = int(s3("x").split("endpoint_override=")[1].split("&")[0].rpartition(":")[2])
    moto = [
        c.laddr.ip
        for c in psutil.net_connections(kind="inet")
        if c.status == psutil.CONN_LISTEN and c.laddr.port == moto_port
    ]
    assert moto and set(moto) <= LOOPBACK, moto


@pytest.mark.unit
def test_local_ranks_count_the_workers_of_each_ray_node():
    from cluster.process_group import local_ranks

    # Two nodes of two workers, numbered node by node (as Ray Train numbers them), then interleaved.
    assert local_ranks(["a", "a", "b", "b"]) == [(0, 2, 0), (1, 2, 0), (0, 2, 1), (1, 2, 1)]
    assert local_ranks(["a", "b", "a"]) == [(0, 2, 0), (0, 1, 1), (1, 2, 0)]
    assert local_ranks(["only"]) == [(0, 1, 0)]


@pytest.mark.unit
@pytest.mark.parametrize(("given", "kept"), [(None, True), ("false", False), ("true", True)])
def test_mlflow_telemetry_is_off_unless_the_environment_turns_it_on(given, kept):
    """MLflow 3 reports usage to its servers by default; a process of the pipeline does not, unless its
    environment says MLFLOW_DISABLE_TELEMETRY=false."""
    env = {k: v for k, v in os.environ.items() if k != "MLFLOW_DISABLE_TELEMETRY"}
    if given is not None:
        env["MLFLOW_DISABLE_TELEMETRY"] = given
    code = (
        "import pipeline.tracking\n"
        "from mlflow.environment_variables import MLFLOW_DISABLE_TELEMETRY\n"
        "print(MLFLOW_DISABLE_TELEMETRY.get())"
    )
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == str(kept), out.stderr[-2000:]
