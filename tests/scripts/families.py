"""Run under torchrun (2 ranks): short training runs of the non-ViT families; the test reads MLflow.

torchrun --standalone --nproc-per-node 2 tests/scripts/families.py OUT_DIR DATA_DIR RUN...
RUN is NAME:MODEL:OBJECTIVE:ZERO_STAGE:STEPS; runs go in order (a distillation run's teacher is the
export of the run named in its TEACHER=... suffix, e.g. distill_levit:levit_debug:distill:2:20:TEACHER=tnt_zero2).
"""

import sys
from pathlib import Path

from pipeline.config import load_config
from pipeline.train.loop import train

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"


def main() -> None:
    out, data, runs = Path(sys.argv[1]), sys.argv[2], sys.argv[3:]
    for spec in runs:
        name, model, objective, zero, steps, *extra = spec.split(":")
        overrides = [
            f"run_dir={out}/{name}", f"data.train={data}", "cluster.launcher=local", f"model.name={model}",
            f"objective.name={objective}", f"deepspeed.zero_stage={zero}", f"optim.steps={steps}",
            "optim.warmup_steps=4", "optim.lr=0.05", "tracking.system_metrics=false", f"tracking.uri=sqlite:///{out}/mlflow.db",
        ]  # fmt: skip
        for item in extra:
            key, value = item.split("=", 1)
            if key == "TEACHER":  # DeiT: the teacher is an earlier run's export, its model that run's
                teacher_model = next(r.split(":")[1] for r in runs if r.split(":")[0] == value)
                overrides += [f"objective.teacher.model={teacher_model}",
                              f"objective.teacher.weights={out}/{value}/export/model.safetensors",
                              "objective.teacher.overrides.num_classes=8", "objective.distill_type=hard"]  # fmt: skip
            else:
                overrides.append(item)
        train(load_config(SMOKE, overrides))


if __name__ == "__main__":
    main()
