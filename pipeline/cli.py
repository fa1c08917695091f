"""Arguments of the pipeline's sub-commands (`vitpipe train`)."""

from __future__ import annotations

import argparse


def add_train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="run one training stage from an experiment config",
        description="Run one training stage. Overrides are dotted KEY=VALUE pairs, e.g. optim.lr=3e-4 "
        "cluster.num_workers=2. cluster.launcher picks Ray Train workers (ray) or this process (local).",
    )
    p.add_argument("config", help="experiment YAML, e.g. configs/experiments/smoke.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return p


def _compare(args: argparse.Namespace) -> int:
    from pipeline.compare import run  # imported here: MLflow takes seconds to import, other commands skip it

    return run(args)


def add_compare_parser(sub) -> argparse.ArgumentParser:
    from pipeline.compare import AGGREGATIONS, FORMATS  # stdlib only at import; MLflow loads in run()

    p = sub.add_parser(
        "compare",
        help="compare MLflow runs: the params that differ, metrics, curves",
        description="Compare MLflow runs chosen by experiment, filter or id (nested child runs included): "
        "a table of the params that differ and of metrics; with --plot, also a figure of one metric against step. "
        "Store: --tracking-uri, else $MLFLOW_TRACKING_URI, else runs/<experiment>/mlflow.db or the only "
        "runs/*/mlflow.db (where `vitpipe train` writes by default).",
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
        "--metric", action="append", default=[], metavar="NAME",
        help="metric column (repeatable); default every metric but system/*",
    )  # fmt: skip
    p.add_argument(
        "--agg", choices=AGGREGATIONS, default="final",
        help="value per run: final step, min, max, or best (min for *loss*, else max); default final",
    )  # fmt: skip
    p.add_argument("--sort", metavar="COLUMN", help="sort rows by this metric (or param) column")
    p.add_argument("--desc", action="store_true", help="sort in descending order")
    p.add_argument("--format", choices=FORMATS, default="table", help="output format")
    p.add_argument("--plot", metavar="METRIC", help="also plot this metric against step, one line per run")
    p.add_argument("--out", metavar="FILE.png", help="where --plot writes the figure")
    p.set_defaults(func=_compare)
    return p
