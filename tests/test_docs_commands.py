"""Every command line README.md and docs/ show parses as written, and every config they name loads.

A flag renamed in the code, a config moved or a sub-command gone fails here, naming the file and line,
instead of in a user's shell. Placeholders (CONFIG, ID, [KEY=VALUE ...]) are filled in or dropped; Ray's and
the shell's own commands are left to them.
"""

from __future__ import annotations

import importlib.util
import re
import shlex
from pathlib import Path

import pytest

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[1]
DOCS = [ROOT / "README.md", *sorted(p for p in (ROOT / "docs").glob("*.md") if p.name != "config.md")]
PLACEHOLDERS = {"CONFIG": "configs/experiments/smoke.yaml", "ID": "job-20261203-120000"}
DROPPED = {"[KEY=VALUE", "...]", "[KEY=VALUE ...]", "..."}


def _commands() -> list[tuple[str, list[str]]]:
    """(file:line, tokens) of each command in the documents' code blocks: continuation lines joined, `;`
    lists split, comments and prompts (`$ `) dropped."""
    found = []
    for doc in DOCS:
        inside, pending, start = False, "", 0
        for n, line in enumerate(doc.read_text().splitlines(), 1):
            if line.lstrip().startswith("```"):
                inside, pending = not inside, ""
                continue
            if not inside:
                continue
            if not pending:
                start = n
            pending += line.rstrip().removesuffix("\\") + " "
            if line.rstrip().endswith("\\"):
                continue
            text, pending = pending.strip().removeprefix("$ "), ""
            for part in text.split("; "):
                try:
                    tokens = shlex.split(part, comments=True)
                except ValueError:
                    continue  # not a command (a YAML or output line with an open quote)
                tokens = [PLACEHOLDERS.get(t, t) for t in tokens if t not in DROPPED]
                if tokens:
                    found.append((f"{doc.relative_to(ROOT)}:{start}", tokens))
    return found


def _module_command(tokens: list[str]) -> tuple[str, list[str]] | None:
    """(module, its arguments) of `[sudo -E] [.venv/bin/]python -m MODULE ...` or `torchrun ... -m MODULE`."""
    if "-m" not in tokens or not re.search(
        r"(python3?|torchrun)$", next((t for t in tokens if t != "sudo" and not t.startswith("-")), "")
    ):
        return None
    i = tokens.index("-m")
    return tokens[i + 1], tokens[i + 2 :]


COMMANDS = _commands()
VITPIPE = [(where, t[1:]) for where, t in COMMANDS if t[0] == "vitpipe" and not t[1].endswith(":")]
MODULES = [(where, m) for where, t in COMMANDS if (m := _module_command(t))]
MAKE = [(where, t[1]) for where, t in COMMANDS if t[0] == "make" and len(t) > 1]


def test_the_documents_show_commands():
    """The extraction itself: a change of the documents' format must not leave the tests below empty."""
    assert len(VITPIPE) >= 40 and len(MODULES) >= 5 and len(MAKE) >= 2, (
        len(VITPIPE),
        len(MODULES),
        len(MAKE),
    )
    assert {t[0] for _, t in VITPIPE} >= {
        "shard",
        "train",
        "run",
        "submit",
        "jobs",
        "logs",
        "stop",
        "compare",
    }


@pytest.mark.parametrize("where, args", VITPIPE, ids=[w for w, _ in VITPIPE])
def test_each_vitpipe_command_parses_and_names_a_config_that_loads(where, args):
    from pipeline.config import load_config, load_experiment
    from vitpipe import build_parser

    try:
        parsed = build_parser().parse_args(args)
    except SystemExit:
        pytest.fail(f"{where}: `vitpipe {shlex.join(args)}` does not parse (argparse printed why above)")
    config = getattr(parsed, "config", None)
    if config is None or "NAME" in config:
        return
    assert (ROOT / config).is_file(), f"{where}: {config} is not a file of the project"
    overrides = [o for o in parsed.overrides if "NAME" not in o]
    load = load_config if parsed.command == "train" else load_experiment
    load(ROOT / config, overrides)  # raises ConfigError naming the file and key


@pytest.mark.parametrize("where, command", MODULES, ids=[w for w, _ in MODULES])
def test_each_python_module_command_exists_and_parses(where, command):
    module, args = command
    assert importlib.util.find_spec(module) is not None, f"{where}: no module {module}"
    if module == "cluster.local":
        from cluster.local import build_parser

        try:
            build_parser().parse_args(args)
        except SystemExit:
            pytest.fail(f"{where}: `python -m cluster.local {shlex.join(args)}` does not parse")
    if module in ("cluster.run", "pipeline.train.launch") and "NAME" not in args[0]:
        from pipeline.config import load_config, load_experiment

        overrides = [a for a in args[1:] if "=" in a]
        (load_experiment if module == "cluster.run" else load_config)(ROOT / args[0], overrides)


@pytest.mark.parametrize("where, target", MAKE, ids=[w for w, _ in MAKE])
def test_each_make_target_exists(where, target):
    assert re.search(rf"^{re.escape(target)}:", (ROOT / "Makefile").read_text(), re.M), (
        f"{where}: make {target}"
    )


def _yaml_blocks() -> list[tuple[str, str]]:
    found = []
    for doc in DOCS:
        for m in re.finditer(r"^( *)```yaml\n(.*?)^\1```", doc.read_text(), re.M | re.S):
            line = doc.read_text()[: m.start()].count("\n") + 1
            body = "\n".join(row.removeprefix(m.group(1)) for row in m.group(2).splitlines())
            found.append((f"{doc.relative_to(ROOT)}:{line}", body))
    return found


YAML_BLOCKS = _yaml_blocks()


@pytest.mark.parametrize("where, body", YAML_BLOCKS, ids=[w for w, _ in YAML_BLOCKS])
def test_each_config_shown_is_a_project_file_or_valid_over_one(where, body):
    """A whole experiment shown must be one of configs/ word for word (README's: test_config); a fragment
    (a few top-level keys) must validate over a real experiment."""
    import json

    import yaml

    from pipeline.config import load_experiment

    shown = yaml.safe_load(body)
    if "stages" in shown:
        files = [p for p in (ROOT / "configs").rglob("*.yaml") if body.strip() in p.read_text()]
        assert files, f"{where}: this experiment is in no file under configs/"
        load_experiment(files[0], [])
        return
    overrides = [f"{key}={json.dumps(value)}" for key, value in shown.items()]
    exp = load_experiment(ROOT / "configs/experiments/two_stage_tiny.yaml", overrides)
    assert exp.name == shown.get("name", exp.name)
