"""Committed benchmark results say what measured them, and `make bench` rewrites every one of them.

.venv/bin/python -m pytest tests/test_bench_results.py -q
"""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "bench/results"
sys.path.insert(0, str(ROOT / "bench"))

from provenance import provenance  # noqa: E402  (bench/provenance.py)


def _git(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run(["git", *args], cwd=ROOT, capture_output=True, text=True)


def _make_bench_outputs() -> set[str]:
    """The result files `make bench` writes (its recipe lines' --out paths)."""
    text = (ROOT / "Makefile").read_text()
    recipe = re.search(r"^bench:.*\n((?:\t.*\n)+)", text, re.M)
    assert recipe, "the Makefile has no bench target"
    return set(re.findall(r"--out (bench/results/\S+\.json)", recipe.group(1)))


def test_provenance_names_this_checkout_and_machine():
    stamp = provenance()
    head = _git("rev-parse", "HEAD").stdout.strip()
    assert stamp["commit"] == head and re.fullmatch(r"[0-9a-f]{40}", head)
    assert isinstance(stamp["dirty"], bool)
    m = stamp["machine"]
    assert m["cpus"] >= 1 and m["cpu"] and m["python"].count(".") == 2
    assert m["torch"] and m["deepspeed"], m
    assert not set(m) & {"hostname", "node", "ip"}, "results are published: no host names or addresses"


@pytest.mark.parametrize("path", sorted(RESULTS.glob("*.json")), ids=lambda p: p.name)
def test_every_committed_result_says_which_commit_and_machine_measured_it(path: Path):
    result = json.loads(path.read_text())
    stamp = result.get("provenance")
    assert stamp, f"{path.relative_to(ROOT)} has no provenance: rerun it with `make bench`"
    commit = stamp["commit"]
    assert re.fullmatch(r"[0-9a-f]{40}", commit or ""), f"{path.name}: commit {commit!r}"
    assert stamp["dirty"] is False, (
        f"{path.name} was measured on a tree with uncommitted changes: commit the code, then rerun the benchmark"
    )
    assert stamp["machine"]["cpus"] >= 1 and stamp["machine"]["cpu"], path.name
    if (ROOT / ".git").exists():
        known = _git("merge-base", "--is-ancestor", commit, "HEAD")
        assert known.returncode == 0, f"{path.name}: commit {commit} is not in this branch's history"


def test_make_bench_rewrites_every_committed_result():
    committed = {f"bench/results/{p.name}" for p in RESULTS.glob("*.json")}
    rewritten = _make_bench_outputs()
    # GPU results come from bench/gpu.py on a GPU machine (docs/gpu.md), never from `make bench` on CPU.
    gpu_only = {c for c in committed if Path(c).name.startswith("gpu-")}
    assert committed - gpu_only <= rewritten, (
        f"not rewritten by `make bench`: {sorted(committed - rewritten)}"
    )
    assert rewritten <= committed, f"`make bench` writes files not committed: {sorted(rewritten - committed)}"
