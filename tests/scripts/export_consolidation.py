"""Run under torchrun (2 ranks): for each ZeRO stage, a short stage whose export is assembled in memory
(`consolidated_state_dict`); rank 0 then compares it with DeepSpeed's zero_to_fp32 over the checkpoint.

    torchrun --nproc-per-node 2 tests/scripts/export_consolidation.py OUT_JSON DATA_DIR RUN_ROOT STAGES...

Rank 0 writes {stage: {"keys": n, "max_abs_diff": d, "missing": [...], "unexpected": [...]}}.
"""

import json
import sys
from pathlib import Path

import torch.distributed as dist
from deepspeed.utils.zero_to_fp32 import get_fp32_state_dict_from_zero_checkpoint

from pipeline.config import load_config
from pipeline.distributed import shutdown_distributed
from pipeline.exported import load_exported
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"


def main() -> None:
    out, data, root, stages = (
        Path(sys.argv[1]),
        sys.argv[2],
        Path(sys.argv[3]),
        [int(s) for s in sys.argv[4:]],
    )
    report = {}
    for stage in stages:
        run_dir = root / f"zero{stage}"
        overrides = [
            f"run_dir={run_dir}",
            f"data.train={data}",
            "cluster.launcher=local",
            f"deepspeed.zero_stage={stage}",
            "optim.steps=4",
            "optim.warmup_steps=1",
            "data.num_workers=1",
            "tracking.system_metrics=false",
        ]
        result = train(load_config(SMOKE, overrides))
        if dist.get_rank() == 0:
            exported, _ = load_exported(result.export)
            on_disk = get_fp32_state_dict_from_zero_checkpoint(
                str(run_dir / "checkpoints"), tag=Path(result.checkpoint).name
            )
            common = exported.keys() & on_disk.keys()
            report[stage] = {
                "keys": len(common),
                "max_abs_diff": max(
                    float((exported[k].float() - on_disk[k].float()).abs().max()) for k in common
                ),
                "missing": sorted(on_disk.keys() - exported.keys()),
                "unexpected": sorted(exported.keys() - on_disk.keys()),
            }
        dist.barrier()
    if dist.get_rank() == 0:
        out.write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    shutdown_distributed()
