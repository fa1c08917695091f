"""The whole journey on embedded defaults, as `make demo` runs it on a laptop (CPU, local Ray, SQLite MLflow).

    .venv/bin/python -m cluster.demo [--size full|small]

1. `vitpipe shard synthetic` writes a JFT-like multi-label corpus, `vitpipe shard digits` the real digits;
2. a local Ray cluster starts (a head and a second node, token authentication on, 127.0.0.1);
3. `vitpipe submit configs/experiments/demo.yaml --follow` runs MAE pretraining, fine-tuning and
   evaluation on digits, and the same fine-tuning from scratch, on 2 Ray Train workers with ZeRO-2;
4. it prints the `vitpipe compare` table, the figures, and the command that opens the MLflow UI.

Re-running reuses the shards and the finished stages (with every stage finished, no Ray cluster starts).
`--size small` is the same journey, shorter (CI runs it as a test).
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import torch

from cluster import local
from cluster.run import finished
from pipeline.config import load_experiment

ROOT = Path(__file__).resolve().parents[1]
CONFIG = "configs/experiments/demo.yaml"
SIZES = {
    # synthetic images, pretraining steps, fine-tuning steps
    "full": {"synthetic": 6000, "pretrain": 300, "finetune": 1000},
    "small": {"synthetic": 600, "pretrain": 20, "finetune": 30},
}


def vitpipe(*args: str, env: dict | None = None) -> None:
    cmd = [sys.executable, "-m", "vitpipe", *args]
    print("$ vitpipe " + " ".join(args), flush=True)
    subprocess.run(cmd, cwd=ROOT, env={**os.environ, **(env or {})}, check=True)


def shard(data: Path, size: dict) -> None:
    synthetic, digits = data / "synthetic", data / "digits"
    if not (synthetic / "manifest.json").is_file():
        vitpipe(
            "shard",
            "synthetic",
            str(synthetic),
            "--num",
            str(size["synthetic"]),
            "--classes",
            "20",
            "--width",
            "96",
            "--height",
            "72",
            "--max-count",
            str(max(50, size["synthetic"] // 8)),
            "--no-progress",
        )
    if not (digits / "manifest.json").is_file():
        vitpipe(
            "shard",
            "digits",
            str(digits),
            "--size",
            "32",
            "--val-fraction",
            "0.2",
            "--max-count",
            "200",
            "--no-progress",
        )


def all_finished(overrides: list[str]) -> bool:
    """Whether every stage of the demo experiment has finished (its DONE.json): then a re-run needs no Ray
    cluster, only the comparison. Says so for each stage."""
    exp = load_experiment(ROOT / CONFIG, overrides)
    done = {name: finished(cfg) for name, cfg in exp.stages}
    if not all(done.values()):
        return False
    for name, where in done.items():
        print(f"[{exp.name}] stage {name}: already finished ({where})", flush=True)
    print(f"every stage has finished: no Ray cluster needed (delete {exp.run_path} to run them again)")
    return True


def submit(overrides: list[str]) -> None:
    """Start a local Ray cluster, run the experiment on it as a Ray job, stop the cluster."""
    temp_dir = tempfile.mkdtemp(prefix="vpdemo", dir="/tmp")  # short: Ray's socket paths have a length limit
    print(f"starting a local Ray cluster (head + 1 node, token auth) in {temp_dir}", flush=True)
    cluster = local.start_head(temp_dir, num_cpus=2)
    try:
        local.add_worker_node(cluster, num_cpus=2)
        env = {"RAY_AUTH_MODE": "token", "RAY_ADDRESS": cluster.dashboard_url}
        vitpipe("submit", CONFIG, *overrides, "--follow", "--python", sys.executable, env=env)
    finally:
        local.stop(cluster)
    # The session's logs, sockets and packages; kept (and named above) when the job failed.
    shutil.rmtree(temp_dir, ignore_errors=True)
    shutil.rmtree(f"{temp_dir}-worker1", ignore_errors=True)


def device_overrides(gpus: int, workers: int) -> list[str]:
    """The demo's device on a machine with `gpus` GPUs. cluster.local's head offers them all (its other node
    none), so `cluster.use_gpu: auto` decides well with none (CPU) or one per worker (GPUs); with fewer than
    the workers it would choose GPUs and wait for the missing ones: the demo runs on the CPU instead."""
    if 0 < gpus < workers:
        print(f"this machine has {gpus} GPU(s) for the demo's {workers} workers: the demo runs on the CPU")
        return ["cluster.use_gpu=false"]
    return []


def main(argv: list[str] | None = None) -> int:
    try:
        return _demo(argv)
    except subprocess.CalledProcessError as exc:  # the failing command already printed why
        print(f"\ndemo failed: `{' '.join(exc.cmd[2:])}` exited {exc.returncode}", file=sys.stderr)
        return 1


def _demo(argv: list[str] | None) -> int:
    p = argparse.ArgumentParser(prog="python -m cluster.demo", description=__doc__.splitlines()[0])
    p.add_argument("--size", choices=sorted(SIZES), default="full")
    p.add_argument("--run-dir", default=None, help="default runs/demo (runs/demo-small for --size small)")
    p.add_argument("--data-dir", default=None, help="default data/demo (data/demo-small for --size small)")
    args = p.parse_args(argv)
    size = SIZES[args.size]
    suffix = "" if args.size == "full" else f"-{args.size}"
    data = Path(args.data_dir or ROOT / f"data/demo{suffix}").resolve()
    run_dir = Path(args.run_dir or ROOT / f"runs/demo{suffix}").resolve()
    t0 = time.time()
    shard(data, size)
    overrides = [
        f"run_dir={run_dir}",
        f"stages.pretrain.data.train={data / 'synthetic'}",
        f"stages.pretrain.optim.steps={size['pretrain']}",
        f"stages.pretrain.optim.warmup_steps={size['pretrain'] // 10}",
        *(
            f"stages.{s}.data.train={data / 'digits'}"
            for s in ("finetune", "eval_finetune", "finetune_scratch", "eval_scratch")
        ),
        *(f"stages.{s}.optim.steps={size['finetune']}" for s in ("finetune", "finetune_scratch")),
        *(
            f"stages.{s}.optim.warmup_steps={size['finetune'] // 10}"
            for s in ("finetune", "finetune_scratch")
        ),
    ]
    workers = max(cfg.cluster.max_workers for _, cfg in load_experiment(ROOT / CONFIG, overrides).stages)
    overrides += device_overrides(torch.cuda.device_count(), workers)
    if not all_finished(overrides):
        submit(overrides)
    uri = f"sqlite:///{run_dir / 'mlflow.db'}"
    print(f"\nfinished in {time.time() - t0:.0f} s\n", flush=True)
    vitpipe(
        "compare",
        "--tracking-uri",
        uri,
        "--experiment",
        "demo",
        "--metric",
        "eval/top1",
        "--metric",
        "fewshot/10shot",
        "--metric",
        "train/loss",
    )
    figures = sorted(run_dir.glob("*/figures/*.png"))
    if figures:
        print("\nfigures:\n" + "\n".join(f"  {f}" for f in figures))
    print(
        f"\nMLflow UI: {Path(sys.executable).with_name('mlflow')} ui --backend-store-uri {uri} --host 127.0.0.1"
    )
    return 0


if __name__ == "__main__":
    sys.exit(main())
