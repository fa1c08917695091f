"""Run under torchrun: one side of a resume on another world size, for each ZeRO stage given.

    torchrun --nproc-per-node 2 tests/scripts/world_size.py save OUT DATA STAGES...    # straight, and stop at 4
    torchrun --nproc-per-node 1 tests/scripts/world_size.py resume OUT DATA STAGES... [KEY=VALUE...]  # reshard at 4, go on to 8
    torchrun --nproc-per-node N tests/scripts/world_size.py go OUT DATA STAGES... [KEY=VALUE...]  # OUT/zeroS/go, started or resumed

`save` runs OUT/zeroS/switch (stopped at step 4), and for the first stage given OUT/zeroS/straight (8 steps
uninterrupted: the loss the switched run is compared with). `resume` resumes
OUT/zeroS/at4 (the test's copy of the stopped run) with optim.steps=4: it loads the resharded step 4 and
saves and exports it at once, on this world size; then it resumes OUT/zeroS/switch to step 8.
"""

import sys
from pathlib import Path

from smoke_run import smoke_run

from pipeline.distributed import shutdown_distributed


def run(out: Path, data: str, stage: int, name: str, *extra: str) -> None:
    smoke_run(
        out / f"zero{stage}" / name, data, out, f"deepspeed.zero_stage={stage}", "optim.ema_decay=0.9", *extra
    )


def main() -> None:
    mode, out, data, rest = sys.argv[1], Path(sys.argv[2]), sys.argv[3], sys.argv[4:]
    stages = [int(a) for a in rest if a.isdigit()]
    extra = [a for a in rest if not a.isdigit()]  # overrides for every run
    for stage in stages:
        if mode == "go":
            run(out, data, stage, "go", *extra)
            continue
        if mode == "save":
            if stage == stages[0]:
                run(out, data, stage, "straight", *extra)
            run(out, data, stage, "switch", "debug.stop_at_step=4", *extra)
            continue
        run(out, data, stage, "at4", "optim.steps=4", *extra)
        run(out, data, stage, "switch", *extra)


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
