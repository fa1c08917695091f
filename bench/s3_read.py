"""Reading many small objects from an S3 server: what `vitpipe shard manifest` does for s3:// inputs.

    .venv/bin/python bench/s3_read.py --out bench/results/s3_read.json    # 600 objects of 60 kB, 3 rounds

Each round reads the same objects on 16 threads (a shard worker's read-ahead) with three clients, in turn:
`data_prep.storage.read_object` (obstore), pyarrow's `open_input_stream` (its S3 reader) and boto3's
`get_object`. Per object: requests the server logged, client CPU (this process) and server CPU (the
moto process), and the wall clock. The server is moto on 127.0.0.1 (the only S3 server here), pinned to
the last core with the clients on the others where the machine has two or more, so the client's CPU and
the server's do not compete. Reported: medians over rounds, and each client's numbers over pyarrow's.
"""

from __future__ import annotations

import argparse
import os
import re
import statistics
import subprocess
import sys
import tempfile
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import boto3  # installed with moto (the dev extra)
import psutil  # installed with ray[default]
import pyarrow.fs as pafs

REPO = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(REPO))

from provenance import write_result  # noqa: E402  (bench/provenance.py, beside this file)
from shard import _free_port, _pin, _wait_for_port  # noqa: E402  (bench/shard.py, beside this file)

from data_prep.storage import Store, read_object  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--num", type=int, default=600, help="objects (default 600)")
    ap.add_argument("--size", type=int, default=60_000, help="bytes per object (default 60000)")
    ap.add_argument("--threads", type=int, default=16)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()

    port = _free_port()
    log_path = Path(tempfile.mkdtemp(prefix="bench-s3-")) / "server.log"
    log = open(log_path, "w")  # the server's request log, read back after each phase
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)], stdout=log, stderr=log
    )
    os.environ.update(
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
        AWS_ENDPOINT_URL=f"http://127.0.0.1:{port}",
    )
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) > 1:
        os.sched_setaffinity(0, set(cores[:-1]))
    try:
        _wait_for_port(port)
        if len(cores) > 1:
            _pin(server.pid, {cores[-1]})
        result = run(args, server.pid, log_path)
    finally:
        server.terminate()
        server.wait()
        log.close()
    result["placement"] = {"server_cpus": cores[-1:], "client_cpus": cores[:-1] or cores}
    write_result(result, args.out)


def run(args, server_pid: int, log_path: Path) -> dict:
    Store("s3://bench?allow_bucket_creation=true").fs.create_dir("bench")
    client = boto3.client("s3")
    data = os.urandom(args.size)
    keys = [f"img/{i:06d}.jpg" for i in range(args.num)]
    for key in keys:
        client.put_object(Bucket="bench", Key=key, Body=data)
    fs, _ = pafs.FileSystem.from_uri("s3://bench")

    def pyarrow_read(key: str) -> bytes:
        with fs.open_input_stream(f"bench/{key}") as f:
            return f.read()

    readers = {
        "vitpipe_read_object": lambda key: read_object(f"s3://bench/{key}"),
        "pyarrow": pyarrow_read,
        "boto3": lambda key: client.get_object(Bucket="bench", Key=key)["Body"].read(),
    }
    for read in readers.values():  # clients made, connections opened: not what a round measures
        read(keys[0])
    server = psutil.Process(server_pid)
    me = psutil.Process()
    rounds: dict[str, list[dict]] = {name: [] for name in readers}
    for _ in range(args.repeats):
        for name, read in readers.items():
            log_start = log_path.stat().st_size
            server0, client0 = sum(server.cpu_times()[:2]), sum(me.cpu_times()[:2])
            t0 = time.perf_counter()
            with ThreadPoolExecutor(args.threads) as pool:
                sizes = [len(b) for b in pool.map(read, keys)]
            wall = time.perf_counter() - t0
            server1, client1 = sum(server.cpu_times()[:2]), sum(me.cpu_times()[:2])
            assert sizes == [args.size] * args.num, f"{name}: short reads"
            time.sleep(0.5)  # the server's last log lines
            with open(log_path) as f:
                f.seek(log_start)
                methods = Counter(
                    m[1] for m in re.finditer(r'"(?:\x1b\[[\d;]*m)*([A-Z]+) /bench/img/', f.read())
                )
            rounds[name].append(
                {
                    "requests_per_object": {k: round(v / args.num, 2) for k, v in sorted(methods.items())},
                    "client_cpu_ms_per_object": round(1000 * (client1 - client0) / args.num, 3),
                    "server_cpu_ms_per_object": round(1000 * (server1 - server0) / args.num, 3),
                    "objects_per_s": round(args.num / wall, 1),
                }
            )
    metrics = ("client_cpu_ms_per_object", "server_cpu_ms_per_object", "objects_per_s")
    summary = {
        name: {
            "requests_per_object": runs[-1]["requests_per_object"],
            **{m: round(statistics.median(r[m] for r in runs), 3) for m in metrics},
            "rounds": runs,
        }
        for name, runs in rounds.items()
    }
    for name in readers:
        summary[name]["over_pyarrow"] = {
            m: round(summary[name][m] / summary["pyarrow"][m], 2) for m in metrics
        }
    return {
        "bench": "s3_read",
        "config": {"num": args.num, "size": args.size, "threads": args.threads, "repeats": args.repeats},
        "readers": summary,
    }


if __name__ == "__main__":
    main()
