"""Nodes that share no disk, rehearsed on one machine: each node a torchrun agent in its own mount namespace
(`unshare --mount`) with its own folder bind-mounted over the same run root, so every rank sees only its
own node's checkpoints at the same paths, as on a GPU cluster with node-local NVMe.
"""

import json
import os
import random
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


EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def _rendezvous_port() -> int:
    """A free port below the kernel's ephemeral range. The nodes' agents bind the rendezvous store seconds
    after the port is chosen; a port from bind(0) lies in the range the kernel meanwhile hands to every
    outgoing connection on the machine (the suite's S3, MLflow and Ray clients): seen on CI as EADDRINUSE
    at rendezvous. Below the range only another listener could take it."""
    low = int(EPHEMERAL.read_text().split()[0]) if EPHEMERAL.is_file() else 32768
    rng = random.Random()
    for _ in range(200):
        port = rng.randrange(max(1024, low - 10000), low)
        with socket.socket() as s:
            try:
                s.bind(("127.0.0.1", port))
            except OSError:
                continue
            return port
    raise RuntimeError(f"no free port below {low}")


def nodes(
    run_root: Path, disks: list[Path], script: str, *args: str, per_node: int = 1, timeout: int = 900
) -> list[str]:
    """`script ARGS` on a torchrun of one node per disk (`per_node` ranks each), node K seeing disks[K] at
    run_root. Returns each node's output; on failure or timeout every node's process group is killed."""
    run_root.mkdir(parents=True, exist_ok=True)
    port = _rendezvous_port()
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
            f"--nproc-per-node={per_node}",
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


def bucket_reads(node_log: str, tag: str) -> tuple[int, int]:
    """What a node's ranks read of checkpoint `tag` from the bucket, from their logs: the bytes of the files
    its first local rank fetched whole and of each rank's parts of the optimizer states and weight EMA; and
    the ranged GETs those parts took."""
    fetched = re.findall(rf"fetched checkpoint {tag} from \S+ for this node's ranks: (\d+) of", node_log)
    parts = re.findall(
        rf"read its part of checkpoint {tag}(?:'s weight EMA)?: (\d+) bytes in (\d+) requests", node_log
    )
    return sum(int(n) for n in fetched) + sum(int(b) for b, _ in parts), sum(int(r) for _, r in parts)


def tag_bytes(disk: Path, tag: str) -> int:
    record = json.loads((disk / "job/checkpoints" / tag / "COMPLETE.json").read_text())
    return sum(f["bytes"] for f in record["files"].values())


def test_a_stage_saved_by_four_ranks_on_two_nodes_goes_on_on_two_and_on_four_reading_its_share(
    tmp_path, smoke_dataset, s3
):
    """Nodes on their own disks, checkpoints in a bucket, every resume on fresh disks: ZeRO-3 saved by 4 ranks
    (2 nodes x 2) at step 4 resumes on 2 ranks (2 nodes x 1) to step 6, which resumes on 4 ranks again to 8,
    which resumes on 4 ranks. At another world size no node downloads the tag: each rank reads its part of
    the saved optimizer states and weight EMA in byte ranges, its node's first rank the small shared files;
    no universal checkpoint is made. Bytes a node reads from the bucket at each
    resume: at most 1.5x its share of the tag (the tag's bytes / 2 nodes). The global batch (64) holds
    throughout: grad_accum 1 -> 2 -> 1."""
    root, out = tmp_path / "run", tmp_path / "shared"
    disks = [tmp_path / "node0", tmp_path / "node1"]
    out.mkdir()
    args = [str(root), str(smoke_dataset), str(out), s3("resize")]

    def fresh_disks() -> None:
        for d in disks:
            shutil.rmtree(d / "job/checkpoints", ignore_errors=True)

    nodes(root, disks, "tests/scripts/resize_nodes.py", *args, "debug.stop_at_step=4", per_node=2)
    whole = {4: tag_bytes(disks[0], "step_00000004")}
    fresh_disks()
    two = nodes(root, disks, "tests/scripts/resize_nodes.py", *args, "debug.stop_at_step=6")
    assert "saved by 4 ranks; resharding it for 2 (each rank reading its part)" in two[0], two[0][-3000:]
    assert "grad_accum 1 -> 2" in two[0], two[0][-3000:]
    whole[6] = tag_bytes(disks[0], "step_00000006")
    fresh_disks()
    four = nodes(root, disks, "tests/scripts/resize_nodes.py", *args, per_node=2)
    assert "saved by 2 ranks; resharding it for 4 (each rank reading its part)" in four[0], four[0][-3000:]
    for logs, tag in ((two, "step_00000004"), (four, "step_00000006")):
        share = whole[int(tag[-2:])] / len(disks)
        for node, node_log in enumerate(logs):
            got, requests = bucket_reads(node_log, tag)
            lines = [line for line in node_log.splitlines() if tag in line and "bytes" in line]
            assert 0.5 * share < got <= 1.5 * share, (tag, node, got, share, lines)
            # ranged GETs: about one per parameter (vit_debug has 56), tensor (fp32 weights, two moments, the
            # EMA) and saved rank it lies in (ZeRO-3 cuts each parameter), plus a few per file's metadata
            ranks = 1 if tag == "step_00000004" else 2
            assert 0 < requests <= ranks * 56 * 4 * 2, (tag, node, requests, lines)
    for d in disks:
        assert not list((d / "job/checkpoints").glob("*/universal")), "a universal checkpoint was made"
    records = [json.loads((d / "job/checkpoints/step_00000008/COMPLETE.json").read_text()) for d in disks]
    for record in records:
        assert (record["world_size"], record["grad_accum"], record["global_batch"]) == (4, 1, 64)
    # Both nodes replaced by fresh ones: at the world size that saved step 8 each node fetches its own
    # ranks' files and the small model states, not the whole tag.
    fresh_disks()
    fresh = nodes(root, disks, "tests/scripts/resize_nodes.py", *args, per_node=2)
    files = records[0]["files"]
    whole = sum(f["bytes"] for f in files.values())
    for node, node_log in enumerate(fresh):
        ranks = (2 * node, 2 * node + 1)
        own = sum(
            f["bytes"]
            for n, f in files.items()
            if any(f"rank_{r}_" in n or n == f"rank_{r}.pt" for r in ranks)
        )
        fetched = re.search(
            r"fetched checkpoint step_00000008 from \S+ for this node's ranks: (\d+) of its (\d+)", node_log
        )
        assert fetched and int(fetched.group(2)) == whole, node_log[-3000:]
        assert own <= int(fetched.group(1)) <= 1.5 * own < whole, (node, int(fetched.group(1)), own, whole)
    from mlflow.tracking import MlflowClient

    from pipeline.tracking import RUN_ID_FILE, read_run_id

    run_id = read_run_id(disks[0] / "job" / RUN_ID_FILE)
    client = MlflowClient(f"sqlite:///{out}/mlflow.db")
    loss = {m.step: m.value for m in client.get_metric_history(run_id, "train/loss")}
    assert sorted(loss) == list(range(1, 9)) and all(0 < v < 100 for v in loss.values()), loss
