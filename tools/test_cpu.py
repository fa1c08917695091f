"""CPU seconds per test, everything it started included: a pytest plugin for deciding what the suite spends.

    PYTHONPATH=tools .venv/bin/python -m pytest tests -n 5 --dist loadgroup -p test_cpu    # as root, Linux
    .venv/bin/python tools/test_cpu.py test-cpu.jsonl                                   # the summary

On 2 cores with five xdist workers a test's wall time says little: the machine is CPU-bound throughout, so
the suite's wall time is about its total CPU over 2, and what shortens it is less CPU. `--durations` cannot
see that CPU: it is spent in torchrun ranks, Ray Train workers and a local cluster's daemons (which leave the
test's process tree when `ray start` returns). So each xdist worker moves itself into a cgroup of its own
(cgroup v1 `cpuacct`, which needs root), every process it starts stays there, and each test's record is the
group's CPU time across the test (set-up and teardown included: a group's cluster start falls to its first
test). One JSON line per test goes to $TEST_CPU_OUT (default test-cpu.jsonl): node id, cpu_s, wall_s, worker.
"""

from __future__ import annotations

import argparse
import collections
import json
import os
import time
from pathlib import Path

import pytest

CPUACCT = Path("/sys/fs/cgroup/cpuacct")
_group: Path | None = None


def _cpu_s() -> float:
    return int((_group / "cpuacct.usage").read_text()) / 1e9


def pytest_configure(config: pytest.Config) -> None:
    global _group
    if not (CPUACCT / "tasks").exists():
        raise pytest.UsageError(f"tools/test_cpu.py needs cgroup v1 cpuacct at {CPUACCT} (and root)")
    _group = CPUACCT / f"vitpipe-test-{os.environ.get('PYTEST_XDIST_WORKER', 'main')}"
    _group.mkdir(exist_ok=True)
    for thread in os.listdir("/proc/self/task"):  # v1 moves threads; children inherit the group
        (_group / "tasks").write_text(thread)


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_protocol(item: pytest.Item, nextitem: pytest.Item | None):
    cpu, wall = _cpu_s(), time.time()
    yield
    record = {
        "id": item.nodeid,
        "cpu_s": round(_cpu_s() - cpu, 2),
        "wall_s": round(time.time() - wall, 2),
        "worker": os.environ.get("PYTEST_XDIST_WORKER"),
    }
    with open(os.environ.get("TEST_CPU_OUT", "test-cpu.jsonl"), "a") as f:
        f.write(json.dumps(record) + "\n")


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Summarise a test_cpu.py record: CPU per module and per unit.")
    p.add_argument("jsonl")
    p.add_argument("--top", type=int, default=30)
    args = p.parse_args(argv)
    rows = [json.loads(line) for line in Path(args.jsonl).read_text().splitlines() if line.strip()]
    total = sum(r["cpu_s"] for r in rows)
    print(f"{len(rows)} tests, {total:.0f} CPU-s")
    modules: collections.Counter = collections.Counter()
    units: dict[str, list[float]] = collections.defaultdict(lambda: [0.0, 0.0])
    for r in rows:
        modules[r["id"].split("::")[0]] += r["cpu_s"]
        unit = r["id"].split("@")[1] if "@" in r["id"] else r["id"].split("[")[0]  # xdist group, or test
        units[unit][0] += r["cpu_s"]
        units[unit][1] += r["wall_s"]
    print("\nCPU-s  share  module")
    for name, cpu in modules.most_common(args.top):
        print(f"{cpu:6.0f}  {cpu / total:5.1%}  {name}")
    print("\nCPU-s  wall-s  unit (an xdist group or a test)")
    for name, (cpu, wall) in sorted(units.items(), key=lambda kv: -kv[1][0])[: args.top]:
        print(f"{cpu:6.0f}  {wall:6.0f}  {name}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
