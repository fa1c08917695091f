"""Run under torchrun (2 ranks): for each ZeRO stage, an uninterrupted run, a run stopped at step K and
resumed, and the same with the optimizer state dropped at resume (the negative control).

    torchrun --nproc-per-node 2 tests/scripts/resume_exactness.py OUT_DIR DATA_DIR STAGES...

Writes nothing itself: each run leaves its MLflow store and exported weights under OUT_DIR/zeroS/NAME.
"""

import sys
from pathlib import Path

from smoke_run import smoke_run

from pipeline.distributed import shutdown_distributed


def run(out: Path, data: str, stage: int, name: str, *extra: str) -> None:
    overrides = [
        f"deepspeed.zero_stage={stage}",
        "model.overrides.drop_path_rate=0.1",
        "optim.ema_decay=0.9",  # its share is checkpointed: the resumed EMA is the uninterrupted one
        *extra,
    ]
    smoke_run(out / f"zero{stage}" / name, data, out, *overrides)


def main() -> None:
    out, data, stages = Path(sys.argv[1]), sys.argv[2], [int(s) for s in sys.argv[3:]]
    for stage in stages:
        run(out, data, stage, "straight")
        run(out, data, stage, "resumed", "debug.stop_at_step=4")
        run(out, data, stage, "resumed")
        run(out, data, stage, "no_optimizer", "debug.stop_at_step=4")
        run(out, data, stage, "no_optimizer", "debug.resume_optimizer=false")


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
