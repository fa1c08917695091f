"""Run under a two-node torchrun (one rank per node), each node in its own mount namespace with its own disk
bind-mounted over RUN_ROOT: checkpoints of ranks that share no disk.

    torchrun --nnodes 2 --node-rank K ... tests/scripts/two_nodes.py RUN_ROOT DATA_DIR OUT_DIR

RUN_ROOT/straight: 8 uninterrupted steps (ZeRO-3). RUN_ROOT/resumed: the same run stopped at step 6; then
node 1 loses its copy of step 6 (its disk only), and the run is started again: both ranks must agree on
step 4, the newest checkpoint every node holds, and end with the straight run's weights. OUT_DIR (shared)
gets, per rank, the checkpoint tags its own disk held after each phase.
"""

import json
import shutil
import sys
from pathlib import Path

import torch.distributed as dist
from smoke_run import smoke_run

from pipeline.distributed import shutdown_distributed


def run(root: Path, data: str, out: Path, name: str, *extra: str):
    # MLflow in OUT_DIR: rank 0 only writes it; OUT_DIR is shared
    overrides = ["deepspeed.zero_stage=3", "checkpoint.every_steps=2", "checkpoint.keep_last=2", *extra]
    return smoke_run(root / name, data, out, *overrides)


def tags(root: Path, name: str) -> list[str]:
    return sorted(p.name for p in (root / name / "checkpoints").glob("step_*"))


def main() -> None:
    root, data, out = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3])
    run(root, data, out, "straight")
    rank = dist.get_rank()
    seen = {"straight": tags(root, "straight")}
    run(root, data, out, "resumed", "debug.stop_at_step=6")
    seen["stopped"] = tags(root, "resumed")
    if rank == 1:  # this node's disk loses the newest checkpoint; node 0 still holds it
        shutil.rmtree(root / "resumed" / "checkpoints" / "step_00000006")
    dist.barrier()
    result = run(root, data, out, "resumed")
    seen["resumed"] = tags(root, "resumed")
    seen["losses"] = result.losses
    (out / f"rank{rank}.json").write_text(json.dumps(seen))
    shutdown_distributed()


if __name__ == "__main__":
    main()
