"""Nodes that share no disk, rehearsed on one machine: each node a torchrun agent in its own mount namespace
(`unshare --mount`) with its own folder bind-mounted over the same run root, so every rank sees only its
own node's checkpoints at the same paths, as on a GPU cluster with node-local NVMe.
"""

import json
import os
import shlex
import shutil
import signal
import socket
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

ROOT = Path(__file__).parents[1]
pytestmark = [
    pytest.mark.dist,
    pytest.mark.slow,
    pytest.mark.skipif(
        os.geteuid() != 0 or shutil.which("unshare") is None,
        reason="a private mount namespace per node needs root and unshare (CI runs as root)",
    ),
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def two_nodes(run_root: Path, disks: list[Path], script: str, *args: str, timeout: int = 900) -> list[str]:
    """`script ARGS` on a two-node torchrun (one rank per node), node K seeing disks[K] at run_root.
    Returns each node's output; on failure or timeout both nodes' process groups are killed."""
    run_root.mkdir(parents=True, exist_ok=True)
    port = _free_port()
    env = {**os.environ, "DS_ACCELERATOR": "cpu", "OMP_NUM_THREADS": "1"}
    procs = []
    for node, disk in enumerate(disks):
        disk.mkdir(parents=True, exist_ok=True)
        torchrun = [
            sys.executable,
            "-m",
            "torch.distributed.run",
            "--nnodes=2",
            f"--node-rank={node}",
            "--nproc-per-node=1",
            "--master-addr=127.0.0.1",
            f"--master-port={port}",
            script,
            *args,
        ]
        inner = f"mount --bind {shlex.quote(str(disk))} {shlex.quote(str(run_root))} && exec {shlex.join(torchrun)}"
        procs.append(
            subprocess.Popen(
                ["unshare", "--mount", "--propagation", "private", "sh", "-c", inner],
                cwd=ROOT,
                env=env,
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                text=True,
                start_new_session=True,
            )
        )
    outputs = []
    try:
        for proc in procs:
            outputs.append(proc.communicate(timeout=timeout)[0])
    finally:
        for proc in procs:
            if proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait()
    for node, (proc, out) in enumerate(zip(procs, outputs)):
        assert proc.returncode == 0, f"node {node} exited {proc.returncode}:\n{out[-6000:]}"
    return outputs


def test_ranks_without_a_shared_disk_prune_their_own_and_agree_on_what_to_resume(tmp_path, smoke_dataset):
    """ZeRO-3 on two nodes with separate disks: every node's disk keeps `keep_last` checkpoints (rank 0
    pruned only its own before); a node that lost the newest checkpoint makes both ranks resume from the
    newest one every node holds (each rank walked its own list before: rank 0 loaded step 6, rank 1 step 4),
    and the result equals the uninterrupted run bitwise."""
    root, out = tmp_path / "run", tmp_path / "shared"
    disks = [tmp_path / "node0", tmp_path / "node1"]
    out.mkdir()
    node0, node1 = two_nodes(
        root, disks, "tests/scripts/two_nodes.py", str(root), str(smoke_dataset), str(out)
    )
    seen = [json.loads((out / f"rank{r}.json").read_text()) for r in (0, 1)]
    keep = ["step_00000006", "step_00000008"]
    for rank in (0, 1):
        assert seen[rank]["straight"] == keep, (rank, seen[rank])  # keep_last 2 on every node's disk
        assert seen[rank]["stopped"] == ["step_00000004", "step_00000006"], (rank, seen[rank])
        assert seen[rank]["resumed"] == keep, (rank, seen[rank])
    assert not (root / "straight").exists()  # the nodes' disks were their own, not the host's folder
    assert "resumed from step_00000004" in node0, node0[-3000:]
    assert "step_00000006" in node1 and "not on this node's disk" in node1, node1[-3000:]
    assert len(seen[0]["losses"]) == 4  # steps 5..8 again
    # Only rank 0's node holds the export (assembled in memory from both ranks' ZeRO-3 partitions).
    a = load_file(str(disks[0] / "straight" / "export" / "model.safetensors"))
    b = load_file(str(disks[0] / "resumed" / "export" / "model.safetensors"))
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert not (disks[1] / "straight" / "export").exists()
    # Every rank wrote its own ZeRO-3 partition on its own disk.
    assert list((disks[1] / "straight" / "checkpoints" / "step_00000008").glob("*rank_1_*"))
    assert not list((disks[0] / "straight" / "checkpoints" / "step_00000008").glob("*rank_1_*"))
