"""Run eval stages in this process group: one per config, each into OUT_DIR/<config stem>.

    torchrun --standalone --nproc-per-node 2 tests/scripts/eval_stage.py OUT_DIR CONFIG.yaml [CONFIG.yaml ...]

tests/test_eval_stage.py runs it with 1 and 2 ranks and compares the eval.json files it leaves.
"""

import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.distributed import shutdown_distributed
from pipeline.eval.run import evaluate


def main() -> None:
    out = Path(sys.argv[1])
    for config in map(Path, sys.argv[2:]):
        evaluate(load_config(config, [f"run_dir={out / config.stem}"]))


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
