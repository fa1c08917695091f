"""The only training loop. Objectives, models and launchers plug into it; it runs on every rank.

Sections in order: distributed set-up, input, model, engine, tracking, resume, the loop, checkpoint.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable
from dataclasses import dataclass, field

import numpy as np
import torch
import torch.distributed as dist

from pipeline.config import ExperimentConfig, flatten, save_resolved
from pipeline.data.loader import make_train_loader
from pipeline.models import create_model
from pipeline.objectives import build_objective, head_bias_init
from pipeline.tracking import Tracker
from pipeline.train import checkpoint
from pipeline.train.engine import DistContext, build_engine, init_distributed, scaled_lr

log = logging.getLogger(__name__)


@dataclass
class StageResult:
    steps: int
    final_loss: float
    checkpoint: str
    mlflow_run_id: str | None
    losses: list[float] = field(default_factory=list)


def seed_everything(seed: int) -> None:
    # Same seed on every rank: identical initial weights; data order and masks take their own seeds.
    torch.manual_seed(seed)
    np.random.seed(seed)


def _to_device(batch: dict, device: torch.device) -> dict:
    return {k: v.to(device, non_blocking=True) if torch.is_tensor(v) else v for k, v in batch.items()}


def train(cfg: ExperimentConfig, report: Callable[[dict], None] | None = None) -> StageResult:
    # -- distributed set-up
    ctx: DistContext = init_distributed(cfg.cluster.use_gpu)
    seed_everything(cfg.seed)
    run_path = cfg.run_path
    ckpt_dir = run_path / "checkpoints"
    if ctx.is_main:
        save_resolved(cfg, run_path / "config.yaml")

    # -- input
    loader, info = make_train_loader(
        cfg.data.train,
        rank=ctx.rank,
        world_size=ctx.world_size,
        batch_size=cfg.data.batch_size,
        img_size=cfg.model.img_size,
        seed=cfg.seed,
        num_workers=cfg.data.num_workers,
        shuffle_buffer=cfg.data.shuffle_buffer,
        min_scale=cfg.data.min_scale,
    )

    # -- model and engine
    num_classes = cfg.model.num_classes or info.num_classes
    model = create_model(
        cfg.model.name,
        img_size=cfg.model.img_size,
        num_classes=num_classes,
        head_bias_init=head_bias_init(cfg.objective),
        **cfg.model.overrides,
    )
    objective = build_objective(cfg.objective)
    engine, _, lr_scheduler = build_engine(model, cfg, ctx)
    accum = cfg.deepspeed.grad_accum
    global_batch = cfg.data.batch_size * accum * ctx.world_size

    # -- tracking (rank 0 only) and resume
    tracker = Tracker(
        cfg.tracking_uri,
        cfg.tracking.experiment or cfg.name,
        run_name=cfg.name,
        enabled=ctx.is_main,
        tags={"objective": cfg.objective.name, "model": cfg.model.name, "world_size": str(ctx.world_size)},
    )
    with tracker:
        start = checkpoint.resume(engine, ckpt_dir)
        if start == 0:
            tracker.log_params(flatten(cfg))
            tracker.log_params(
                {"derived.global_batch": global_batch, "derived.lr": scaled_lr(cfg, ctx.world_size)}
            )
            tracker.log_artifact(str(run_path / "config.yaml")) if ctx.is_main else None
        if ctx.is_main:
            n_params = sum(p.numel() for p in model.parameters())
            print(
                f"[{cfg.name}] {cfg.model.name} {n_params / 1e6:.2f}M params | world {ctx.world_size} | "
                f"global batch {global_batch} | lr {scaled_lr(cfg, ctx.world_size):.2e} | "
                f"ZeRO-{cfg.deepspeed.zero_stage} {cfg.deepspeed.precision} | steps {start}->{cfg.optim.steps}",
                flush=True,
            )

        # -- the loop
        batches = iter(loader)
        losses: list[float] = []
        t0 = t_log = time.perf_counter()
        last_loss = float("nan")
        for step in range(start, cfg.optim.steps):
            for _ in range(accum):
                batch = _to_device(next(batches), ctx.device)
                loss, metrics = objective.loss(engine, batch)
                engine.backward(loss)
                engine.step()
            done = step + 1
            if done % cfg.tracking.log_every == 0 or done == cfg.optim.steps:
                mean_loss = loss.detach().clone()
                dist.all_reduce(mean_loss)  # every rank reaches each log step: the collective is safe
                last_loss = mean_loss.item() / ctx.world_size  # the only host sync: at log steps
                losses.append(last_loss)
                now = time.perf_counter()
                steps_since = cfg.tracking.log_every if done % cfg.tracking.log_every == 0 else 1
                values = {
                    "train/loss": last_loss,  # mean over ranks
                    "train/lr": lr_scheduler.get_last_lr()[0],
                    "train/images_per_s": steps_since * global_batch / max(now - t_log, 1e-9),
                    "data/skipped": batch["skipped"],
                    **{f"train/{k}": v.item() for k, v in metrics.items()},
                }
                gnorm = engine.get_global_grad_norm()
                if gnorm is not None:
                    values["train/grad_norm"] = float(gnorm)
                tracker.log_metrics(values, step=done)
                t_log = now
                if ctx.is_main:
                    rate = (done - start) / (now - t0)
                    eta = (cfg.optim.steps - done) / max(rate, 1e-9)
                    print(
                        f"step {done}/{cfg.optim.steps} loss {last_loss:.4f} {rate:.2f} steps/s eta {eta:.0f}s",
                        flush=True,
                    )
            if (
                cfg.checkpoint.every_steps
                and done % cfg.checkpoint.every_steps == 0
                and done < cfg.optim.steps
            ):
                checkpoint.save(engine, ckpt_dir, done, cfg.checkpoint.keep_last, ctx.is_main)

        # -- final checkpoint
        final = checkpoint.save(engine, ckpt_dir, cfg.optim.steps, cfg.checkpoint.keep_last, ctx.is_main)
        tracker.set_tags({"checkpoint": str(final)})
        result = StageResult(cfg.optim.steps, last_loss, str(final), tracker.run_id, losses)
        if report is not None:
            report({"final_loss": last_loss, "steps": cfg.optim.steps})  # called once on every rank
    dist.barrier()
    return result
