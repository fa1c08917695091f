"""Where a benchmark's numbers come from, written into every result file (`bench/results/*.json`).

    from provenance import write_result      # bench scripts run as `python bench/NAME.py`: bench/ is on sys.path
    write_result(result, args.out)           # adds result["provenance"], prints the JSON, writes it atomically

`provenance` records the commit (and whether tracked files other than bench/results/ differed from it:
`make bench` rewrites those files one benchmark after another), when (UTC) and on what machine (CPU
model, cores this process may use, memory, OS, Python, torch, DeepSpeed). A committed number without them
cannot be checked against the code it claims to measure; tests/test_bench_results.py refuses such a file.
"""

from __future__ import annotations

import datetime
import importlib.metadata
import json
import os
import platform
import subprocess
from pathlib import Path

from data_prep import atomic

ROOT = Path(__file__).resolve().parents[1]
RESULTS = "bench/results"


def _git(*args: str) -> str | None:
    try:
        done = subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.SubprocessError):
        return None
    return done.stdout.strip() if done.returncode == 0 else None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


def _cpu_model() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def machine() -> dict:
    """The machine as a reader of the result needs it; no host name or address (results are published)."""
    pages = os.sysconf("SC_PHYS_PAGES") if hasattr(os, "sysconf") else 0
    return {
        "cpu": _cpu_model(),
        "cpus": len(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else os.cpu_count(),
        "memory_gib": round(pages * os.sysconf("SC_PAGE_SIZE") / 2**30, 1) if pages else None,
        "platform": platform.platform(),
        "python": platform.python_version(),
        "torch": _version("torch"),
        "deepspeed": _version("deepspeed"),
    }


def provenance() -> dict:
    """{"commit": full hash or None outside git, "dirty": tracked changes outside bench/results/,
    "measured_at": UTC ISO time, "machine": machine()}."""
    status = _git("status", "--porcelain", "--untracked-files=no", "--", ".", f":(exclude){RESULTS}")
    return {
        "commit": _git("rev-parse", "HEAD"),
        "dirty": None if status is None else bool(status),
        "measured_at": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "machine": machine(),
    }


def write_result(result: dict, out: str | Path | None, stamp: dict | None = None) -> None:
    """Stamp `result` (with `stamp`, or a fresh provenance()), print it and write it to `out` atomically."""
    result["provenance"] = stamp or provenance()
    print(json.dumps(result, indent=2))
    if out:
        atomic.write_json(Path(out), result, indent=2)
