"""Build a wheelhouse for a GPU node without network: every wheel `vitpipe[gpu]` needs beyond the node's own
CUDA torch, for `pip install --no-index --find-links` there (docs/gpu.md).

    make wheelhouse                                   # = .venv/bin/python tools/wheelhouse.py --out wheelhouse
    .venv/bin/python tools/wheelhouse.py --out wheelhouse-py312 \
        --python-version 3.12 --platform manylinux_2_28_x86_64    # another Python or platform: wheels only

Run it with the project's venv (torch and deepspeed installed, as `make setup` leaves it), on a machine with
network. Without --python-version/--platform the wheels are for this machine's Python minor and platform.
1. vitpipe and deepspeed as pure-Python wheels (py3-none-any). deepspeed ships only as source: it is built
   against this venv's torch (--no-build-isolation) with DS_BUILD_OPS=0, so no op is compiled here; the
   node compiles the few it uses on first use, against its own torch and CUDA.
2. Resolve vitpipe[gpu] with pip's JSON install report (`pip install --dry-run --ignore-installed
   --report`), every package pinned to the version installed in this venv: the wheelhouse holds what the
   tests ran against (--no-pin resolves the newest instead).
3. Keep what the project needs once a torch is installed: drop the CUDA torch stack (`TORCH_STACK`) and
   every package only it needs (the nvidia-* CUDA libraries, cuda-toolkit, cuda-bindings, triton, sympy),
   which the node's torch brings, built for its CUDA.
4. `pip wheel` (or `pip download`, for another target) the kept packages into OUT.
"""

from __future__ import annotations

import argparse
import importlib.metadata
import json
import os
import re
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

ROOT = Path(__file__).resolve().parents[1]
PROJECT = "vitpipe"
# Built for one torch and one CUDA, so the node's own builds are used: torchvision and torchaudio come from
# the same index as its torch (the `gpu` extra's torchvision too).
TORCH_STACK = frozenset({"torch", "torchvision", "torchaudio"})


def needed_beside_torch(report: dict, torch_stack: frozenset[str] = TORCH_STACK) -> list[dict]:
    """The entries of a pip install report (`pip install --dry-run --report`) that its requested packages
    need when the torch stack is already installed: every package reachable from a requested one along
    requirements that do not pass through the stack, with markers and extras evaluated as pip did. A
    package both torch and something else need (filelock: torch and ray) is kept; one only torch needs
    (nvidia-cublas, triton) is not. Report order."""
    env = report["environment"]
    items = {canonicalize_name(i["metadata"]["name"]): i for i in report["install"]}
    extras: dict[str, set[str]] = {}  # reached package -> the extras it is needed with ("" = none)
    todo = []
    for name, item in items.items():
        if item.get("requested") and name not in torch_stack:
            extras[name] = {""} | {canonicalize_name(e) for e in item.get("requested_extras") or ()}
            todo.append(name)
    while todo:
        name = todo.pop()
        for line in items[name]["metadata"].get("requires_dist") or ():
            req = Requirement(line)
            dep = canonicalize_name(req.name)
            if dep in torch_stack or dep not in items:
                continue
            if req.marker and not any(req.marker.evaluate({**env, "extra": e}) for e in extras[name]):
                continue
            want = {""} | {canonicalize_name(e) for e in req.extras}
            if not want <= extras.get(dep, set()):
                extras[dep] = extras.get(dep, set()) | want
                todo.append(dep)
    return [item for name, item in items.items() if name in extras]


def platform_tags(platform: str) -> list[str]:
    """The wheel platform tags a node of `platform` installs, newest first. pip takes --platform literally
    (manylinux_2_28_x86_64 alone finds no manylinux2014 wheel, as ray's are); for its own machine it
    accepts every older glibc too, and so does this for a manylinux tag."""
    match = re.fullmatch(r"manylinux(?:_2_(\d+)|(2014|2010|1))_(\w+)", platform)
    if not match:
        return [platform]
    glibc_minor = int(match[1]) if match[1] else {"2014": 17, "2010": 12, "1": 5}[match[2]]
    arch = match[3]
    tags = [f"manylinux_2_{minor}_{arch}" for minor in range(glibc_minor, 4, -1)]
    legacy = {17: "manylinux2014", 12: "manylinux2010", 5: "manylinux1"}  # the same glibc, older names
    return tags + [f"{name}_{arch}" for minor, name in legacy.items() if minor <= glibc_minor]


def installed_pins(skip: set[str]) -> list[str]:
    """`name==version` for every distribution installed in this interpreter's environment, less `skip`."""
    pins = {}
    for dist in importlib.metadata.distributions():
        name = canonicalize_name(dist.metadata["Name"] or "")
        if name and name not in skip:
            pins[name] = f"{name}=={dist.version}"
    return sorted(pins.values())


def run(cmd: list[str], what: str, capture: bool = False, **kwargs) -> None:
    """Run a pip step; on failure exit naming the step (with pip's output when `capture` held it back)."""
    print("+", " ".join(cmd), file=sys.stderr, flush=True)
    done = subprocess.run(cmd, capture_output=capture, text=True, **kwargs)
    if done.returncode:
        if capture:
            sys.stderr.write(done.stdout[-4000:] + done.stderr[-4000:])
        sys.exit(f"wheelhouse: {what} failed (pip's reasons above)")


def build_project_wheel(pip: list[str], out: Path, tmp: Path) -> None:
    """vitpipe's wheel, built from a copy of the files git tracks or would track: a build in the checkout
    would pack whatever a previous build left in build/lib (modules deleted since, too)."""
    listed = subprocess.run(
        ["git", "-C", str(ROOT), "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        check=True,
        capture_output=True,
        text=True,
    ).stdout
    src = tmp / "src"
    for rel in filter(None, listed.split("\0")):
        path = ROOT / rel
        if path.is_file():  # a deleted file is still listed until the deletion is committed
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(path, src / rel)
    cmd = [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--wheel-dir", str(out), str(src)]
    run(cmd, f"building the {PROJECT} wheel")


def build_deepspeed_wheel(pip: list[str], spec: str, accelerator: str, out: Path) -> None:
    """deepspeed as a pure-Python wheel; exits with a message when the build compiled ops into it."""
    # No wheel cache: a wheel cached from a build with DS_BUILD_OPS=1 would be reused under the same name.
    env = {**os.environ, "DS_BUILD_OPS": "0", "DS_ACCELERATOR": accelerator}
    cmd = [*pip, "wheel", "--quiet", "--no-deps", "--no-build-isolation", "--no-cache-dir"]
    run([*cmd, "--wheel-dir", str(out), spec], f"building the {spec} wheel", env=env)
    for wheel in out.glob("deepspeed-*.whl"):
        if not wheel.name.endswith("-py3-none-any.whl"):
            sys.exit(f"{wheel}: deepspeed was built with compiled ops (expected a py3-none-any wheel)")


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--out", default=str(ROOT / "wheelhouse"), help="wheel folder (its *.whl are replaced)")
    p.add_argument(
        "--deepspeed",
        help="deepspeed requirement to build (default: the version installed here, e.g. deepspeed==0.19.8)",
    )
    p.add_argument(
        "--accelerator",
        default="cuda",
        help="DS_ACCELERATOR for the deepspeed build (recorded in the wheel; no op is compiled either way)",
    )
    p.add_argument("--python-version", help="target Python, e.g. 3.12 (default: this interpreter's)")
    p.add_argument(
        "--platform",
        action="append",
        default=[],
        help="target platform, e.g. manylinux_2_28_x86_64: the node's glibc (older manylinux tags are added); "
        "repeatable; default: this machine's",
    )
    p.add_argument("--no-pin", action="store_true", help="newest versions, not those installed in this venv")
    args = p.parse_args(argv)

    out = Path(args.out).resolve()
    out.mkdir(parents=True, exist_ok=True)
    for stale in out.glob("*.whl"):  # pip on the node takes the newest version it finds: no leftovers
        stale.unlink()
    pip = [sys.executable, "-m", "pip"]
    target = ["--only-binary=:all:"] if args.python_version or args.platform else []
    target += ["--python-version", args.python_version] if args.python_version else []
    for platform in args.platform:
        for tag in platform_tags(platform):
            target += ["--platform", tag]
    deepspeed = args.deepspeed or f"deepspeed=={importlib.metadata.version('deepspeed')}"

    with tempfile.TemporaryDirectory(prefix="wheelhouse-") as tmp_dir:
        tmp = Path(tmp_dir)
        build_project_wheel(pip, out, tmp)
        build_deepspeed_wheel(pip, deepspeed, args.accelerator, out)

        constraints = []
        if not args.no_pin:
            (tmp / "pins.txt").write_text("\n".join(installed_pins({PROJECT, *TORCH_STACK})) + "\n")
            constraints = ["--constraint", str(tmp / "pins.txt")]
        report_path = tmp / "report.json"
        # Not --quiet: that would hide the reasons of a resolution failure; the output is shown only then.
        run(
            [*pip, "install", "--dry-run", "--ignore-installed", "--report", str(report_path)]
            + ["--find-links", str(out), *constraints, *target, f"{PROJECT}[gpu]"],
            f"resolving {PROJECT}[gpu]"
            + (" at this venv's versions (--no-pin resolves afresh)" if constraints else ""),
            capture=True,
        )
        report = json.loads(report_path.read_text())
        built = {PROJECT, canonicalize_name(Requirement(deepspeed).name)}
        needed = [
            f"{i['metadata']['name']}=={i['metadata']['version']}"
            for i in needed_beside_torch(report)
            if canonicalize_name(i["metadata"]["name"]) not in built
        ]
        (tmp / "requirements.txt").write_text("\n".join(needed) + "\n")
        fetch = ["download", "--dest"] if target else ["wheel", "--wheel-dir"]
        cmd = [*pip, *fetch, str(out), "--quiet", "--no-deps", *target, "-r", str(tmp / "requirements.txt")]
        run(cmd, f"fetching {len(needed)} wheels")

    wheels = sorted(out.glob("*.whl"))
    size = sum(w.stat().st_size for w in wheels) / 2**20
    left_out = sorted({i["metadata"]["name"] for i in report["install"]} - {n.split("==")[0] for n in needed})
    print(f"{out}: {len(wheels)} wheels, {size:.0f} MiB", file=sys.stderr)
    print(f"left to the node's torch: {', '.join(n for n in left_out if n not in built)}", file=sys.stderr)
    print(f"on the node: pip install --no-index --find-links {out.name} '{PROJECT}[gpu]'", file=sys.stderr)


if __name__ == "__main__":
    main()
