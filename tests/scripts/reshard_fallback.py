"""tests/scripts/world_size.py with rank 1 finding the saved optimizer layout unknown (as under another
DeepSpeed version): the resume must fall back to DeepSpeed's universal conversion on every rank.

    torchrun --nproc-per-node 2 tests/scripts/reshard_fallback.py resume OUT DATA STAGES...
"""

import logging
import os

import world_size

from pipeline.distributed import shutdown_distributed
from pipeline.train import reshard

planned = reshard.plan


def plan(engine, tag_dir, record, store):
    if os.environ.get("RANK") == "1":
        raise reshard.LayoutMismatch(f"{tag_dir}: a layout this test calls unknown")
    return planned(engine, tag_dir, record, store)


if __name__ == "__main__":
    logging.basicConfig(format="%(levelname)s %(name)s: %(message)s")
    reshard.plan = plan
    world_size.main()
    shutdown_distributed()
