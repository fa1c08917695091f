"""What the torchrun test scripts share: a short run of the smoke config on the local launcher (8 steps, 2 of
warm-up, one loader worker, no system metrics, MLflow in MLFLOW_DIR/mlflow.db)."""

from pathlib import Path

from pipeline.config import load_config
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"


def smoke_run(run_dir: Path, data: str, mlflow_dir: Path, *extra: str):
    """Train the smoke config into RUN_DIR on DATA; EXTRA overrides come last, so they win."""
    overrides = [
        f"run_dir={run_dir}",
        f"data.train={data}",
        "cluster.launcher=local",
        "optim.steps=8",
        "optim.warmup_steps=2",
        "data.num_workers=1",
        "tracking.system_metrics=false",
        f"tracking.uri=sqlite:///{mlflow_dir}/mlflow.db",
        *extra,
    ]
    return train(load_config(SMOKE, overrides))
