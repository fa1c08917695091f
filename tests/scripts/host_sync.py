"""Run under torchrun (2 ranks): one training stage with every tensor-to-host read counted, per step.

    torchrun --nproc-per-node 2 tests/scripts/host_sync.py OUT_DIR DATA_DIR RUN_ROOT '{"CASE": [OVERRIDES...]}'

A read is any call of Tensor.item, .tolist, .cpu, .numpy, or a conversion to bool, int, float or an
index, made in this process by any code (ours, DeepSpeed's, torch's Python), and any call of DeepSpeed's
accelerator `synchronize` (a no-op on CPU): on a GPU each one waits for the device. The loader runs in worker processes (data.num_workers=1), so its own reads are not
counted. Each case is a training stage in RUN_ROOT/CASE; for each, rank 0 writes OUT_DIR/CASE.json: {"log_every": N, "steps": [[step, reads in the step, reads after it], ...],
"where": {step: [call sites]}}, "reads after" counting from the end of a step to the start of the next.
"""

import json
import sys
import traceback
from pathlib import Path

import torch

from pipeline.config import load_config
from pipeline.distributed import shutdown_distributed
from pipeline.train import loop

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"
READS = ("item", "tolist", "cpu", "numpy", "__bool__", "__int__", "__float__", "__index__")


class Counter:
    def __init__(self) -> None:
        self.reads = 0
        self.sites: list[str] = []

    def wrap(self, name: str):
        original = getattr(torch.Tensor, name)

        def counted(tensor, *args, **kwargs):
            self.reads += 1
            frame = traceback.extract_stack(limit=2)[0]
            self.sites.append(f"{name} at {frame.filename}:{frame.lineno}")
            return original(tensor, *args, **kwargs)

        setattr(torch.Tensor, name, counted)

    def wrap_device_sync(self) -> None:
        """DeepSpeed's device synchronize (its accelerator's): a no-op on CPU, a full stall on a GPU."""
        from deepspeed.accelerator import get_accelerator

        accelerator = get_accelerator()
        original = accelerator.synchronize

        def counted(*args, **kwargs):
            self.reads += 1
            frame = traceback.extract_stack(limit=2)[0]
            self.sites.append(f"synchronize at {frame.filename}:{frame.lineno}")
            return original(*args, **kwargs)

        accelerator.synchronize = counted


def counted_run(cfg, counter: Counter) -> dict:
    """Train `cfg` with every step's host reads counted: {"log_every", "steps", "where"}."""
    steps: list[list[int]] = []
    where: dict[int, list[str]] = {}
    step_fn = loop.train_step
    last_end = [None]

    def counted_step(engine, objective, batches, to_device, seed, step, accum, rank):
        if last_end[0] is not None:  # the reads of the loop body after the previous step
            steps[-1][2] = counter.reads - last_end[0]
        before = len(counter.sites)
        start = counter.reads
        result = step_fn(engine, objective, batches, to_device, seed, step, accum, rank)
        steps.append([step + 1, counter.reads - start, 0])
        last_end[0] = counter.reads
        if counter.reads > start:
            where[step + 1] = counter.sites[before:]
        return result

    loop.train_step = counted_step
    try:
        loop.train(cfg)
    finally:
        loop.train_step = step_fn
    if last_end[0] is not None:
        steps[-1][2] = counter.reads - last_end[0]
    return {"log_every": cfg.tracking.log_every, "steps": steps, "where": where}


def main() -> None:
    out, data, run_root, cases = Path(sys.argv[1]), sys.argv[2], Path(sys.argv[3]), json.loads(sys.argv[4])
    counter = Counter()
    for name in READS:
        counter.wrap(name)
    counter.wrap_device_sync()
    for case, extra in cases.items():  # one launch for every case: a launch costs more CPU than a case
        cfg = load_config(
            SMOKE,
            [
                f"run_dir={run_root / case}",
                f"data.train={data}",
                "cluster.launcher=local",
                "optim.steps=12",
                "optim.warmup_steps=2",
                "data.num_workers=1",
                "tracking.system_metrics=false",
                "tracking.log_every=5",
                "model.overrides.drop_path_rate=0.1",
                *extra,
            ],
        )
        report = counted_run(cfg, counter)
        if torch.distributed.get_rank() == 0:
            (out / f"{case}.json").write_text(json.dumps(report))


if __name__ == "__main__":
    main()
    shutdown_distributed()  # else gloo's threads may abort this rank's exit
