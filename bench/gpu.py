"""GPU training throughput, MFU and peak memory for the reference models, and the loader with CPU and CUDA
decode, on whatever GPU this machine has: one short run that fits a few minutes of borrowed device time.

    .venv/bin/python bench/gpu.py                              # default cases: bench/results/gpu-<device>.json
    .venv/bin/python bench/gpu.py --list                       # the cases, their settings and time caps
    .venv/bin/python bench/gpu.py --cases vit_b16,loader_cuda  # only these (`all`: the opt-in ones too)
    .venv/bin/python bench/gpu.py --dry-run                    # the same code on CPU, debug models (CI runs it)
    .venv/bin/python bench/gpu.py --cpu-compile --out bench/results/compile-cpu.json   # eager vs compiled, CPU

Training cases (one GPU, bf16, 224 px, the real engine, objective and `train_step` of the training loop,
batches already on the device, so the model alone is measured): images/s over the timed steps (after
warm-up; a device sync only at the end), MFU (model FLOPs: 3 x forward, MAE's encoder on the kept 25%) and
HFU (with the forward that activation checkpointing recomputes) against this GPU's dense peak, peak memory,
and the host syncs of the timed steps (`torch.cuda.set_sync_debug_mode("warn")`).
Loader cases: 500x375 JPEG shards (`data_prep.synthetic`, built first, inside the budget) into 224 px batches
on the device with CPU decode (PIL in the workers) and CUDA decode (nvJPEG, prefetched a step ahead); then
ViT-B/16 training fed by the CUDA-decode loader, with the host's wait and the GPU's idle fraction.

Each case runs in its own process (clean memory counters, no engine left over) under a time cap (on a GPU:
the caps are an H200's; CPU runs have only the budget), and the whole run under `--budget-s` (default 420 s, dataset building included): a case that would start with less
than MIN_CASE_S left is skipped. The JSON is rewritten (atomically) after every case, each case marked
done, failed (with the exception's last lines) or skipped, so a run killed at its limit keeps what it did.
docs/gpu.md gives the arithmetic of the default run's time and the goals:
MFU >= 0.45 (ViT-B/16), >= 0.50 (ViT-H/14), >= 0.40 (MAE-H/14) on one H200; CUDA decode feeding ViT-B/16 at
>= 4,000 images/s with the GPU idle < 5% of the time.
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
from dataclasses import asdict, dataclass, field
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from provenance import provenance  # noqa: E402  (bench/provenance.py, beside this file)

from data_prep import atomic  # noqa: E402  (after the path set-up, as a script)

BUDGET_S = 420.0  # the default run's hard total: 7 minutes
MIN_CASE_S = 20.0  # a case needs at least this (process start, imports, engine) to report anything
CLASSES = 1000
JPEGS = 4096  # 16 batches of 256: every loader worker of 8 gets whole shards of 64


@dataclass(frozen=True)
class Train:
    """One training case: the model and how it is trained; steps timed after `warmup` untimed ones."""

    model: str
    zero: int
    checkpointing: float  # model.grad_checkpointing: the fraction of blocks recomputed in backward
    objective: str
    batch: int
    img: int = 224
    compiled: bool = False
    steps: int = 20
    warmup: int = 3

    def dry(self) -> Train:  # the same code path at a debug size, on CPU
        small = "mae_vit_debug" if self.objective == "mae" else "vit_debug"
        return Train(small, self.zero, self.checkpointing, self.objective, 8, 32, self.compiled, 2, 1)


@dataclass(frozen=True)
class Case:
    kind: str  # "train", "loader" (decode into device batches) or "fed" (CUDA-decode loader into training)
    cap_s: float  # the most this case may take (process start to result), within what is left of the budget
    expected_s: float  # what the case should take on one H200 (docs/gpu.md's arithmetic)
    train: Train | None = None
    decode: str | None = None
    default: bool = True
    why: str = ""
    extra: dict = field(default_factory=dict)


# In run order: the goals' cases first, so a short budget still measures them.
CASES: dict[str, Case] = {
    "vit_b16": Case("train", 60, 30, Train("vit_b16", 1, 0.0, "supervised_softmax", 256, steps=30)),
    "vit_h14": Case(
        "train",
        90,
        45,
        Train("vit_h14", 1, 0.0, "supervised_softmax", 128, steps=15),
        why="ZeRO-1, no recompute: ~46 GB of activations + ~13 GB of model states fit one H200",
    ),
    "mae_vit_h14": Case("train", 90, 40, Train("mae_vit_h14", 1, 0.0, "mae", 256, steps=15)),
    "loader_cuda": Case("loader", 45, 20, decode="cuda"),
    "fed_cuda_vit_b16": Case("fed", 60, 30, Train("vit_b16", 1, 0.0, "supervised_softmax", 256, steps=30)),
    "loader_cpu": Case("loader", 45, 20, decode="cpu"),
    "vit_h14_zero3_ckpt": Case(
        "train",
        90,
        45,
        Train("vit_h14", 3, 1.0, "supervised_softmax", 128, steps=10),
        why="the multi-GPU recipe's memory: ZeRO-3 and every block recomputed",
    ),
    "vit_b16_compiled": Case(
        "train",
        120,
        75,
        Train("vit_b16", 1, 0.0, "supervised_softmax", 256, compiled=True, steps=30, warmup=5),
        why="compiled per block under ZeRO-1, where a block's parameters are whole",
    ),
    # Opt-in (--cases NAME or all): not needed for a goal.
    "vit_l16": Case("train", 90, 40, Train("vit_l16", 1, 0.0, "supervised_softmax", 128), default=False),
    "vit_h14_compiled": Case(
        "train",
        180,
        100,
        Train("vit_h14", 1, 0.0, "supervised_softmax", 128, compiled=True, steps=15, warmup=5),
        default=False,
    ),
    "mae_vit_h14_zero3_ckpt": Case(
        "train", 90, 45, Train("mae_vit_h14", 3, 1.0, "mae", 256, steps=10), default=False
    ),
}
CPU_COMPILE_CASES = {
    name: Case("train", 600, 60, Train("vit_s16", 1, 0.0, "supervised_softmax", 32, 64, compiled, 10, 3))
    for name, compiled in (("vit_s16_64px", False), ("vit_s16_64px_compiled", True))
}
GOALS = {"vit_b16": 0.45, "vit_h14": 0.50, "mae_vit_h14": 0.40}
CUDA_DECODE_GOAL = {"images_per_s": 4000.0, "gpu_idle_fraction": 0.05}


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _stage_config(t: Train, gpu: bool, data: dict | None = None):
    """A stage config for one case. `data.decode: cuda` on CPU (the dry run) is set after validation,
    which refuses it without a GPU: the dry run feeds the same path a PIL decoder instead of nvJPEG."""
    from pipeline.config import validate_config

    data = dict(data or {})
    decode = data.pop("decode", "cpu")
    cfg = validate_config(
        {
            "name": "bench",
            "data": {"train": "unused", "batch_size": t.batch, "decode": decode if gpu else "cpu", **data},
            "model": {
                "name": t.model,
                "img_size": t.img,
                "num_classes": CLASSES,
                "compile": t.compiled,
                "grad_checkpointing": t.checkpointing,
            },
            "objective": {"name": t.objective},
            "optim": {"steps": 100_000, "warmup_steps": 0},
            # One GPU reduces nothing: no overlap, and no per-backward device sync from DeepSpeed's epilogue.
            "deepspeed": {"zero_stage": t.zero, "overlap_comm": False},
            "cluster": {"launcher": "local", "use_gpu": gpu},
        }
    )
    cfg.data.decode = decode
    return cfg


def _build(t: Train, gpu: bool, num_classes: int = CLASSES, data: dict | None = None):
    """(cfg, ctx, engine, objective, forward FLOPs per image) for a training case, the model made on the device."""
    import torch

    from pipeline.distributed import init_distributed
    from pipeline.models import create_model
    from pipeline.objectives import build_objective
    from pipeline.stage import model_kwargs
    from pipeline.train.engine import build_engine
    from pipeline.train.loop import _flops_per_image

    cfg = _stage_config(t, gpu, data)
    ctx = init_distributed(gpu)
    torch.manual_seed(0)
    with torch.device(ctx.device):  # initialised where it trains: ViT-H on the host takes tens of seconds
        model = create_model(t.model, **model_kwargs(cfg, num_classes))
    flops = _flops_per_image(model)
    objective = build_objective(cfg.objective)
    engine, _, _ = build_engine(model, cfg, ctx)
    objective.prepare(engine.module, ctx.device)
    return cfg, ctx, engine, objective, flops


# ---------------------------------------------------------------------- one case, in its own process


def run_training(t: Train, gpu: bool) -> dict:
    import torch

    from pipeline.hardware import peak_flops
    from pipeline.models.layers import checkpointed_fraction
    from pipeline.train.loop import train_step

    cfg, ctx, engine, objective, flops = _build(t, gpu)
    recomputed = checkpointed_fraction(engine.module)  # the blocks' share that runs its forward twice
    g = torch.Generator(device=ctx.device).manual_seed(0)
    batch = {
        "image": torch.randint(
            0, 256, (t.batch, 3, t.img, t.img), dtype=torch.uint8, device=ctx.device, generator=g
        ),
        "target": torch.randint(0, CLASSES, (t.batch,), device=ctx.device, generator=g),
        "skipped": 0,
    }
    stream = iter(lambda: batch, None)

    def sync() -> None:
        if gpu:
            torch.cuda.synchronize()

    t_warm = time.perf_counter()
    for step in range(t.warmup):  # compilation (if any), allocator warm-up, ZeRO-3 trace recording
        loss, *_ = train_step(engine, objective, stream, dict, 0, step, 1, 0)
    float(loss)
    sync()
    warmup_s = time.perf_counter() - t_warm
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
        for step in range(t.warmup, t.warmup + t.steps):
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
        images_per_s = t.steps * t.batch / elapsed
    else:  # the median step: a shared CPU's other jobs show up as outliers, not in the median
        images_per_s = t.batch / statistics.median([b - a for a, b in zip(marks, marks[1:])])
    device_name = torch.cuda.get_device_name(ctx.device) if gpu else platform.processor() or "cpu"
    peak = peak_flops(device_name, cfg.deepspeed.precision, cfg.deepspeed.tf32) if gpu else None
    out = {
        "device": device_name,
        **asdict(t),
        "precision": cfg.deepspeed.precision,
        "warmup_s": round(warmup_s, 2),
        "images_per_s": images_per_s,
        "step_s": elapsed / t.steps,
        "final_loss": final,
        "forward_flops_per_image": flops,
        "peak_tflops": None if peak is None else peak / 1e12,
        "checkpointed_fraction": recomputed,
        "host_syncs_in_timed_steps": len(syncs),
        "host_sync_examples": sorted(set(syncs))[:5],
    }
    if peak and flops:
        out["mfu"] = 3 * flops * images_per_s / peak
        out["hfu"] = (3 + recomputed) * flops * images_per_s / peak
    if gpu:
        out["peak_memory_gib"] = torch.cuda.max_memory_allocated(ctx.device) / 2**30
    return out


def build_jpegs(root: str, num: int) -> dict:
    """The loader cases' dataset: `num` 500x375 JPEGs of the JFT-like synthetic corpus, 64 per shard."""
    from data_prep.synthetic import class_names, synthetic_samples
    from data_prep.writer import write_dataset

    t0 = time.perf_counter()
    if not (Path(root) / "manifest.json").exists():
        write_dataset(
            Path(root), synthetic_samples(num, 100, seed=0), class_names(100), multi_label=True, max_count=64
        )
    return {"images": num, "seconds": round(time.perf_counter() - t0, 1)}


def _device_batches(loader, data_cfg, img: int, device, gpu: bool):
    """The loop's batch iterator for decode cuda: a prefetch thread running DeviceDecode (nvJPEG on a GPU,
    PIL on the dry run's CPU) a batch ahead. -> (batches, to_device for train_step)."""
    from pipeline.data.device import DeviceDecode, batch_to_device, pil_decoder, prefetch

    to_device = (
        batch_to_device(device, data_cfg, img) if gpu else DeviceDecode(device, img, pil_decoder(device))
    )
    return prefetch(iter(loader), to_device, device)


def run_loader(
    decode: str, data_root: str, batch: int, img: int, batches: int, gpu: bool, workers: int
) -> dict:
    import torch

    from pipeline.data.device import batch_to_device
    from pipeline.data.loader import make_train_loader
    from pipeline.data.sources import dataset_info
    from pipeline.train.loop import _shutdown_loader

    device = torch.device("cuda", 0) if gpu else torch.device("cpu")
    t = Train("vit_b16", 1, 0.0, "supervised_softmax", batch, img)
    cfg = _stage_config(t, gpu, {"num_workers": workers, "decode": decode, "shuffle_buffer": 64})
    info = dataset_info(data_root, "train")
    loader = make_train_loader(info, cfg.data, rank=0, world_size=1, img_size=img, seed=0, pin_memory=gpu)
    if decode == "cuda":
        it, to_device = _device_batches(loader, cfg.data, img, device, gpu)
    else:
        it, to_device = iter(loader), batch_to_device(device, cfg.data, img)
    # Past what is made ahead before timing starts: each worker's prefetch_factor (2) batches and the
    # prefetch thread's queue (2) and batch in hand; the timed batches are then made while timed.
    for _ in range(2 * workers + 3 + 2):
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
    if out["image"].shape != (batch, 3, img, img):
        raise AssertionError(f"loader batch of shape {tuple(out['image'].shape)}, not {(batch, 3, img, img)}")
    return {"decode": decode, "workers": workers, "batch": batch, "images_per_s": batches * batch / elapsed}


def run_fed_training(data_root: str, t: Train, gpu: bool, workers: int) -> dict:
    """ViT-B/16 training fed by the CUDA-decode loader: images/s, the host's wait and the GPU's idle time."""
    import torch

    from pipeline.data.loader import make_train_loader
    from pipeline.data.sources import dataset_info
    from pipeline.train.loop import _shutdown_loader, train_step

    info = dataset_info(data_root, "train")
    data = {"num_workers": workers, "decode": "cuda", "shuffle_buffer": 64}
    cfg, ctx, engine, objective, _ = _build(t, gpu, info.num_classes, data)
    loader = make_train_loader(info, cfg.data, rank=0, world_size=1, img_size=t.img, seed=0, pin_memory=gpu)
    it, to_device = _device_batches(loader, cfg.data, t.img, ctx.device, gpu)
    for step in range(t.warmup):
        loss, *_ = train_step(engine, objective, it, to_device, 0, step, 1, 0)
    float(loss)
    it.gpu_idle_seconds()  # the warm-up's idle time left out
    waited = 0.0
    t0 = time.perf_counter()
    for step in range(t.warmup, t.warmup + t.steps):
        loss, _, _, w, _ = train_step(engine, objective, it, to_device, 0, step, 1, 0)
        waited += w
    float(loss)
    if gpu:
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    idle = it.gpu_idle_seconds()
    _shutdown_loader(it)
    return {
        "model": t.model,
        "decode": "cuda" if gpu else "cuda, PIL standing in for nvJPEG",
        "workers": workers,
        "images_per_s": t.steps * t.batch / elapsed,
        "data_wait_fraction": waited / elapsed,
        "gpu_idle_fraction": None if idle is None else idle / elapsed,
    }


def child(kind: str, spec: dict, result_path: Path) -> None:
    """One case in this process: its result (or its exception's last lines) goes to `result_path`."""
    from pipeline.distributed import shutdown_distributed

    try:
        if kind == "train":
            result = run_training(Train(**spec["train"]), spec["gpu"])
        elif kind == "data":
            result = build_jpegs(spec["data"], spec["num"])
        elif kind == "loader":
            args = ("decode", "data", "batch", "img", "batches", "gpu", "workers")
            result = run_loader(*(spec[k] for k in args))
        else:
            result = run_fed_training(spec["data"], Train(**spec["train"]), spec["gpu"], spec["workers"])
    except BaseException as exc:
        lines = "".join(traceback.format_exception(exc)).rstrip().splitlines()
        atomic.write_json(result_path, {"status": "failed", "error": lines[-12:]})
        raise  # no group destroy after a failure: after a CUDA error NCCL's teardown can hang
    # Destroyed on success (engine.shutdown_distributed's rule), else NCCL warns that it never was.
    shutdown_distributed()
    atomic.write_json(result_path, {"status": "done", **result})


# ---------------------------------------------------------------------- the orchestrating process


def _stderr_tail(text: str, n: int = 12) -> list[str]:
    """The last lines of a child's stderr that say something (not NCCL's or Python's shutdown warnings)."""
    noise = ("destroy_process_group", "ProcessGroupNCCL", "warnings.warn")
    lines = [line for line in (text or "").rstrip().splitlines() if not any(s in line for s in noise)]
    return lines[-n:]


def run_case(kind: str, spec: dict, timeout: float) -> dict:
    env = {**os.environ, "RANK": "0", "LOCAL_RANK": "0", "WORLD_SIZE": "1"}
    env.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))
    env["DS_ACCELERATOR"] = "cuda" if spec.get("gpu") else "cpu"  # the case's device, whatever is exported
    with tempfile.TemporaryDirectory() as tmp:
        result_path = Path(tmp) / "result.json"
        cmd = [
            sys.executable,
            __file__,
            "--child",
            kind,
            "--spec",
            json.dumps(spec),
            "--result",
            str(result_path),
        ]
        t0 = time.perf_counter()
        try:
            proc = subprocess.run(cmd, cwd=ROOT, env=env, capture_output=True, text=True, timeout=timeout)
            stderr, code = proc.stderr, proc.returncode
        except subprocess.TimeoutExpired as exc:
            err = exc.stderr.decode(errors="replace") if isinstance(exc.stderr, bytes) else exc.stderr
            stderr, code = (
                f"{err or ''}\ntimed out after {timeout:.0f} s (its cap, or what was left of the budget)",
                None,
            )
        wall = round(time.perf_counter() - t0, 1)
        if result_path.exists():
            result = json.loads(result_path.read_text())
        else:  # killed, crashed in C++, or timed out before it could write
            result = {"status": "failed", "exit_code": code, "error": _stderr_tail(stderr)}
    return {**result, "wall_s": wall}


def _selected(names: str | None, table: dict[str, Case], parser: argparse.ArgumentParser) -> list[str]:
    if names is None:
        return [n for n, c in table.items() if c.default]
    if names == "all":
        return list(table)
    chosen = [n.strip() for n in names.split(",") if n.strip()]
    unknown = [n for n in chosen if n not in table]
    if unknown:
        parser.error(f"--cases: unknown {', '.join(unknown)}; the cases are {', '.join(table)} (or all)")
    return [n for n in table if n in chosen]  # the table's order: goals first


def main() -> None:
    started = time.perf_counter()
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument(
        "--cases", help="comma-separated case names (see --list), or all; default: the default set"
    )
    p.add_argument("--list", action="store_true", help="print the cases and exit")
    p.add_argument("--budget-s", type=float, default=BUDGET_S, help="hard wall-clock total, dataset included")
    p.add_argument("--dry-run", action="store_true", help="debug models on CPU, a few steps: checks the code")
    p.add_argument("--cpu-compile", action="store_true", help="eager vs compiled ViT-S/16 at 64 px on CPU")
    p.add_argument("--out", help="JSON path; default bench/results/gpu-<device>.json (dry run: print only)")
    p.add_argument("--child", choices=["train", "data", "loader", "fed"], help=argparse.SUPPRESS)
    p.add_argument("--spec", help=argparse.SUPPRESS)
    p.add_argument("--result", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        return child(args.child, json.loads(args.spec), Path(args.result))
    table = CPU_COMPILE_CASES if args.cpu_compile else CASES
    if args.list:
        for name, c in table.items():
            setting = asdict(c.train) if c.train else {"decode": c.decode}
            flag = "" if c.default else " (opt-in)"
            print(f"{name}{flag}: expected {c.expected_s:.0f} s, cap {c.cap_s:.0f} s; {setting} {c.why}")
        return
    names = _selected(args.cases, table, p)

    import torch

    gpu = torch.cuda.is_available() and not (args.dry_run or args.cpu_compile)
    if not gpu and not (args.dry_run or args.cpu_compile):
        p.error("no CUDA device here: run with --dry-run (debug models on CPU) or --cpu-compile")
    deadline = started + args.budget_s
    # Loader workers: up to 8 (one GPU's share of a 16-core-per-GPU node); 1 on the dry run's CPU.
    workers = min(8, max(1, (os.cpu_count() or 2) - 1)) if gpu else 1
    # The name only: no CUDA context is made here (the cases' processes make their own).
    device = torch.cuda.get_device_name(0) if gpu else platform.processor() or "cpu"
    default_out = None if args.dry_run else ROOT / "bench/results" / f"gpu-{device.replace(' ', '_')}.json"
    out = args.out or default_out
    result: dict = {
        "benchmark": "gpu",
        "device": device,
        "dry_run": args.dry_run,
        "torch": torch.__version__,
        "cuda": torch.version.cuda,
        "provenance": provenance(),
        "budget_s": args.budget_s,
        "cases": {n: {"status": "pending"} for n in names},
    }

    def write() -> None:
        result["wall_s"] = round(time.perf_counter() - started, 1)
        result["goals"] = _goals(result["cases"])
        result["errors"] = sorted(n for n, r in result["cases"].items() if r.get("status") == "failed")
        if out:
            atomic.write_json(Path(out), result, indent=2)

    write()  # a file from the start: a run killed during its first case still says what it was to run
    tmp = tempfile.TemporaryDirectory()
    data_root = str(Path(tmp.name) / "jpegs")
    data_state: dict | None = None
    try:
        for name in names:
            case = table[name]
            left = deadline - time.perf_counter()
            needs_data = case.kind in ("loader", "fed")
            if needs_data and data_state is None:  # the loader cases' dataset, once, inside the budget
                if left < MIN_CASE_S:
                    data_state = {"status": "skipped", "reason": f"{left:.0f} s of the budget left"}
                else:
                    spec = {"data": data_root, "num": JPEGS if gpu else 64}
                    data_state = run_case("data", spec, timeout=min(60.0, left) if gpu else left)
                result["dataset"] = data_state
                left = deadline - time.perf_counter()
            if needs_data and data_state.get("status") != "done":
                why = data_state.get("reason") or data_state.get("status")
                result["cases"][name] = {"status": "skipped", "reason": f"no JPEG dataset ({why})"}
            elif left < MIN_CASE_S:
                result["cases"][name] = {"status": "skipped", "reason": f"{left:.0f} s of the budget left"}
            else:
                result["cases"][name] = run_case(
                    case.kind,
                    _spec(case, gpu, data_root, workers, args.dry_run),
                    min(case.cap_s, left) if gpu else left,
                )
            r = result["cases"][name]
            write()
            print(f"{name:22s} {r['status']:8s} {_summary(r)}", flush=True)
    finally:
        tmp.cleanup()
    if args.cpu_compile:
        cases = result["cases"]
        eager, comp = cases["vit_s16_64px"], cases.get("vit_s16_64px_compiled", {})
        result["compiled_over_eager_images_per_s"] = comp.get("images_per_s", 0) / max(
            eager.get("images_per_s", 1e-9), 1e-9
        )
    write()
    print(json.dumps(result, indent=2))
    if result["errors"]:
        sys.exit(f"{len(result['errors'])} case(s) failed: {', '.join(result['errors'])}")


def _spec(case: Case, gpu: bool, data_root: str, workers: int, dry: bool) -> dict:
    t = case.train.dry() if dry and case.train else case.train
    if case.kind == "train":
        return {"train": asdict(t), "gpu": gpu}
    if case.kind == "loader":
        batch, img, batches = (256, 224, 24) if gpu else (8, 32, 3)
        return {
            "decode": case.decode,
            "data": data_root,
            "batch": batch,
            "img": img,
            "batches": batches,
            "gpu": gpu,
            "workers": workers,
        }
    return {"data": data_root, "train": asdict(t), "gpu": gpu, "workers": workers}


def _summary(r: dict) -> str:
    if r.get("status") != "done":
        return r.get("reason") or " | ".join((r.get("error") or [])[-2:])
    parts = [f"{r['images_per_s']:.1f} img/s" if "images_per_s" in r else ""]
    for key in ("mfu", "hfu", "peak_memory_gib", "data_wait_fraction", "gpu_idle_fraction"):
        if r.get(key) is not None:
            parts.append(f"{key}={r[key]:.3f}")
    return f"{' '.join(p for p in parts if p)} ({r['wall_s']} s)"


def _goals(cases: dict) -> dict:
    goals = {}
    for name, goal in GOALS.items():
        measured = [cases[k].get("mfu") for k in (name, f"{name}_compiled") if k in cases]
        measured = [m for m in measured if m is not None]
        goals[name] = {"mfu_goal": goal, "mfu": max(measured) if measured else None}
        if goals[name]["mfu"] is not None:
            goals[name]["met"] = goals[name]["mfu"] >= goal
    fed = cases.get("fed_cuda_vit_b16", {})
    goals["cuda_decode_into_vit_b16"] = {
        "images_per_s_goal": CUDA_DECODE_GOAL["images_per_s"],
        "gpu_idle_fraction_goal": CUDA_DECODE_GOAL["gpu_idle_fraction"],
        "images_per_s": fed.get("images_per_s"),
        "gpu_idle_fraction": fed.get("gpu_idle_fraction"),
        "data_wait_fraction": fed.get("data_wait_fraction"),
    }
    return goals


if __name__ == "__main__":
    main()
