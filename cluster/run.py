"""Run a stage on Ray Train workers: one TorchTrainer run, DeepSpeed inside each worker.

vitpipe train configs/experiments/smoke.yaml                  # starts or joins Ray
ray job submit --working-dir . -- python -m cluster.run configs/experiments/smoke.yaml
"""

from __future__ import annotations

import os
import sys

from pipeline.config import ExperimentConfig, load_config
from pipeline.train.launch import prepare_data


def _worker(config: dict) -> None:
    # Runs in every Ray Train worker; TorchTrainer has already joined the process group.
    import ray.train

    from pipeline.config import validate_config
    from pipeline.train.loop import train

    cfg = validate_config(config["cfg"], source="<ray worker>")
    train(cfg, report=ray.train.report)


def _connect(cfg: ExperimentConfig) -> None:
    import ray

    if ray.is_initialized():
        return
    env = {"DS_ACCELERATOR": "cuda" if cfg.cluster.use_gpu else "cpu"}
    address = cfg.cluster.address or os.environ.get("RAY_ADDRESS")
    if address:
        ray.init(address=address, runtime_env={"env_vars": env})
    else:
        # A private local instance bound to loopback.
        ray.init(runtime_env={"env_vars": env}, include_dashboard=False)


def run_training(cfg: ExperimentConfig):
    """Resolve paths on the driver, prepare data once, then run the workers. Returns ray.train.Result."""
    from ray.train import FailureConfig, RunConfig, ScalingConfig
    from ray.train.torch import TorchConfig, TorchTrainer

    # Workers may start in other directories: pass absolute paths.
    cfg = cfg.model_copy(
        update={
            "run_dir": str(cfg.run_path),
            "data": cfg.data.model_copy(update={"train": os.path.abspath(cfg.data.train)}),
        }
    )
    prepare_data(cfg)
    _connect(cfg)
    c = cfg.cluster
    trainer = TorchTrainer(
        _worker,
        train_loop_config={"cfg": cfg.model_dump(mode="json")},
        scaling_config=ScalingConfig(
            num_workers=c.num_workers,
            use_gpu=c.use_gpu,
            resources_per_worker={"CPU": c.cpus_per_worker, **({"GPU": 1} if c.use_gpu else {})},
            placement_strategy=c.placement_strategy,
        ),
        torch_config=TorchConfig(backend="nccl" if c.use_gpu else "gloo"),
        run_config=RunConfig(
            name=cfg.name,
            storage_path=str(cfg.run_path / "ray"),
            failure_config=FailureConfig(max_failures=c.max_failures),
        ),
    )
    return trainer.fit()


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv:
        sys.exit("usage: python -m cluster.run CONFIG [KEY=VALUE ...]")
    run_training(load_config(argv[0], argv[1:]))


if __name__ == "__main__":
    main()
