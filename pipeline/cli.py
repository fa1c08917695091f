"""Arguments of the pipeline's sub-commands: `vitpipe train` here, `vitpipe compare` from its module."""

from __future__ import annotations

import argparse

from pipeline.compare import add_compare_parser  # stdlib only at import: MLflow loads when compare runs

__all__ = ["add_compare_parser", "add_train_parser"]


def add_train_parser(sub) -> argparse.ArgumentParser:
    p = sub.add_parser(
        "train",
        help="run one training stage from an experiment config",
        description="Run one training stage. Overrides are dotted KEY=VALUE pairs, e.g. optim.steps=100 "
        "cluster.num_workers=2. cluster.launcher picks Ray Train workers (ray) or this process (local).",
    )
    p.add_argument("config", help="experiment YAML, e.g. configs/experiments/smoke.yaml")
    p.add_argument("overrides", nargs="*", metavar="KEY=VALUE", help="dotted config overrides")
    return p
