"""Step overhead of our loop (DeepSpeed engine, objective, control all-reduce) against a bare PyTorch loop.

    .venv/bin/python bench/step_overhead.py --out bench/results/step_overhead.json [--quick]

Same model (vit_ti16 at 64 px), same AdamW, same gradient clipping, same in-memory uint8 batches, one
process on CPU. Rounds alternate between the two loops; the ratio is the median over rounds.
Goal: ours <= 1.10x the bare step time.
"""

from __future__ import annotations

import argparse
import itertools
import os
import statistics
import time

os.environ.setdefault("DS_ACCELERATOR", "cpu")
os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT="29533")

import torch  # noqa: E402
from provenance import write_result  # noqa: E402  (bench/provenance.py, beside this file)

from pipeline.config import validate_config  # noqa: E402
from pipeline.data.device import batch_to_device  # noqa: E402
from pipeline.data.transforms import normalize  # noqa: E402
from pipeline.distributed import init_distributed
from pipeline.models import create_model, param_groups  # noqa: E402
from pipeline.objectives import build_objective, model_kwargs  # noqa: E402
from pipeline.train import checkpoint  # noqa: E402
from pipeline.train.engine import build_engine  # noqa: E402
from pipeline.train.loop import train_step  # noqa: E402

MODEL, IMG, BATCH, CLASSES = "vit_ti16", 64, 32, 100


def batches(n: int = 8):
    g = torch.Generator().manual_seed(0)
    return [
        {
            "image": torch.randint(0, 256, (BATCH, 3, IMG, IMG), dtype=torch.uint8, generator=g),
            "target": torch.randint(0, CLASSES, (BATCH,), generator=g),
            "skipped": 0,
        }
        for _ in range(n)
    ]


def ours(steps: int):
    cfg = validate_config(
        {
            "name": "bench",
            "data": {"train": "unused", "batch_size": BATCH},
            "model": {"name": MODEL, "img_size": IMG, "num_classes": CLASSES},
            "objective": {"name": "supervised_softmax"},
            "optim": {"steps": 10_000, "warmup_steps": 0},
            "deepspeed": {"zero_stage": 0, "precision": "fp32"},
            "cluster": {"launcher": "local"},
        }
    )
    ctx = init_distributed(False)
    torch.manual_seed(0)
    objective = build_objective(cfg.objective)
    model = create_model(MODEL, img_size=IMG, **model_kwargs(cfg.objective, CLASSES))
    engine, _, _ = build_engine(model, cfg, ctx)
    data = itertools.cycle(batches())
    to_device = batch_to_device(ctx.device, cfg.data, IMG)
    log_every = cfg.tracking.log_every

    def run() -> float:
        t0 = time.perf_counter()
        for step in range(steps):
            train_step(engine, objective, data, to_device, 0, step, 1, 0)
            if (step + 1) % log_every == 0:
                checkpoint.all_agree(True, ctx.control_group)  # the loop's stop check, at log steps
        return (time.perf_counter() - t0) / steps

    return run


def bare(steps: int):
    torch.manual_seed(0)
    model = create_model(MODEL, img_size=IMG, num_classes=CLASSES)
    opt = torch.optim.AdamW(param_groups(model, 0.05), lr=1e-3)
    data = itertools.cycle(batches())

    def run() -> float:
        t0 = time.perf_counter()
        for _ in range(steps):
            b = next(data)
            loss = torch.nn.functional.cross_entropy(model(normalize(b["image"])), b["target"])
            opt.zero_grad(set_to_none=True)
            loss.backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
        return (time.perf_counter() - t0) / steps

    return run


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="a smoke run: few steps and rounds")
    args = p.parse_args()
    steps, rounds = (3, 2) if args.quick else (20, 7)
    run_ours, run_bare = ours(steps), bare(steps)
    run_ours(), run_bare()  # warm-up
    t_ours, t_bare = [], []
    for _ in range(rounds):
        t_bare.append(run_bare())
        t_ours.append(run_ours())
    ratios = [o / b for o, b in zip(t_ours, t_bare)]
    result = {
        "benchmark": "step_overhead",
        "model": MODEL,
        "img_size": IMG,
        "batch": BATCH,
        "steps_per_round": steps,
        "rounds": rounds,
        "bare_step_s_median": statistics.median(t_bare),
        "ours_step_s_median": statistics.median(t_ours),
        "ratio_median": statistics.median(ratios),
        "ratios": ratios,
        "goal_ratio_max": 1.10,
        "meets_goal": statistics.median(ratios) <= 1.10,
        "threads": torch.get_num_threads(),
        "quick": args.quick,
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
