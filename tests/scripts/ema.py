"""Run under torchrun: the weight EMA of a real DeepSpeed engine, per ZeRO stage, against a reference.

    torchrun --nproc-per-node 2 tests/scripts/ema.py save OUT PRECISIONS STAGES...    # PRECISIONS: fp32,bf16
    torchrun --nproc-per-node N tests/scripts/ema.py load OUT PRECISIONS STAGES...

Each precision's results go under OUT/PRECISION.

`save`: for each ZeRO stage, the smoke model (its debug ViT) takes 4 AdamW steps on random batches; after each
step rank 0 lerps a reference EMA of the whole consolidated fp32 weights, while every rank updates its own
share (WeightEma). Rank 0 writes OUT/zeroS/report.json: which parameters differ from the reference (none is
allowed: the same fp32 lerp, element for element) and how far the EMA lies from the final weights; the EMA
files go to OUT/zeroS/tag and the reference to OUT/zeroS/reference.pt.

`load`: for each ZeRO stage S, a fresh engine on this world size and ZeRO stage (S + 1) % 4 loads
OUT/zeroS/tag's EMA (saved by 2 ranks under ZeRO S) and rank 0 writes OUT/zeroS/loaded_on_N.json: the
parameters whose consolidated EMA is not the saved reference bit for bit, and for ZeRO-0 the errors of a load
from a copy of the tag without rank 1's file.
"""

import json
import shutil
import sys
from pathlib import Path

import torch
import torch.distributed as dist

from pipeline.config import load_config
from pipeline.distributed import DistContext, init_distributed, shutdown_distributed
from pipeline.models import create_model
from pipeline.stage import model_kwargs
from pipeline.train.ema import WeightEma, ema_file
from pipeline.train.engine import build_engine, consolidated_state_dict

SMOKE = Path(__file__).parents[2] / "configs/experiments/smoke.yaml"
DECAY = 0.5  # large steps: an EMA away from the weights in 4 steps


def engine_for(stage: int, precision: str, ctx: DistContext):
    cfg = load_config(
        SMOKE,
        [
            f"deepspeed.zero_stage={stage}",
            f"deepspeed.precision={precision}",
            "optim.lr=0.01",
            "optim.warmup_steps=0",
            "data.batch_size=2",
            "deepspeed.grad_accum=1",
        ],
    )
    torch.manual_seed(0)
    model = create_model(cfg.model.name, **model_kwargs(cfg, 10))
    engine, _, _ = build_engine(model, cfg, ctx)
    return engine, cfg


def trainable(engine) -> list[str]:
    return [n for n, p in engine.module.named_parameters() if p.requires_grad]


def save(out: Path, precision: str, stage: int, ctx: DistContext) -> None:
    engine, cfg = engine_for(stage, precision, ctx)
    ema = WeightEma.of_engine(engine, DECAY, ctx.rank, ctx.world_size, ctx.control_group)
    names = trainable(engine)
    start = consolidated_state_dict(engine)
    reference = {k: start[k].clone() for k in names} if ctx.rank == 0 else None
    dtype = torch.bfloat16 if precision == "bf16" else torch.float32
    gen = torch.Generator().manual_seed(1 + ctx.rank)
    for _ in range(4):
        x = torch.randn(2, 3, cfg.model.img_size, cfg.model.img_size, generator=gen).to(dtype)
        loss = engine(x).float().logsumexp(-1).mean()
        engine.backward(loss)
        engine.step()
        ema.update()
        full = consolidated_state_dict(engine)
        if ctx.rank == 0:
            for k in names:
                reference[k].lerp_(full[k], 1 - DECAY)
    got = ema.consolidated(ctx.device)
    root = out / f"zero{stage}"
    (root / "tag").mkdir(parents=True, exist_ok=True)
    ema.save(root / "tag")
    if ctx.rank == 0:
        torch.save(reference, root / "reference.pt")
        report = {
            "params": len(names),
            "elements": sum(reference[k].numel() for k in names),
            "owned": [f.stop - f.start for f in ema.fragments],
            "differ": [k for k in names if not torch.equal(got[k], reference[k])],
            "from_weights": max(float((got[k] - full[k]).abs().max()) for k in names),
            "moved": max(float((full[k] - start[k]).abs().max()) for k in names),
        }
        (root / "report.json").write_text(json.dumps(report))
    dist.barrier()


def load(out: Path, precision: str, stage: int, ctx: DistContext) -> None:
    root = out / f"zero{stage}"
    engine, _ = engine_for((stage + 1) % 4, precision, ctx)
    ema = WeightEma.of_engine(engine, DECAY, ctx.rank, ctx.world_size, ctx.control_group)
    assert ema.load(root / "tag")
    got = ema.consolidated(ctx.device)
    result = {}
    if ctx.rank == 0:
        reference = torch.load(root / "reference.pt")
        result["differ"] = [k for k in reference if not torch.equal(got[k], reference[k])]
    if stage == 0:  # a copy of the tag without rank 1's file: the ranks whose share it held refuse it
        partial = root / f"partial_{ctx.world_size}"
        if ctx.rank == 0:
            partial.mkdir(exist_ok=True)
            shutil.copy(root / "tag" / ema_file(0), partial / ema_file(0))
        dist.barrier()
        try:
            ema.load(partial)
            error = None
        except RuntimeError as exc:
            error = str(exc)
        errors = [None] * ctx.world_size
        dist.all_gather_object(errors, error)
        result["without_rank_1"] = " | ".join(e for e in errors if e)
    if ctx.rank == 0:
        (root / f"loaded_on_{ctx.world_size}.json").write_text(json.dumps(result))
    dist.barrier()


def main() -> None:
    mode, out, precisions = sys.argv[1], Path(sys.argv[2]), sys.argv[3].split(",")
    stages = [int(s) for s in sys.argv[4:]]
    ctx = init_distributed(use_gpu=False)
    for precision in precisions:  # one process group for all: a launch costs more CPU than a case
        for stage in stages:
            (save if mode == "save" else load)(out / precision, precision, stage, ctx)


if __name__ == "__main__":
    main()
    shutdown_distributed()
