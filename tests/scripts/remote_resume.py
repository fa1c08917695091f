"""Run under torchrun (2 ranks): checkpoints on object storage survive the loss of the local run directory.

    torchrun --nproc-per-node 2 tests/scripts/remote_resume.py OUT_DIR DATA_DIR STORE_URI

OUT_DIR/straight: 8 uninterrupted steps, local checkpoints only, with a weight EMA (as both runs). OUT_DIR/remote: the same run with
checkpoint.uri=STORE_URI, stopped at step 4; its local run directory is then deleted (a new machine)
and the run is started again, which must resume from the stored step 4 and continue its MLflow run.
"""

import os
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from smoke_run import smoke_run

from pipeline.distributed import shutdown_distributed


def run(out: Path, data: str, name: str, *extra: str) -> None:
    smoke_run(out / name, data, out, "deepspeed.zero_stage=2", "optim.ema_decay=0.9", *extra)


def main() -> None:
    out, data, uri = Path(sys.argv[1]), sys.argv[2], sys.argv[3]
    run(out, data, "straight")
    run(out, data, "remote", f"checkpoint.uri={uri}", "debug.stop_at_step=4")
    dist.barrier()
    if int(os.environ["RANK"]) == 0:
        # The machine that saved step 4 is gone, and its disk with it: checkpoints, and the run-id file
        # (the resumed stage finds its MLflow run by the checkpoint URI it is tagged with).
        shutil.rmtree(out / "remote")
    dist.barrier()
    run(out, data, "remote", f"checkpoint.uri={uri}")


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
