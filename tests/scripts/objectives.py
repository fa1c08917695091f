"""Run under torchrun (2 ranks): train a tiny model with each objective; the test reads MLflow.

torchrun --standalone --nproc-per-node 2 tests/scripts/objectives.py OUT_DIR DATA_DIR OBJECTIVE...
"""

import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"

PER_OBJECTIVE = {
    "supervised_softmax": ["objective.label_smoothing=0.1", "objective.mixup_alpha=0.8", "objective.cutmix_alpha=1.0",
                           "optim.lr=0.05"],
    "supervised_sigmoid": ["optim.lr=0.05"],
    "mae": ["model.name=mae_vit_debug", "optim.lr=0.1", "model.overrides.norm_pix_loss=true"],
    "masked_patch_prediction": ["model.name=mpp_vit_debug", "optim.lr=0.05"],
    # The teacher is the supervised_softmax run's export (run first).
    "distill": ["optim.lr=0.05", "objective.distill_type=soft", "objective.teacher.model=vit_debug",
                "objective.teacher.weights={out}/supervised_softmax/export/model.safetensors",
                "objective.teacher.overrides.num_classes=8"],
}  # fmt: skip


def main() -> None:
    out, data, names = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for name in names:
        overrides = [
            f"run_dir={out}/{name}", f"data.train={data}", "cluster.launcher=local", f"objective.name={name}",
            "optim.steps=40", "optim.warmup_steps=4", "tracking.system_metrics=false", "deepspeed.zero_stage=2",
            f"tracking.uri=sqlite:///{out}/mlflow.db",  # one store for every run (new stores cost ~4 s each)
            *(o.format(out=out) for o in PER_OBJECTIVE[name]),
        ]  # fmt: skip
        train(load_config(SMOKE, overrides))


if __name__ == "__main__":
    main()
