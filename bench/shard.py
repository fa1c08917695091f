"""Throughput and memory of `vitpipe shard synthetic`, run as the real command in a subprocess.

    .venv/bin/python bench/shard.py --out bench/results/shard.json          # 10k images; 10k vs 50k
    .venv/bin/python bench/shard.py --quick                                  # smoke: 1k; 1k vs 5k

Speed: images/s with --workers 1 (in-process) and --workers 2 (worker processes), in alternating
rounds, from the wall clock of the whole command (interpreter start-up included) and from the rate
the command itself reports (listing, writing, index and manifest). Speed-up: the median over rounds
of the 2-worker / 1-worker ratio. Goal: >= 1.7x. Each round also measures the machine's ceiling: the
same drawing and encoding without vitpipe in 1 and 2 processes; on a shared machine that is what
other tenants leave, and the number to read the speed-up against.
Memory: peak RSS summed over the command's process tree (the driver and every worker, sampled every
20 ms), at a small and a 5x larger corpus with the default workers. Goal: large <= 1.2x small.
Object storage: `vitpipe shard manifest --resize-max 384` (the README's journey) of the same 500x375
JPEGs, local files into a local folder against s3:// objects into an s3:// prefix, in alternating rounds
with 2 workers. The S3 server (moto, the only one here) spends about 4 ms of CPU per GET, work a real
object store does on machines of its own. So it is measured twice: `own_core`, the server on the last
core and vitpipe (local and bucket runs alike) on the others, as on a cluster; and `shared_cores`, all
of them on every core, where the server's CPU competes with vitpipe's decoding (informational: on 2
cores it bounds the ratio near 0.7 even for a client that cost nothing). Goal, on `own_core`:
bucket-to-bucket images/s >= 0.7x local-to-local (median of the rounds' ratios). Each run records the
server's CPU time and vitpipe's own (the command's process tree); `images_per_vitpipe_cpu_s` compares
the two sides without the server.
Fan-out (`--sections fanout`, its own run into bench/results/shard_fanout.json): the planner's driver at
the shape of 300M inputs, ~160 labels spans x 300 ranges x 300 buckets (see fanout_rounds). Goals: the
driver's peak RSS <= 1.25x that of the same folder planned as one range, its CPU <= 5% of the workers'.
Sizes: 256x192 for speed (about 2.5 ms to draw and encode an image, so per-shard work dominates as
with real JPEGs; at tiny sizes the fixed start-up and index costs would), 64x48 for memory. The whole
bench takes about 8 minutes on 2 cores; each run records the 1-minute load average before and after, since
other work on a shared machine skews the speed and the speed-up.
"""

from __future__ import annotations

import argparse
import io
import json
import multiprocessing
import os
import re
import shutil
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil  # installed with ray[default]
from provenance import write_result  # bench/provenance.py, beside this file

from data_prep.synthetic import render

REPO = Path(__file__).resolve().parents[1]


def run_shard(out: Path, num: int, workers: int, width: int, height: int, max_count: int) -> dict:
    args = [
        "synthetic",
        str(out),
        "--num",
        str(num),
        "--classes",
        "100",
        "--width",
        str(width),
        "--height",
        str(height),
        "--max-count",
        str(max_count),
        "--workers",
        str(workers),
    ]
    return run_command(args, num, lambda: shutil.rmtree(out, ignore_errors=True))


def run_command(
    args: list[str], num: int, cleanup, env: dict | None = None, cpus: set[int] | None = None
) -> dict:
    """`vitpipe shard ARGS` in a subprocess (on the cores `cpus` where given, its workers too): wall
    clock, reported rate and peak RSS; `cleanup()` after."""
    cmd = [sys.executable, "-m", "vitpipe", "shard", *args, "--no-progress"]
    load_before = os.getloadavg()[0]  # other work on the machine skews both numbers: record it
    cpu0 = os.times()
    t0 = time.perf_counter()
    proc = subprocess.Popen(
        cmd,
        cwd=REPO,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=env,
        preexec_fn=None if cpus is None else lambda: os.sched_setaffinity(0, cpus),
    )
    peak = {"tree": 0, "process": 0}
    stop = threading.Event()

    def sample() -> None:
        root = psutil.Process(proc.pid)
        while not stop.is_set():
            try:
                procs = [root, *root.children(recursive=True)]
                rss = [p.memory_info().rss for p in procs]
            except psutil.Error:
                rss = []
            if rss:
                peak["tree"] = max(peak["tree"], sum(rss))
                peak["process"] = max(peak["process"], max(rss))
            stop.wait(0.02)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    stdout, stderr = proc.communicate()
    wall = time.perf_counter() - t0
    cpu1 = os.times()  # children's times include the command's own waited-for worker processes
    cpu = (cpu1.children_user + cpu1.children_system) - (cpu0.children_user + cpu0.children_system)
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout}\n{stderr}")
    reported = re.search(r"\(([\d.]+) images/s", stdout)
    cleanup()
    return {
        "wall_s": round(wall, 3),
        "images_per_s_wall": round(num / wall, 1),
        "images_per_s_reported": float(reported.group(1)) if reported else None,
        "cpu_s": round(cpu, 2),
        "peak_rss_tree_mb": round(peak["tree"] / 2**20, 1),
        "peak_rss_process_mb": round(peak["process"] / 2**20, 1),
        "load_avg_1min": [round(load_before, 2), round(os.getloadavg()[0], 2)],
    }


def _draw_and_encode(num: int, width: int, height: int) -> float:
    """The per-image work of a synthetic shard without vitpipe around it: seconds for `num` images."""
    t0 = time.perf_counter()
    for i in range(num):
        img, _ = render(i, 0, 100, 1.3, width, height)
        img.save(io.BytesIO(), "JPEG", quality=90)
    return time.perf_counter() - t0


def calibrate(num: int, width: int, height: int) -> float:
    """The speed-up 2 processes get on this machine right now (other tenants' load included)."""
    with multiprocessing.get_context("spawn").Pool(2) as pool:
        pool.starmap(_draw_and_encode, [(5, width, height)] * 2)  # imports done before timing
        one = _draw_and_encode(num, width, height)
        t0 = time.perf_counter()
        pool.starmap(_draw_and_encode, [(num, width, height)] * 2)
        two = time.perf_counter() - t0
    return round(2 * one / two, 2)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def _wait_for_port(port: int, timeout_s: float = 30.0) -> None:
    deadline = time.monotonic() + timeout_s
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            return
        except OSError:
            if time.monotonic() > deadline:
                raise RuntimeError(f"no server on 127.0.0.1:{port} after {timeout_s:.0f} s") from None
            time.sleep(0.2)


def _pin(pid: int, cpus: set[int]) -> None:
    """Every thread of process `pid` onto `cpus` (affinity is per thread; threads started later inherit it
    from the one that starts them)."""
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            os.sched_setaffinity(int(tid), cpus)
        except OSError:  # the thread ended meanwhile
            pass


def bucket_rounds(
    tmp: Path, num: int, workers: int, size: tuple[int, int], resize_max: int, max_count: int, repeats: int
) -> dict:
    """Local-to-local against bucket-to-bucket `vitpipe shard manifest` of the same `num` JPEGs, with the S3
    server on a core of its own (the goal) and on the cores vitpipe uses."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from data_prep.storage import Store

    port = _free_port()
    server = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    env = {
        **os.environ,
        "AWS_ACCESS_KEY_ID": "bench",
        "AWS_SECRET_ACCESS_KEY": "bench",
        "AWS_DEFAULT_REGION": "us-east-1",
        "AWS_ENDPOINT_URL": f"http://127.0.0.1:{port}",
    }
    cores = sorted(os.sched_getaffinity(0))
    placements = {"shared_cores": (set(cores), set(cores))}  # (vitpipe's cores, the server's)
    if len(cores) > 1:
        placements = {"own_core": (set(cores[:-1]), {cores[-1]}), **placements}
    saved = dict(os.environ)
    os.environ.update(env)
    runs = {place: {"local": [], "bucket": []} for place in placements}
    try:
        _wait_for_port(port)
        Store("s3://bench?allow_bucket_creation=true").fs.create_dir("bench")
        inputs = Store("s3://bench/img")
        (tmp / "img").mkdir(parents=True, exist_ok=True)
        local_rows, bucket_rows = [], []
        for i in range(num):
            img, labels = render(i, 0, 100, 1.3, *size)
            buf = io.BytesIO()
            img.save(buf, "JPEG", quality=90)
            (tmp / "img" / f"{i:06d}.jpg").write_bytes(buf.getvalue())
            inputs.write_bytes(f"{i:06d}.jpg", buf.getvalue())
            local_rows.append({"path": str(tmp / "img" / f"{i:06d}.jpg"), "label": labels[0]})
            bucket_rows.append({"path": f"s3://bench/img/{i:06d}.jpg", "label": labels[0]})
        pq.write_table(pa.Table.from_pylist(local_rows), tmp / "local.parquet")
        pq.write_table(pa.Table.from_pylist(bucket_rows), tmp / "bucket.parquet")
        common = ["--max-count", str(max_count), "--workers", str(workers), "--resize-max", str(resize_max)]
        server_proc = psutil.Process(server.pid)
        for i in range(repeats):
            for place, (ours, theirs) in placements.items():
                _pin(server.pid, theirs)
                for kind, manifest, out, cleanup in (
                    (
                        "local",
                        "local.parquet",
                        str(tmp / f"local-{i}"),
                        lambda p=tmp / f"local-{i}": shutil.rmtree(p),
                    ),
                    (
                        "bucket",
                        "bucket.parquet",
                        f"s3://bench/out-{i}",
                        lambda u=f"s3://bench/out-{i}": Store(u).delete_dir(""),
                    ),
                ):
                    before = sum(server_proc.cpu_times()[:2])
                    run = run_command(
                        ["manifest", str(tmp / manifest), out, *common], num, cleanup, env, ours
                    )
                    run["server_cpu_s"] = round(sum(server_proc.cpu_times()[:2]) - before, 2)
                    runs[place][kind].append(run)
    finally:
        os.environ.clear()
        os.environ.update(saved)
        server.terminate()
        server.wait()
    result = {
        "command": "vitpipe shard manifest {local,bucket}.parquet {DIR,s3://bench/out} --workers W --resize-max R",
        "num": num,
        "workers": workers,
        "size": size,
        "resize_max": resize_max,
    }
    for place, (ours, theirs) in placements.items():
        result[place] = _bucket_summary(
            runs[place], num, sorted(ours), sorted(theirs), goal=place == "own_core"
        )
    return result


def _bucket_summary(
    runs: dict[str, list[dict]], num: int, ours: list[int], theirs: list[int], goal: bool
) -> dict:
    pairs = list(zip(runs["local"], runs["bucket"]))
    wall = round(statistics.median(b["images_per_s_wall"] / a["images_per_s_wall"] for a, b in pairs), 2)
    ratio = {
        "value": wall,
        "per_round": [round(b["images_per_s_wall"] / a["images_per_s_wall"], 3) for a, b in pairs],
    }
    if goal:
        ratio.update(goal=0.7, ok=wall >= 0.7)
    return {
        "vitpipe_cpus": ours,
        "server_cpus": theirs,
        "local_to_local": {
            "images_per_s_wall": median_of(runs["local"], "images_per_s_wall"),
            "runs": runs["local"],
        },
        "bucket_to_bucket": {
            "images_per_s_wall": median_of(runs["bucket"], "images_per_s_wall"),
            "runs": runs["bucket"],
        },
        "ratio_bucket_over_local": ratio,
        "images_per_vitpipe_cpu_s_bucket_over_local": round(
            statistics.median(a["cpu_s"] / b["cpu_s"] for a, b in pairs), 2
        ),
        "s3_server_cpu_ms_per_image": round(
            1000 * statistics.median(b["server_cpu_s"] for _, b in pairs) / num, 2
        ),
    }


def _size(text: str) -> tuple[int, int]:
    w, h = text.lower().split("x")
    return int(w), int(h)


def median_of(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


def speed_rounds(tmp: Path, num: int, size: tuple[int, int], max_count: int, repeats: int) -> dict:
    """Rounds alternate 1 and 2 workers, so load from elsewhere falls on both alike; the speed-up is the
    median of each round's ratio."""
    runs: dict[int, list[dict]] = {1: [], 2: []}
    ceiling = []
    for i in range(repeats):
        ceiling.append(calibrate(max(100, num // 20), *size))
        for workers in (1, 2):
            runs[workers].append(run_shard(tmp / f"w{workers}-{i}", num, workers, *size, max_count))
    ratios = {
        k: [b[k] / a[k] for a, b in zip(runs[1], runs[2])]
        for k in ("images_per_s_wall", "images_per_s_reported")
    }
    wall = round(statistics.median(ratios["images_per_s_wall"]), 2)
    return {
        "speed": {
            f"workers_{w}": {
                "images_per_s_wall": median_of(runs[w], "images_per_s_wall"),
                "images_per_s_reported": median_of(runs[w], "images_per_s_reported"),
                "runs": runs[w],
            }
            for w in (1, 2)
        },
        "speedup_2_workers": {
            "wall": wall,
            "reported": round(statistics.median(ratios["images_per_s_reported"]), 2),
            "goal": 1.7,
            "ok": wall >= 1.7,
            "machine_ceiling": statistics.median(ceiling),
            "machine_ceiling_per_round": ceiling,
        },
    }


def memory_runs(tmp: Path, num: int, size: tuple[int, int], max_count: int, repeats: int) -> dict:
    memory = {}
    for label, n in (("small", num), ("large", 5 * num)):
        runs = [run_shard(tmp / f"m{label}-{i}", n, 2, *size, max_count) for i in range(repeats)]
        memory[label] = {"num": n, "peak_rss_tree_mb": median_of(runs, "peak_rss_tree_mb"), "runs": runs}
    ratio = round(memory["large"]["peak_rss_tree_mb"] / memory["small"]["peak_rss_tree_mb"], 3)
    return {"memory": memory, "rss_ratio_large_over_small": {"value": ratio, "goal": 1.2, "ok": ratio <= 1.2}}


SECTIONS = ("speed", "memory", "bucket")
# Not in the default run: `make bench` runs each on its own (bench/results/shard_planning.json, shard_fanout.json).
EXTRA_SECTIONS = ("planning", "fanout")
PLAN_IMAGES = 200  # distinct small JPEGs a generated manifest's rows point at (distinct keys)
FOLDER_CLASSES = 1000  # class folders of the generated class folder (files: hard links to the JPEGs)


def _plan_images(folder: Path) -> None:
    import numpy as np
    from PIL import Image

    (folder / "img").mkdir(parents=True, exist_ok=True)
    rng = np.random.default_rng(0)
    for i in range(PLAN_IMAGES):
        pixels = rng.integers(0, 255, (192, 256, 3), dtype=np.uint8)
        Image.fromarray(pixels).save(folder / "img" / f"{i}.jpg", quality=90)


def write_manifest(folder: Path, rows: int, csv: bool = False) -> Path:
    """manifest.parquet of `rows` rows (path, two of 18,000 labels, a distinct key) over PLAN_IMAGES real
    256x192 JPEGs beside it (as in the speed runs: per-image work, not per-shard, dominates a whole build),
    written in row groups of 2^20 rows (pyarrow's default); `csv`: the same rows as manifest.csv (labels
    joined by '|')."""
    import pyarrow as pa
    import pyarrow.csv as pacsv
    import pyarrow.parquet as pq

    _plan_images(folder)
    labels_type = pa.string() if csv else pa.list_(pa.string())
    schema = pa.schema([("path", pa.string()), ("labels", labels_type), ("key", pa.string())])
    path = folder / f"manifest-{rows}.{'csv' if csv else 'parquet'}"
    writer = pacsv.CSVWriter(path, schema) if csv else pq.ParquetWriter(path, schema)
    with writer as w:
        for start in range(0, rows, 1 << 20):
            idx = range(start, min(rows, start + (1 << 20)))
            labels = [[f"c{i * 7 % 18_000}", f"c{i * 13 % 18_000}"] for i in idx]
            w.write_table(
                pa.table(
                    {
                        "path": [f"img/{i % PLAN_IMAGES}.jpg" for i in idx],
                        "labels": ["|".join(pair) for pair in labels] if csv else labels,
                        "key": [f"k{i:010d}" for i in idx],
                    },
                    schema=schema,
                )
            )
    return path


def write_folder(folder: Path, files: int, classes: int = FOLDER_CLASSES) -> Path:
    """A class folder of `files` files in `classes` class folders: hard links to the PLAN_IMAGES JPEGs
    (each file a real image and a directory entry of its own, with its own key)."""
    _plan_images(folder)
    root = folder / f"classes-{files}-{classes}"
    per = files // classes
    for c in range(classes):
        (root / f"n{c:05d}").mkdir(parents=True, exist_ok=True)
        for j in range(per):
            os.link(
                folder / "img" / f"{(c * per + j) % PLAN_IMAGES}.jpg", root / f"n{c:05d}" / f"{j:06d}.jpg"
            )
    return root


def write_flat_labels(root: Path) -> Path:
    """root/labels.csv for the folder `write_folder` made, read as a flat folder: a row per file (file, two
    of 18,000 labels joined by '|'), in a shuffled order (a labels file is rarely in the listing's)."""
    import numpy as np
    import pyarrow as pa
    import pyarrow.csv as pacsv

    names = sorted(p.relative_to(root).as_posix() for p in root.glob("*/*.jpg"))
    order = np.random.default_rng(0).permutation(len(names))
    path = root / "labels.csv"
    schema = pa.schema([("file", pa.string()), ("labels", pa.string())])
    with pacsv.CSVWriter(path, schema) as w:
        for start in range(0, len(names), 1 << 20):
            idx = order[start : start + (1 << 20)]
            labels = [f"c{i * 7 % 18_000}|c{i * 13 % 18_000}" for i in idx]
            w.write_table(pa.table({"file": [names[i] for i in idx], "labels": labels}, schema=schema))
    return path


def plan_child(
    manifest: str,
    out: str,
    workers: int,
    full: bool,
    serial: bool = False,
    fanout: tuple[int, int] | None = None,
) -> None:
    """In a process of its own (what `vitpipe shard manifest` runs): the whole build (`full`), or its
    planning alone (tally, list, sort, and every shard task generated, none written). Prints what the
    driver (this process) and its worker processes spent. A folder with a labels.csv is a flat folder;
    `serial`: planned by the serial planner (`plan.py`), as a flat folder was before it was ranged;
    `fanout`: (rows per range, rows per bucket) in place of the planner's 1M and 1M."""
    import resource

    from data_prep import ranged
    from data_prep.build import BuildOptions, _serial_planner, build_dataset, job_fingerprint
    from data_prep.dataset_dir import DatasetDir
    from data_prep.executors import Executor
    from data_prep.ranged import RangedPlanner
    from data_prep.sources.folder import FolderSource
    from data_prep.sources.table import ManifestSource

    if fanout:
        ranged.RANGE_ROWS, ranged.BUCKET_ROWS = fanout

    # The driver's peak RSS: VmHWM (ru_maxrss would not do: Linux keeps it across exec, so it starts at the
    # bench's own). The workers': sampled once a second (a faster sampler costs the driver CPU it measures).
    peak = {"worker": 0}
    stop = threading.Event()

    def sample() -> None:
        me = psutil.Process()
        while not stop.is_set():
            try:
                for child in me.children(recursive=True):
                    peak["worker"] = max(peak["worker"], child.memory_info().rss)
            except psutil.Error:
                pass
            stop.wait(1.0)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    t0 = time.perf_counter()
    if not Path(manifest).is_dir():
        source = ManifestSource(manifest)
    else:
        labels = Path(manifest) / "labels.csv"
        source = FolderSource(manifest, labels if labels.is_file() else None)
    opts = BuildOptions(workers=workers, progress=False, max_count=1000)
    shards = images = 0
    if serial:
        root = DatasetDir(out)
        root.make()
        serial_planner = _serial_planner(root, source, opts, job_fingerprint(source, opts))
        shards = sum(1 for _ in serial_planner.tasks())
        images = serial_planner.total  # the items planned (none written)
        planner = None
    elif full:
        report = build_dataset(source, out, opts)
        shards, images = report.num_shards, report.num_written
        planner = None
    else:
        root = DatasetDir(out)
        root.make()
        with Executor(workers) as executor:
            planner = RangedPlanner.make(source, root, "", job_fingerprint(source, opts), opts)
            planner.survey(executor)
            planner.seal()
            planner.list(executor)
            planner.sort(executor)
            shards = sum(1 for _ in planner.shard_tasks())
    wall = time.perf_counter() - t0
    stop.set()
    sampler.join()
    me, kids = resource.getrusage(resource.RUSAGE_SELF), resource.getrusage(resource.RUSAGE_CHILDREN)
    record = {
        "wall_s": round(wall, 2),
        "driver_cpu_s": round(me.ru_utime + me.ru_stime, 2),
        "workers_cpu_s": round(kids.ru_utime + kids.ru_stime, 2),
        "driver_peak_rss_mb": round(_vm_hwm_kb() / 1024, 1),
        "worker_peak_rss_mb": round(peak["worker"] / 2**20, 1),
        "shards": shards,
        "images": images,
    }
    if planner is not None:
        record |= {"ranges": len(planner.ranges), "buckets": planner.plan.buckets, "items": planner.items()}
        # The shuffles' metadata on the driver: a (labels span, range) pair per piece of a labels part,
        # a (range, bucket) pair per piece of a range part.
        record["labels_spans"] = len(planner.labels_markers)
        record["span_range_pairs"] = sum(len(m["pieces"]) for m in planner.labels_markers.values())
        record["range_bucket_pairs"] = sum(len(m["pieces"]) for m in planner.range_markers.values())
    print(json.dumps(record))


def _vm_hwm_kb() -> int:
    """This process's peak resident set (kB), from /proc/self/status."""
    with open("/proc/self/status") as f:
        return int(next(line for line in f if line.startswith("VmHWM:")).split()[1])


def _run_child(
    manifest: Path,
    out: Path,
    workers: int,
    full: bool,
    serial: bool = False,
    fanout: tuple[int, int] | None = None,
) -> dict:
    cmd = [sys.executable, __file__, "--plan-child", str(manifest), str(out), str(workers)]
    cmd += ["--full"] if full else []
    cmd += ["--serial"] if serial else []
    cmd += ["--fanout", f"{fanout[0]},{fanout[1]}"] if fanout else []
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True)
    shutil.rmtree(out, ignore_errors=True)
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{proc.stdout}\n{proc.stderr}")
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _other_run(source: Path, tmp: Path) -> dict:
    run = _run_child(source, tmp / "plan-out", 2, full=False)
    run["rows"] = run["items"]
    run["driver_cpu_share"] = round(run["driver_cpu_s"] / max(1e-9, run["workers_cpu_s"]), 4)
    run["rows_per_s"] = round(run["rows"] / run["wall_s"])
    return run


def planning_rounds(tmp: Path, sizes: tuple[int, int], e2e_rows: int, repeats: int) -> dict:
    """Planning a Parquet manifest at two sizes through the real code with 2 worker processes (the driver's
    peak RSS and CPU, against the workers'), then whole builds of a smaller manifest with 1 and 2 workers
    in alternating rounds (images/s, the driver's share of the CPU)."""
    small, large = sizes
    planning = {}
    for rows in sizes:
        manifest = write_manifest(tmp, rows)
        run = _run_child(manifest, tmp / "plan-out", 2, full=False)
        run["rows"] = rows
        run["driver_cpu_s_per_million_rows"] = round(run["driver_cpu_s"] / (rows / 1e6), 2)
        run["driver_cpu_share"] = round(run["driver_cpu_s"] / max(1e-9, run["workers_cpu_s"]), 4)
        run["rows_per_s"] = round(rows / run["wall_s"])
        planning[str(rows)] = run
        manifest.unlink()
    a, b = planning[str(small)], planning[str(large)]
    growth = {
        "driver_peak_rss": round(b["driver_peak_rss_mb"] / a["driver_peak_rss_mb"], 3),
        "driver_cpu_s": round(b["driver_cpu_s"] / a["driver_cpu_s"], 3),
        "rows": large / small,
    }
    # The same at the large size from a CSV manifest (surveyed: its byte spans' rows are counted first), a
    # class folder of a tenth of it (listed with a stat per file, as ImageNet's layout), and the same files
    # as a flat folder with a labels.csv (joined to the files by range; against the serial planner, which
    # read the labels file whole on the driver).
    other, baselines = {}, {}
    csv = write_manifest(tmp, large, csv=True)
    other["csv"] = _other_run(csv, tmp)
    csv.unlink()
    folder = write_folder(tmp, large // 10)
    other["folder"] = _other_run(folder, tmp)
    write_flat_labels(folder)
    other["flat"] = _other_run(folder, tmp)
    serial = _run_child(folder, tmp / "plan-out", 1, full=False, serial=True)
    serial["rows"] = serial.pop("images")
    baselines["flat_serial"] = serial
    other["flat"]["driver_peak_rss_vs_serial"] = round(
        other["flat"]["driver_peak_rss_mb"] / serial["driver_peak_rss_mb"], 3
    )
    other["flat"]["driver_cpu_s_vs_serial"] = round(other["flat"]["driver_cpu_s"] / serial["driver_cpu_s"], 4)
    shutil.rmtree(folder)
    manifest = write_manifest(tmp, e2e_rows)
    rounds = []
    for _ in range(repeats):
        one = _run_child(manifest, tmp / "e2e-1", 1, full=True)
        two = _run_child(manifest, tmp / "e2e-2", 2, full=True)
        for run in (one, two):
            run["images_per_s"] = round(run["images"] / run["wall_s"], 1)
        two["driver_cpu_share"] = round(two["driver_cpu_s"] / max(1e-9, two["workers_cpu_s"]), 4)
        rounds.append(
            {
                "workers_1": one,
                "workers_2": two,
                "speedup": round(two["images_per_s"] / one["images_per_s"], 3),
            }
        )
    speedup = statistics.median(r["speedup"] for r in rounds)
    e2e_share = statistics.median(r["workers_2"]["driver_cpu_share"] for r in rounds)
    return {
        "planning": planning,
        "planning_growth": growth,
        "planning_other": other,
        "planning_baselines": baselines,
        "end_to_end": {"rows": e2e_rows, "rounds": rounds},
        "goals": {
            "driver_peak_rss_mb_at_large": {
                "value": b["driver_peak_rss_mb"],
                "goal": "<= 1024",
                "met": b["driver_peak_rss_mb"] <= 1024,
            },
            "driver_peak_rss_growth": {
                "value": growth["driver_peak_rss"],
                "goal": "<= 1.2",
                "met": growth["driver_peak_rss"] <= 1.2,
            },
            "planning_driver_cpu_share_at_large": {
                "value": b["driver_cpu_share"],
                "goal": "<= 0.05",
                "met": b["driver_cpu_share"] <= 0.05,
            },
            **{
                f"{kind}_driver_peak_rss_mb": {
                    "value": run["driver_peak_rss_mb"],
                    "goal": "<= 1024",
                    "met": run["driver_peak_rss_mb"] <= 1024,
                }
                for kind, run in other.items()
            },
            **{
                f"{kind}_driver_cpu_share": {
                    "value": run["driver_cpu_share"],
                    "goal": "<= 0.05",
                    "met": run["driver_cpu_share"] <= 0.05,
                }
                for kind, run in other.items()
            },
            "end_to_end_driver_cpu_share": {"value": e2e_share, "goal": "<= 0.05", "met": e2e_share <= 0.05},
            "speedup_2_vs_1_workers": {"value": speedup, "goal": ">= 1.7", "met": speedup >= 1.7},
        },
    }


FANOUT_FILES, FANOUT_FOLDERS = 300_000, 300  # a flat folder of 300 top-level folders of 1,000 files each
FANOUT = (1_000, 1_000)  # rows per range and per bucket: 300 ranges, 300 buckets, ~160 labels spans


def fanout_rounds(tmp: Path, repeats: int) -> dict:
    """The driver at the shape of 300M inputs: ~160 labels spans x 300 ranges x 300 buckets, from a flat
    folder of 300k files with a shuffled labels.csv planned with ranges and buckets of 1,000 rows (the
    planner's are 1M), against the same folder planned as one range, one span and one bucket. What the driver
    holds per (span, range) and (range, bucket) pair does not depend on the rows behind it, so this is the
    metadata of 300M inputs (160 x 300 and 300 x 300 pairs) at a thousandth of the rows. Alternating rounds;
    medians."""
    folder = write_folder(tmp, FANOUT_FILES, FANOUT_FOLDERS)
    write_flat_labels(folder)
    rounds = []
    for _ in range(repeats):
        one = _other_run(folder, tmp)
        many = _run_child(folder, tmp / "plan-out", 2, full=False, fanout=FANOUT)
        many["driver_cpu_share"] = round(many["driver_cpu_s"] / max(1e-9, many["workers_cpu_s"]), 4)
        rounds.append({"one_range": one, "fanout": many})
    shutil.rmtree(folder)

    def med(kind: str, key: str) -> float:
        return statistics.median(r[kind][key] for r in rounds)

    rss_ratio = round(med("fanout", "driver_peak_rss_mb") / med("one_range", "driver_peak_rss_mb"), 3)
    share = med("fanout", "driver_cpu_share")
    last = rounds[-1]["fanout"]
    return {
        "files": FANOUT_FILES,
        "top_level_folders": FANOUT_FOLDERS,
        "rows_per_range_and_bucket": list(FANOUT),
        "shape": {
            k: last[k]
            for k in ("ranges", "labels_spans", "buckets", "span_range_pairs", "range_bucket_pairs")
        },
        "rounds": rounds,
        "median": {
            kind: {
                key: med(kind, key)
                for key in ("driver_peak_rss_mb", "driver_cpu_s", "workers_cpu_s", "wall_s")
            }
            for kind in ("one_range", "fanout")
        },
        "goals": {
            "driver_peak_rss_vs_one_range": {"value": rss_ratio, "goal": "<= 1.25", "met": rss_ratio <= 1.25},
            "driver_cpu_share": {"value": share, "goal": "<= 0.05", "met": share <= 0.05},
        },
    }


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--quick", action="store_true", help="1k images for speed, 1k vs 5k for memory, 300 for bucket"
    )
    ap.add_argument("--speed-num", type=int, default=None, help="images per speed run (default 10000)")
    ap.add_argument(
        "--mem-num", type=int, default=None, help="small corpus for memory (default 10000; 5x it too)"
    )
    ap.add_argument(
        "--bucket-num", type=int, default=None, help="images per object storage run (default 3000)"
    )
    ap.add_argument(
        "--speed-size", type=_size, default=(256, 192), help="WxH of speed runs (default 256x192)"
    )
    ap.add_argument("--mem-size", type=_size, default=(64, 48), help="WxH of memory runs (default 64x48)")
    ap.add_argument("--max-count", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=None, help="runs per setting (default 3, quick 2)")
    ap.add_argument(
        "--sections",
        default=",".join(SECTIONS),
        help=f"comma-separated subset of {','.join(SECTIONS + EXTRA_SECTIONS)} (default: {','.join(SECTIONS)})",
    )
    ap.add_argument(
        "--plan-rows",
        default="1000000,10000000",
        help="planning section: two manifest sizes, small,large (default 1000000,10000000)",
    )
    ap.add_argument("--e2e-rows", type=int, default=40_000, help="planning section: rows of the whole builds")
    ap.add_argument("--out", help="also write the JSON here")
    ap.add_argument("--plan-child", nargs=3, metavar=("MANIFEST", "OUT", "WORKERS"), help=argparse.SUPPRESS)
    ap.add_argument("--full", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--serial", action="store_true", help=argparse.SUPPRESS)
    ap.add_argument("--fanout", type=lambda v: tuple(int(x) for x in v.split(",")), help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.plan_child:
        manifest, out, workers = args.plan_child
        plan_child(manifest, out, int(workers), args.full, args.serial, args.fanout)
        return
    sections = [x for x in args.sections.split(",") if x]
    unknown = set(sections) - set(SECTIONS) - set(EXTRA_SECTIONS)
    if unknown:
        ap.error(f"--sections: unknown {sorted(unknown)}; choose from {', '.join(SECTIONS + EXTRA_SECTIONS)}")
    speed_num = args.speed_num or (1000 if args.quick else 10_000)
    mem_num = args.mem_num or (1000 if args.quick else 10_000)
    bucket_num = args.bucket_num or (300 if args.quick else 1500)
    repeats = args.repeats or (2 if args.quick else 3)
    result = {
        "bench": "shard",
        "command": "vitpipe shard synthetic OUT --num N --classes 100 --width W --height H --max-count M --workers K",
        "config": {
            "quick": args.quick,
            "sections": sections,
            "speed_num": speed_num,
            "mem_num": mem_num,
            "bucket_num": bucket_num,
            "speed_size": args.speed_size,
            "mem_size": args.mem_size,
            "max_count": args.max_count,
            "repeats": repeats,
        },
    }
    tmp = Path(tempfile.mkdtemp(prefix="bench-shard-"))
    try:
        if "speed" in sections:
            result.update(speed_rounds(tmp, speed_num, args.speed_size, args.max_count, repeats))
        if "memory" in sections:
            result.update(memory_runs(tmp, mem_num, args.mem_size, args.max_count, repeats))
        if "planning" in sections:
            small, large = (int(x) for x in args.plan_rows.split(","))
            result["command"] = "vitpipe shard manifest MANIFEST.parquet OUT --max-count 1000 --workers K"
            result |= planning_rounds(tmp, (small, large), args.e2e_rows, repeats)
        if "fanout" in sections:
            result["command"] = (
                "vitpipe shard folder DIR OUT --labels DIR/labels.csv --max-count 1000 --workers 2"
            )
            result["fanout"] = fanout_rounds(tmp, repeats)
        if "bucket" in sections:
            result["object_storage"] = bucket_rounds(
                tmp, bucket_num, 2, (500, 375), 384, args.max_count, repeats
            )
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    write_result(result, args.out)


if __name__ == "__main__":
    main()
