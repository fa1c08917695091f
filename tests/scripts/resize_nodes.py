"""One phase of a stage that changes size, each node on its own disk (bind-mounted over RUN_ROOT) and the
bucket the only shared store of checkpoints:

    torchrun --nnodes N ... tests/scripts/resize_nodes.py RUN_ROOT DATA_DIR OUT_DIR CHECKPOINT_URI [KEY=VALUE...]

RUN_ROOT/job: ZeRO-3, 8 steps, checkpoints to CHECKPOINT_URI; the overrides say where this phase stops.
"""

import logging
import sys
from pathlib import Path

from smoke_run import smoke_run

from pipeline.distributed import shutdown_distributed


def main() -> None:
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    for name in (
        "pipeline.train.checkpoint",
        "pipeline.train.transfer",
        "pipeline.train.loop",
    ):  # what each node read from the bucket
        logging.getLogger(name).setLevel(logging.INFO)
    root, data, out, uri, extra = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), sys.argv[4], sys.argv[5:]
    # OUT_DIR (MLflow) is shared; rank 0 alone writes it
    smoke_run(
        root / "job",
        data,
        out,
        "deepspeed.zero_stage=3",
        "optim.ema_decay=0.9",
        f"checkpoint.uri={uri}",
        *extra,
    )
    shutdown_distributed()


if __name__ == "__main__":
    main()
