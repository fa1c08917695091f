"""`vitpipe compare`: MLflow runs side by side: the params that differ, chosen metrics, metric curves.

    vitpipe compare --experiment smoke                                  # every run of an experiment
    vitpipe compare --experiment smoke --metric train/loss --agg best --sort train/loss
    vitpipe compare --filter "params.optim.lr = '0.001'" --format markdown
    vitpipe compare --run 3f2a9c... --run 9c1b04... --format csv > runs.csv
    vitpipe compare --experiment smoke --plot train/loss --out loss.png
    vitpipe compare --experiment ablation --over-seeds --metric eval/map --sort eval/map --desc

Runs are chosen by experiment name (`--experiment`, repeatable), an MLflow search filter (`--filter`,
over the chosen experiments or, without any, over all of them) and run ids (`--run`, repeatable); the
union is taken, and the nested child runs of every chosen run are added (`--no-children` skips them).

Which store: `--tracking-uri`, else `$MLFLOW_TRACKING_URI`, else the store `vitpipe train` writes by
default (`sqlite:///<run_dir>/mlflow.db`, run_dir `runs/<name>`): `runs/<E>/mlflow.db` for the first
`--experiment E` that has one, else the only `runs/*/mlflow.db` under the current directory.

Metric columns default to every metric the runs logged except MLflow's `system/*` samples (ask for
those with `--metric`). `--agg` turns a history into one number: `final` (the value at the last
step), `min`, `max`, or `best` (min for names containing "loss", max otherwise).
A missing experiment, run or metric prints one line naming what exists and exits with status 2.

The plain table fits a terminal (`--width`, 120 columns by default): the run, its id and parent,
the params that differ in meaning and the metrics. Params whose values are paths or URIs (run
directories, data and checkpoint locations, tracking URIs) and params that only repeat the run's
name are left out; long cells are cut; when the rest still does not fit, the chosen metrics come
first, then the params, and a note on stderr names what was left out. `--wide` shows every column
in full, as csv always does; markdown leaves out the same params but is never cut to a width.

`--over-seeds` puts the replicas of one configuration in one row: the runs of an experiment with
`seeds: [0, 1, 2]` (stage X runs as X_s0, X_s1, X_s2), or any runs whose params are equal once the
seed, the run's name and where the run writes are set aside (`replica_key`). A row shows the group's
runs (the stage name without the seed suffix), `n`, the params that differ between groups, and per
metric the mean over the runs and its standard error (sample standard deviation, ddof 1, over
sqrt(n)): `0.853 ± 0.012`; a group of one run has no error (`0.65 ± -`). A run without the metric
is left out of that mean, and the cell says how many runs it used when that is not every run of the
group: `0.420 ± 0.020 (n=2)`. csv has METRIC (the mean), METRIC_se, METRIC_n and the group's run ids.
Runs without params (an experiment's parent run, which holds per-stage summaries) are not grouped.
`--sort` orders the groups by the mean.
"""

from __future__ import annotations

import argparse
import csv
import difflib
import io
import math
import os
import re
import sys
import textwrap
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, replace
from pathlib import Path
from typing import TYPE_CHECKING

from pipeline.tracking import replica_name

if TYPE_CHECKING:
    from mlflow import MlflowClient
    from mlflow.entities import Run

PARENT_TAG = "mlflow.parentRunId"
AGGREGATIONS = ("final", "best", "min", "max")
FORMATS = ("table", "markdown", "csv")
MISSING = "-"  # shown for a param or metric a run does not have
MAX_LISTED = 12  # names listed in an error message before "..."
TABLE_WIDTH = 120  # columns the plain table fits by default (--width)
# Which differing params a fitted table offers room to first (by key prefix; the rest alphabetically,
# derived.* last): what the stage is, then the model, the objective, the optimizer, the data.
PARAM_PRIORITY = ("kind", "model.name", "objective.name", "model.", "objective.", "optim.", "data.")
MAX_CELL = 24  # characters of a cell the fitted table shows; longer ones end in "..."
SEED_PARAM = "seed"  # the param that tells replicas apart (pipeline.config.flatten logs the stage's seed)


@dataclass(frozen=True)
class MeanSE:
    """A metric over a group of seed replicas: the mean of the runs that have it, its standard error
    (None for one run), how many runs that was (`n`) and how many the group has (`size`)."""

    mean: float
    se: float | None
    n: int
    size: int


Cell = str | float | int | MeanSE | None


class CompareError(Exception):
    """A one-line problem for the user (exit status 2)."""


def _listing(names: Sequence[str]) -> str:
    shown = ", ".join(names[:MAX_LISTED])
    return (shown + f", ... ({len(names)} in all)") if len(names) > MAX_LISTED else (shown or "none")


# ---------------------------------------------------------------- which store


def resolve_tracking_uri(flag: str | None, experiments: Sequence[str], cwd: Path | None = None) -> str:
    """The store to read; see the module docstring for the order."""
    if flag:
        return flag
    if os.environ.get("MLFLOW_TRACKING_URI"):
        return os.environ["MLFLOW_TRACKING_URI"]
    runs_dir = (cwd or Path.cwd()) / "runs"
    for name in experiments:
        db = runs_dir / name / "mlflow.db"
        if db.is_file():
            return f"sqlite:///{db.absolute()}"
    stores = sorted(runs_dir.glob("*/mlflow.db"))
    if len(stores) == 1:
        return f"sqlite:///{stores[0].absolute()}"
    found = _listing([f"sqlite:///{p}" for p in stores]) if stores else "none under ./runs"
    raise CompareError(
        f"which MLflow store? pass --tracking-uri or set MLFLOW_TRACKING_URI (stores found: {found})"
    )


def open_client(uri: str) -> MlflowClient:
    """An MlflowClient on `uri`; a missing SQLite file is an error (MLflow would create an empty one)."""
    if uri.startswith("sqlite:///"):
        path = Path(uri.removeprefix("sqlite:///").split("?", 1)[0])
        if not path.is_file():
            raise CompareError(f"no MLflow database at {path} (tracking URI {uri})")
    from mlflow import MlflowClient

    return MlflowClient(tracking_uri=uri)


# ---------------------------------------------------------------- which runs


def _all_pages(fetch: Callable[..., list]) -> list:
    """Every item of a paged MLflow search (1000 per page)."""
    items, token = [], None
    while True:
        page = fetch(page_token=token)
        items.extend(page)
        token = page.token
        if not token:
            return items


def _experiments(client: MlflowClient) -> list:
    """Every active experiment of the store."""
    return _all_pages(lambda page_token: client.search_experiments(page_token=page_token))


def _experiment_names(client: MlflowClient) -> list[str]:
    return sorted(e.name for e in _experiments(client))


def _search_runs(client: MlflowClient, experiment_ids: list[str], filter_string: str) -> list[Run]:
    return _all_pages(
        lambda page_token: client.search_runs(
            experiment_ids, filter_string, max_results=1000, page_token=page_token
        )
    )


def _experiment_ids(client: MlflowClient, names: Sequence[str], uri: str) -> list[str]:
    ids = []
    for name in names:
        exp = client.get_experiment_by_name(name)
        if exp is None or exp.lifecycle_stage != "active":
            existing = _experiment_names(client)
            close = difflib.get_close_matches(name, existing, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            raise CompareError(
                f"no experiment named {name!r} in {uri}{hint}; experiments there: {_listing(existing)}"
            )
        ids.append(exp.experiment_id)
    return ids


def _get_run(client: MlflowClient, run_id: str, uri: str) -> Run:
    from mlflow.exceptions import MlflowException

    try:
        return client.get_run(run_id)
    except MlflowException as exc:
        if exc.error_code != "RESOURCE_DOES_NOT_EXIST":
            raise
    exp_ids = [e.experiment_id for e in _experiments(client)]
    recent = client.search_runs(exp_ids, max_results=MAX_LISTED, order_by=["attributes.start_time DESC"])
    listed = _listing([f"{r.info.run_id} ({r.info.run_name})" for r in recent])
    raise CompareError(f"no run with id {run_id!r} in {uri}; most recent runs there: {listed}")


def select_runs(
    client: MlflowClient,
    uri: str,
    experiments: Sequence[str] = (),
    filter_string: str | None = None,
    run_ids: Sequence[str] = (),
    include_children: bool = True,
) -> list[Run]:
    """The union of the runs chosen by experiment (+ filter) and by id, plus their nested children."""
    if not (experiments or filter_string or run_ids):
        raise CompareError(
            "choose runs with --experiment NAME, --filter EXPR or --run ID; "
            f"experiments in {uri}: {_listing(_experiment_names(client))}"
        )
    selected: dict[str, Run] = {}
    if experiments or filter_string:
        if experiments:
            exp_ids = _experiment_ids(client, experiments, uri)
        else:
            exp_ids = [e.experiment_id for e in _experiments(client)]
        selected.update((r.info.run_id, r) for r in _search_runs(client, exp_ids, filter_string or ""))
    for run_id in run_ids:
        selected[run_id] = _get_run(client, run_id, uri)
    if include_children and selected:
        # One search per involved experiment finds every child; walk down from the chosen runs.
        everything = _search_runs(client, sorted({r.info.experiment_id for r in selected.values()}), "")
        children: dict[str, list[Run]] = defaultdict(list)
        for r in everything:
            if PARENT_TAG in r.data.tags:
                children[r.data.tags[PARENT_TAG]].append(r)
        queue = list(selected)
        while queue:
            for child in children[queue.pop()]:
                if child.info.run_id not in selected:
                    selected[child.info.run_id] = child
                    queue.append(child.info.run_id)
    if not selected:
        what = [f"experiments {', '.join(experiments)}" if experiments else "all experiments"]
        if filter_string:
            what.append(f"filter {filter_string!r}")
        raise CompareError(f"no runs match ({'; '.join(what)}) in {uri}")
    return _tree_order(list(selected.values()))


def _tree_order(runs: list[Run]) -> list[Run]:
    """Oldest first, each run followed by its own children (which are oldest first too)."""
    by_id = {r.info.run_id: r for r in runs}
    kids: dict[str | None, list[Run]] = defaultdict(list)
    for r in sorted(runs, key=lambda r: (r.info.start_time or 0, r.info.run_id)):
        parent = r.data.tags.get(PARENT_TAG)
        kids[parent if parent in by_id else None].append(r)
    ordered: list[Run] = []

    def visit(r: Run) -> None:
        ordered.append(r)
        for child in kids[r.info.run_id]:
            visit(child)

    for root in kids[None]:
        visit(root)
    return ordered


# ---------------------------------------------------------------- the table


def differing_params(runs: Sequence[Run]) -> list[str]:
    """Param keys whose value is not the same in every run, sorted.

    A key absent from a top-level run counts as a value of its own (a config field one run lacks is a
    difference). A nested child run that lacks its parent's keys does not: children log only their
    own params and inherit the rest, so counting those absences would list every parent param. A run
    with no params at all (an experiment's parent run) is left out of the comparison for the same reason.
    """
    runs = [r for r in runs if r.data.params]
    ids = {r.info.run_id for r in runs}
    is_child = [r.data.tags.get(PARENT_TAG) in ids for r in runs]
    keys = sorted({k for r in runs for k in r.data.params})

    def values(key: str) -> set[str | None]:
        return {
            r.data.params.get(key) for r, child in zip(runs, is_child) if key in r.data.params or not child
        }

    return [k for k in keys if len(values(k)) > 1]


def choose_metrics(runs: Sequence[Run], requested: Sequence[str]) -> list[str]:
    """The metric columns: the requested ones (each must exist in some run) or all but system/*."""
    available = sorted({k for r in runs for k in r.data.metrics})
    missing = [m for m in requested if m not in available]
    if missing:
        raise CompareError(
            f"no chosen run has metric {', '.join(map(repr, missing))}; their metrics: {_listing(available)}"
        )
    return list(dict.fromkeys(requested)) or [m for m in available if not m.startswith("system/")]


def resolve_agg(agg: str, metric: str) -> str:
    """`best` is the minimum of a loss and the maximum of anything else (accuracy, mAP, throughput)."""
    if agg == "best":
        return "min" if "loss" in metric.lower() else "max"
    return agg


def aggregate(client: MlflowClient, run: Run, metric: str, agg: str) -> float | None:
    """One number from a run's metric history; None if the run never logged it."""
    if metric not in run.data.metrics:
        return None
    how = resolve_agg(agg, metric)
    if how == "final":
        return run.data.metrics[metric]  # MLflow's latest value: highest step, then latest timestamp
    values = [m.value for m in client.get_metric_history(run.info.run_id, metric) if not math.isnan(m.value)]
    if not values:
        return math.nan
    return min(values) if how == "min" else max(values)


@dataclass
class Table:
    columns: list[str]
    rows: list[list[Cell]]
    # Full ids, row by row (the `id` column shows 8 characters outside csv); a group's row: its runs'
    # ids, space-separated (csv only).
    run_ids: list[str]
    kinds: list[str]  # per column: "run", "id", "parent", "n" (a group's size), "param" or "metric"
    grouped: bool = False  # rows are groups of seed replicas, metric cells MeanSE

    def column(self, name: str) -> int:
        # A metric column may be asked for by its bare name ("train/loss" for "train/loss [best]").
        for i, col in enumerate(self.columns):
            if name in (col, col.split(" [")[0]):
                return i
        raise CompareError(f"cannot sort by {name!r}: not a column; columns: {_listing(self.columns)}")


def build_table(client: MlflowClient, runs: Sequence[Run], metrics: Sequence[str], agg: str) -> Table:
    names = {r.info.run_id: r.info.run_name or r.info.run_id[:8] for r in runs}
    nested = any(PARENT_TAG in r.data.tags for r in runs)
    params = differing_params(runs)
    suffix = "" if agg == "final" else f" [{agg}]"
    columns = ["run", "id", *(["parent"] if nested else []), *params, *(m + suffix for m in metrics)]
    rows: list[list[Cell]] = []
    for r in runs:
        parent_id = r.data.tags.get(PARENT_TAG)
        parent = [names.get(parent_id, (parent_id or "")[:8]) or None] if nested else []
        row: list[Cell] = [names[r.info.run_id], r.info.run_id, *parent]
        row += [r.data.params.get(p) for p in params]
        row += [aggregate(client, r, m, agg) for m in metrics]
        rows.append(row)
    kinds = [*TEXT_COLUMNS[: 3 if nested else 2], *(["param"] * len(params)), *(["metric"] * len(metrics))]
    return Table(columns, rows, [r.info.run_id for r in runs], kinds)


def _sort_key(value: Cell) -> tuple:
    """Numbers (and numeric strings, e.g. params) by value, before text; used only on present cells.
    A mean over seeds sorts by the mean."""
    if isinstance(value, MeanSE):
        return (0, value.mean)
    if isinstance(value, float | int):
        return (0, value)
    try:
        return (0, float(value))
    except (TypeError, ValueError):
        return (1, str(value))


def sort_table(table: Table, column: str, descending: bool = False) -> Table:
    """Rows ordered by one column; runs without a value (or NaN) go last in either direction."""
    i = table.column(column)
    order = list(range(len(table.rows)))

    def absent(k: int) -> bool:
        v = table.rows[k][i]
        v = v.mean if isinstance(v, MeanSE) else v
        return v is None or (isinstance(v, float) and math.isnan(v))

    present = sorted(
        (k for k in order if not absent(k)), key=lambda k: _sort_key(table.rows[k][i]), reverse=descending
    )
    order = present + [k for k in order if absent(k)]
    return replace(table, rows=[table.rows[k] for k in order], run_ids=[table.run_ids[k] for k in order])


# ---------------------------------------------------------------- seed replicas: mean and standard error


@dataclass
class ReplicaGroup:
    """Runs that differ only in their seed (and name and output places): one configuration's replicas."""

    label: str  # the runs' name without the seed suffix (pretrain_s0 -> pretrain), or their names
    key: dict[str, str]  # the params that say what the runs computed (`replica_key`)
    runs: list[Run]


def _inherited_params(runs: Sequence[Run]) -> dict[str, dict[str, str]]:
    """Run id -> its params over those of its chosen ancestors: a nested child logs only its own."""
    by_id = {r.info.run_id: r for r in runs}
    out = {}
    for r in runs:
        chain: list[Run] = []
        node: Run | None = r
        while node is not None and node.info.run_id not in {c.info.run_id for c in chain}:
            chain.append(node)
            node = by_id.get(node.data.tags.get(PARENT_TAG))  # None past the first ancestor not chosen
        out[r.info.run_id] = {k: v for n in reversed(chain) for k, v in n.data.params.items()}
    return out


def replica_key(run_name: str, params: dict[str, str]) -> dict[str, str]:
    """What a run computed, the same for every seed's replica of it: its params without

    - `seed`;
    - the run's name (a param equal to it: `name`);
    - where the run writes: a path or URI param that holds the run's name as a path segment
      (run_dir RUNS/X_s0, checkpoint.uri s3://.../X_s0, the default tracking URI RUNS/X/mlflow.db);

    and in the other paths and URIs, what the run reads (init_from, teacher weights, data), a path
    segment ending in the run's replica suffix (`_s0` for seed 0: RUNS/pretrain_s0/export) ends in `_s*`
    instead, so that replicas reading their own seed's earlier stage agree and runs reading different
    stages do not.
    """
    seed = params.get(SEED_PARAM)
    suffix = None if seed is None else re.compile(re.escape(replica_name("", seed)) + r"(?=[/?#]|$)")
    key = {}
    for k, v in params.items():
        if k == SEED_PARAM or (run_name and v == run_name):
            continue
        if path_like(v):
            if run_name and run_name in re.split(r"[/?#]", v):
                continue
            if suffix is not None:
                v = suffix.sub(replica_name("", "*"), v)
        key[k] = v
    return key


def group_replicas(runs: Sequence[Run]) -> tuple[list[ReplicaGroup], list[Run]]:
    """The runs as groups of seed replicas (equal `replica_key`), in the order of their first run, and
    the runs left out: those without params (an experiment's parent run holds per-stage summaries)."""
    params = _inherited_params(runs)
    groups: dict[tuple, ReplicaGroup] = {}
    left_out = []
    for r in runs:
        if not params[r.info.run_id]:
            left_out.append(r)
            continue
        name = r.info.run_name or ""
        key = replica_key(name, params[r.info.run_id])
        group = groups.setdefault(tuple(sorted(key.items())), ReplicaGroup("", key, []))
        group.runs.append(r)
    for group in groups.values():
        group.label = ",".join(dict.fromkeys(_stage_name(r, params[r.info.run_id]) for r in group.runs))
    return list(groups.values()), left_out


def _stage_name(run: Run, params: dict[str, str]) -> str:
    """The run's name without its replica suffix: pretrain_s0 -> pretrain."""
    name = run.info.run_name or run.info.run_id[:8]
    seed = params.get(SEED_PARAM)
    return name if seed is None else name.removesuffix(replica_name("", seed)) or name


def mean_se(values: Sequence[float], size: int) -> MeanSE | None:
    """Mean and standard error of the mean (sample std, ddof 1, over sqrt(n)); no error for one value.
    A NaN or an infinity (a run that diverged) makes both NaN rather than being dropped."""
    n = len(values)
    if n == 0:
        return None
    if not all(math.isfinite(v) for v in values):
        return MeanSE(math.nan, math.nan if n > 1 else None, n, size)
    mean = math.fsum(values) / n
    se = math.sqrt(math.fsum((v - mean) ** 2 for v in values) / (n - 1) / n) if n > 1 else None
    return MeanSE(mean, se, n, size)


def build_group_table(
    client: MlflowClient, groups: Sequence[ReplicaGroup], metrics: Sequence[str], agg: str
) -> Table:
    """One row per group: its runs, n, the params that differ between groups, per metric the mean and
    standard error of the runs' values (each run's history reduced by `agg` first)."""
    keys = sorted({k for g in groups for k in g.key})
    params = [k for k in keys if len({g.key.get(k) for g in groups}) > 1]
    suffix = "" if agg == "final" else f" [{agg}]"
    columns = ["runs", "n", *params, *(m + suffix for m in metrics)]
    rows: list[list[Cell]] = []
    for g in groups:
        row: list[Cell] = [g.label, len(g.runs), *(g.key.get(p) for p in params)]
        for m in metrics:
            values = [aggregate(client, r, m, agg) for r in g.runs]
            row.append(mean_se([v for v in values if v is not None], len(g.runs)))
        rows.append(row)
    kinds = ["run", "n", *(["param"] * len(params)), *(["metric"] * len(metrics))]
    ids = [" ".join(r.info.run_id for r in g.runs) for g in groups]
    return Table(columns, rows, ids, kinds, grouped=True)


# ---------------------------------------------------------------- fitting a terminal

_URI = re.compile(r"^[A-Za-z][A-Za-z0-9+.-]*:(//|/)")  # s3://, gs://, file:///, sqlite:///, http://


def path_like(value: str) -> bool:
    """A filesystem path or URI: where something is, not what the run did."""
    return value.startswith(("/", "~", "./", "../", "pipe:")) or bool(_URI.match(value))


def _same_as_run_name(table: Table, i: int) -> bool:
    present = [row for row in table.rows if row[i] is not None]
    return bool(present) and all(row[i] == row[0] for row in present)


def _absent(value: Cell) -> bool:
    return value is None or value in ("None", "")


def locational_params(table: Table) -> list[int]:
    """Param columns that differ only in where things are (paths, URIs) or repeat the run's name."""
    out = []
    for i, kind in enumerate(table.kinds):
        if kind != "param":
            continue
        values = [str(row[i]) for row in table.rows if not _absent(row[i])]
        if (values and all(map(path_like, values))) or _same_as_run_name(table, i):
            out.append(i)
    return out


def _param_rank(key: str) -> tuple[int, str]:
    if key.startswith("derived."):
        return len(PARAM_PRIORITY) + 1, key
    ranks = [n for n, prefix in enumerate(PARAM_PRIORITY) if key == prefix or key.startswith(prefix)]
    return (ranks[0] if ranks else len(PARAM_PRIORITY)), key


def cut_cell(text: str, limit: int = MAX_CELL) -> str:
    return text if len(text) <= limit else text[: limit - 3] + "..."


def _select(table: Table, keep: Sequence[int]) -> Table:
    keep = sorted(keep)
    rows = [[row[i] for i in keep] for row in table.rows]
    return replace(
        table, columns=[table.columns[i] for i in keep], rows=rows, kinds=[table.kinds[i] for i in keep]
    )


def fit_table(table: Table, width: int | None, metrics_first: bool) -> tuple[Table, list[str], list[str]]:
    """The columns a reader needs: no locational params, and with `width`, what fits in it.

    Returns the table (cells cut to MAX_CELL when `width` is set), the locational params left out,
    and the other columns left out for want of room. The run, id and parent columns always stay; of
    the rest, the chosen metrics (`metrics_first`) or else the params (up to half the room) are offered
    a place first, the params in PARAM_PRIORITY order, each taken if it still fits. Columns keep their
    table order.
    """
    dropped = set(locational_params(table))
    locational = [table.columns[i] for i in sorted(dropped)]
    if width is None:
        return _select(table, [i for i in range(len(table.columns)) if i not in dropped]), locational, []
    cut_rows = [[cut_cell(v) if isinstance(v, str) else v for v in row] for row in table.rows]
    table = replace(table, rows=cut_rows)

    def col_width(i: int) -> int:
        return max([len(table.columns[i]), *(len(_text(row[i], table.columns[i])) for row in table.rows)])

    keep = [i for i, kind in enumerate(table.kinds) if kind in (*TEXT_COLUMNS, "n")]
    used = sum(col_width(i) for i in keep) + 2 * (len(keep) - 1)
    metrics = [i for i, kind in enumerate(table.kinds) if kind == "metric"]
    params = sorted(
        (i for i, kind in enumerate(table.kinds) if kind == "param" and i not in dropped),
        key=lambda i: _param_rank(table.columns[i]),
    )
    # Without --metric every metric is a column: the params get at most half the room left, so that
    # some metrics show too, then the metrics, then the params again with whatever is left.
    rounds = [(metrics, width), (params, width)]
    if not metrics_first:
        rounds = [(params, used + (width - used) // 2), (metrics, width), (params, width)]
    for columns, limit in rounds:
        for i in columns:
            if i not in keep and used + 2 + col_width(i) <= limit:
                keep.append(i)
                used += 2 + col_width(i)
    left_out = [table.columns[i] for i in params + metrics if i not in keep]
    return _select(table, keep), locational, left_out


def left_out_note(locational: Sequence[str], left_out: Sequence[str], width: int | None) -> str:
    """A note naming the columns a fitted table does not show, wrapped to the width ("" if none)."""
    parts = []
    if locational:
        parts.append(f"path/URI or run-name params {_listing(list(locational))}")
    if left_out:
        columns = f"{len(left_out)} column{'s' * (len(left_out) != 1)}"
        parts.append(f"{columns} beyond {width} characters: {_listing(list(left_out))}")
    if not parts:
        return ""
    note = f"not shown (--wide shows every column): {'; '.join(parts)}"
    return textwrap.fill(note, width or TABLE_WIDTH, subsequent_indent="  ", break_on_hyphens=False)


# ---------------------------------------------------------------- rendering


def _text(value: Cell, column: str) -> str:
    if value is None:
        return MISSING
    if isinstance(value, MeanSE):
        return _mean_se_text(value)
    if column == "id":
        return str(value)[:8]
    if isinstance(value, float):
        return str(int(value)) if value.is_integer() and abs(value) < 1e15 else f"{value:.6g}"
    return str(value)


def _mean_se_text(value: MeanSE) -> str:
    """`0.853 ± 0.012`: the error to two significant digits and the mean to the same decimal place;
    `± -` for one run (no error); `(n=2)` when not every run of the group has the metric."""
    mean, se = value.mean, value.se
    if se is None or not (math.isfinite(mean) and math.isfinite(se)):
        text = f"{_text(mean, '')} ± {MISSING}"  # one run, or a NaN (a diverged run) in the mean
    elif se == 0:
        text = f"{_text(mean, '')} ± 0"
    else:
        decimals = min(15, max(0, 1 - math.floor(math.log10(se))))
        text = f"{mean:.{decimals}f} ± {se:.{decimals}f}"
    return text if value.n == value.size else f"{text} (n={value.n})"


TEXT_COLUMNS = ("run", "id", "parent", "runs")  # left-aligned even when a name or hex id parses as a number


def _numeric(column: str, values: Sequence[Cell]) -> bool:
    present = [v for v in values if v is not None]
    return column not in TEXT_COLUMNS and bool(present) and all(_sort_key(v)[0] == 0 for v in present)


def render_table(table: Table) -> str:
    """Aligned plain text for a terminal: numbers (and means ± errors) right-aligned, text left-aligned."""
    cells = [[_text(v, c) for v, c in zip(row, table.columns)] for row in table.rows]
    cols = list(zip(*cells)) if cells else [() for _ in table.columns]
    widths = [max([len(h), *map(len, col)]) for h, col in zip(table.columns, cols)]
    right = [_numeric(h, [row[i] for row in table.rows]) for i, h in enumerate(table.columns)]

    def line(items: Sequence[str]) -> str:
        return "  ".join(s.rjust(w) if r else s.ljust(w) for s, w, r in zip(items, widths, right)).rstrip()

    return "\n".join([line(table.columns), line(["-" * w for w in widths]), *map(line, cells)])


def render_markdown(table: Table) -> str:
    cells = [[_text(v, c).replace("|", r"\|") for v, c in zip(row, table.columns)] for row in table.rows]
    numeric = [_numeric(h, [row[i] for row in table.rows]) for i, h in enumerate(table.columns)]
    align = ["---:" if right else "---" for right in numeric]
    rows = [table.columns, align, *cells]
    return "\n".join("| " + " | ".join(r) + " |" for r in rows)


def _csv_value(value: Cell) -> str | int:
    return "" if value is None else repr(value) if isinstance(value, float) else value


def render_csv(table: Table) -> str:
    """Full run ids and full-precision numbers; an absent value is an empty field. A grouped table has
    three columns per metric, METRIC (the mean), METRIC_se and METRIC_n (runs in the mean), and the
    group's run ids last."""
    if table.grouped:
        return _render_grouped_csv(table)
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow(table.columns)
    for row, run_id in zip(table.rows, table.run_ids):
        out = [_csv_value(v) for v in row]
        out[table.columns.index("id")] = run_id
        writer.writerow(out)
    return buf.getvalue().rstrip("\n")


def _render_grouped_csv(table: Table) -> str:
    def with_suffix(column: str, suffix: str) -> str:  # "eval/map [best]" -> "eval/map_se [best]"
        name, sep, agg = column.partition(" [")
        return f"{name}{suffix}{sep}{agg}"

    header: list[str] = []
    for column, kind in zip(table.columns, table.kinds):
        extra = [with_suffix(column, "_se"), with_suffix(column, "_n")] if kind == "metric" else []
        header += [column, *extra]
    buf = io.StringIO()
    writer = csv.writer(buf, lineterminator="\n")
    writer.writerow([*header, "run_ids"])
    for row, run_ids in zip(table.rows, table.run_ids):
        out: list[str | int] = []
        for value, kind in zip(row, table.kinds):
            if kind != "metric":
                out.append(_csv_value(value))
            elif value is None:
                out += ["", "", 0]
            else:
                out += [_csv_value(value.mean), _csv_value(value.se), value.n]
        writer.writerow([*out, run_ids])
    return buf.getvalue().rstrip("\n")


RENDERERS: dict[str, Callable[[Table], str]] = {
    "table": render_table,
    "markdown": render_markdown,
    "csv": render_csv,
}


# ---------------------------------------------------------------- the plot


def plot_metric(client: MlflowClient, runs: Sequence[Run], metric: str, out: Path, title: str = "") -> int:
    """One line per run of `metric` against step, legend by run name; returns the number of lines."""
    from matplotlib.figure import Figure  # no pyplot: no global backend state, works headless

    names = [r.info.run_name or r.info.run_id[:8] for r in runs]
    fig = Figure(figsize=(8, 4.8), dpi=120)
    ax = fig.add_subplot()
    lines = 0
    for r, name in zip(runs, names):
        if metric not in r.data.metrics:
            continue
        history = sorted(
            client.get_metric_history(r.info.run_id, metric), key=lambda m: (m.step, m.timestamp)
        )
        by_step = {m.step: m.value for m in history}  # last write wins per step, as MLflow's "latest"
        steps = sorted(by_step)
        label = name if names.count(name) == 1 else f"{name} ({r.info.run_id[:8]})"
        ax.plot(
            steps,
            [by_step[s] for s in steps],
            label=label,
            linewidth=1.5,
            marker="o" if len(steps) <= 30 else None,
            markersize=3,
        )
        lines += 1
    ax.set_xlabel("step")
    ax.set_ylabel(metric)
    ax.set_title(title or metric)
    ax.grid(True, alpha=0.3)
    ax.legend(fontsize="small", loc="best")
    fig.tight_layout()
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out)
    return lines


# ---------------------------------------------------------------- entry points


def add_compare_parser(sub) -> argparse.ArgumentParser:
    """`vitpipe compare`'s arguments; `pipeline.cli` adds them to the vitpipe command."""
    p = sub.add_parser(
        "compare",
        help="compare MLflow runs: the params that differ, metrics, curves",
        description="Compare MLflow runs chosen by experiment, filter or id (nested child runs included): "
        "a table of the params that differ and of metrics; with --plot, also a figure of one metric against step. "
        "Store: --tracking-uri, else $MLFLOW_TRACKING_URI, else runs/<experiment>/mlflow.db or the only "
        "runs/*/mlflow.db (where `vitpipe train` writes by default). The table fits --width columns "
        "without the params that are paths or URIs; --wide shows every column.",
    )
    p.add_argument(
        "--tracking-uri", metavar="URI", help="MLflow tracking URI, e.g. sqlite:///runs/smoke/mlflow.db"
    )
    p.add_argument(
        "--experiment", action="append", default=[], metavar="NAME", help="experiment name (repeatable)"
    )
    p.add_argument(
        "--filter", metavar="EXPR", help="MLflow search filter, e.g. \"params.optim.lr = '0.001'\""
    )
    p.add_argument("--run", action="append", default=[], metavar="ID", help="run id (repeatable)")
    p.add_argument("--no-children", action="store_true", help="leave out nested child runs")
    p.add_argument(
        "--metric",
        action="append",
        default=[],
        metavar="NAME",
        help="metric column (repeatable); default every metric but system/*",
    )
    p.add_argument(
        "--agg",
        choices=AGGREGATIONS,
        default="final",
        help="value per run: final step, min, max, or best (min for *loss*, else max); default final",
    )
    p.add_argument(
        "--over-seeds",
        action="store_true",
        help="one row per configuration: runs equal but for seed, name and output paths (an experiment's "
        "seeds: replicas X_s0, X_s1, ...) grouped, each metric as mean ± standard error, with n",
    )
    p.add_argument("--sort", metavar="COLUMN", help="sort rows by this metric (or param) column")
    p.add_argument("--desc", action="store_true", help="sort in descending order")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format")
    p.add_argument(
        "--width",
        type=int,
        default=TABLE_WIDTH,
        metavar="COLS",
        help=f"characters the plain table fits (default {TABLE_WIDTH})",
    )
    p.add_argument(
        "--wide", action="store_true", help="every differing param and metric, cells in full (csv always is)"
    )
    p.add_argument("--plot", metavar="METRIC", help="also plot this metric against step, one line per run")
    p.add_argument("--out", metavar="FILE.png", help="where --plot writes the figure")
    p.set_defaults(func=run)
    return p


def run(args: argparse.Namespace) -> int:
    """The `vitpipe compare` handler (arguments from `add_compare_parser`)."""
    from mlflow.exceptions import MlflowException  # MLflow takes seconds to import; only here and below

    try:
        if args.plot and not args.out:
            raise CompareError("--plot needs --out FILE.png")
        uri = resolve_tracking_uri(args.tracking_uri, args.experiment)
        client = open_client(uri)
        runs = select_runs(client, uri, args.experiment, args.filter, args.run, not args.no_children)
        notes = []
        if args.over_seeds:
            groups, without_params = group_replicas(runs)
            if without_params:
                names = [r.info.run_name or r.info.run_id[:8] for r in without_params]
                note = f"not grouped (no params, e.g. an experiment's parent run): {_listing(names)}"
                notes.append(textwrap.fill(note, args.width, subsequent_indent="  ", break_on_hyphens=False))
            if not groups:
                raise CompareError("--over-seeds: no chosen run has params to group by")
            runs = [r for g in groups for r in g.runs]
        metrics = choose_metrics(runs, args.metric)
        if args.plot:
            choose_metrics(runs, [args.plot])  # the same one-line error when no run has it
        if args.over_seeds:
            table = build_group_table(client, groups, metrics, args.agg)
        else:
            table = build_table(client, runs, metrics, args.agg)
        if args.sort:
            table = sort_table(table, args.sort, args.desc)
        if not args.wide and args.format != "csv":
            width = args.width if args.format == "table" else None
            table, locational, left_out = fit_table(table, width, metrics_first=bool(args.metric))
            notes.append(left_out_note(locational, left_out, width))
        print(RENDERERS[args.format](table))
        for note in filter(None, notes):
            print(note, file=sys.stderr)
        if args.plot:
            title = f"{args.plot} ({', '.join(args.experiment)})" if args.experiment else args.plot
            n = plot_metric(client, runs, args.plot, Path(args.out), title)
            print(f"wrote {args.out}: {args.plot} of {n} run{'s' * (n != 1)}", file=sys.stderr)
    except CompareError as exc:
        print(f"vitpipe compare: {exc}", file=sys.stderr)
        return 2
    except MlflowException as exc:  # a malformed filter, an unreachable server: MLflow's own words
        print(f"vitpipe compare: {str(exc.message).splitlines()[0]}", file=sys.stderr)
        return 2
    return 0


def main(argv: Sequence[str] | None = None) -> int:
    """`python -m pipeline.compare ARGS` (the same arguments as `vitpipe compare ARGS`)."""
    parser = argparse.ArgumentParser(prog="vitpipe")
    add_compare_parser(parser.add_subparsers(dest="command", required=True))
    args = parser.parse_args(["compare", *(sys.argv[1:] if argv is None else argv)])
    return run(args)


if __name__ == "__main__":
    sys.exit(main())
