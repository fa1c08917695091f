"""What listens where: the local runs open sockets on loopback only (docs/security.md).

    .venv/bin/python -m pytest tests/test_security.py -q

Each test runs the real thing in a child process, which lists the listening TCP sockets of itself and of
every process it started (Ray's GCS, raylet, dashboard agents and workers are all its descendants) with
psutil while it runs, and prints them as JSON.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
LOOPBACK = {"127.0.0.1", "::1", "::ffff:127.0.0.1"}

# listeners() -> {"name pid": [[ip, port], ...]}: the listening sockets of this process and its descendants.
LISTENERS = textwrap.dedent(
    """
    import json, psutil

    def listeners():
        found = {}
        me = psutil.Process()
        for proc in [me, *me.children(recursive=True)]:
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
