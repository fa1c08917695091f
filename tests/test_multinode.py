"""Nodes that share no disk, rehearsed on one machine: each node a torchrun agent in its own mount namespace
(`unshare --mount`) with its own folder bind-mounted over the same run root, so every rank sees only its
own node's checkpoints at the same paths, as on a GPU cluster with node-local NVMe.
"""

import json
import os
import re
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


def nodes(run_root: Path, disks: list[Path], script: str, *args: str, timeout: int = 900) -> list[str]:
    """`script ARGS` on a torchrun of one node per disk (one rank per node), node K seeing disks[K] at run_root.
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
            f"--nnodes={len(disks)}",
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
    node0, node1 = nodes(root, disks, "tests/scripts/two_nodes.py", str(root), str(smoke_dataset), str(out))
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


def test_a_stage_saved_by_two_nodes_goes_on_on_one_and_back_on_two(tmp_path, smoke_dataset, s3):
    """Nodes on their own disks, checkpoints in a bucket: ZeRO-3 saved by 2 ranks at step 4 resumes on one
    node (whose disk holds only rank 0's partition: the whole tag comes from the bucket, converted to a
    universal checkpoint there), stops at step 6 and resumes on two nodes again (node 1's disk never saw
    step 6). The global batch (32) holds throughout: grad_accum 1 -> 2 -> 1."""
    root, out = tmp_path / "run", tmp_path / "shared"
    disks = [tmp_path / "node0", tmp_path / "node1"]
    out.mkdir()
    args = [str(root), str(smoke_dataset), str(out), s3("resize")]
    nodes(root, disks, "tests/scripts/resize_nodes.py", *args, "debug.stop_at_step=4")
    (one,) = nodes(root, disks[:1], "tests/scripts/resize_nodes.py", *args, "debug.stop_at_step=6")
    assert "saved by 2 ranks; resharding it for 1" in one and "grad_accum 1 -> 2" in one, one[-3000:]
    assert (disks[0] / "job/checkpoints/step_00000004/universal").is_dir()
    node0, node1 = nodes(root, disks, "tests/scripts/resize_nodes.py", *args)
    assert "saved by 1 ranks; resharding it for 2" in node0, node0[-3000:]
    # Node 1's disk never saw step 6 (saved on node 0 alone): it came from the bucket and was converted there.
    assert (disks[1] / "job/checkpoints/step_00000006/universal").is_dir()
    records = [json.loads((d / "job/checkpoints/step_00000008/COMPLETE.json").read_text()) for d in disks]
    for record in records:
        assert (record["world_size"], record["grad_accum"], record["global_batch"]) == (2, 1, 32)
    # Both nodes replaced by fresh ones (no checkpoints on their disks): at the world size that saved step 8
    # each node fetches its own rank's files and the small model states, not the whole tag.
    for d in disks:
        shutil.rmtree(d / "job/checkpoints")
    fresh = nodes(root, disks, "tests/scripts/resize_nodes.py", *args)
    files = records[0]["files"]
    whole = sum(f["bytes"] for f in files.values())
    for rank, node_log in enumerate(fresh):
        own = sum(f["bytes"] for n, f in files.items() if f"rank_{rank}_" in n or n == f"rank_{rank}.pt")
        fetched = re.search(
            r"fetched checkpoint step_00000008 from \S+ for this node's ranks: (\d+) of its (\d+)", node_log
        )
        assert fetched and int(fetched.group(2)) == whole, node_log[-3000:]
        assert own <= int(fetched.group(1)) <= 1.5 * own < whole, (rank, int(fetched.group(1)), own, whole)
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import RUN_ID_FILE, read_run_id

    run_id = read_run_id(disks[0] / "job" / RUN_ID_FILE)
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert sorted(loss) == list(range(1, 9)) and all(0 < v < 100 for v in loss.values()), loss
