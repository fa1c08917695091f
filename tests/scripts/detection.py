"""Run under torchrun (2 ranks): MAE pretraining at 32 px, then SETR segmentation from its encoder at 48 px
(position embeddings resampled) under each ZeRO stage given, then the eval stage of the last one's export.

torchrun --standalone --nproc-per-node 2 tests/scripts/segmentation.py OUT_DIR DATA_DIR ZERO_STAGE...

Every stage logs to OUT_DIR/mlflow.db; the test reads the losses, eval.json and the figure.
"""

import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.eval.run import evaluate
from pipeline.train.engine import shutdown_distributed
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"
DET_STEPS = 30


def common(out: Path, data: str, name: str) -> list[str]:
    return [
        f"name={name}",
        f"run_dir={out}/{name}",
        f"data.train={data}",
        "data.synthetic=null",  # the dataset is given
        "cluster.launcher=local",
        "tracking.system_metrics=false",
        f"tracking.uri=sqlite:///{out}/mlflow.db",  # one store for every run (new stores cost ~4 s each)
        "deepspeed.precision=fp32",
    ]


def main() -> None:
    out, data, zero_stages = Path(sys.argv[1]), sys.argv[2], [int(z) for z in sys.argv[3:]]
    pretrain = [
        *common(out, data, "mae"),
        "model.name=mae_vit_debug",
        "model.img_size=32",
        "objective.name=mae",
        "optim.steps=10",
        "optim.lr=0.05",
        "deepspeed.zero_stage=2",
    ]
    train(load_config(SMOKE, pretrain))
    segment = [
        "model.name=setr_pup_vit_debug",
        "model.img_size=48",
        f"model.init_from={out}/mae/export",
        "objective.name=segmentation",
        "data.min_scale=0.5",
        f"optim.steps={DET_STEPS}",
        "optim.warmup_steps=3",
        "optim.lr=0.05",
    ]
    for zero in zero_stages:
        train(
            load_config(
                SMOKE, [*common(out, data, f"det_zero{zero}"), *segment, f"deepspeed.zero_stage={zero}"]
            )
        )
    last = zero_stages[-1]
    evaluate(
        load_config(
            SMOKE,
            [
                *common(out, data, "det_eval"),
                *segment,
                "kind=eval",
                f"model.init_from={out}/det_zero{last}/export",
                "model.init_head=true",
                "eval.eval_split=val",
                "eval.batch_size=16",
            ],
        )
    )


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
