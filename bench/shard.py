"""Throughput and memory of `vitpipe shard synthetic`, run as the real command in a subprocess.

    .venv/bin/python bench/shard.py --out bench/results/shard.json          # 10k images; 10k vs 50k
    .venv/bin/python bench/shard.py --quick                                  # smoke: 1k; 1k vs 5k

Speed: images/s with --workers 1 (in-process) and --workers 2 (worker processes), median over
repeats, from the wall clock of the whole command (start-up included) and from the rate the command
itself reports (planning and writing only). Goal: 2 workers >= 1.7x one.
Memory: peak RSS summed over the command's process tree (the driver and every worker, sampled every
20 ms), at a small and a 5x larger corpus with the default workers. Goal: large <= 1.2x small.
Small images keep the whole bench to a few minutes; per-image cost does not change the shape.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path

import psutil  # installed with ray[default]

REPO = Path(__file__).resolve().parents[1]


def run_shard(out: Path, num: int, workers: int, width: int, height: int, max_count: int) -> dict:
    cmd = [
        sys.executable, "-m", "vitpipe", "shard", "synthetic", str(out), "--num", str(num), "--classes", "100",
        "--width", str(width), "--height", str(height), "--max-count", str(max_count),
        "--workers", str(workers), "--no-progress",
    ]  # fmt: skip
    t0 = time.perf_counter()
    proc = subprocess.Popen(cmd, cwd=REPO, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
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
    stop.set()
    sampler.join()
    if proc.returncode != 0:
        raise RuntimeError(f"{' '.join(cmd)} failed ({proc.returncode}):\n{stdout}\n{stderr}")
    reported = re.search(r"\(([\d.]+) images/s\)", stdout)
    shutil.rmtree(out, ignore_errors=True)
    return {
        "wall_s": round(wall, 3),
        "images_per_s_wall": round(num / wall, 1),
        "images_per_s_reported": float(reported.group(1)) if reported else None,
        "peak_rss_tree_mb": round(peak["tree"] / 2**20, 1),
        "peak_rss_process_mb": round(peak["process"] / 2**20, 1),
    }


def median_of(runs: list[dict], key: str) -> float:
    return round(statistics.median(r[key] for r in runs), 2)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--quick", action="store_true", help="1k images for speed, 1k vs 5k for memory")
    ap.add_argument("--speed-num", type=int, default=None, help="images per speed run (default 10000)")
    ap.add_argument(
        "--mem-num", type=int, default=None, help="small corpus for memory (default 10000; 5x it too)"
    )
    ap.add_argument("--width", type=int, default=128)
    ap.add_argument("--height", type=int, default=96)
    ap.add_argument("--max-count", type=int, default=500)
    ap.add_argument("--repeats", type=int, default=None, help="runs per setting (default 3, quick 2)")
    ap.add_argument("--out", help="also write the JSON here")
    args = ap.parse_args()
    speed_num = args.speed_num or (1000 if args.quick else 10_000)
    mem_num = args.mem_num or (1000 if args.quick else 10_000)
    repeats = args.repeats or (2 if args.quick else 3)
    tmp = Path(tempfile.mkdtemp(prefix="bench-shard-"))
    try:
        speed = {}
        for workers in (1, 2):
            runs = [
                run_shard(
                    tmp / f"w{workers}-{i}", speed_num, workers, args.width, args.height, args.max_count
                )
                for i in range(repeats)
            ]
            speed[f"workers_{workers}"] = {
                "images_per_s_wall": median_of(runs, "images_per_s_wall"),
                "images_per_s_reported": median_of(runs, "images_per_s_reported"),
                "runs": runs,
            }
        memory = {}
        for label, num in (("small", mem_num), ("large", 5 * mem_num)):
            runs = [
                run_shard(tmp / f"m{label}-{i}", num, 2, args.width, args.height, args.max_count)
                for i in range(repeats)
            ]
            memory[label] = {
                "num": num,
                "peak_rss_tree_mb": median_of(runs, "peak_rss_tree_mb"),
                "runs": runs,
            }
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
    w1, w2 = speed["workers_1"], speed["workers_2"]
    speedup_wall = round(w2["images_per_s_wall"] / w1["images_per_s_wall"], 2)
    speedup_reported = round(w2["images_per_s_reported"] / w1["images_per_s_reported"], 2)
    rss_ratio = round(memory["large"]["peak_rss_tree_mb"] / memory["small"]["peak_rss_tree_mb"], 3)
    result = {
        "bench": "shard",
        "command": "vitpipe shard synthetic OUT --num N --classes 100 --width W --height H --max-count M --workers K",
        "config": {
            "quick": args.quick,
            "speed_num": speed_num,
            "mem_num": mem_num,
            "width": args.width,
            "height": args.height,
            "max_count": args.max_count,
            "repeats": repeats,
        },  # fmt: skip
        "machine": {
            "cpus": os.cpu_count(),
            "python": platform.python_version(),
            "platform": platform.platform(),
        },
        "speed": speed,
        "speedup_2_workers": {
            "wall": speedup_wall,
            "reported": speedup_reported,
            "goal": 1.7,
            "ok": speedup_wall >= 1.7,
        },  # fmt: skip
        "memory": memory,
        "rss_ratio_large_over_small": {"value": rss_ratio, "goal": 1.2, "ok": rss_ratio <= 1.2},
    }
    text = json.dumps(result, indent=2)
    print(text)
    if args.out:
        Path(args.out).parent.mkdir(parents=True, exist_ok=True)
        Path(args.out).write_text(text + "\n")


if __name__ == "__main__":
    main()
