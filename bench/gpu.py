"""GPU training throughput, MFU and peak memory for the reference models, and the loader with CPU and CUDA
decode, on whatever GPU this machine has.

    .venv/bin/python bench/gpu.py                      # on a GPU: writes bench/results/gpu-<device>.json
    .venv/bin/python bench/gpu.py --dry-run            # the same code on CPU with debug models (CI runs it)
    .venv/bin/python bench/gpu.py --cpu-compile --out bench/results/compile-cpu.json   # eager vs compiled on CPU

Training cases (one GPU, bf16, 224 px, the real engine, objective and `train_step` of the training loop,
batches already on the device so the model alone is measured):
  ViT-B/16 and ViT-L/16 (ZeRO-1), ViT-H/14 (ZeRO-3, activation checkpointing), MAE-H/14 (ZeRO-2, mask 0.75),
  each eager and under torch.compile (`model.compile`). Per case: images/s over the timed steps (after
  warm-up; a device sync only at the end), MFU (model FLOPs: 3 x forward, MAE's encoder on the kept 25%)
  and HFU (with the recomputed forward under activation checkpointing) against the peak table's entry for
  this GPU, peak memory, and the host syncs the steps made (`torch.cuda.set_sync_debug_mode("warn")`).
Loader cases: 500x375 JPEG shards (`data_prep.synthetic`) into 224 px batches on the device: CPU decode
  (PIL in the loader workers, one per CPU core) and CUDA decode (nvJPEG, `data.decode: cuda`); then ViT-B/16
  training fed by the CUDA-decode loader, with the fraction of time the step waited for data.
Each case runs in its own process (clean memory counters, no engine left over from the last case).
Goals on one H200: MFU >= 0.45 (ViT-B/16), >= 0.50 (ViT-H/14), >= 0.40 (MAE-H/14); CUDA decode >= 4,000
images/s into ViT-B/16 training with a data-wait fraction under 0.05. Budget: under 8 minutes.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

# name -> model, ZeRO stage, activation checkpointing, objective, batch per GPU, image size
GPU_CASES = {
    "vit_b16": ("vit_b16", 1, False, "supervised_softmax", 256, 224),
    "vit_l16": ("vit_l16", 1, False, "supervised_softmax", 128, 224),
    "vit_h14": ("vit_h14", 3, True, "supervised_softmax", 128, 224),
    "mae_vit_h14": ("mae_vit_h14", 2, True, "mae", 256, 224),
}
DRY_CASES = {  # the same code paths, debug sizes, on CPU
    "vit_b16": ("vit_debug", 1, False, "supervised_softmax", 8, 32),
    "vit_l16": ("vit_debug", 1, False, "supervised_softmax", 8, 32),
    "vit_h14": ("vit_debug", 3, True, "supervised_softmax", 8, 32),
    "mae_vit_h14": ("mae_vit_debug", 2, True, "mae", 8, 32),
}
CPU_COMPILE_CASES = {"vit_s16_64px": ("vit_s16", 1, False, "supervised_softmax", 32, 64)}
GOALS = {"vit_b16": 0.45, "vit_h14": 0.50, "mae_vit_h14": 0.40}
CUDA_DECODE_GOAL = 4000.0
CLASSES = 1000


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage_config(
    model_name: str, zero: int, ckpt: bool, objective: str, batch: int, img: int, gpu: bool, **extra
):
    """A stage config for one case. `data.decode: cuda` on CPU (the dry run) is set after validation,
    which refuses it without a GPU: the dry run feeds the same path a PIL decoder instead of nvJPEG."""
    from pipeline.config import validate_config

    data = dict(extra.pop("data", {}))
    decode = data.pop("decode", "cpu")
    cfg = validate_config(
        {
            "name": "bench",
            "data": {"train": "unused", "batch_size": batch, "decode": decode if gpu else "cpu", **data},
            "model": {"name": model_name, "img_size": img, "num_classes": CLASSES, **extra.pop("model", {})},
            "objective": {"name": objective},
            "optim": {"steps": 100_000, "warmup_steps": 0},
            # One GPU reduces nothing: no overlap, and no per-backward device sync from DeepSpeed's epilogue.
            "deepspeed": {"zero_stage": zero, "activation_checkpointing": ckpt, "overlap_comm": False},
            "cluster": {"launcher": "local", "use_gpu": gpu},
            **extra,
        }
    )
    cfg.data.decode = decode
    return cfg


# ---------------------------------------------------------------------- one case, in its own process


def run_training(spec: tuple, compiled: bool, steps: int, warmup: int, gpu: bool) -> dict:
    import torch

    from pipeline.hardware import peak_flops
    from pipeline.models import create_model
    from pipeline.objectives import build_objective
    from pipeline.stage import model_kwargs
    from pipeline.train.engine import build_engine, init_distributed
    from pipeline.train.loop import _flops_per_image, train_step

    model_name, zero, ckpt, objective_name, batch, img = spec
    cfg = _stage_config(model_name, zero, ckpt, objective_name, batch, img, gpu, model={"compile": compiled})
    ctx = init_distributed(gpu)
    torch.manual_seed(0)
    model = create_model(model_name, **model_kwargs(cfg, CLASSES))
    flops = _flops_per_image(model)
    objective = build_objective(cfg.objective)
    engine, _, _ = build_engine(model, cfg, ctx)
    objective.prepare(engine.module, ctx.device)
    g = torch.Generator(device=ctx.device).manual_seed(0)
    batches = [
        {
            "image": torch.randint(
                0, 256, (batch, 3, img, img), dtype=torch.uint8, device=ctx.device, generator=g
            ),
            "target": torch.randint(0, CLASSES, (batch,), device=ctx.device, generator=g),
            "skipped": 0,
        }
        for _ in range(2)
    ]
    stream = iter(lambda: batches[0], None)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    t_compile = time.perf_counter()
    for step in range(warmup):  # compilation (if any), allocator warm-up, ZeRO-3 trace recording
        loss, *_ = train_step(engine, objective, stream, dict, 0, step, 1, 0)
    float(loss)
    sync()
    warmup_s = time.perf_counter() - t_compile
    device_syncs = []
    if gpu:
        torch.cuda.reset_peak_memory_stats()
        torch.cuda.set_sync_debug_mode("warn")  # sees syncs inside torch ops, not torch.cuda.synchronize
        original_sync = torch.cuda.synchronize

        def counted_sync(*a, **kw):
            device_syncs.append(traceback.extract_stack(limit=2)[0])
            return original_sync(*a, **kw)

        torch.cuda.synchronize = counted_sync
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        t0 = time.perf_counter()
        marks = [t0]  # on CPU each step's own time (the host runs the work); on GPU only the window counts
        for step in range(warmup, warmup + steps):
            loss, *_ = train_step(engine, objective, stream, dict, 0, step, 1, 0)
            marks.append(time.perf_counter())
        if gpu:
            torch.cuda.set_sync_debug_mode(0)
            torch.cuda.synchronize = original_sync
        final = float(loss)
        sync()
        elapsed = time.perf_counter() - t0
    syncs = [str(w.message).splitlines()[0] for w in caught if "synchroniz" in str(w.message).lower()]
    syncs += [f"torch.cuda.synchronize from {f.filename}:{f.lineno}" for f in device_syncs]
    if gpu:
        images_per_s = steps * batch / elapsed
    else:  # the median step: a shared CPU's other jobs show up as outliers, not in the median
        images_per_s = batch / statistics.median([b - a for a, b in zip(marks, marks[1:])])
    device_name = torch.cuda.get_device_name(ctx.device) if gpu else platform.processor() or "cpu"
    peak = peak_flops(device_name, cfg.deepspeed.precision, cfg.deepspeed.tf32) if gpu else None
    out = {
        "device": device_name,
        "model": model_name,
        "zero_stage": zero,
        "activation_checkpointing": ckpt,
        "compiled": compiled,
        "precision": cfg.deepspeed.precision,
        "batch": batch,
        "img_size": img,
        "steps": steps,
        "warmup_s": round(warmup_s, 2),
        "images_per_s": images_per_s,
        "step_s": elapsed / steps,
        "final_loss": final,
        "forward_flops_per_image": flops,
        "peak_tflops": None if peak is None else peak / 1e12,
        "host_syncs_in_timed_steps": len(syncs),
        "host_sync_examples": sorted(set(syncs))[:5],
    }
    if peak and flops:
        out["mfu"] = 3 * flops * images_per_s / peak
        out["hfu"] = (3 + ckpt) * flops * images_per_s / peak
    if gpu:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    return out


def _jpeg_dataset(root: Path, num: int) -> Path:
    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset

    if not (root / "manifest.json").exists():
        write_dataset(
            root, synthetic_samples(num, 100, seed=0), class_names(100), multi_label=True, max_count=64
        )
    return root


def run_loader(
    decode: str, data_root: str, batch: int, img: int, batches: int, gpu: bool, workers: int
) -> dict:
    import torch

    from pipeline.data.device import DeviceDecode, batch_to_device, pil_decoder
    from pipeline.data.loader import make_train_loader
    from pipeline.data.sources import dataset_info
    from pipeline.train.loop import _shutdown_loader

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    extra = {"data": {"num_workers": workers, "decode": decode, "shuffle_buffer": 64}}
    cfg = _stage_config("vit_b16", 1, False, "supervised_softmax", batch, img, gpu, **extra)
    info = dataset_info(data_root, "train")
    loader = make_train_loader(info, cfg.data, rank=0, world_size=1, img_size=img, seed=0)
    if decode == "cuda" and not gpu:  # dry run: the same path with PIL in nvJPEG's place
        to_device = DeviceDecode(device, img, pil_decoder(device))
    else:
        to_device = batch_to_device(device, cfg.data, img)
    it = iter(loader)
    for _ in range(2):  # workers started, first batches in flight
        to_device(next(it))
    if gpu:
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    for _ in range(batches):
        out = to_device(next(it))
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    _shutdown_loader(it)
    assert out["image"].shape == (batch, 3, img, img)
    return {"decode": decode, "workers": workers, "batch": batch, "images_per_s": batches * batch / elapsed}


def run_fed_training(data_root: str, spec: tuple, steps: int, gpu: bool, workers: int) -> dict:
    """ViT-B/16 training fed by the CUDA-decode loader: images/s and the fraction of time spent waiting."""

    from pipeline.data.device import DeviceDecode, batch_to_device, pil_decoder
    from pipeline.data.loader import make_train_loader
    from pipeline.data.sources import dataset_info
    from pipeline.models import create_model
    from pipeline.objectives import build_objective
    from pipeline.stage import model_kwargs
    from pipeline.train.engine import build_engine, init_distributed
    from pipeline.train.loop import _shutdown_loader, train_step

    model_name, zero, ckpt, objective_name, batch, img = spec
    extra = {"data": {"num_workers": workers, "decode": "cuda", "shuffle_buffer": 64}}
    cfg = _stage_config(model_name, zero, ckpt, objective_name, batch, img, gpu, **extra)
    ctx = init_distributed(gpu)
    info = dataset_info(data_root, "train")
    model = create_model(model_name, **model_kwargs(cfg, info.num_classes))
    objective = build_objective(cfg.objective)
    engine, _, _ = build_engine(model, cfg, ctx)
    loader = make_train_loader(info, cfg.data, rank=0, world_size=1, img_size=img, seed=0)
    to_device = (
        batch_to_device(ctx.device, cfg.data, img)
        if gpu
        else DeviceDecode(ctx.device, img, pil_decoder(ctx.device))
    )
    it = iter(loader)
    for step in range(3):
        loss, *_ = train_step(engine, objective, it, to_device, 0, step, 1, 0)
    float(loss)
    waited = 0.0
    t0 = time.perf_counter()
    for step in range(3, 3 + steps):
        loss, _, _, w = train_step(engine, objective, it, to_device, 0, step, 1, 0)
        waited += w
    float(loss)
    elapsed = time.perf_counter() - t0
    _shutdown_loader(it)
    return {
        "model": model_name,
        "decode": "cuda" if gpu else "cuda, PIL standing in for nvJPEG",
        "workers": workers,
        "images_per_s": steps * batch / elapsed,
        "data_wait_fraction": waited / elapsed,
    }


def child(args: argparse.Namespace) -> None:
    """One case in this process; prints its JSON on the last line."""
    os.environ.update(
        RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=args.port
    )
    spec = json.loads(args.spec)
    if args.case == "train":
        result = run_training(
            tuple(spec["case"]), spec["compiled"], spec["steps"], spec["warmup"], spec["gpu"]
        )
    elif args.case == "loader":
        result = run_loader(
            spec["decode"],
            spec["data"],
            spec["batch"],
            spec["img"],
            spec["batches"],
            spec["gpu"],
            spec["workers"],
        )
    else:
        result = run_fed_training(
            spec["data"], tuple(spec["case"]), spec["steps"], spec["gpu"], spec["workers"]
        )
    print(json.dumps(result))


# ---------------------------------------------------------------------- the orchestrating process


def _run_case(kind: str, spec: dict, timeout: float) -> dict:
    env = {**os.environ}
    if not spec.get("gpu"):
        env.setdefault("DS_ACCELERATOR", "cpu")
    cmd = [sys.executable, __file__, "--child", kind, "--spec", json.dumps(spec), "--port", str(_free_port())]
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
    except subprocess.TimeoutExpired:
        return {"error": f"timed out after {timeout:.0f} s", **spec}
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        return {"error": (proc.stderr or proc.stdout).strip().splitlines()[-1:], **spec, "wall_s": wall}
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    result["wall_s"] = round(wall, 1)
    return result


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--dry-run", action="store_true", help="debug models on CPU, a few steps: checks the code")
    p.add_argument("--cpu-compile", action="store_true", help="eager vs compiled ViT-S/16 at 64 px on CPU")
    p.add_argument("--out", help="JSON path; default bench/results/gpu-<device>.json (dry run: print only)")
    p.add_argument("--steps", type=int, help="timed steps per training case")
    p.add_argument(
        "--budget-s", type=float, default=450.0, help="wall-clock budget; later cases get what is left"
    )
    p.add_argument("--no-compile", action="store_true", help="eager cases only")
    p.add_argument("--child", choices=["train", "loader", "fed"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--port", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        args.case = args.child
        return child(args)

    import torch

    gpu = torch.cuda.is_available() and not (args.dry_run or args.cpu_compile)
    if not gpu and not (args.dry_run or args.cpu_compile):
        p.error("no CUDA device here: run with --dry-run (debug models on CPU) or --cpu-compile")
    device = "cpu"  # on a GPU: the name the first case reports (this process makes no CUDA context)
    cases = GPU_CASES if gpu else CPU_COMPILE_CASES if args.cpu_compile else DRY_CASES
    steps = args.steps or (30 if gpu else 10 if args.cpu_compile else 2)
    warmup = 5 if gpu else 3 if args.cpu_compile else 1
    # Loader workers: up to 8 (one GPU's share of a 16-core-per-GPU node, and an epoch of 64 shards still
    # gives every worker a batch of 256).
    workers = min(8, max(1, (os.cpu_count() or 2) - 1)) if gpu else 1
    started = time.perf_counter()
    deadline = started + args.budget_s

    def timeout(most: float) -> float:  # every case gets what is left of the budget, at most `most`
        return max(30.0, min(most, deadline - time.perf_counter()))

    result: dict = {
        "benchmark": "gpu",
        "device": device,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "training": {},
        "loader": {},
    }

    for name, case in cases.items():
        for compiled in (False, True):
            if compiled and (args.no_compile or (args.dry_run and name != "vit_b16")):
                continue  # the dry run compiles one case: compiling on CPU takes minutes per model
            spec = {"case": case, "compiled": compiled, "steps": steps, "warmup": warmup, "gpu": gpu}
            r = _run_case("train", spec, timeout=timeout(240))
            device = r.get("device", device)
            result["training"][f"{name}{'_compiled' if compiled else ''}"] = r
            print(
                f"{name:14s} compiled={compiled!s:5s} {r.get('images_per_s', 0):9.1f} img/s "
                f"mfu={r.get('mfu')} {r.get('error', '')}",
                flush=True,
            )

    result["device"] = device
    if not args.cpu_compile:
        with tempfile.TemporaryDirectory() as tmp:
            data = str(_jpeg_dataset(Path(tmp) / "jpegs", 4096 if gpu else 64))
            batch, img, batches = (256, 224, 12) if gpu else (8, 32, 3)
            for decode in ("cpu", "cuda"):
                spec = {
                    "decode": decode,
                    "data": data,
                    "batch": batch,
                    "img": img,
                    "batches": batches,
                    "gpu": gpu,
                    "workers": workers,
                }
                result["loader"][decode] = _run_case("loader", spec, timeout=timeout(120))
            spec = {"data": data, "case": cases["vit_b16"], "steps": steps, "gpu": gpu, "workers": workers}
            result["loader"]["cuda_into_vit_b16"] = _run_case("fed", spec, timeout=timeout(180))

    training = result["training"]
    result["goals"] = {
        name: {
            "mfu_goal": goal,
            "mfu": max((training.get(k, {}).get("mfu") or 0.0) for k in (name, f"{name}_compiled")),
        }
        for name, goal in GOALS.items()
    }
    fed = result["loader"].get("cuda_into_vit_b16", {})
    result["goals"]["cuda_decode_into_vit_b16"] = {
        "images_per_s_goal": CUDA_DECODE_GOAL,
        "images_per_s": fed.get("images_per_s"),
        "data_wait_fraction": fed.get("data_wait_fraction"),
    }
    if args.cpu_compile:
        eager, comp = training["vit_s16_64px"], training["vit_s16_64px_compiled"]
        result["compiled_over_eager_images_per_s"] = comp.get("images_per_s", 0) / max(
            eager.get("images_per_s", 1e-9), 1e-9
        )
    result["wall_s"] = round(time.perf_counter() - started, 1)
    result["errors"] = sorted(
        k for section in ("training", "loader") for k, v in result[section].items() if "error" in v
    )
    text = json.dumps(result, indent=2)
    print(text)
    out = args.out or (
        None if args.dry_run else str(ROOT / "bench/results" / f"gpu-{device.replace(' ', '_')}.json")
    )
    if out:
        Path(out).write_text(text + "\n")
    if result["errors"]:
        sys.exit(f"{len(result['errors'])} case(s) failed: {', '.join(result['errors'])}")


if __name__ == "__main__":
    main()
