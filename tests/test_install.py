"""Installing next to a cluster's own torch: the supported torch range in pyproject.toml, the torch APIs the
project relies on (each with the release that introduced it), and the wheelhouse recipe's rule for what the
node's torch brings (tools/wheelhouse.py, docs/gpu.md).

    .venv/bin/python -m pytest tests/test_install.py
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import os
import subprocess
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from packaging.requirements import Requirement
from packaging.specifiers import SpecifierSet
from packaging.version import Version
from torch import nn

pytestmark = pytest.mark.unit

ROOT = Path(__file__).parents[1]


def _load_wheelhouse():
    spec = importlib.util.spec_from_file_location("wheelhouse", ROOT / "tools/wheelhouse.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


wheelhouse = _load_wheelhouse()


# ---------------------------------------------------------------------- the supported range


def torch_specifier() -> SpecifierSet:
    tomllib = pytest.importorskip("tomllib")  # Python 3.11+; the project supports 3.10, where this skips
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    reqs = [Requirement(line) for line in project["dependencies"]]
    (torch_req,) = [r for r in reqs if r.name == "torch"]
    return torch_req.specifier


def torch_floor() -> Version:
    floors = [Version(s.version) for s in torch_specifier() if s.operator == ">="]
    assert len(floors) == 1, f"pyproject.toml: torch needs one lower bound (>=), has {torch_specifier()}"
    return floors[0]


def test_installed_torch_is_inside_the_supported_range():
    spec = torch_specifier()
    assert any(s.operator in ("<", "<=") for s in spec), f"pyproject.toml: torch {spec} has no ceiling"
    assert spec.contains(Version(torch.__version__)), (
        f"torch {torch.__version__} is outside the supported range {spec} (pyproject.toml); run the suite on "
        "it and widen the range, or install a torch inside it"
    )


def test_deepspeed_accepts_the_floor():
    """DeepSpeed's own torch requirement admits every torch in our range, from its floor."""
    reqs = [Requirement(line) for line in importlib.metadata.requires("deepspeed") or ()]
    for req in reqs:
        if req.name == "torch" and req.marker is None:
            assert req.specifier.contains(torch_floor()), f"deepspeed needs torch{req.specifier}"


# ---------------------------------------------------------------------- the torch APIs relied on


@dataclass(frozen=True)
class TorchAPI:
    name: str
    since: str  # the first torch release that has it
    source: str  # where `since` comes from
    used_in: str
    check: Callable[[], object]  # raises (or returns False) on a torch without it


def _sdpa_with_scale_and_mask():
    q = torch.ones(1, 2, 3, 4)  # [B, heads, N, D]
    mask = torch.zeros(2, 3, 3)  # [heads, N, N], broadcast over B
    return F.scaled_dot_product_attention(q, q, q, attn_mask=mask, scale=0.5).shape == q.shape


def _device_context():
    with torch.device("meta"):
        return torch.empty(1).is_meta


def _pre_hook_with_kwargs():
    seen = []
    layer = nn.Identity()
    handle = layer.register_forward_pre_hook(lambda m, args, kwargs: seen.append(kwargs), with_kwargs=True)
    layer(input=torch.ones(1))
    handle.remove()
    return seen and "input" in seen[0]


def _checkpoint_non_reentrant():
    from torch.utils.checkpoint import checkpoint

    x = torch.ones(2, requires_grad=True)
    checkpoint(lambda t: t * 2, x, use_reentrant=False).sum().backward()
    return x.grad.tolist() == [2.0, 2.0]


def _loader_without_prefetch():
    from torch.utils.data import DataLoader

    return list(DataLoader([1, 2], batch_size=None, num_workers=0, prefetch_factor=None)) == [1, 2]


def _sdpa_kernel():
    from torch.nn.attention import SDPBackend, sdpa_kernel

    with sdpa_kernel(SDPBackend.MATH):
        return _sdpa_with_scale_and_mask()


def _flop_counter():
    from torch.utils.flop_counter import FlopCounterMode

    with FlopCounterMode(display=False) as counter:
        torch.ones(2, 3) @ torch.ones(3, 4)
    return counter.get_total_flops() == 2 * 2 * 3 * 4


def _autocast():
    with torch.autocast("cpu", dtype=torch.bfloat16, enabled=False):
        return True


# Sources: the release notes (github.com/pytorch/pytorch/releases), the docs of each version
# (docs.pytorch.org/docs/<version>/...) and the pull request that added the API. Newest first.
TORCH_APIS = [
    TorchAPI(
        "torch.nn.attention.sdpa_kernel, SDPBackend",
        "2.3",
        "docs: torch.nn.attention created Jan 24 2024, first released in 2.3 (Apr 2024)",
        "tests/conftest.py, tests/test_flops.py",
        _sdpa_kernel,
    ),
    TorchAPI(
        "F.scaled_dot_product_attention(..., attn_mask=, scale=)",
        "2.1",
        "pytorch/pytorch#95259 (the scale kwarg, merged after the 2.0 branch cut); SDPA itself is 2.0",
        "pipeline/models/layers.py, cvt.py, swin.py",
        _sdpa_with_scale_and_mask,
    ),
    TorchAPI(
        "torch.utils.flop_counter.FlopCounterMode(display=False)",
        "2.1",
        "pytorch/pytorch#95751 (Mar 2023, after the 2.0 branch cut)",
        "tests/test_flops.py, tests/conftest.py",
        _flop_counter,
    ),
    TorchAPI(
        "with torch.device('meta'): (device as a context manager)",
        "2.0",
        "2.0 release notes: 'torch.set_default_device and torch.device as context manager' (#91525)",
        "pipeline/config.py, pipeline/models/flops.py",
        _device_context,
    ),
    TorchAPI(
        "nn.Module.register_forward_pre_hook(..., with_kwargs=True)",
        "2.0",
        "docs: the 2.0 signature has with_kwargs, 1.13's has not",
        "pipeline/models/analysis.py",
        _pre_hook_with_kwargs,
    ),
    TorchAPI(
        "Tensor.untyped_storage()",
        "2.0",
        "2.0 release notes: TypedStorage deprecated for untyped_storage()",
        "bench/zero_memory.py",
        lambda: torch.ones(2).untyped_storage().nbytes() == 8,
    ),
    TorchAPI(
        "torch.compile",
        "2.0",
        "2.0 release notes",
        "pipeline/train/engine.py (DeepSpeed's engine.compile)",
        lambda: callable(torch.compile),
    ),
    TorchAPI(
        "DataLoader(prefetch_factor=None)",
        "2.0",
        "docs: 2.0's default is None; 1.13 rejects any value but 2 without workers",
        "pipeline/data/loader.py",
        _loader_without_prefetch,
    ),
    TorchAPI(
        "torch.load(..., weights_only=)",
        "1.13",
        "1.13 release notes",
        "pipeline/train/checkpoint.py",
        lambda: "weights_only" in inspect.signature(torch.load).parameters,
    ),
    TorchAPI(
        "torch.set_float32_matmul_precision",
        "1.12",
        "1.12 release notes",
        "pipeline/train/engine.py",
        lambda: callable(torch.set_float32_matmul_precision),
    ),
    TorchAPI(
        "torch.utils.checkpoint.checkpoint(..., use_reentrant=False)",
        "1.11",
        "pytorch/pytorch#65537 (the non-reentrant variant's rollout)",
        "pipeline/models/vit.py, mae.py, swin.py, cvt.py, levit.py, tnt.py",
        _checkpoint_non_reentrant,
    ),
    TorchAPI(
        "torch.cuda.set_sync_debug_mode",
        "1.10",
        "1.10 release notes",
        "bench/gpu.py",
        lambda: callable(torch.cuda.set_sync_debug_mode),
    ),
    TorchAPI(
        "torch.frombuffer",
        "1.10",
        "1.10 release notes",
        "pipeline/data/transforms.py, batching.py",
        lambda: torch.frombuffer(bytearray(b"ab"), dtype=torch.uint8).tolist() == [97, 98],
    ),
    TorchAPI(
        "torch.autocast(device_type, ...)", "1.10", "1.10 release notes", "pipeline/eval/run.py", _autocast
    ),
    TorchAPI(
        "python -m torch.distributed.run (torchrun)",
        "1.10",
        "1.10 release notes",
        "bench/multinode.py, bench/zero_memory.py, tests",
        lambda: importlib.util.find_spec("torch.distributed.run") is not None,
    ),
]


@pytest.mark.parametrize("api", TORCH_APIS, ids=lambda api: api.name)
def test_installed_torch_has_the_api(api: TorchAPI):
    assert api.check(), f"torch {torch.__version__} lacks {api.name} (used in {api.used_in})"


def test_floor_has_every_api():
    """An API newer than the floor must raise the floor (pyproject.toml), and the other way round."""
    newest = max(TORCH_APIS, key=lambda api: Version(api.since))
    assert torch_floor() >= Version(newest.since), (
        f"{newest.name} needs torch {newest.since} ({newest.source}); pyproject.toml's floor is {torch_floor()}"
    )


# ---------------------------------------------------------------------- the wheelhouse recipe


def _item(name: str, version: str, *requires: str, requested: bool = False, extras=()) -> dict:
    item = {
        "metadata": {"name": name, "version": version, "requires_dist": list(requires)},
        "requested": requested,
    }
    return {**item, "requested_extras": list(extras)} if requested else item


# A pip install report (`pip install --dry-run --ignore-installed --report`) of vitpipe[gpu] resolved against
# a CUDA torch, cut down; the requirement lines are copied from a real one (torch 2.14.1+cu13).
REPORT = {
    "environment": {
        "implementation_name": "cpython",
        "platform_machine": "x86_64",
        "platform_system": "Linux",
        "python_full_version": "3.11.7",
        "python_version": "3.11",
        "sys_platform": "linux",
        "os_name": "posix",
        "platform_python_implementation": "CPython",
    },
    "install": [
        _item(
            "vitpipe",
            "0.1.0",
            "torch<2.14,>=2.11",
            "deepspeed>=0.16",
            "ray[default,train]>=2.40",
            "matplotlib>=3.8",
            'torchvision>=0.19; extra == "gpu"',
            'pytest<9,>=8; extra == "dev"',
            requested=True,
            extras=["gpu"],
        ),
        _item("deepspeed", "0.19.8", "ninja", "torch>=2.0.0", "nvidia-ml-py", 'torchvision; extra == "dev"'),
        _item(
            "torch",
            "2.14.1",
            "filelock",
            "sympy>=1.13.3",
            'cuda-toolkit[cublas,cudart]==13.0.3; platform_system == "Linux"',
            'cuda-bindings<14,>=13.0.3; platform_system == "Linux" and python_version < "3.15"',
            'nvidia-cudnn-cu13==9.24.0.43; platform_system == "Linux"',
            'triton~=3.8.0; platform_system == "Linux" and python_version < "3.15"',
        ),
        _item(
            "cuda-toolkit",
            "13.0.3.0",
            "nvidia-cublas==13.1.1.3.*; sys_platform == 'linux' and extra == 'cublas'",
            "nvidia-cuda-runtime==13.0.96.*; sys_platform == 'linux' and extra == 'cudart'",
        ),
        _item("cuda-bindings", "13.5.0", "cuda-pathfinder>=1.4.2"),
        _item("cuda-pathfinder", "1.9.1"),
        _item("nvidia-cublas", "13.1.1.3"),
        _item("nvidia-cuda-runtime", "13.0.96"),
        _item("nvidia-cudnn-cu13", "9.24.0.43", "nvidia-cublas"),
        _item("triton", "3.8.0", 'importlib-metadata; python_version < "3.10"'),
        _item("torchvision", "0.29.1", "numpy", "torch (>=2.14.0)"),
        _item("sympy", "1.14.0", "mpmath<1.4,>=1.1.0"),
        _item("mpmath", "1.3.0"),
        _item("filelock", "4.3.1"),
        _item("ray", "2.60.0", "filelock", 'aiohttp>=3.13.3; extra == "default"'),
        _item("aiohttp", "3.14.5"),
        _item("matplotlib", "3.11.2", "fonttools>=4.22.0", "numpy>=1.25"),
        _item("fonttools", "4.68.0", 'sympy; extra == "symfont"'),
        _item("numpy", "2.4.6"),
        _item("ninja", "1.13.2"),
        _item("nvidia-ml-py", "13.615.71"),
    ],
}


def test_wheelhouse_leaves_out_what_the_nodes_torch_brings():
    kept = {item["metadata"]["name"] for item in wheelhouse.needed_beside_torch(REPORT)}
    assert kept == {
        "vitpipe",
        "deepspeed",
        "nvidia-ml-py",  # NVML bindings deepspeed needs: not a CUDA library, torch does not bring it
        "ninja",
        "ray",
        "aiohttp",  # ray's `default` extra, asked for by vitpipe
        "filelock",  # torch needs it, ray too
        "matplotlib",
        "fonttools",  # its sympy only with the `symfont` extra, which nothing asks for
        "numpy",
    }
    for name in kept:  # the rule as docs/gpu.md states it
        assert name not in wheelhouse.TORCH_STACK and name != "triton" and not name.startswith("cuda-")
        assert not name.startswith("nvidia-") or name == "nvidia-ml-py"


def test_wheelhouse_platform_takes_older_manylinux_tags():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and "manylinux_2_29_x86_64" not in tags
    assert {"manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux1_x86_64"} <= set(tags)  # ray: 2014
    assert "manylinux2014_aarch64" in wheelhouse.platform_tags("manylinux2014_aarch64")
    assert wheelhouse.platform_tags("macosx_11_0_arm64") == ["macosx_11_0_arm64"]


def test_wheelhouse_pins_leave_out_the_torch_stack():
    pins = wheelhouse.installed_pins({"vitpipe", *wheelhouse.TORCH_STACK})
    names = {pin.split("==")[0] for pin in pins}
    assert f"deepspeed=={importlib.metadata.version('deepspeed')}" in pins
    assert not names & {"vitpipe", "torch"}


def test_make_wheelhouse_runs_the_recipe():
    dry = subprocess.run(
        ["make", "-n", "wheelhouse"], cwd=ROOT, capture_output=True, text=True, check=True, timeout=60
    ).stdout
    assert "tools/wheelhouse.py --out wheelhouse" in dry


def test_deepspeed_is_imported_without_mlflow_and_mlflow_still_imports_after():
    """A rank other than 0 never tracks, but `import deepspeed` imports mlflow for its autotuner (0.9 s of CPU
    per process): the engine's import keeps it out, and rank 0's later `import mlflow` works. What a rank
    imports (the training loop, the eval stage, the Ray Train entry) takes DeepSpeed that way, and scipy only
    where detection matches boxes."""
    code = (
        "import sys\n"
        "import pipeline.train.loop, pipeline.eval.run, cluster.run\n"
        "import deepspeed.autotuning.autotuner as tuner\n"
        "print('deepspeed' in sys.modules, 'mlflow' in sys.modules, tuner.has_mlflow, 'scipy' in sys.modules)\n"
        "import mlflow\n"
        "print(mlflow.__name__)\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code],
        cwd=ROOT,
        capture_output=True,
        text=True,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
        timeout=120,
    )
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "False", "False", "mlflow"], proc.stdout


def test_deepspeed_muon_is_imported_without_compiling_and_compile_still_works():
    """DeepSpeed's ZeRO optimizers import its Muon optimizer, whose kernels `torch.compile` decorates at
    import (inductor loads: 1.1 s of CPU per rank). The engine builder imports it with dynamo off; dynamo
    is on again after, for `model.compile`."""
    code = (
        "import os, sys, torch\n"
        "from pipeline.distributed import deepspeed_module\n"
        "from pipeline.train.engine import MUON, import_muon_uncompiled\n"
        "deepspeed_module()\n"
        "import_muon_uncompiled()\n"
        "print(MUON in sys.modules, 'torch._inductor.compile_fx' in sys.modules, 'TORCHDYNAMO_DISABLE' in os.environ)\n"
        "from torch._dynamo.utils import counters\n"
        "f = torch.compile(lambda x: x * 2 + 1, backend='eager')\n"
        "print(f(torch.ones(2)).tolist() == [3.0, 3.0], counters['stats']['unique_graphs'])\n"
    )
    proc = subprocess.run(
        [sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120,
        env={**os.environ, "DS_ACCELERATOR": "cpu"},
    )  # fmt: skip
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert proc.stdout.split() == ["True", "False", "False", "True", "1"], proc.stdout


def _imported(path: Path) -> set[str]:
    """The modules a source file imports (absolute imports; the package's own are all absolute)."""
    import ast

    found = set()
    for node in ast.walk(ast.parse(path.read_text(), str(path))):
        if isinstance(node, ast.Import):
            found |= {a.name for a in node.names}
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            found |= {node.module, *(f"{node.module}.{a.name}" for a in node.names)}
    return found


def test_imports_point_one_way():
    """cluster/ -> pipeline/ -> data_prep/ (../shared/ARCHITECTURE.md); inside pipeline/, the stage runtime
    and everything below it (stage.py, objectives.py, data/, models/, ...) never import train/ or eval/."""
    above = ("pipeline.train", "pipeline.eval")
    rules = {
        "data_prep": ("pipeline", "cluster", "vitpipe"),
        "pipeline": ("cluster",),
    }
    wrong = []
    for package, banned in rules.items():
        for path in sorted((ROOT / package).rglob("*.py")):
            rel = path.relative_to(ROOT).as_posix()
            below = package == "pipeline" and not rel.startswith(("pipeline/train/", "pipeline/eval/"))
            for name in _imported(path):
                top = name.split(".")[0]
                if top in banned or (below and name.startswith(above)):
                    wrong.append(f"{rel} imports {name}")
    assert not wrong, "\n".join(wrong)
