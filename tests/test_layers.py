"""Import layers over the whole project, read from the source with `ast` (nothing is imported or run).

    cluster/  ->  pipeline/  ->  data_prep/        a package imports only the ones to its right
    pipeline/models/                               single-device PyTorch: no training, evaluation or
                                                   cluster code, no torch.distributed, DeepSpeed, Ray, MLflow

No module imports itself back through any chain of imports, whether the imports sit at module level
or inside functions. An import inside a function is allowed only for the heavy third-party
dependencies in `LAZY_IMPORTS`, each with the reason it is worth the surprise; never for a project
module (that is how cycles were hidden).

    .venv/bin/python -m pytest tests/test_layers.py -q
"""

from __future__ import annotations

import ast
from dataclasses import dataclass
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
PACKAGES = ("data_prep", "pipeline", "cluster")

# The only dependencies a project module may import inside a function: heavy to import and needed on
# few paths, so the modules that do not take those paths (and the processes they spawn) stay light.
LAZY_IMPORTS = {
    "deepspeed": "seconds to import and probes the accelerator; only engine building and consolidation need it",
    "mlflow": "seconds to import; only the rank-0 tracking writer and `vitpipe compare` talk to MLflow",
    "ray": "seconds to import; only the optional `--ray` shard executor and job submission use it",
    "fsspec": "only object-storage URIs (s3://, gs://) need a filesystem implementation",
    "matplotlib": "only the analysis figures draw anything",
    "sklearn": "only `vitpipe shard digits` reads its bundled digits",
    "pyarrow": "`verify` workers are spawned per shard and never read Parquet; only the index check does",
    "scipy": "0.2 s in every rank that imports the objectives; only detection's box matching uses it",
    "torchvision": "an optional GPU extra (it must match the CUDA torch); only data.decode: cuda decodes with it",
}

# The same, for one importing module only: (importer, imported module) -> why. Every vitpipe command
# imports pipeline.config; torch (and what loads it) comes in only when a config is checked.
_CONFIG_WITHOUT_TORCH = "`vitpipe --help`, `jobs` and `compare` start without torch (seconds)"
LAZY_IMPORTS_IN = {
    ("pipeline.config", "pipeline.models"): "the model registry checks model names and options; "
    + _CONFIG_WITHOUT_TORCH,
    ("pipeline.config", "torch"): "a model built on the meta device checks its options; "
    + _CONFIG_WITHOUT_TORCH,
    ("pipeline.config", "webdataset"): "expands a local shard pattern the way the loader does, to check the "
    "files exist before anything starts (webdataset imports torch); " + _CONFIG_WITHOUT_TORCH,
    ("data_prep.verify", "data_prep.index"): "pyarrow, for naming a damaged shard's keys from the index: "
    "only on that rare path, so the spawned per-shard workers of `vitpipe shard verify` stay light",
    (
        "cluster.submit",
        "cluster.preflight",
    ): "imports Ray and the data stack (seconds); every vitpipe command "
    "imports cluster.submit, and only a submit whose dataset is a local path asks the cluster's nodes",
    ("pipeline.train.launch", "pipeline.train.loop"): "imports DeepSpeed, which reads DS_ACCELERATOR once, "
    "at its import: run_rank first sets it from the stage's device (pipeline.distributed.use_accelerator); "
    "a Ray worker imports this module (through cluster.run) before it knows its stage",
}

# What pipeline/models may not import (the family code runs on one device, under any wrapper).
MODELS_FORBIDDEN = (
    "pipeline.train",
    "pipeline.eval",
    "pipeline.stage",
    "pipeline.tracking",
    "cluster",
    "torch.distributed",
    "deepspeed",
    "ray",
    "mlflow",
)


@dataclass(frozen=True)
class Import:
    module: str  # the importing module, e.g. "pipeline.train.loop"
    target: str  # what it imports: a project module where one is named, else the dotted name
    file: str  # relative to the repository root
    line: int
    in_function: bool

    def __str__(self) -> str:
        where = "inside a function" if self.in_function else "at module level"
        return f"{self.file}:{self.line} imports {self.target} ({where})"


def project_modules(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> dict[str, Path]:
    """Dotted module name -> file, for every .py file of the packages (a package is its __init__)."""
    modules = {}
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            parts = path.relative_to(root).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            modules[".".join(parts)] = path
    return modules


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING"
    )


class _ImportCollector(ast.NodeVisitor):
    def __init__(self, module: str, path: Path, file: str, modules: dict[str, Path]):
        self.module, self.file, self.modules = module, file, modules
        self.is_package = path.name == "__init__.py"
        self.depth = 0  # function nesting
        self.found: list[Import] = []

    def _add(self, target: str, node: ast.stmt) -> None:
        self.found.append(Import(self.module, target, self.file, node.lineno, self.depth > 0))

    def _function(self, node) -> None:
        self.depth += 1
        self.generic_visit(node)
        self.depth -= 1

    visit_FunctionDef = visit_AsyncFunctionDef = visit_Lambda = _function

    def visit_If(self, node: ast.If) -> None:
        if _is_type_checking(node.test):  # annotations only: never imported at run time
            for child in node.orelse:
                self.visit(child)
            return
        self.generic_visit(node)

    def visit_Import(self, node: ast.Import) -> None:
        for alias in node.names:
            self._add(alias.name, node)

    def visit_ImportFrom(self, node: ast.ImportFrom) -> None:
        base = node.module or ""
        if node.level:  # relative: resolve against the importing package
            package = self.module.split(".") if self.is_package else self.module.split(".")[:-1]
            package = package[: len(package) - (node.level - 1)]
            base = ".".join(package + ([base] if base else []))
        for alias in node.names:
            name = f"{base}.{alias.name}"
            # `from pkg import submodule` imports the submodule; `from pkg import name` runs pkg/__init__.
            if base.split(".")[0] in PACKAGES and name not in self.modules:
                name = base
            self._add(name, node)


def collect_imports(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[Import]:
    modules = project_modules(root, packages)
    found = []
    for module, path in modules.items():
        collector = _ImportCollector(module, path, str(path.relative_to(root)), modules)
        collector.visit(ast.parse(path.read_text(), filename=str(path)))
        found += collector.found
    return found


def _owner(target: str, modules: dict[str, Path]) -> str | None:
    """The project module an import runs: the longest module name that the target starts with."""
    parts = target.split(".")
    for i in range(len(parts), 0, -1):
        name = ".".join(parts[:i])
        if name in modules:
            return name
    return None


def import_cycles(root: Path = ROOT, packages: tuple[str, ...] = PACKAGES) -> list[list[Import]]:
    """Each group of modules that import one another in a circle, as the imports that close it."""
    modules = project_modules(root, packages)
    edges: dict[str, list[Import]] = {m: [] for m in modules}
    for imp in collect_imports(root, packages):
        owner = _owner(imp.target, modules)
        if owner is not None and owner != imp.module:
            edges[imp.module].append(imp)

    # Tarjan's strongly connected components, iteratively (no recursion limit to worry about).
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[set[str]] = []
    for start in modules:
        if start in index:
            continue
        work = [(start, iter(edges[start]))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, children = work[-1]
            child = next(children, None)
            if child is not None:
                target = _owner(child.target, modules)
                if target not in index:
                    index[target] = low[target] = len(index)
                    stack.append(target)
                    on_stack.add(target)
                    work.append((target, iter(edges[target])))
                elif target in on_stack:
                    low[node] = min(low[node], index[target])
                continue
            work.pop()
            if work:
                low[work[-1][0]] = min(low[work[-1][0]], low[node])
            if low[node] == index[node]:
                component = set()
                while True:
                    member = stack.pop()
                    on_stack.discard(member)
                    component.add(member)
                    if member == node:
                        break
                if len(component) > 1:
                    components.append(component)
    return [
        [imp for m in sorted(c) for imp in edges[m] if _owner(imp.target, modules) in c] for c in components
    ]


def _report(imports: list[Import]) -> str:
    return "\n  ".join(dict.fromkeys(str(i) for i in imports))  # `from m import a, b`: one line


def _importing(package: str, imports: list[Import]) -> list[Import]:
    return [i for i in imports if i.module == package or i.module.startswith(package + ".")]


def _matches(target: str, prefixes: tuple[str, ...]) -> bool:
    return any(target == p or target.startswith(p + ".") for p in prefixes)


# ---------------------------------------------------------------------- the rules


def test_models_are_single_device_pytorch():
    bad = [
        i for i in _importing("pipeline.models", collect_imports()) if _matches(i.target, MODELS_FORBIDDEN)
    ]
    assert not bad, (
        "pipeline/models must not import training, evaluation, cluster or distributed code:\n  "
        + (_report(bad))
    )


def test_data_prep_imports_neither_pipeline_nor_cluster():
    bad = [
        i for i in _importing("data_prep", collect_imports()) if _matches(i.target, ("pipeline", "cluster"))
    ]
    assert not bad, "data_prep is the bottom layer:\n  " + _report(bad)


def test_pipeline_imports_nothing_from_cluster():
    bad = [i for i in _importing("pipeline", collect_imports()) if _matches(i.target, ("cluster",))]
    assert not bad, "pipeline runs without Ray; only cluster/ knows about it:\n  " + _report(bad)


def test_no_import_cycles():
    cycles = import_cycles()
    assert not cycles, "modules that import one another in a circle (function-level imports count):\n" + (
        "\n".join("  " + _report(c) for c in cycles)
    )


def _lazy_allowed(imp: Import) -> bool:
    return imp.target.split(".")[0] in LAZY_IMPORTS or any(
        imp.module == importer and _matches(imp.target, (target,)) for importer, target in LAZY_IMPORTS_IN
    )


def test_imports_inside_functions_are_only_heavy_optional_dependencies():
    inner = [i for i in collect_imports() if i.in_function and not _lazy_allowed(i)]
    project = [i for i in inner if i.target.split(".")[0] in PACKAGES]
    assert not project, (
        "project modules imported inside functions (import at the top; if that makes a cycle, fix the "
        "layering instead of hiding it):\n  " + _report(project)
    )
    other = [i for i in inner if i not in project]
    assert not other, (
        "imports inside functions that are not in LAZY_IMPORTS (import at the top, or add the heavy "
        "dependency to LAZY_IMPORTS with the reason):\n  " + _report(other)
    )


def test_every_lazy_import_exception_is_still_used():
    inner = [i for i in collect_imports() if i.in_function]
    unused = set(LAZY_IMPORTS) - {i.target.split(".")[0] for i in inner}
    unused |= {
        pair
        for pair in LAZY_IMPORTS_IN
        if not any(i.module == pair[0] and _matches(i.target, pair[1:]) for i in inner)
    }
    assert not unused, f"no longer imported inside a function (drop the exception): {sorted(unused)}"


# ---------------------------------------------------------------------- the checker itself


def test_the_checker_finds_a_cycle_hidden_inside_a_function(tmp_path):
    """A cycle closed only by a function-level import (as cli.py <-> compare.py once was) is found."""
    pkg = tmp_path / "pipeline"
    (pkg / "sub").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "sub" / "__init__.py").write_text("from pipeline.sub import b  # noqa\n")
    (pkg / "cli.py").write_text("from pipeline.compare import table\n")
    (pkg / "compare.py").write_text("def main():\n    from pipeline import cli\n    return cli\n")
    (pkg / "sub" / "b.py").write_text("from . import c\n")
    (pkg / "sub" / "c.py").write_text(
        "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from pipeline.sub import b\n"
    )
    cycles = import_cycles(tmp_path, ("pipeline",))
    assert [sorted({i.module for i in c}) for c in cycles] == [["pipeline.cli", "pipeline.compare"]]
    inner = [i for i in collect_imports(tmp_path, ("pipeline",)) if i.in_function]
    assert [(i.module, i.target, i.line) for i in inner] == [("pipeline.compare", "pipeline.cli", 2)]
