"""`vitpipe compare` on a real MLflow store (SQLite in a temp folder) built with MLflow's own client.

.venv/bin/python -m pytest tests/test_compare.py -q
"""

from __future__ import annotations

import csv
import io
import math
import re
import subprocess
import sys
from pathlib import Path

import pytest

from pipeline.compare import (
    MAX_CELL,
    TABLE_WIDTH,
    CompareError,
    cut_cell,
    main,
    mean_se,
    path_like,
    replica_key,
    resolve_tracking_uri,
)

pytestmark = pytest.mark.unit

REPO = Path(__file__).resolve().parents[1]

# Two sweep runs that differ in optim.lr only, a nested few-shot child of the first, and a run in a
# second experiment. Losses: final 1.25 vs best (min) 1.2 for lr-1e-3; top-1 final 0.48 vs best 0.5.
LOSS = {"lr-1e-3": [2.0, 1.5, 1.2, 1.3, 1.25], "lr-3e-4": [2.1, 1.9, 1.7, 1.6, 1.55], "baseline": [3.0, 2.5]}
TOP1 = {"lr-1e-3": [0.2, 0.4, 0.5, 0.45, 0.48], "lr-3e-4": [0.1, 0.15, 0.2, 0.25, 0.3]}


@pytest.fixture(scope="module")
def store(tmp_path_factory) -> dict[str, str]:
    from mlflow import MlflowClient
    from mlflow.entities import Metric

    root = tmp_path_factory.mktemp("mlflow")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    ids: dict[str, str] = {"uri": uri}

    def make_run(
        exp_id: str,
        name: str,
        start: int,
        params: dict[str, str],
        metrics: dict[str, list[float]],
        parent: str | None = None,
    ) -> str:
        tags = {"mlflow.parentRunId": parent} if parent else {}
        run_id = client.create_run(exp_id, start_time=start, tags=tags, run_name=name).info.run_id
        for key, value in params.items():
            client.log_param(run_id, key, value)
        batch = [
            Metric(key, v, start + step, step) for key, vs in metrics.items() for step, v in enumerate(vs, 1)
        ]
        client.log_batch(run_id, metrics=batch)
        client.set_terminated(run_id)
        ids[name] = run_id
        return run_id

    sweep = client.create_experiment("sweep", artifact_location=(root / "artifacts").as_uri())
    other = client.create_experiment("other", artifact_location=(root / "artifacts").as_uri())
    common = {"model.name": "vit_debug", "seed": "0"}
    first = make_run(
        sweep,
        "lr-1e-3",
        1_000,
        {**common, "optim.lr": "0.001"},
        {
            "train/loss": LOSS["lr-1e-3"],
            "eval/top1": TOP1["lr-1e-3"],
            "system/cpu_utilization_percentage": [50.0, 60.0],
        },
    )
    make_run(
        sweep,
        "lr-3e-4",
        2_000,
        {**common, "optim.lr": "0.0003"},
        {"train/loss": LOSS["lr-3e-4"], "eval/top1": TOP1["lr-3e-4"]},
    )
    make_run(sweep, "fewshot-5", 3_000, {"fewshot.shots": "5"}, {"fewshot/5shot": [0.6]}, parent=first)
    make_run(other, "baseline", 4_000, {**common, "optim.lr": "0.001"}, {"train/loss": LOSS["baseline"]})
    return ids


def compare(store: dict[str, str], capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(["--tracking-uri", store["uri"], *argv])
    out, err = capsys.readouterr()
    return rc, out, err


def parse_table(text: str) -> tuple[list[str], dict[str, dict[str, str]]]:
    """Plain-text table -> (header, {run name: {column: cell}}); no cell in the fixture holds a space."""
    lines = text.strip().splitlines()
    header = lines[0].split()
    assert set(lines[1].replace(" ", "")) == {"-"}
    rows = [dict(zip(header, line.split())) for line in lines[2:]]
    return header, {row["run"]: row for row in rows}


def error_line(err: str) -> str:
    lines = [line for line in err.splitlines() if line.startswith("vitpipe compare:")]
    assert len(lines) == 1 and "Traceback" not in err, err
    return lines[0]


# ---------------------------------------------------------------- tables


def test_table_shows_differing_params_and_final_values(store, capsys):
    rc, out, _ = compare(store, capsys, "--experiment", "sweep")
    assert rc == 0
    header, rows = parse_table(out)
    # model.name and seed are equal everywhere; the child's missing parent params are no difference.
    assert header == [
        "run",
        "id",
        "parent",
        "fewshot.shots",
        "optim.lr",
        "eval/top1",
        "fewshot/5shot",
        "train/loss",
    ]
    assert list(rows) == ["lr-1e-3", "fewshot-5", "lr-3e-4"]  # oldest first, children under their parent
    assert rows["lr-1e-3"] == {
        "run": "lr-1e-3",
        "id": store["lr-1e-3"][:8],
        "parent": "-",
        "fewshot.shots": "-",
        "optim.lr": "0.001",
        "eval/top1": "0.48",
        "fewshot/5shot": "-",
        "train/loss": "1.25",
    }
    assert rows["fewshot-5"]["parent"] == "lr-1e-3"
    assert rows["fewshot-5"]["fewshot/5shot"] == "0.6" and rows["fewshot-5"]["train/loss"] == "-"
    assert rows["lr-3e-4"]["train/loss"] == "1.55" and rows["lr-3e-4"]["optim.lr"] == "0.0003"


def test_table_columns_are_aligned(store, capsys):
    _, out, _ = compare(store, capsys, "--experiment", "sweep", "--metric", "train/loss")
    lines = out.strip().splitlines()
    # Numbers right-aligned: every row's train/loss ends in the same column as the header.
    assert len({len(line) for line in lines}) == 1, lines


@pytest.mark.parametrize(
    ("agg", "loss", "top1"),
    [("final", "1.25", "0.48"), ("best", "1.2", "0.5"), ("min", "1.2", "0.2"), ("max", "2", "0.5")],
)
def test_aggregations(store, capsys, agg, loss, top1):
    rc, out, _ = compare(
        store,
        capsys,
        "--experiment",
        "sweep",
        "--metric",
        "train/loss",
        "--metric",
        "eval/top1",
        "--agg",
        agg,
    )
    assert rc == 0
    suffix = "" if agg == "final" else f" [{agg}]"
    assert out.splitlines()[0].endswith(f"train/loss{suffix}  eval/top1{suffix}")
    cells = out.strip().splitlines()[2].split()  # lr-1e-3's row: ... loss top1
    assert cells[-2:] == [loss, top1]


def test_sort_ascending_descending_and_missing_last(store, capsys):
    _, out, _ = compare(store, capsys, "--experiment", "sweep", "--sort", "train/loss")
    assert list(parse_table(out)[1]) == ["lr-1e-3", "lr-3e-4", "fewshot-5"]
    _, out, _ = compare(store, capsys, "--experiment", "sweep", "--sort", "train/loss", "--desc")
    assert list(parse_table(out)[1]) == ["lr-3e-4", "lr-1e-3", "fewshot-5"]
    # A bare metric name finds its aggregated column; params sort numerically.
    _, out, _ = compare(
        store, capsys, "--experiment", "sweep", "--agg", "best", "--sort", "eval/top1", "--desc"
    )
    assert list(parse_table(out)[1]) == ["lr-1e-3", "lr-3e-4", "fewshot-5"]
    _, out, _ = compare(store, capsys, "--experiment", "sweep", "--sort", "optim.lr")
    assert list(parse_table(out)[1]) == ["lr-3e-4", "lr-1e-3", "fewshot-5"]


def test_markdown(store, capsys):
    rc, out, _ = compare(
        store, capsys, "--experiment", "sweep", "--metric", "train/loss", "--format", "markdown"
    )
    assert rc == 0
    lines = out.strip().splitlines()
    assert lines[0] == "| run | id | parent | fewshot.shots | optim.lr | train/loss |"
    assert lines[1] == "| --- | --- | --- | ---: | ---: | ---: |"
    assert lines[2] == f"| lr-1e-3 | {store['lr-1e-3'][:8]} | - | - | 0.001 | 1.25 |"
    assert len(lines) == 5


def test_csv_has_full_ids_and_full_precision(store, capsys):
    rc, out, _ = compare(store, capsys, "--experiment", "sweep", "--format", "csv", "--agg", "best")
    assert rc == 0
    rows = {r["run"]: r for r in csv.DictReader(io.StringIO(out))}
    assert rows["lr-1e-3"]["id"] == store["lr-1e-3"]
    assert float(rows["lr-1e-3"]["train/loss [best]"]) == 1.2
    assert rows["fewshot-5"]["train/loss [best]"] == "" and rows["fewshot-5"]["parent"] == "lr-1e-3"


# ---------------------------------------------------------------- choosing runs


def test_filter_across_all_experiments(store, capsys):
    _, out, _ = compare(store, capsys, "--filter", "params.optim.lr = '0.001'", "--metric", "train/loss")
    # Both experiments searched; the child of lr-1e-3 comes along although it has no optim.lr.
    assert list(parse_table(out)[1]) == ["lr-1e-3", "fewshot-5", "baseline"]
    _, out, _ = compare(store, capsys, "--filter", "params.optim.lr = '0.001'", "--no-children")
    assert list(parse_table(out)[1]) == ["lr-1e-3", "baseline"]


def test_run_ids_bring_their_children_and_combine_experiments(store, capsys):
    _, out, _ = compare(store, capsys, "--run", store["lr-1e-3"], "--metric", "train/loss")
    assert list(parse_table(out)[1]) == ["lr-1e-3", "fewshot-5"]
    _, out, _ = compare(
        store, capsys, "--experiment", "other", "--run", store["lr-3e-4"], "--metric", "train/loss"
    )
    header, rows = parse_table(out)
    assert list(rows) == ["lr-3e-4", "baseline"] and "parent" not in header
    assert rows["baseline"]["optim.lr"] == "0.001" and rows["baseline"]["train/loss"] == "2.5"


# ---------------------------------------------------------------- the plot


def test_plot_writes_a_png(store, capsys, tmp_path):
    out_png = tmp_path / "plots" / "loss.png"
    rc, out, err = compare(
        store,
        capsys,
        "--experiment",
        "sweep",
        "--experiment",
        "other",
        "--plot",
        "train/loss",
        "--out",
        str(out_png),
    )
    assert rc == 0 and "train/loss" in out
    assert out_png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "train/loss of 3 runs" in err  # the child run has no train/loss


# ---------------------------------------------------------------- errors


@pytest.mark.parametrize(
    ("argv", "expected"),
    [
        (["--experiment", "nope"], ["no experiment named 'nope'", "Default, other, sweep"]),
        (["--experiment", "sweeep"], ["did you mean 'sweep'?"]),
        (["--experiment", "sweep", "--metric", "nope"], ["metric 'nope'", "eval/top1", "train/loss"]),
        (["--run", "0123456789abcdef"], ["no run with id '0123456789abcdef'", "(baseline)"]),
        (["--experiment", "sweep", "--plot", "nope", "--out", "x.png"], ["metric 'nope'", "train/loss"]),
        (["--experiment", "sweep", "--plot", "train/loss"], ["--plot needs --out"]),
        (["--experiment", "sweep", "--sort", "nope"], ["cannot sort by 'nope'", "train/loss"]),
        (["--filter", "params.x ="], ["Invalid clause"]),
        (["--filter", "params.optim.lr = '9'"], ["no runs match", "params.optim.lr = '9'"]),
        ([], ["choose runs with", "sweep"]),
    ],
)
def test_errors_are_one_line_with_exit_code_2(store, capsys, argv, expected):
    rc, out, err = compare(store, capsys, *argv)
    assert rc == 2 and out == ""
    line = error_line(err)
    for text in expected:
        assert text in line, line


def test_missing_database_is_not_created(tmp_path, capsys):
    db = tmp_path / "typo.db"
    assert main(["--tracking-uri", f"sqlite:///{db}", "--experiment", "sweep"]) == 2
    assert f"no MLflow database at {db}" in error_line(capsys.readouterr().err)
    assert not db.exists()


def test_default_store_follows_the_train_layout(tmp_path, monkeypatch):
    monkeypatch.delenv("MLFLOW_TRACKING_URI", raising=False)
    with pytest.raises(CompareError, match="none under ./runs"):
        resolve_tracking_uri(None, [], cwd=tmp_path)
    for name in ("a", "b"):
        (tmp_path / "runs" / name).mkdir(parents=True)
        (tmp_path / "runs" / name / "mlflow.db").touch()
    assert resolve_tracking_uri(None, ["b"], cwd=tmp_path) == f"sqlite:///{tmp_path / 'runs/b/mlflow.db'}"
    with pytest.raises(CompareError, match="runs/a/mlflow.db, sqlite:///.*runs/b/mlflow.db"):
        resolve_tracking_uri(None, [], cwd=tmp_path)
    monkeypatch.setenv("MLFLOW_TRACKING_URI", "http://mlflow:5000")
    assert resolve_tracking_uri(None, ["b"], cwd=tmp_path) == "http://mlflow:5000"
    assert resolve_tracking_uri("sqlite:///x.db", ["b"], cwd=tmp_path) == "sqlite:///x.db"


# ---------------------------------------------------------------- fitting a terminal

# Runs shaped like an experiment's stages: locations that differ everywhere (run dirs, data and init
# paths, a tracking URI, the stage name) and more differing params than 120 columns can hold.
MANY = {f"optim.schedule_param_{i:02d}": "cosine_with_restarts_{}" for i in range(12)}


def _experiment_store(tmp_path_factory, name: str):
    """(uri, client, experiment id) of a new SQLite MLflow store holding one experiment `name`."""
    from mlflow import MlflowClient

    root = tmp_path_factory.mktemp(f"mlflow_{name}")
    uri = f"sqlite:///{root / 'mlflow.db'}"
    client = MlflowClient(tracking_uri=uri)
    return uri, client, client.create_experiment(name, artifact_location=(root / "artifacts").as_uri())


@pytest.fixture(scope="module")
def stages_store(tmp_path_factory) -> dict[str, str]:
    from mlflow.entities import Metric, Param

    uri, client, exp = _experiment_store(tmp_path_factory, "stages")
    stages = [("pretrain", "0.0015"), ("finetune", "0.005"), ("finetune_scratch", "0.005")]
    for k, (name, lr) in enumerate(stages):
        run_id = client.create_run(exp, start_time=1_000 * (k + 1), run_name=name).info.run_id
        params = {
            "name": name,
            "run_dir": f"/work/main/runs/demo/{name}",
            "data.train": f"/work/main/data/demo/{'synthetic' if k == 0 else 'digits'}",
            "model.init_from": "/work/main/runs/demo/pretrain/export" if k == 1 else "None",
            "checkpoint.uri": f"s3://bucket/demo/{name}",
            "tracking.uri": f"sqlite:////work/main/runs/demo/{name}.db",
            "optim.lr": lr,
            "objective.name": "mae" if k == 0 else "supervised_softmax",
            **{key: value.format(k) for key, value in MANY.items()},
        }
        client.log_batch(run_id, params=[Param(key, value) for key, value in params.items()])
        metrics = {"train/loss": 1.0 + k, "eval/top1": 0.5 + k / 10, "fewshot/10shot": 0.4 + k / 10}
        client.log_batch(run_id, metrics=[Metric(key, v, 1, 1) for key, v in metrics.items()])
        client.set_terminated(run_id)
    return {"uri": uri}


def test_default_table_fits_120_columns_without_locations(stages_store, capsys):
    metrics = ["--metric", "eval/top1", "--metric", "fewshot/10shot", "--metric", "train/loss"]
    rc, out, err = compare(stages_store, capsys, "--experiment", "stages", *metrics)
    assert rc == 0
    lines = out.strip().splitlines()
    assert max(map(len, lines)) <= TABLE_WIDTH == 120, "\n".join(lines)
    header, rows = parse_table(out)
    # The run, its id, every chosen metric, and the params that differ in meaning and fit.
    assert header[:2] == ["run", "id"] and header[-3:] == ["eval/top1", "fewshot/10shot", "train/loss"]
    assert {"objective.name", "optim.lr"} <= set(header)
    assert list(rows) == ["pretrain", "finetune", "finetune_scratch"]
    assert rows["finetune"]["optim.lr"] == "0.005" and rows["finetune_scratch"]["train/loss"] == "3"
    # Paths, URIs and the stage name repeated are no difference a reader needs.
    for location in ("name", "run_dir", "data.train", "model.init_from", "checkpoint.uri", "tracking.uri"):
        assert location not in header
    # What was left out is named on stderr, with the way to see it.
    assert max(map(len, err.splitlines())) <= TABLE_WIDTH, err
    note = " ".join(err.split())
    assert note.startswith("not shown (--wide shows every column):") and "run_dir" in note, note
    assert "beyond 120 characters" in note and "optim.schedule_param_11" in note, note
    # Without --metric, the params that matter most come first but leave room for metrics.
    _, out, _ = compare(stages_store, capsys, "--experiment", "stages")
    header, _ = parse_table(out)
    assert max(map(len, out.splitlines())) <= 120
    assert {"objective.name", "optim.lr", "eval/top1"} <= set(header)


def test_fitted_cells_are_cut_and_width_is_adjustable(stages_store, capsys):
    rc, out, _ = compare(stages_store, capsys, "--experiment", "stages", "--width", "80")
    assert rc == 0 and max(map(len, out.strip().splitlines())) <= 80
    header, rows = parse_table(out)
    # Without --metric the params are offered room first; cells longer than 24 characters are cut.
    assert header[2] == "objective.name" and rows["finetune"]["objective.name"] == "supervised_softmax"
    long = "supervised_softmax_with_label_smoothing"
    assert cut_cell(long) == long[: MAX_CELL - 3] + "..." and len(cut_cell(long)) == MAX_CELL


def test_wide_shows_every_column_in_full(stages_store, capsys):
    rc, out, err = compare(stages_store, capsys, "--experiment", "stages", "--wide")
    assert rc == 0 and err == ""
    header, rows = parse_table(out)
    locations = ["name", "run_dir", "data.train", "model.init_from", "checkpoint.uri", "tracking.uri"]
    assert set(header) >= {*locations, *MANY}
    assert rows["finetune"]["run_dir"] == "/work/main/runs/demo/finetune"
    assert rows["pretrain"]["tracking.uri"].endswith("/pretrain.db")
    assert max(map(len, out.splitlines())) > TABLE_WIDTH
    # csv is always wide; markdown leaves out the locations but is not cut to a width.
    _, out, _ = compare(stages_store, capsys, "--experiment", "stages", "--format", "csv")
    assert "run_dir" in out.splitlines()[0] and "optim.schedule_param_11" in out.splitlines()[0]
    _, out, _ = compare(stages_store, capsys, "--experiment", "stages", "--format", "markdown")
    assert "run_dir" not in out.splitlines()[0] and "optim.schedule_param_11" in out.splitlines()[0]


@pytest.mark.parametrize(
    ("value", "expected"),
    [
        ("/work/runs/a", True),
        ("~/data", True),
        ("./data", True),
        ("../x", True),
        ("s3://b/k", True),
        ("sqlite:///runs/a/mlflow.db", True),
        ("file:///tmp/x", True),
        ("http://mlflow:5000", True),
        ("pipe:aws s3 cp s3://b/x -", True),
        ("vit_debug", False),
        ("0.001", False),
        ("[0.9, 0.95]", False),
        ("None", False),
        ("cls", False),
    ],
)
def test_path_like(value, expected):
    assert path_like(value) is expected


# ---------------------------------------------------------------- the real command


def test_vitpipe_compare_command(store):
    ok = subprocess.run(
        [
            sys.executable,
            "-m",
            "vitpipe",
            "compare",
            "--tracking-uri",
            store["uri"],
            "--experiment",
            "sweep",
            "--format",
            "csv",
            "--metric",
            "train/loss",
        ],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert ok.returncode == 0, ok.stderr
    assert [r["run"] for r in csv.DictReader(io.StringIO(ok.stdout))] == ["lr-1e-3", "fewshot-5", "lr-3e-4"]
    bad = subprocess.run(
        [sys.executable, "-m", "vitpipe", "compare", "--tracking-uri", store["uri"], "--experiment", "nope"],
        cwd=REPO,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert bad.returncode == 2 and "Traceback" not in bad.stderr
    assert "vitpipe compare: no experiment named 'nope'" in bad.stderr


# ---------------------------------------------------------------- seed replicas: --over-seeds

# An experiment run with `seeds: [0, 1, 2]`, shaped as cluster.run logs it: a parent run without params
# (per-stage summaries as metrics) and, per seed, nested stage runs named STAGE_sK whose run_dir,
# checkpoint.uri and (for finetune) init_from name their own seed's replicas. Two variants on every seed
# (finetune from the pretrain export, scratch without), a third (probe) on seed 0 only; scratch_s2 has
# no few-shot metric.
SEED_RUNS = {  # stage: (optim.lr, init_from stage, {seed: (eval/top1, fewshot/10shot)})
    "finetune": ("0.005", "pretrain", {0: (0.80, 0.5), 1: (0.83, 0.6), 2: (0.86, 0.7)}),
    "scratch": ("0.005", None, {0: (0.70, 0.40), 1: (0.74, 0.44), 2: (0.72, None)}),
    "probe": ("0.001", "pretrain", {0: (0.65, 0.3)}),
}
# By hand: finetune top-1 mean 0.83, sample std 0.03, se 0.03 / sqrt(3) = 0.01732; few-shot 0.6, std 0.1,
# se 0.05774. scratch top-1 0.72, std 0.02, se 0.01155; few-shot of 2 runs 0.42, std 0.02 * sqrt(2),
# se 0.02. probe: one run, no error.
SEED_TABLE = [
    ["runs", "n", "optim.lr", "eval/top1", "fewshot/10shot"],
    ["finetune", "3", "0.005", "0.830 ± 0.017", "0.600 ± 0.058"],
    ["scratch", "3", "0.005", "0.720 ± 0.012", "0.420 ± 0.020 (n=2)"],
    ["probe", "1", "0.001", "0.65 ± -", "0.3 ± -"],
]


@pytest.fixture(scope="module")
def seeds_store(tmp_path_factory) -> dict[str, str]:
    from mlflow.entities import Metric, Param

    uri, client, exp = _experiment_store(tmp_path_factory, "seeds")
    runs = "/work/main/runs/seeds"
    parent = client.create_run(exp, start_time=1_000, run_name="seeds").info.run_id
    client.log_metric(parent, "finetune_s0/top1", 0.8)
    ids = {"uri": uri, "seeds": parent}
    start = 2_000
    for seed in (0, 1, 2):
        for stage, (lr, init, results) in SEED_RUNS.items():
            if seed not in results:
                continue
            name = f"{stage}_s{seed}"
            tags = {"mlflow.parentRunId": parent}
            run_id = client.create_run(exp, start_time=start, tags=tags, run_name=name).info.run_id
            start += 1_000
            params = {
                "name": name,
                "seed": str(seed),
                "run_dir": f"{runs}/{name}",
                "checkpoint.uri": f"s3://bucket/seeds/{name}?endpoint_override=127.0.0.1:9000",
                "tracking.uri": f"sqlite:///{runs}/mlflow.db",
                "data.train": "/work/main/data/digits",
                "model.init_from": f"{runs}/{init}_s{seed}/export" if init else "None",
                "optim.lr": lr,
            }
            client.log_batch(run_id, params=[Param(k, v) for k, v in params.items()])
            top1, fewshot = results[seed]
            metrics = {"eval/top1": top1, **({} if fewshot is None else {"fewshot/10shot": fewshot})}
            client.log_batch(run_id, metrics=[Metric(k, v, 1, 1) for k, v in metrics.items()])
            client.set_terminated(run_id)
            ids[name] = run_id
    client.set_terminated(parent)
    return ids


def parse_cells(text: str) -> list[list[str]]:
    """Plain-text table -> rows of cells; columns are 2+ spaces apart (a `mean ± se` cell has single ones)."""
    lines = text.strip().splitlines()
    assert set(lines[1].replace(" ", "")) == {"-"}
    return [re.split(r"\s{2,}", line.strip()) for line in [lines[0], *lines[2:]]]


def test_over_seeds_table_has_mean_and_standard_error_per_group(seeds_store, capsys):
    rc, out, err = compare(seeds_store, capsys, "--experiment", "seeds", "--over-seeds")
    assert rc == 0, err
    # Replicas grouped although name, run_dir, checkpoint.uri and init_from differ per seed; finetune and
    # scratch apart although they differ only in init_from (a path: not shown, but not set aside).
    assert parse_cells(out) == SEED_TABLE
    lines = out.strip().splitlines()
    assert len({len(line) for line in lines}) == 1, lines  # numbers and means right-aligned
    note = " ".join(err.split())
    assert "not grouped (no params, e.g. an experiment's parent run): seeds" in note
    assert "model.init_from" in note  # a path column, left out of the fitted table as without the flag


def test_over_seeds_wide_shows_the_normalised_init_from_and_no_seed_or_locations(seeds_store, capsys):
    _, out, _ = compare(seeds_store, capsys, "--experiment", "seeds", "--over-seeds", "--wide")
    header, *rows = parse_cells(out)
    assert header == ["runs", "n", "model.init_from", "optim.lr", "eval/top1", "fewshot/10shot"]
    assert [row[2] for row in rows] == [
        "/work/main/runs/seeds/pretrain_s*/export",
        "None",
        "/work/main/runs/seeds/pretrain_s*/export",
    ]


def test_over_seeds_sorts_by_the_mean(seeds_store, capsys):
    _, out, _ = compare(seeds_store, capsys, "--experiment", "seeds", "--over-seeds", "--sort", "eval/top1")
    assert [row[0] for row in parse_cells(out)[1:]] == ["probe", "scratch", "finetune"]
    argv = ["--experiment", "seeds", "--over-seeds", "--sort", "fewshot/10shot", "--desc"]
    _, out, _ = compare(seeds_store, capsys, *argv)
    assert [row[0] for row in parse_cells(out)[1:]] == ["finetune", "scratch", "probe"]


def test_over_seeds_markdown(seeds_store, capsys):
    rc, out, _ = compare(seeds_store, capsys, "--experiment", "seeds", "--over-seeds", "--format", "markdown")
    assert rc == 0
    assert out.strip().splitlines() == [
        "| " + " | ".join(SEED_TABLE[0]) + " |",
        "| --- | ---: | ---: | ---: | ---: |",
        *("| " + " | ".join(row) + " |" for row in SEED_TABLE[1:]),
    ]


def test_over_seeds_csv_has_mean_se_and_n_columns(seeds_store, capsys):
    rc, out, _ = compare(seeds_store, capsys, "--experiment", "seeds", "--over-seeds", "--format", "csv")
    assert rc == 0
    reader = csv.DictReader(io.StringIO(out))
    assert reader.fieldnames == [
        "runs",
        "n",
        "model.init_from",
        "optim.lr",
        "eval/top1",
        "eval/top1_se",
        "eval/top1_n",
        "fewshot/10shot",
        "fewshot/10shot_se",
        "fewshot/10shot_n",
        "run_ids",
    ]
    rows = {r["runs"]: r for r in reader}
    finetune, scratch, probe = rows["finetune"], rows["scratch"], rows["probe"]
    assert finetune["n"] == "3" and finetune["eval/top1_n"] == "3"
    assert float(finetune["eval/top1"]) == pytest.approx(0.83)
    assert float(finetune["eval/top1_se"]) == pytest.approx(0.03 / 3**0.5)
    assert float(finetune["fewshot/10shot_se"]) == pytest.approx(0.1 / 3**0.5)
    assert float(scratch["eval/top1_se"]) == pytest.approx(0.02 / 3**0.5)
    assert float(scratch["fewshot/10shot"]) == pytest.approx(0.42) and scratch["fewshot/10shot_n"] == "2"
    assert float(scratch["fewshot/10shot_se"]) == pytest.approx(0.02)
    assert probe["eval/top1"] == "0.65" and probe["eval/top1_se"] == "" and probe["eval/top1_n"] == "1"
    assert finetune["run_ids"].split() == [seeds_store[f"finetune_s{k}"] for k in range(3)]
    # An aggregation suffix stays at the end of each column name.
    _, out, _ = compare(
        seeds_store, capsys, "--experiment", "seeds", "--over-seeds", "--format", "csv", "--agg", "best"
    )
    assert "eval/top1 [best],eval/top1_se [best],eval/top1_n [best]" in out.splitlines()[0]


def test_without_over_seeds_every_replica_is_a_row(seeds_store, capsys):
    _, out, _ = compare(seeds_store, capsys, "--experiment", "seeds", "--metric", "eval/top1")
    header, rows = parse_table(out)
    assert "seed" in header and len(rows) == 8  # the parent and seven stage runs
    assert rows["finetune_s1"]["eval/top1"] == "0.83"


def test_over_seeds_needs_runs_with_params(seeds_store, capsys):
    rc, _, err = compare(seeds_store, capsys, "--run", seeds_store["seeds"], "--no-children", "--over-seeds")
    assert rc == 2 and "no chosen run has params to group by" in error_line(err)


@pytest.mark.parametrize(
    ("name", "params", "expected"),
    [
        # The run's own places and name go, its seed goes, what it reads is kept with the suffix made `_s*`.
        (
            "finetune_s1",
            {
                "name": "finetune_s1",
                "seed": "1",
                "run_dir": "/r/e/finetune_s1",
                "checkpoint.uri": "s3://b/e/finetune_s1?region=x",
                "model.init_from": "/r/e/pretrain_s1/export",
                "objective.teacher.weights": "s3://b/e/teacher_s1?region=x",
                "optim.lr": "0.1",
            },
            {
                "model.init_from": "/r/e/pretrain_s*/export",
                "objective.teacher.weights": "s3://b/e/teacher_s*?region=x",
                "optim.lr": "0.1",
            },
        ),
        # Another seed's replica is a different input; `_s1` inside a segment is no replica suffix.
        (
            "finetune_s1",
            {"seed": "1", "model.init_from": "/r/e/pretrain_s0/export", "data.train": "/d/cls_s1x"},
            {"model.init_from": "/r/e/pretrain_s0/export", "data.train": "/d/cls_s1x"},
        ),
        # Runs named by hand (vitpipe train ... seed=1 name=lr-seed1): their run dir and store go too.
        (
            "lr-seed1",
            {"name": "lr-seed1", "seed": "1", "tracking.uri": "sqlite:///runs/lr-seed1/mlflow.db"},
            {},
        ),
    ],
)
def test_replica_key(name, params, expected):
    assert replica_key(name, params) == expected


def test_mean_se_of_a_diverged_run_is_nan_not_an_error():
    assert math.isnan(mean_se([0.5, math.inf, -math.inf], 3).mean)  # fsum(inf, -inf) raises ValueError
    assert math.isnan(mean_se([0.5, math.nan], 2).se)
    same = mean_se([1.0, 2.0, 3.0], 3)
    assert same.mean == 2.0 and same.se == pytest.approx(1 / math.sqrt(3))
