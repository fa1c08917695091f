"""One phase of a stage that changes size, each node on its own disk (bind-mounted over RUN_ROOT) and the
bucket the only shared store of checkpoints:

    torchrun --nnodes N ... tests/scripts/resize_nodes.py RUN_ROOT DATA_DIR OUT_DIR CHECKPOINT_URI [KEY=VALUE...]

RUN_ROOT/job: ZeRO-3, 8 steps, checkpoints to CHECKPOINT_URI; the overrides say where this phase stops.
"""

import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.train.engine import shutdown_distributed
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"


def main() -> None:
    root, data, out, uri, extra = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5:]
    overrides = [
        f"run_dir={root}/job",
        f"data.train={data}",
        "cluster.launcher=local",
        "deepspeed.zero_stage=3",
        "optim.steps=8",
        "optim.warmup_steps=2",
        "data.num_workers=1",
        "tracking.system_metrics=false",
        f"tracking.uri=sqlite:///{out}/mlflow.db",  # OUT_DIR is shared; rank 0 alone writes it
        f"checkpoint.uri={uri}",
        *extra,
    ]
    train(load_config(SMOKE, overrides))
    shutdown_distributed()


if __name__ == "__main__":
    main()
