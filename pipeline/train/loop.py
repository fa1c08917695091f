"""The only training loop. Objectives, models and launchers plug into it; it runs on every rank.

`Trainer` runs a stage on each rank in named steps: set-up (distributed start, model, objective, engine),
resume, step, log, save, finish (final checkpoint and export); `train(cfg)` is `Trainer(cfg).run()`.

A step makes no host sync: the loss is read, metrics logged and stop requests agreed only every
`tracking.log_every` steps (tests/test_host_sync.py counts every tensor-to-host read of a run).

A step whose loss or gradients are not finite stops the stage (`NonFiniteLoss`) at the next log step or
save, as MAE's and big_vision's loops stop: where DeepSpeed checks no overflow (bf16 ZeRO-1/2, where engine.py
turns it off, and ZeRO-0 in fp32) its update leaves the weights NaN, and saving them would, after `keep_last`
more saves, have pruned every checkpoint worth resuming from; elsewhere DeepSpeed skips the step (counted in
`engine.skipped_steps`), and a run whose loss went NaN is diverging all the same. A log step checks the
values it reads anyway (no collective); a save first checks this rank's share of the fp32 weights too, and
the ranks agree, so no checkpoint holds a weight that is not finite.

Exactness: a stage stopped after step N and resumed gives the same per-step losses and final weights
(and weight EMA) as an uninterrupted one (CPU, fp32): the checkpoint holds model, optimizer, scheduler,
step, every rank's RNG states and share of the weight EMA (pipeline.train.ema), and the data stream's
deal, which continues at batch N x grad_accum (see pipeline.data.train_stream). Resumed on another number
of ranks, the ZeRO state is resharded (pipeline.train.checkpoint), the global batch kept
(`keep_global_batch`) and the stream re-dealt (pipeline.data.deal).
"""

from __future__ import annotations

import functools
import logging
import math
import os
import signal
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist

from data_prep.storage import Store, child
from pipeline.config import ConfigError, StageConfig, nearest_accum
from pipeline.data.deal import SHARDS, Deal, continue_deal
from pipeline.data.device import Prefetcher, batch_to_device, prefetch
from pipeline.data.loader import make_train_loader
from pipeline.data.sources import DatasetInfo
from pipeline.hardware import peak_flops
from pipeline.models import create_model
from pipeline.models.flops import estimate_mfu, flops_per_image
from pipeline.models.layers import checkpointed_fraction
from pipeline.objectives import build_objective
from pipeline.stage import (
    STOP_FILE,
    init_weights,
    model_kwargs,
    open_stage,
    output_classes,
    preprocessing_of,
)
from pipeline.train import checkpoint, reshard
from pipeline.train.ema import WeightEma, local_masters
from pipeline.train.engine import build_engine, consolidated_state_dict, peak_lr
from pipeline.train.export import export_weights
from pipeline.train.saving import Checkpointer
from pipeline.train.tag import read_record, tag_for

log = logging.getLogger(__name__)
PROGRESS_LINES = 20  # a stage prints a progress line about every 1/20 of its steps...
PROGRESS_MAX_SILENCE_S = 60.0  # ...and at a log step at least once a minute on a long run


@dataclass
class StageResult:
    steps: int
    final_loss: float
    checkpoint: str
    mlflow_run_id: str | None
    export: str | None = None
    stopped_early: bool = False
    losses: list[float] = field(default_factory=list)


def progress_due(done: int, total: int, last_printed: int | None, seconds_since: float) -> bool:
    """Whether this log step prints a progress line: the first, every 1/PROGRESS_LINES, the last, or
    after PROGRESS_MAX_SILENCE_S without one. MLflow still gets every log step (tracking.log_every)."""
    every = max(1, total // PROGRESS_LINES)
    crossed = last_printed is None or done // every > last_printed // every
    return crossed or done == total or seconds_since >= PROGRESS_MAX_SILENCE_S


def step_seed(seed: int, step: int, micro: int, rank: int) -> int:
    """An integer seed per (seed, step, micro-step, rank): resumable, and equal across processes."""
    return int(np.random.SeedSequence([seed, step, micro, rank]).generate_state(1)[0])


class StopRequest:
    """SIGTERM, a STOP file in the run directory, or a STOP object beside the stage's stored checkpoints
    asks the loop to checkpoint and stop.

    The loop checks at every log step (`tracking.log_every`: no collective between them) and all ranks
    agree before acting. The file serves where no signal reaches the loop: Ray Train runs it in a worker
    thread, so a job driver that receives `ray job stop`'s SIGTERM writes RUN_DIR/STOP instead. The driver's
    disk is not every worker's (nodes that share no disk), so it also writes STOP to the stage's object
    storage (`checkpoint.uri`), which rank 0 polls at most every REMOTE_POLL_S seconds.
    """

    REMOTE_POLL_S = 5.0

    def __init__(self, stop_file: Path, store: Store | None = None) -> None:
        self.signalled = False
        self.stop_file = stop_file
        self.store = store
        self._remote = False
        self._polled = -float("inf")
        if threading.current_thread() is threading.main_thread():
            self._previous = signal.signal(signal.SIGTERM, self._handle)
        else:  # Ray Train runs the loop in a thread; Ray turns a stop into an exception there instead
            self._previous = None

    def _handle(self, signum, frame) -> None:
        self.signalled = True

    @property
    def requested(self) -> bool:
        if self.signalled or self.stop_file.exists():
            return True
        if (
            self.store is not None
            and not self._remote
            and time.monotonic() - self._polled >= self.REMOTE_POLL_S
        ):
            self._polled = time.monotonic()
            # The bucket out of reach for a moment must not end a long run: logged, and asked again.
            try:
                self._remote = self.store.exists(STOP_FILE)
            except OSError as exc:
                log.warning("could not check %s for a stop request: %s", self.store.describe(STOP_FILE), exc)
        return self._remote

    def restore(self) -> None:
        if self._previous is not None:
            signal.signal(signal.SIGTERM, self._previous)


def train_step(
    engine, objective, batches, to_device: Callable[[dict], dict], seed: int, step: int, accum: int, rank: int
):
    """One optimizer step: `accum` micro-batches through the objective and the engine, with no host sync
    (tests/test_host_sync.py counts). Returns (loss, metrics, last batch, seconds the host spent getting
    batches: waiting on the loader, and moving or decoding them onto the device, the sum of the micro-batches'
    losses: not finite where any was)."""
    waited, total = 0.0, None
    for micro in range(accum):
        t = time.perf_counter()
        batch = to_device(next(batches))  # with data.decode: cuda, the decode too
        waited += time.perf_counter() - t
        batch["seed"] = step_seed(seed, step, micro, rank)
        loss, metrics = objective.loss(engine, batch)
        engine.backward(loss)
        engine.step()
        total = loss.detach() if total is None else total + loss.detach()
    return loss, metrics, batch, waited, total


def _flops_per_image(model) -> int | None:
    """Forward FLOPs of one training image: under patch dropout the blocks see the kept tokens only."""
    try:
        return int(flops_per_image(model, mask_ratio=getattr(model, "patch_dropout", 0.0) or None))
    except (TypeError, ValueError, NotImplementedError):
        return None


def _peak_flops(cfg: StageConfig, device: torch.device) -> float | None:
    """The MFU denominator per device: tracking.peak_tflops, else the table's peak for this GPU and precision."""
    if cfg.tracking.peak_tflops:
        return cfg.tracking.peak_tflops * 1e12
    if device.type != "cuda":
        return None
    name = torch.cuda.get_device_name(device)
    peak = peak_flops(name, cfg.deepspeed.precision, tf32=cfg.deepspeed.tf32)
    if peak is None:
        log.warning("no peak FLOP/s known for %r: set tracking.peak_tflops to log MFU", name)
    return peak


def keep_global_batch(cfg: StageConfig, saved: dict | None, world_size: int) -> tuple[StageConfig, int]:
    """The config to run on `world_size` ranks with, and the global batch the stage keeps.

    The global batch (micro-batch x grad_accum x ranks) stays the one the checkpoint resumed from kept when
    that was saved by another number of ranks, or when the stage is elastic (`cluster.num_workers: [MIN,
    MAX]`: then it starts as micro-batch x grad_accum x MAX), and grad_accum adjusts. Where no grad_accum
    makes it exactly (16,384 on 1,016 ranks), the nearest within `deepspeed.global_batch_tolerance` runs and
    optim.lr scales with it (optim.base_lr does by itself; `lr_rescale` moves a restored schedule); beyond
    the tolerance a ConfigError names the numbers of ranks that fit. A checkpoint of such a run resumed on
    its own number of ranks keeps the target, unless the config's grad_accum has changed since."""
    micro, c, accum = cfg.data.batch_size, cfg.cluster, cfg.deepspeed.grad_accum
    own = micro * accum * world_size
    if saved is not None:
        target = (
            saved.get("target_global_batch")
            or saved.get("global_batch")
            or micro * accum * saved["world_size"]
        )
        moved = saved["world_size"] != world_size or c.elastic
        carried = saved.get("config_grad_accum") == accum and target != own
        if not (moved or carried):
            return cfg, own  # the checkpoint's own shape
        source = f"step {saved['step']} was saved on {saved['world_size']} ranks, keeping a global batch of {target}"
    elif c.elastic and c.launcher == "ray":
        target = micro * accum * c.max_workers
        source = f"the elastic stage's global batch is {target} ({micro} x {accum} x {c.max_workers} workers)"
    else:
        return cfg, own
    new_accum, off = nearest_accum(target, micro, world_size)
    effective = micro * new_accum * world_size
    tolerance = cfg.deepspeed.global_batch_tolerance
    if off > tolerance:
        fits = [
            w
            for w in range(1, int(target * (1 + tolerance) / micro) + 1)
            if nearest_accum(target, micro, w)[1] <= tolerance
        ]
        runs: list[list[int]] = []  # contiguous sizes that fit, the three nearest world_size named
        for w in fits:
            if runs and runs[-1][1] == w - 1:
                runs[-1][1] = w
            else:
                runs.append([w, w])
        nearest = sorted(sorted(runs, key=lambda r: min(abs(r[0] - world_size), abs(r[1] - world_size)))[:3])
        near = ", ".join(f"{a}-{b}" if b > a else str(a) for a, b in nearest)
        advice = f"Resume on a number of ranks that does ({near})" + (
            f", or set data.batch_size to a divisor of {target // world_size}"
            if target % world_size == 0
            else ""
        )
        raise ConfigError(
            f"{source}; on {world_size} ranks a micro-batch of {micro} (data.batch_size) cannot make it: "
            f"{world_size} x {micro} does not divide {target}, and the nearest, {effective}, is {off:.2%} off "
            f"(deepspeed.global_batch_tolerance: {tolerance:g}). {advice}"
        )
    update = {"deepspeed": cfg.deepspeed.model_copy(update={"grad_accum": new_accum})}
    if off:
        log.warning(
            "%s; on %d ranks no grad_accum makes it: %d x %d x %d = %d (%+.2f%%) runs, the learning rate scaled by %.5f",
            source,
            world_size,
            micro,
            new_accum,
            world_size,
            effective,
            100 * (effective - target) / target,
            effective / target,
        )
        if cfg.optim.base_lr is None:  # base_lr * global_batch / 256 scales by itself
            update["optim"] = cfg.optim.model_copy(update={"lr": cfg.optim.lr * effective / target})
    elif new_accum != accum:
        log.warning(
            "on %d ranks: grad_accum %d -> %d keeps the global batch of %d",
            world_size,
            accum,
            new_accum,
            target,
        )
    return cfg.model_copy(update=update), target


def lr_rescale(lr_scheduler, saved: dict | None, global_batch: int) -> float:
    """Scale the learning rate a checkpoint restored by global_batch / the global batch it was saved with
    (the linear rule that optim.base_lr follows too): 1.0, and nothing changed, where they are equal. Every
    group's current rate, its schedule's base and the optimizer's initial_lr move together."""
    before = (saved or {}).get("global_batch")
    if not before or before == global_batch:
        return 1.0
    scale = global_batch / before
    lr_scheduler.base_lrs = [b * scale for b in lr_scheduler.base_lrs]
    for group in lr_scheduler.optimizer.param_groups:
        group["lr"] *= scale
        if "initial_lr" in group:
            group["initial_lr"] *= scale
    return scale


def saved_deal(
    restored: checkpoint.Restored, saved: dict | None, shape: tuple[int, int, int, int], info: DatasetInfo
) -> Deal:
    """The deal the checkpoint's stream was on; a checkpoint from before deals were saved streamed on the
    initial deal of the shape it was saved with, in whole-shard epochs. (`info`: the dataset's shard URLs read a deal saved with URLs.)"""
    if "data" in restored.extra:
        return Deal.from_dict(restored.extra["data"], info.urls)
    record = saved or {}
    world = restored.saved_by or shape[0]
    accum = record.get("grad_accum") or (shape[3] * shape[0] // world if world != shape[0] else shape[3])
    return Deal(world, shape[1], record.get("micro_batch", shape[2]), accum, epochs=SHARDS)


def train(
    cfg: StageConfig, report: Callable[..., None] | None = None, parent_run_id: str | None = None
) -> StageResult:
    """This rank's part of a training stage. `report(metrics, pointer=None)`, from the launcher (Ray Train), is
    called once at the end on every rank; on rank 0 `pointer` says where the export is."""
    return Trainer(cfg, report, parent_run_id).run()


@dataclass
class _Interval:
    """What the log step reports about the steps since the last one (host-side counters only)."""

    start: float = field(default_factory=time.perf_counter)
    steps: int = 0
    data_wait: float = 0.0  # seconds getting batches
    saving: float = 0.0  # seconds the steps were held by checkpoint saves: images/s leaves them out


class Trainer:
    """One training stage on this rank, in named steps (the shape of torchtitan's Trainer):

        setup()    distributed start, dataset, model, objective, engine (sized by the checkpoint it resumes)
        resume()   weights, optimizer, RNG, weight EMA and the data stream's deal from the newest checkpoint
        step()     one optimizer step, no host sync
        log()      every tracking.log_every steps: the only host reads, metrics, progress
        save()     a checkpoint (the step waits for the host copy; the rest runs beside training)
        finish()   the final checkpoint and the consolidated export; the launcher's report

    `run()` calls them in that order; a stop request (SIGTERM, the STOP file) saves and ends the loop at the
    next log step."""

    def __init__(
        self, cfg: StageConfig, report: Callable[..., None] | None = None, parent_run_id: str | None = None
    ) -> None:
        self.report, self.parent_run_id = report, parent_run_id
        self.setup(cfg)
        self.resume()

    # -- set-up: distributed start, seeds, RUN_DIR/config.yaml; model, objective, engine
    def setup(self, cfg: StageConfig) -> None:
        self.stage = stage = open_stage(cfg)
        cfg, ctx = stage.cfg, stage.ctx
        self.ctx, self.run_path = ctx, stage.run_path
        self.ckpt_dir = self.run_path / "checkpoints"
        self.info = stage.dataset("train")  # read by rank 0, handed to the others
        self.objective = build_objective(cfg.objective, cfg.data.mean, cfg.data.std)
        self.model_kwargs = model_kwargs(cfg, output_classes(cfg, self.info))
        model = create_model(cfg.model.name, **self.model_kwargs)
        if cfg.model.init_from:
            init_weights(model, cfg.model.init_from, cfg.model.init_head, cfg.model.name)
        self.model = model
        self.flops_img = _flops_per_image(model)
        self.num_params = sum(p.numel() for p in model.parameters())  # before ZeRO-3 partitions them
        # The engine is sized by the checkpoint it will resume: on another world size grad_accum adjusts.
        self.store = Store(cfg.checkpoint.uri) if cfg.checkpoint.uri else None  # s3://, gs://, ...
        self.saved = checkpoint.newest_record(self.ckpt_dir, self.store, ctx.rank, ctx.control_group)
        config_accum = cfg.deepspeed.grad_accum
        cfg, target = keep_global_batch(cfg, self.saved, ctx.world_size)
        self.cfg = cfg
        self.engine, _, self.lr_scheduler = build_engine(model, cfg, ctx)
        self.objective.prepare(self.engine.module, ctx.device)
        self.accum = cfg.deepspeed.grad_accum
        self.global_batch = cfg.data.batch_size * self.accum * ctx.world_size
        self.meta = {  # into every checkpoint's COMPLETE.json: a resume on another world size keeps the batch
            "micro_batch": cfg.data.batch_size,
            "grad_accum": self.accum,
            "global_batch": self.global_batch,
            "target_global_batch": target,
            "config_grad_accum": config_accum,
        }

    # -- resume: weights, optimizer, scheduler, RNG, weight EMA, the stream's position
    def resume(self) -> None:
        cfg, ctx = self.cfg, self.ctx
        self.restored = restored = checkpoint.resume(
            self.engine,
            self.ckpt_dir,
            ctx.rank,
            ctx.world_size,
            ctx.control_group,
            load_optimizer=cfg.debug.resume_optimizer,
            store=self.store,
            local_rank=ctx.local_rank,
            seed=cfg.seed,
        )
        self.start = restored.step if restored else 0
        self.ema = _weight_ema(self.engine, cfg, ctx, self.ckpt_dir, restored, self.store)
        if restored is not None and cfg.debug.resume_optimizer:
            lr_rescale(self.lr_scheduler, self.saved, self.global_batch)  # where the global batch moved
        self.lr = peak_lr(cfg, ctx.world_size)
        # Which samples each rank and loader worker reads: a resume on another shape re-deals the epoch's rest.
        shape = (ctx.world_size, max(1, cfg.data.num_workers), cfg.data.batch_size, self.accum)
        self.deal = Deal(*shape)
        if restored is not None:
            self.deal = continue_deal(
                saved_deal(restored, self.saved, shape, self.info),
                self.start,
                shape,
                self.info,
                cfg.seed,
                resampled=cfg.data.resampled,
            )
        self.saver = Checkpointer(
            self.engine,
            self.ckpt_dir,
            ctx.rank,
            cfg.checkpoint.keep_last,
            local_rank=ctx.local_rank,
            store=self.store,
            group=ctx.control_group,
            asynchronous=cfg.checkpoint.asynchronous,
        )

    # -- input
    def batches(self):
        cfg = self.cfg
        loader = make_train_loader(
            self.info,
            cfg.data,
            rank=self.ctx.rank,
            world_size=self.ctx.world_size,
            img_size=cfg.model.img_size,
            seed=cfg.seed,
            start_batch=self.deal.rank_batches(self.start),
            masks=cfg.objective.name == "segmentation",
            pin_memory=self.ctx.device.type == "cuda",
            boxes=self.model.num_queries
            if cfg.objective.name == "detection"
            else 0,  # one object a query at most
            deal=self.deal,
        )
        batches = iter(loader)
        self.to_device = batch_to_device(self.ctx.device, cfg.data, cfg.model.img_size)
        if cfg.data.decode == "cuda":  # a thread decodes batch N+1 on a side stream while step N runs
            batches, self.to_device = prefetch(batches, self.to_device, self.ctx.device)
        return batches

    # -- step: no host sync
    def step(self, step: int, batches) -> tuple:
        cfg = self.cfg
        _maybe_kill(cfg, self.ctx.rank, step + 1, self.run_path)
        if cfg.debug.step_delay_s:
            time.sleep(cfg.debug.step_delay_s)
        objective = self.objective
        if cfg.debug.nan_rank == self.ctx.rank and cfg.debug.nan_at_step == step + 1:
            objective = _NanLoss(objective)
        out = train_step(
            self.engine, objective, batches, self.to_device, cfg.seed, step, self.accum, self.ctx.rank
        )
        self.step_loss = out[4]
        if self.ema is not None:
            self.ema.update()
        self.interval.steps += 1
        self.interval.data_wait += out[3]
        return out

    # -- log: every log_every steps, the only host syncs
    def log(self, done: int, loss, metrics: dict, batch: dict, batches) -> None:
        """The loss and skipped samples summed over ranks in one call, the metrics read; rank 0 logs them
        and prints progress."""
        cfg, ctx, span = self.cfg, self.ctx, self.interval
        skipped = torch.tensor(float(batch["skipped"]), device=ctx.device)
        packed = torch.stack([loss.detach().float(), skipped, self.step_loss.float()])
        dist.all_reduce(packed)
        self.last_loss = packed[0].item() / ctx.world_size
        self.losses.append(self.last_loss)
        now = time.perf_counter()
        training_s = max(now - span.start - span.saving, 1e-9)  # checkpoint saves left out
        # decode cuda: GPU idle between batches (CUDA events, read after the sync above)
        gpu_idle = batches.gpu_idle_seconds() if isinstance(batches, Prefetcher) else None
        images_per_s = span.steps * self.global_batch / training_s
        values = {
            "train/loss": self.last_loss,  # mean over ranks
            "train/lr": self.lr_scheduler.get_last_lr()[0],
            "train/images_per_s": images_per_s,
            "data/skipped_samples": packed[1].item(),
            **({"data/epoch": float(batch["epoch"])} if "epoch" in batch else {}),  # rank 0's stream
            # rank 0's time getting batches (loader wait, copy or GPU decode; decode cuda: the wait for the
            # prefetch thread's decode), a fraction of the interval
            "data/wait_fraction": min(1.0, span.data_wait / training_s),
            **{f"train/{k}": v.item() for k, v in metrics.items()},
        }
        if gpu_idle is not None:  # the GPU's side of data/wait_fraction: idle between batches
            values["data/gpu_idle_fraction"] = min(1.0, gpu_idle / training_s)
        gnorm = self.engine.get_global_grad_norm()
        if gnorm is not None:
            values["train/grad_norm"] = float(gnorm)
        if self.flops_img:
            per_device = images_per_s / ctx.world_size
            model_flops = 3 * self.flops_img  # training = 3x forward (flops_per_train_step)
            values["perf/tflops_per_device"] = model_flops * per_device / 1e12
            if self.peak:
                values["perf/mfu"] = estimate_mfu(model_flops, per_device, self.peak)
                hardware_flops = (3 + self.recompute) * self.flops_img
                values["perf/hfu"] = estimate_mfu(hardware_flops, per_device, self.peak)
        if span.saving:  # the steps' wait for saves: their host copies (asynchronous) or all of them
            values["checkpoint/stall_s"] = span.saving
        if self.saver.completed:  # from a save's start until its tag was complete, on this rank
            values["checkpoint/save_s"] = self.saver.completed[-1][1]
            self.saver.completed.clear()
        self.tracker.log_metrics(values, step=done)  # a non-finite value too: the run shows where it went
        self.interval = _Interval(start=now)
        # The same values on every rank (summed over ranks; DeepSpeed's norm and step count are global).
        total = f"the training loss summed over the step's micro-batches and the {ctx.world_size} ranks"
        bad = self._not_finite(total, packed[2].item(), values.get("train/grad_norm"))
        if bad:
            self._stop_not_finite(done, " and ".join(bad))
        self.checked = done
        if ctx.is_main and progress_due(done, cfg.optim.steps, self.last_printed, now - self.t_print):
            self.last_printed, self.t_print = done, now
            rate = (done - self.start) / (now - self.t0)
            eta = (cfg.optim.steps - done) / max(rate, 1e-9)
            print(
                f"step {done}/{cfg.optim.steps} loss {self.last_loss:.4f} {rate:.2f} steps/s eta {eta:.0f}s",
                flush=True,
            )

    # -- save
    def save(self, step: int) -> Path:
        """The stall: until every rank holds its copy of the state (the rest runs beside the next steps).
        First the ranks agree that the step's losses, the gradient norm and every rank's share of the fp32
        weights are finite (host reads and a CPU all-reduce at a save only, which syncs anyway)."""
        rank = self.ctx.rank
        gnorm = self.engine.get_global_grad_norm()
        loss = None if self.step_loss is None else float(self.step_loss)  # None: no step ran in this process
        bad = self._not_finite(f"rank {rank}'s training loss", loss, None if gnorm is None else float(gnorm))
        if not all(bool(torch.isfinite(w).all()) for w in self.masters):  # a host read per tensor, at a save
            bad.append(f"rank {rank}'s share of the fp32 weights is not finite")
        if not checkpoint.all_agree(not bad, self.ctx.control_group):
            self._stop_not_finite(step, " and ".join(bad) or "another rank found a value that is not finite")
        self.checked = step
        t = time.perf_counter()
        more = None if self.ema is None else self.ema.snapshot
        path = self.saver.save(step, {"step": step, "data": self.deal.to_dict()}, self.meta, more=more)
        self.interval.saving += time.perf_counter() - t
        return path

    def _not_finite(self, loss_name: str, loss: float | None, gnorm: float | None) -> list[str]:
        """What is NaN or infinite, in words ([] when nothing is): the loss (None: not read), DeepSpeed's
        gradient norm (None: it computed none) and the optimizer steps DeepSpeed skipped for gradients that
        were not finite (a host count, the same on every rank), since the last check."""
        bad = [f"{loss_name} is {loss}"] if loss is not None and not math.isfinite(loss) else []
        if gnorm is not None and not math.isfinite(gnorm):
            bad.append(f"the gradient norm is {gnorm}")
        skipped = self.engine.skipped_steps - self.skipped_at_start
        if skipped:
            why = "their gradients were not finite"
            bad.append(f"DeepSpeed skipped {skipped} of the steps after step {self.checked}: {why}")
        return bad

    def _stop_not_finite(self, step: int, what: str) -> None:
        """Every rank at once: a save in flight (from before this step, checked then) completes, nothing
        after it is saved, and the stage fails naming the step, the value and what to change."""
        cfg = self.cfg
        try:
            self.saver.wait()
        except Exception as exc:  # that save's own failure (on every rank): logged, the NaN raised
            log.error("rank %d: %s", self.ctx.rank, exc)
        clip = cfg.optim.grad_clip
        raise NonFiniteLoss(
            f"[{cfg.name}] step {step}: {what}. The stage stops and saves nothing from here on: its newest "
            f"checkpoint in {self.ckpt_dir} is from step {self.checked} or before, which passed this check. A "
            "resumed run replays the same batches: first lower the learning rate (optim.base_lr or optim.lr), "
            "lengthen optim.warmup_steps or "
            + (f"lower optim.grad_clip (now {clip:g})" if clip else "set optim.grad_clip (now off)")
            + f", or look for a broken input in steps {self.checked + 1}-{step}."
        )

    # -- the loop
    def run(self) -> StageResult:
        cfg, ctx = self.cfg, self.ctx
        self.peak = _peak_flops(cfg, ctx.device)
        # Training = 3 x forward (model FLOPs, MFU); activation checkpointing runs the forward of the blocks it
        # checkpoints again (hardware FLOPs; the blocks hold nearly all of them): the share it selects.
        self.recompute = checkpointed_fraction(self.engine.module)
        derived = {
            "derived.global_batch": self.global_batch,
            "derived.lr": self.lr,
            "derived.num_params": self.num_params,
            "derived.flops_per_image": self.flops_img,
            "derived.precision": cfg.deepspeed.precision,
            "derived.peak_tflops_per_device": None if self.peak is None else self.peak / 1e12,
        }
        # A stop request belongs to the run it stopped: the job driver clears both before the stage starts.
        stop = StopRequest(self.run_path / STOP_FILE, self.store if ctx.is_main else None)
        tags = {"objective": cfg.objective.name}
        resumed = self.restored is not None
        with self.stage.tracking(tags, self.parent_run_id, params=derived, resumed=resumed) as tracker:
            self.tracker = tracker
            if ctx.is_main:
                tracker.set_tags({"checkpoint_dir": str(self.ckpt_dir)})
                self._print_start()
            self.losses: list[float] = []
            self.last_loss = float("nan")
            # The last step found finite (a resumed run's start: when it was saved); DeepSpeed's count of
            # skipped steps there; this rank's share of the fp32 weights (views the optimizer updates).
            self.checked, self.skipped_at_start = self.start, self.engine.skipped_steps
            self.masters = [w for _, w in local_masters(self.engine, ctx.rank, ctx.world_size)]
            self.step_loss = None
            self.t0 = self.t_print = time.perf_counter()
            self.interval = _Interval(start=self.t0)
            self.last_printed = None
            stopped_early = interrupted = False
            batches = self.batches()
            try:
                for step in range(self.start, cfg.optim.steps):
                    loss, metrics, batch, _, _ = self.step(step, batches)
                    done = step + 1
                    if done % cfg.tracking.log_every == 0 or done == cfg.optim.steps:
                        self.log(done, loss, metrics, batch, batches)
                        # a stop request waits for the next log step: no collective in between (a CPU flag)
                        interrupted = not checkpoint.all_agree(not stop.requested, ctx.control_group)
                    if interrupted or done == cfg.debug.stop_at_step:
                        self.save(done)
                        self.saver.wait()  # the process may end next: the checkpoint complete first
                        tracker.status = "KILLED"
                        stopped_early = True
                        if ctx.is_main:
                            print(
                                f"stopped at step {done}: checkpoint {self.ckpt_dir / tag_for(done)}",
                                flush=True,
                            )
                        # A signal ends the process (torchrun, a scheduler); a STOP file ends the stage (Ray).
                        if interrupted and not checkpoint.all_agree(not stop.signalled, ctx.control_group):
                            stop.restore()
                            _shutdown_loader(batches)
                            raise SystemExit(128 + signal.SIGTERM)
                        break
                    every = cfg.checkpoint.every_steps
                    if every and done % every == 0 and done < cfg.optim.steps:
                        self.save(done)
            except (
                BaseException
            ):  # the prefetch thread and the loader's workers do not outlive a failed stage
                _shutdown_loader(batches)
                raise
            stop.restore()
            _shutdown_loader(batches)
            result = self.finish(stopped_early)
        # On the gloo control group: a rank that died in rank 0's closing work (MLflow, the export) closes
        # its connections, which gloo's barrier reports at once (NCCL's waits out its timeout).
        dist.barrier(group=ctx.control_group)
        return result

    def _print_start(self) -> None:
        cfg, ctx, restored = self.cfg, self.ctx, self.restored
        print(
            f"[{cfg.name}] {cfg.model.name} {self.num_params / 1e6:.2f}M params | "
            f"{cfg.objective.name} | world {ctx.world_size} | global batch {self.global_batch} | "
            f"lr {self.lr:.2e} | ZeRO-{cfg.deepspeed.zero_stage} {cfg.deepspeed.precision} | "
            f"steps {self.start}->{cfg.optim.steps}"
            + (f" | weight EMA {cfg.optim.ema_decay:g}" if self.ema is not None else "")
            + (f" (resumed from {restored.tag})" if restored else ""),
            flush=True,
        )

    # -- finish: the final checkpoint, the consolidated export, the launcher's report
    def finish(self, stopped_early: bool) -> StageResult:
        cfg, ctx, store, tracker = self.cfg, self.ctx, self.store, self.tracker
        export_path = None
        final_dir = self.ckpt_dir / tag_for(cfg.optim.steps)
        if not stopped_early:
            final_dir = self.save(cfg.optim.steps)
            if cfg.checkpoint.export:
                export_path = self._export()
            self.saver.wait()  # the final checkpoint, written while the export was
            tracker.set_tags({"checkpoint": str(final_dir)})
        result = StageResult(
            cfg.optim.steps,
            self.last_loss,
            str(final_dir),
            tracker.run_id,
            export_path,
            stopped_early,
            self.losses,
        )
        if self.report is not None:  # every rank; rank 0 with where the export is (the launcher's checkpoint)
            pointer = None
            if ctx.is_main and export_path:
                pointer = {
                    "export": str(Path(export_path).parent),
                    "export_uri": child(cfg.checkpoint.uri, "export") if store is not None else None,
                    "model": cfg.model.name,
                    "step": cfg.optim.steps,
                }
            self.report(
                {"final_loss": self.last_loss, "steps": cfg.optim.steps, "stopped_early": stopped_early},
                pointer,
            )
        return result

    def _export(self) -> str | None:
        """The consolidated fp32 weights (and EMA) in RUN_DIR/export, and on the store: a collective."""
        cfg, ctx, store, tracker = self.cfg, self.ctx, self.store, self.tracker
        state = consolidated_state_dict(self.engine)  # every rank
        ema_state = None if self.ema is None else self.ema.consolidated(ctx.device)  # likewise
        export_path, failure = None, None
        if ctx.is_main:
            try:
                export_path = str(
                    export_weights(
                        state,
                        cfg.model.name,
                        self.model_kwargs,
                        self.run_path / "export",
                        cfg.optim.steps,
                        preprocessing=preprocessing_of(cfg),
                        ema=ema_state,
                        ema_decay=cfg.optim.ema_decay,
                    )
                )
                if store is not None:  # the next stage may run on other machines: it reads this copy
                    for f in sorted((self.run_path / "export").iterdir()):
                        store.upload(f, f"export/{f.name}")
                    tracker.set_tags({"export_uri": child(cfg.checkpoint.uri, "export")})
                tracker.set_tags({"export": export_path})
            except Exception as exc:  # the other ranks must not wait for rank 0 forever
                failure = exc
        if not checkpoint.all_agree(failure is None, ctx.control_group):
            if failure is not None:
                raise failure
            raise RuntimeError(f"rank {ctx.rank}: rank 0 failed to write the export; see its log")
        return export_path


def _weight_ema(
    engine, cfg: StageConfig, ctx, ckpt_dir: Path, restored: checkpoint.Restored | None, store: Store | None
) -> WeightEma | None:
    """The stage's weight EMA (optim.ema_decay), or None: from the resumed checkpoint's EMA where it has one,
    else from the current weights. Every rank must call it; a rank that cannot load its share fails them all.
    Resumed on another number of ranks, a rank reads its share's slices of the saved EMA files in byte ranges,
    from this node's disk or the bucket."""
    if not cfg.optim.ema_decay:
        return None
    ema = WeightEma.of_engine(engine, cfg.optim.ema_decay, ctx.rank, ctx.world_size, ctx.control_group)
    if restored is None:
        return ema
    failure, found = None, False
    tag_dir = ckpt_dir / restored.tag
    resharded = restored.saved_by not in (0, ctx.world_size)
    sources = None
    try:
        if resharded:  # the slices of the saved files that hold this rank's share, in byte ranges
            sources = reshard.Sources(tag_dir, read_record(tag_dir), store)
            found = ema.load(tag_dir, functools.partial(reshard.SafetensorsParts, sources))
            log.info(
                "rank %d: read its part of checkpoint %s's weight EMA: %d bytes in %d requests from %s",
                ctx.rank,
                restored.tag,
                sources.bucket_bytes,
                sources.bucket_requests,
                store.describe() if store is not None else "no bucket",
            )
        else:
            found = ema.load(tag_dir)
    except Exception as exc:  # the other ranks must not go on into the first step's collectives
        failure = exc
    finally:
        if sources is not None:
            sources.close()
    if not checkpoint.all_agree(failure is None, ctx.control_group):
        if failure is not None:
            raise failure
        raise RuntimeError(f"rank {ctx.rank}: another rank could not load the weight EMA of {restored.tag}")
    if not checkpoint.all_agree(found, ctx.control_group):
        ema.reset()  # every rank restarts it, or none: one EMA
        if ctx.is_main:
            log.warning(
                "checkpoint %s holds no weight EMA (saved without optim.ema_decay): the EMA starts from its weights",
                restored.tag,
            )
    return ema


def _shutdown_loader(batches) -> None:
    """Stop the loader's worker processes now. Left to garbage collection, a persistent worker can outlive
    the stage: with torch.compile the exiting rank waited on its worker forever (seen on CPU, 2 ranks).
    With decode cuda the batches come through a Prefetcher: its thread stops taking batches first."""
    if isinstance(batches, Prefetcher):
        batches.close()
        batches = batches.source
    shutdown = getattr(batches, "_shutdown_workers", None)  # DataLoader's multi-process iterator
    if shutdown is not None:
        shutdown()


class NonFiniteLoss(RuntimeError):
    """The training loss or gradient norm is NaN or infinite: raised on every rank at the same step."""


class _NanLoss:
    """Fault injection (`debug.nan_rank`, `debug.nan_at_step`): the objective's loss times NaN, so that the
    gradients, and the weights they update, are NaN as a diverging run's are."""

    def __init__(self, objective):
        self.objective = objective

    def loss(self, engine, batch):
        loss, metrics = self.objective.loss(engine, batch)
        return loss * float("nan"), metrics


def _maybe_kill(cfg: StageConfig, rank: int, step: int, run_path: Path) -> None:
    """Fault injection: the configured rank's process dies at the configured step, once per run dir."""
    d = cfg.debug
    if d.kill_rank != rank or d.kill_at_step != step:
        return
    marker = run_path / f"debug_killed_rank{rank}_step{step}"
    if marker.exists():
        return
    marker.write_text("killed\n")
    log.error("debug: killing rank %d at step %d", rank, step)
    os.kill(os.getpid(), signal.SIGKILL)
