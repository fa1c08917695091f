"""Checkpoints through object storage: a ViT-B ZeRO-3 stage of 2 ranks saving to and resuming from a bucket.

    .venv/bin/python bench/multinode.py --out bench/results/multinode.json [--quick] [--store URI]

Runs its workers under `torchrun --standalone --nproc-per-node 2` (gloo; CPU here, the same code on GPUs),
against a local S3-protocol server (moto, started here) unless --store names a bucket prefix whose
credentials are in the environment. What each rank does, `--repeats` times (medians reported):
- step_s: one optimizer step, the median of 3 (bf16, `--batch` images of `--img-size` per rank);
- local_save_s: a baseline, a synchronous save to the local disk only;
- save_s: the synchronous save through the bucket (`Checkpointer(asynchronous=False)`): every rank writes
  its ZeRO-3 partition, hashes and uploads it, rank 0 uploads COMPLETE.json and `latest` once all have (the
  time of the slowest rank): what a step waited for before saves ran in the background;
- async_stall_s: the asynchronous save through the bucket (`Checkpointer`, the default): the time `save`
  holds the step (every rank's host copy of its state; the slowest rank). Training steps then run until the
  save is complete on every rank; async_complete_s is from the save's start to then, and contention_s what
  those steps took beyond as many plain steps (the background thread's writing, hashing and uploading
  share this machine's 2 cores with both ranks; a GPU node's steps run on the GPU);
- resume_s: the local checkpoint folder deleted (a new machine), `checkpoint.resume`: list the bucket,
  download, verify the hashes, load into the engine;
- stall_fraction: async_stall_s / (every_steps x step_s), the share of wall time a stage saving every
  `--every-steps` steps (100 by default) spends held by saves (goal <= 1%); sync_stall_fraction the same
  for save_s, and stall_fraction_with_contention adds contention_s.
Then one rank alone (`torchrun --nproc-per-node 1`, a node lost for good) resumes the 2-rank checkpoint:
- reshard_resume_s: the local folder deleted again, `checkpoint.resume` on 1 rank: read its part of both
  saved ranks' optimizer states in byte ranges from the bucket (`pipeline.train.reshard`; on one rank, all of
  it) and load it; against resume_s, the same-world-size resume of the same run (reshard_over_resume).
  Measured at 2afc328 and before, this downloaded the whole tag and converted it to a universal checkpoint
  (`ds_to_universal`): 13.9 s, 2.54x the resume.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import re
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("DS_ACCELERATOR", "cpu")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

import torch  # noqa: E402
import torch.distributed as dist  # noqa: E402
from provenance import write_result  # noqa: E402  (bench/provenance.py, beside this file)

from data_prep.storage import Store  # noqa: E402
from pipeline.config import validate_config  # noqa: E402
from pipeline.data.transforms import normalize  # noqa: E402
from pipeline.distributed import init_distributed, shutdown_distributed
from pipeline.models import create_model  # noqa: E402
from pipeline.train import checkpoint  # noqa: E402
from pipeline.train.engine import build_engine  # noqa: E402
from pipeline.train.saving import Checkpointer  # noqa: E402
from pipeline.train.tag import COMPLETE  # noqa: E402


def slowest(seconds: float) -> float:
    """The slowest rank's time: a collective save or resume holds every rank until the last one is done."""
    t = torch.tensor([seconds], dtype=torch.float64)
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t.item())


def worker(args: argparse.Namespace) -> None:
    ctx = init_distributed(False)
    cfg = validate_config(
        {
            "name": "bench",
            "data": {"train": "unused", "batch_size": args.batch},
            "model": {"name": args.model, "img_size": args.img_size, "num_classes": 1000},
            "optim": {"steps": 1000, "warmup_steps": 0},
            "deepspeed": {"zero_stage": 3, "precision": "bf16"},
            "cluster": {"launcher": "local"},
        }
    )
    torch.manual_seed(0)
    model = create_model(args.model, img_size=args.img_size, num_classes=1000)
    num_params = sum(p.numel() for p in model.parameters())
    engine, _, _ = build_engine(model, cfg, ctx)
    x = normalize(torch.randint(0, 256, (args.batch, 3, args.img_size, args.img_size), dtype=torch.uint8))
    x = x.to(torch.bfloat16)
    y = torch.randint(0, 1000, (args.batch,))
    store = Store(args.store)
    ckpt_dir = Path(args.work) / "checkpoints"
    if args.reshard:  # one rank resumes what two saved
        times = []
        for _ in range(args.repeats):
            shutil.rmtree(ckpt_dir, ignore_errors=True)  # a new machine: only the bucket holds it
            t = time.perf_counter()
            restored = checkpoint.resume(engine, ckpt_dir, ctx.rank, ctx.world_size, store=store)
            times.append(time.perf_counter() - t)
            assert restored is not None and restored.saved_by == 2, restored
        Path(args.worker_out).write_text(json.dumps({"reshard_resume_s": times}))
        shutdown_distributed()
        return

    def train_step() -> float:
        t = time.perf_counter()
        loss = torch.nn.functional.cross_entropy(engine(x), y)
        engine.backward(loss)
        engine.step()
        return time.perf_counter() - t

    local = Checkpointer(
        engine, Path(args.work) / "local", ctx.rank, 1, local_rank=ctx.local_rank, asynchronous=False
    )
    sync = Checkpointer(
        engine, ckpt_dir, ctx.rank, 1, local_rank=ctx.local_rank, store=store, asynchronous=False
    )
    saver = Checkpointer(engine, ckpt_dir, ctx.rank, 1, local_rank=ctx.local_rank, store=store)
    runs = {
        k: []
        for k in (
            "step_s",
            "local_save_s",
            "save_s",
            "async_stall_s",
            "async_complete_s",
            "contention_s",
            "overlap_steps",
            "resume_s",
        )
    }
    nbytes, step = 0, 0
    for _ in range(args.repeats):
        dist.barrier()
        runs["step_s"].append(statistics.median(slowest(train_step()) for _ in range(3)))
        step += 3
        dist.barrier()
        t = time.perf_counter()  # a baseline: the same save to the local disk only
        local.save(step)
        runs["local_save_s"].append(slowest(time.perf_counter() - t))
        dist.barrier()
        t = time.perf_counter()
        sync.save(step)
        runs["save_s"].append(slowest(time.perf_counter() - t))
        dist.barrier()
        t = time.perf_counter()
        saver.save(step + 1)  # the same state under the next tag: the bucket's older tag is pruned after
        runs["async_stall_s"].append(slowest(time.perf_counter() - t))
        # Training goes on until the save is complete on every rank (the ranks agree before each step).
        overlap = []
        while not checkpoint.all_agree(not saver.in_flight, ctx.control_group):
            overlap.append(slowest(train_step()))
        tag_dir = saver.wait()
        runs["async_complete_s"].append(slowest(time.perf_counter() - t))
        runs["overlap_steps"].append(len(overlap))
        runs["contention_s"].append(sum(overlap) - len(overlap) * runs["step_s"][-1])
        step += 1 + len(overlap)
        record = json.loads((tag_dir / COMPLETE).read_text())
        nbytes = sum(f["bytes"] for f in record["files"].values())
        dist.barrier()
        if ctx.local_rank == 0:
            shutil.rmtree(ckpt_dir)  # a new machine: only the bucket holds the checkpoint
        dist.barrier()
        t = time.perf_counter()
        restored = checkpoint.resume(
            engine, ckpt_dir, ctx.rank, ctx.world_size, store=store, local_rank=ctx.local_rank
        )
        runs["resume_s"].append(slowest(time.perf_counter() - t))
        assert restored is not None and restored.step == int(tag_dir.name.split("_")[1]), restored
        step = restored.step
    if ctx.rank == 0:
        Path(args.worker_out).write_text(
            json.dumps(
                {**runs, "checkpoint_bytes": nbytes, "num_params": num_params, "world_size": ctx.world_size}
            )
        )
    shutdown_distributed()


class _ServerErrors(logging.Handler):
    """Counts the 5xx answers moto's request log (werkzeug's logger) shows. moto 5.2 fails some
    CompleteMultipartUpload requests under concurrent uploads ('seek of closed file'); the client retries
    them, and the save times then include the retries: the result says how many there were."""

    def __init__(self) -> None:
        super().__init__()
        self.count = 0

    def emit(self, record: logging.LogRecord) -> None:
        if re.search(r'" 5\d\d ', record.getMessage()):
            self.count += 1


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--out")
    p.add_argument("--quick", action="store_true", help="vit_debug at 32 px (a smoke run)")
    p.add_argument("--store", help="bucket prefix (credentials from the environment); default: a local moto")
    p.add_argument("--img-size", type=int, default=224)
    p.add_argument("--batch", type=int, default=2, help="images per rank per step")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--every-steps", type=int, default=100)
    p.add_argument("--worker-out", help=argparse.SUPPRESS)
    p.add_argument("--work", help=argparse.SUPPRESS)
    p.add_argument("--model", default="vit_b16", help=argparse.SUPPRESS)
    p.add_argument("--reshard", action="store_true", help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.quick:
        args.model, args.img_size = "vit_debug", 32
    if args.worker_out:
        return worker(args)
    server, server_errors = None, _ServerErrors()
    if args.store is None:
        logging.getLogger("werkzeug").addHandler(server_errors)
        from moto.server import ThreadedMotoServer

        os.environ.update(
            AWS_ACCESS_KEY_ID="bench", AWS_SECRET_ACCESS_KEY="bench", AWS_DEFAULT_REGION="us-east-1"
        )
        server = ThreadedMotoServer(ip_address="127.0.0.1", port=0, verbose=False)
        server.start()
        host, port = server.get_host_and_port()
        query = f"endpoint_override={host}:{port}&scheme=http&region=us-east-1"
        Store(f"s3://bench?{query}&allow_bucket_creation=true").fs.create_dir("bench")
        args.store = f"s3://bench/multinode?{query}"
    try:
        with tempfile.TemporaryDirectory() as work:
            out = os.path.join(work, "result.json")
            cmd = [
                sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
                __file__, "--worker-out", out, "--work", work, "--store", args.store, "--model", args.model,
                "--img-size", str(args.img_size), "--batch", str(args.batch), "--repeats", str(args.repeats),
            ]  # fmt: skip
            env = {**os.environ, "OMP_NUM_THREADS": "1"}
            subprocess.run(cmd, check=True, env=env, stdout=subprocess.DEVNULL)
            raw = json.loads(Path(out).read_text())
            one = [a if a != "2" or cmd[i - 1] != "--nproc-per-node" else "1" for i, a in enumerate(cmd)]
            subprocess.run([*one, "--reshard"], check=True, env=env, stdout=subprocess.DEVNULL)
            raw.update(json.loads(Path(out).read_text()))
    finally:
        if server is not None:
            server.stop()
    med = {
        k: statistics.median(raw[k])
        for k in (
            "step_s",
            "local_save_s",
            "save_s",
            "async_stall_s",
            "async_complete_s",
            "contention_s",
            "resume_s",
        )
    }
    step, every = med["step_s"], args.every_steps
    stall = med["async_stall_s"] / (every * step)
    reshard = statistics.median(raw["reshard_resume_s"])
    result = {
        "benchmark": "multinode",
        "model": args.model,
        "img_size": args.img_size,
        "batch_per_rank": args.batch,
        "zero_stage": 3,
        "precision": "bf16",
        "world_size": raw["world_size"],
        "num_params": raw["num_params"],
        "checkpoint_bytes": raw["checkpoint_bytes"],
        "store": "local moto S3 server" if server is not None else "given bucket",
        "server_5xx_responses": server_errors.count if server is not None else None,
        "device": "cuda" if torch.cuda.is_available() else "cpu",
        "repeats": args.repeats,
        **{f"median_{k}": v for k, v in med.items()},
        "save_ratio_bucket_over_local": med["save_s"] / med["local_save_s"],
        "stall_over_sync_save": med["async_stall_s"] / med["save_s"],
        "save_MB_per_s": raw["checkpoint_bytes"] / med["save_s"] / 1e6,
        "every_steps": every,
        "stall_fraction": {
            "value": stall,
            "goal": "<= 0.01 (asynchronous save, ViT-B ZeRO-3 through the bucket)",
            "met": stall <= 0.01,
        },
        "sync_stall_fraction": med["save_s"] / (every * step),
        "stall_fraction_with_contention": (med["async_stall_s"] + med["contention_s"]) / (every * step),
        "median_reshard_resume_s": reshard,
        "reshard_over_resume": reshard / med["resume_s"],
        "runs": {k: raw[k] for k in (*med, "overlap_steps", "reshard_resume_s")},
    }
    write_result(result, args.out)


if __name__ == "__main__":
    main()
