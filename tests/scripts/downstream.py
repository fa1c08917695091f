"""Run under torchrun (2 ranks): MAE pretraining at 32 px, then a dense downstream task from its encoder at
48 px (position embeddings resampled) under each ZeRO stage given, then the eval stage of the last one's
export. TASK: segmentation (SETR-PUP; runs seg_zeroN, seg_eval) or detection (DETR; det_zeroN, det_eval, and
det_resumed: the last ZeRO stage's run stopped halfway and resumed).

torchrun --standalone --nproc-per-node 2 tests/scripts/downstream.py TASK OUT_DIR DATA_DIR ZERO_STAGE...

Every training stage keeps a weight EMA (exported beside its weights; MAE's as a plain ViT encoder). Every
stage logs to OUT_DIR/mlflow.db; the test reads the losses, eval.json and the figure.
"""

import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.distributed import shutdown_distributed
from pipeline.eval.run import evaluate
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"
STEPS = 30
TASKS = {  # objective -> (model, run name prefix)
    "segmentation": ("setr_pup_vit_debug", "seg"),
    "detection": ("detr_vit_debug", "det"),
}


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
        "optim.ema_decay=0.8",  # exported beside the weights: the eval stage evaluates both
    ]


def main() -> None:
    task, out, data = sys.argv[1], Path(sys.argv[2]), sys.argv[3]
    zero_stages = [int(z) for z in sys.argv[4:]]
    model, prefix = TASKS[task]
    pretrain = [
        *common(out, data, "mae"),
        "model.name=mae_vit_debug",
        "model.img_size=32",
        "objective.name=mae",
        "optim.steps=10",
        "optim.base_lr=0.05",
        "deepspeed.zero_stage=2",
    ]
    train(load_config(SMOKE, pretrain))
    downstream = [
        f"model.name={model}",
        "model.img_size=48",
        f"model.init_from={out}/mae/export",
        f"objective.name={task}",
        "data.min_scale=0.5",
        f"optim.steps={STEPS}",
        "optim.warmup_steps=3",
        "optim.base_lr=0.05",
    ]
    for zero in zero_stages:
        train(
            load_config(
                SMOKE,
                [*common(out, data, f"{prefix}_zero{zero}"), *downstream, f"deepspeed.zero_stage={zero}"],
            )
        )
    last = zero_stages[-1]
    if task == "detection":  # stopped halfway and resumed under the last ZeRO stage: {prefix}_resumed
        resumed = [*common(out, data, f"{prefix}_resumed"), *downstream, f"deepspeed.zero_stage={last}"]
        train(load_config(SMOKE, [*resumed, f"debug.stop_at_step={STEPS // 2}"]))
        train(load_config(SMOKE, resumed))
    evaluate(
        load_config(
            SMOKE,
            [
                *common(out, data, f"{prefix}_eval"),
                *downstream,
                "kind=eval",
                f"model.init_from={out}/{prefix}_zero{last}/export",
                "model.init_head=true",
                "eval.eval_split=val",
                "eval.batch_size=16",
            ],
        )
    )


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
