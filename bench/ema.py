"""Weight EMA (optim.ema_decay) at the scale the pipeline stands in for: what one rank of 1,024 pays for
ViT-H/14's EMA, and what a resume on another world size reads.

    .venv/bin/python bench/ema.py --out bench/results/ema.json [--model vit_h14] [--world 1024] [--resume-world 768]

The rank's share is laid out from vit_h14's real parameter list (built on the meta device) as DeepSpeed lays it
out: ZeRO-3, ceil(numel / W) elements of every parameter, and ZeRO-0, 1/W of the parameters laid end to end
(`pipeline.train.ema.flat_share`; ZeRO-1/2 cut each parameter group end to end the same way). The tensors are
real, on CPU; the shares of the other ranks are written as real files. Measured, per rank:

- memory: the EMA's bytes against the whole model in fp32 (goal: 1 / W);
- update: median time of `WeightEma.update` against torch AdamW's step (foreach) over the same share, the step
  the rank takes anyway, alternating rounds (goal: < 0.5x);
- resume: every one of W ranks saves its file into one tag (W x 2.5 MB for ViT-H), then ranks of a world of
  --resume-world (and of the same world) load their share: files opened and elements read, against the share
  (goal: elements read = the share; files opened a few, not W, which a rank opening every file would).
"""

from __future__ import annotations

import argparse
import math
import shutil
import statistics
import tempfile
import time
from pathlib import Path

import torch
from provenance import write_result  # bench/provenance.py, beside this file

from pipeline.models import create_model
from pipeline.train.ema import Fragment, WeightEma, flat_share

DECAY = 0.9999


def parameters(model: str) -> list[tuple[str, tuple[int, ...]]]:
    with torch.device("meta"):
        net = create_model(model, img_size=224, num_classes=18_291)  # JFT's classes
    return [(n, tuple(p.shape)) for n, p in net.named_parameters() if p.requires_grad]


def zero3_share(params: list[tuple[str, tuple[int, ...]]], rank: int, world: int) -> list[Fragment]:
    """ZeRO-3's partition of every parameter: rank r holds [r x ceil(n / W), (r + 1) x ceil(n / W)) of it."""
    out = []
    for name, shape in params:
        numel = math.prod(shape)
        size = -(-numel // world)
        start, stop = rank * size, min((rank + 1) * size, numel)
        if start < stop:
            out.append(Fragment(name, start, stop, numel))
    return out


def share(layout: str, params, rank: int, world: int) -> list[Fragment]:
    if layout == "zero3":
        return zero3_share(params, rank, world)
    return flat_share([(n, math.prod(s)) for n, s in params], rank, world)


def ema_of(fragments: list[Fragment], params, rank: int, world: int, seed: int) -> WeightEma:
    g = torch.Generator().manual_seed(seed)
    pairs = [(f, torch.randn(f.stop - f.start, generator=g)) for f in fragments]
    return WeightEma(pairs, params, DECAY, rank, world)


def update_cost(fragments: list[Fragment], params, world: int, rounds: int) -> dict:
    ema = ema_of(fragments, params, 0, world, seed=0)
    weights = [torch.nn.Parameter(m) for m in ema._masters]  # AdamW steps the same tensors the EMA follows
    ema._masters = weights
    for w in weights:
        w.grad = torch.randn_like(w)
    adamw = torch.optim.AdamW(weights, lr=1e-4, foreach=True)
    ema_s, adamw_s = [], []
    for _ in range(rounds):
        t = time.perf_counter()
        adamw.step()
        adamw_s.append(time.perf_counter() - t)
        t = time.perf_counter()
        ema.update()
        ema_s.append(time.perf_counter() - t)
    return {
        "fragments": len(fragments),
        "elements": sum(f.stop - f.start for f in fragments),
        "ema_update_ms_median": 1e3 * statistics.median(ema_s),
        "adamw_step_ms_median": 1e3 * statistics.median(adamw_s),
        "ratio_median": statistics.median(e / a for e, a in zip(ema_s, adamw_s)),
    }


def resume_reads(layout: str, params, world: int, new_world: int, samples: int) -> dict:
    """Save W files into one tag, then load sampled ranks of `new_world` (and of W): what each read."""
    tag = Path(tempfile.mkdtemp(prefix="vitpipe-bench-ema-"))
    try:
        t = time.perf_counter()
        for rank in range(world):
            ema_of(share(layout, params, rank, world), params, rank, world, seed=rank).save(tag)
        save_s = time.perf_counter() - t
        tag_bytes = sum(p.stat().st_size for p in tag.iterdir())
        rows = []
        for target in (new_world, world):
            ranks = sorted({round(i * (target - 1) / max(1, samples - 1)) for i in range(samples)})
            for rank in ranks:
                mine = share(layout, params, rank, target)
                ema = ema_of(mine, params, rank, target, seed=10**6 + rank)
                t = time.perf_counter()
                assert ema.load(tag)
                rows.append(
                    {
                        "world": target,
                        "rank": rank,
                        "share_elements": sum(f.stop - f.start for f in mine),
                        "files_opened": ema.last_load["files_opened"],
                        "elements_read": ema.last_load["elements_read"],
                        "load_s": time.perf_counter() - t,
                    }
                )
        return {
            "layout": layout,
            "saved_world": world,
            "tag_files": world,
            "tag_bytes": tag_bytes,
            "save_all_ranks_s": save_s,
            "loads": rows,
            "max_files_opened_on_another_world": max(r["files_opened"] for r in rows if r["world"] != world),
            "max_files_opened_on_the_same_world": max(r["files_opened"] for r in rows if r["world"] == world),
            "every_load_read_exactly_its_share": all(r["elements_read"] == r["share_elements"] for r in rows),
        }
    finally:
        shutil.rmtree(tag, ignore_errors=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--model", default="vit_h14")
    ap.add_argument("--world", type=int, default=1024)
    ap.add_argument("--resume-world", type=int, default=768)
    ap.add_argument("--rounds", type=int, default=30)
    ap.add_argument("--samples", type=int, default=5, help="ranks of each new world that load")
    ap.add_argument("--out")
    args = ap.parse_args()
    torch.set_num_threads(1)  # one core per rank, as under torchrun's OMP_NUM_THREADS=1

    params = parameters(args.model)
    total = sum(math.prod(s) for _, s in params)
    result: dict = {
        "model": args.model,
        "params": total,
        "world": args.world,
        "resume_world": args.resume_world,
        "goals": {
            "ema_bytes_per_rank_over_model_bytes": f"<= 1/{args.world} plus rounding",
            "update_over_adamw_step": "< 0.5",
            "resume": "elements read = the share; files opened a few, not the world size",
        },
    }
    for layout in ("zero3", "zero0"):
        mine = share(layout, params, 0, args.world)
        owned = sum(f.stop - f.start for f in mine)
        result[layout] = {
            "ema_bytes_per_rank": 4 * owned,
            "model_fp32_bytes": 4 * total,
            "ema_bytes_per_rank_over_model_bytes": owned / total,
            "update": update_cost(mine, params, args.world, args.rounds),
            "resume": resume_reads(layout, params, args.world, args.resume_world, args.samples),
        }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
