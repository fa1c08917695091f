"""Model-state memory per rank: ViT-B/16 training on 2 ranks at ZeRO stage 0 against stage 3.

    .venv/bin/python bench/zero_memory.py --out bench/results/zero_memory.json [--quick]

Each stage runs in its own `torchrun --standalone --nproc-per-node 2` launch, so peak RSS is per stage.

After one full step and a second backward (so optimizer state and gradients exist), each rank counts
the bytes of every live tensor it holds (unique storages, found through the garbage collector) and
splits them into parameters (for ZeRO-3 the rank's partitions), optimizer state (Adam moments and
fp32 master partitions) and the rest (gradients and flat buffers). Each rank's peak RSS beside it.
Goal: stage 3 total <= 0.55x stage 0 total (theory for mixed-precision Adam on 2 ranks: 16P/2 vs 16P).
In fp32, DeepSpeed's ZeRO-3 keeps the rank's parameter partition and a separate fp32 master partition,
so fp32 lands nearer 20P/2: run both with --precision.
"""

from __future__ import annotations

import argparse
import gc
import json
import os
import resource
import subprocess
import sys
import tempfile

os.environ.setdefault("DS_ACCELERATOR", "cpu")

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from provenance import write_result  # noqa: E402  (bench/provenance.py, beside this file)

from pipeline.config import validate_config  # noqa: E402
from pipeline.data.transforms import normalize  # noqa: E402
from pipeline.distributed import init_distributed
from pipeline.models import create_model  # noqa: E402
from pipeline.train.engine import build_engine  # noqa: E402


def storage_key(t: torch.Tensor):
    s = t.untyped_storage()
    return s.data_ptr(), s.nbytes()


def live_tensor_bytes() -> dict[tuple, int]:
    gc.collect()
    seen: dict[tuple, int] = {}
    for obj in gc.get_objects():
        try:
            if torch.is_tensor(obj) and obj.device.type == "cpu" and obj.untyped_storage().nbytes() > 0:
                k = storage_key(obj)
                seen[k] = k[1]
        except (RuntimeError, ReferenceError):
            continue
    return seen


def measure(stage: int, model_name: str, img: int, precision: str) -> dict:
    cfg = validate_config(
        {
            "name": "bench",
            "data": {"train": "unused", "batch_size": 2},
            "model": {"name": model_name, "img_size": img, "num_classes": 1000},
            "optim": {"steps": 100, "warmup_steps": 0},
            "deepspeed": {"zero_stage": stage, "precision": precision},
            "cluster": {"launcher": "local"},
        }
    )
    ctx = init_distributed(False)
    torch.manual_seed(0)
    before = set(live_tensor_bytes())
    model = create_model(model_name, img_size=img, num_classes=1000)
    n_params = sum(p.numel() for p in model.parameters())
    engine, optimizer, _ = build_engine(model, cfg, ctx)
    dtype = {"fp32": torch.float32, "bf16": torch.bfloat16, "fp16": torch.float16}[precision]
    x = normalize(torch.randint(0, 256, (2, 3, img, img), dtype=torch.uint8)).to(dtype)
    y = torch.randint(0, 1000, (2,))
    for _ in range(2):  # the first step creates the Adam moments
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        if _ == 0:
            engine.step()
    held = {k: v for k, v in live_tensor_bytes().items() if k not in before}
    params = set()
    for p in engine.module.parameters():
        t = getattr(p, "ds_tensor", None)  # ZeRO-3: this rank's partition
        t = t if t is not None else p.data
        if t.untyped_storage().nbytes():
            params.add(storage_key(t))
    opt_state = set()
    inner = getattr(optimizer, "optimizer", optimizer)
    for state in inner.state.values():
        opt_state |= {storage_key(v) for v in state.values() if torch.is_tensor(v) and v.numel() > 1}
    for group in inner.param_groups:  # ZeRO's fp32 master partitions are the inner optimizer's params
        opt_state |= {storage_key(p) for p in group["params"]} - params
    out = {
        "params_bytes": sum(held.get(k, 0) for k in params),
        "optimizer_bytes": sum(held.get(k, 0) for k in opt_state),
        "total_bytes": sum(held.values()),
    }
    out["other_bytes"] = out["total_bytes"] - out["params_bytes"] - out["optimizer_bytes"]
    out["num_params"] = n_params
    out["bytes_per_param"] = out["total_bytes"] / n_params
    return out


def worker(stage: int, model_name: str, img: int, precision: str, out: str) -> None:
    r = measure(stage, model_name, img, precision)
    r["peak_rss_bytes"] = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024
    gathered = [None] * dist.get_world_size()
    dist.all_gather_object(gathered, r)
    if dist.get_rank() == 0:
        with open(out, "w") as f:
            json.dump(gathered, f)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="vit_debug instead of vit_b16 (a smoke run)")
    p.add_argument(
        "--precision",
        choices=["fp32", "bf16"],
        default="bf16",
        help="bf16 (default) is how ZeRO runs on GPUs; fp32 ZeRO-3 keeps two fp32 parameter copies",
    )
    p.add_argument("--worker-stage", type=int, help=argparse.SUPPRESS)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    args = p.parse_args()
    model_name, img = ("vit_debug", 32) if args.quick else ("vit_b16", 32)
    if args.worker_stage is not None:
        return worker(args.worker_stage, model_name, img, args.precision, args.worker_out)
    per_stage = {}
    with tempfile.TemporaryDirectory() as tmp:
        for stage in (0, 3):
            out = os.path.join(tmp, f"zero{stage}.json")
            cmd = [
                sys.executable,
                "-m",
                "torch.distributed.run",
                "--standalone",
                "--nproc-per-node",
                "2",
                __file__,
                "--worker-stage",
                str(stage),
                "--worker-out",
                out,
                "--precision",
                args.precision,
                *(["--quick"] if args.quick else []),
            ]
            subprocess.run(
                cmd, check=True, env={**os.environ, "OMP_NUM_THREADS": "1"}, stdout=subprocess.DEVNULL
            )
            with open(out) as f:
                per_stage[stage] = json.load(f)
    world = len(per_stage[0])
    ratio = max(r["total_bytes"] for r in per_stage[3]) / max(r["total_bytes"] for r in per_stage[0])
    result = {
        "benchmark": "zero_memory",
        "model": model_name,
        "img_size": img,
        "world_size": world,
        "precision": args.precision,
        "per_rank": {f"rank{r}": {f"zero{s}": per_stage[s][r] for s in (0, 3)} for r in range(world)},
        "ratio_zero3_over_zero0": ratio,
        "goal_ratio_max": 0.55,
        "meets_goal": ratio <= 0.55,
        "peak_rss_ratio_zero3_over_zero0": max(r["peak_rss_bytes"] for r in per_stage[3])
        / max(r["peak_rss_bytes"] for r in per_stage[0]),
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
