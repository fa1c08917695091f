"""The eval stage: an exported model's classification metrics, few-shot and linear-probe accuracy and
analysis figures, computed on every rank and equal to a single-process evaluation.

    vitpipe run configs/experiments/ablation_posemb.yaml      # `kind: eval` stages after train stages
    vitpipe train CONFIG kind=eval model.init_from=runs/NAME/export model.init_head=true cluster.launcher=local
    torchrun --nproc-per-node 2 -m pipeline.train.launch CONFIG kind=eval model.init_from=runs/NAME/export \
        model.init_head=true cluster.launcher=local

Sections in order: distributed set-up, model, tracking, passes over eval_split (and train_split for the
linear evaluators), classification metrics, few-shot and probe, figures, eval.json.

Every rank runs the same number of batches (`make_eval_loader` pads; `valid` marks real rows), so no
rank waits on another in a collective. Top-k and precision@1 are masked sums, all-reduced. mAP, few-shot
and the probe need every row at once: the valid rows are gathered on rank 0 and sorted by sample key,
the order a single process sees whatever the world size, evaluated there, and the results broadcast,
so every rank returns the same dict. Nothing is exported; RUN_DIR/eval.json keeps the metrics.
"""

from __future__ import annotations

import logging
import math
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.distributed as dist
from torch import nn
from torch.utils.data import DataLoader

from data_prep import atomic
from pipeline.config import EvalConfig, StageConfig
from pipeline.data.batching import MASK_IGNORE
from pipeline.data.loader import make_eval_loader
from pipeline.data.sources import DatasetInfo
from pipeline.data.transforms import IMAGENET_MEAN, IMAGENET_STD, normalize
from pipeline.distributed import DistContext
from pipeline.eval.fewshot import fewshot_ridge, linear_probe
from pipeline.eval.figures import (
    detection_figure,
    model_figures,
    segmentation_figure,
    source_loss_curve,
    source_stage_dir,
)
from pipeline.eval.metrics import (
    MetricState,
    coco_box_ap,
    confusion_matrix,
    mean_average_precision,
    segmentation_scores,
    top1_is_positive,
    topk_correct,
)
from pipeline.exported import ema_weights
from pipeline.models import create_model
from pipeline.models.boxes import cxcywh_to_xyxy
from pipeline.models.detr import detections
from pipeline.stage import Stage, init_weights, model_kwargs, open_stage, output_classes
from pipeline.tracking import Tracker

log = logging.getLogger(__name__)
EVAL_FILE = "eval.json"
EMA_PREFIX = "eval_ema/"  # the weight EMA's metrics (optim.ema_decay): eval/top1 -> eval_ema/top1
FIGURE_IMAGES = 16  # eval images the attention-distance figure averages over
FIGURE_ROWS = 8  # eval images the segmentation figure shows
MAX_TAG_LEN = 1000


@dataclass
class SplitPass:
    """One rank's rows of a pass over a split, padding included (`valid` marks real samples); on CPU."""

    features: torch.Tensor  # [N, D] float32 pre-logits
    logits: torch.Tensor | None  # [N, K] float32, when the head was run
    targets: torch.Tensor  # [N] class indices or [N, K] multi-hot
    valid: torch.Tensor  # [N] bool
    keys: list[str]
    images: torch.Tensor | None  # [<=FIGURE_IMAGES, 3, H, W] normalised valid images, on the device


# ---------------------------------------------------------------- model


def load_model(
    cfg: StageConfig, num_classes: int, device: torch.device, classifier: bool = True
) -> tuple[nn.Module, dict]:
    """The stage's model built as the training loop builds it, with the export's weights; eval mode.
    `classifier`: it must be one (forward_features, forward_head); a SETR model is evaluated per pixel."""
    model = create_model(cfg.model.name, **model_kwargs(cfg, num_classes))
    if classifier and not (hasattr(model, "forward_features") and hasattr(model, "forward_head")):
        raise ValueError(
            f"kind: eval needs a classifier (forward_features, forward_head): {cfg.model.name} is "
            f"{type(model).__name__}; evaluate the exported encoder's model name instead"
        )
    meta = init_weights(model, cfg.model.init_from, cfg.model.init_head, cfg.model.name)
    return model.to(device).eval().requires_grad_(False), meta


def _amp_dtype(cfg: StageConfig, device: torch.device) -> torch.dtype | None:
    # Mixed precision only where it pays (CUDA); on CPU the pass stays fp32, as the tests compare it.
    if device.type != "cuda" or cfg.deepspeed.precision == "fp32":
        return None
    return torch.bfloat16 if cfg.deepspeed.precision == "bf16" else torch.float16


# ---------------------------------------------------------------- passes


@torch.no_grad()
def embed_split(
    model: nn.Module,
    loader: DataLoader,
    device: torch.device,
    *,
    with_logits: bool,
    max_batches: int | None = None,
    amp_dtype: torch.dtype | None = None,
    mean=IMAGENET_MEAN,
    std=IMAGENET_STD,
) -> SplitPass:
    """Pre-logits (and logits) of every batch the loader yields, up to max_batches; inputs normalised
    with `mean` and `std` (the stage's data.mean / data.std)."""
    feats, logits, targets, valid, keys = [], [], [], [], []
    images = None
    for i, batch in enumerate(loader):
        if max_batches is not None and i >= max_batches:
            break
        x = normalize(batch["image"].to(device, non_blocking=True), mean, std)  # [B, 3, H, W] float32
        with torch.autocast(device.type, dtype=amp_dtype or torch.float32, enabled=amp_dtype is not None):
            tokens = model.forward_features(x)  # [B, T, D]
        # The head in fp32, outside autocast (the weights are fp32 here): bf16 logits (steps of 1/16 at
        # |logit| 8-16) tied scores, which top-k breaks by class index and AP merges into one threshold.
        tokens = tokens.float()
        feats.append(model.forward_head(tokens, pre_logits=True).cpu())  # [B, D]
        if with_logits:
            logits.append(model.forward_head(tokens).cpu())  # [B, K]
        targets.append(batch["target"])
        valid.append(batch["valid"])
        keys.extend(batch["key"])
        if images is None and batch["valid"].any():
            images = x[batch["valid"].to(device)][:FIGURE_IMAGES]
    if not feats:
        raise ValueError("the eval loader yielded no batch")
    return SplitPass(
        torch.cat(feats),
        torch.cat(logits) if with_logits else None,
        torch.cat(targets),
        torch.cat(valid),
        keys,
        images,
    )


def gather_valid(part: SplitPass, ctx: DistContext) -> dict | None:
    """On rank 0: every rank's valid rows in key order {"features", "targets", "logits"?, "keys"}; else None."""
    v = part.valid
    local = {
        "features": part.features[v],
        "targets": part.targets[v],
        "keys": [k for k, ok in zip(part.keys, v.tolist()) if ok],
    }
    if part.logits is not None:
        local["logits"] = part.logits[v]
    parts: list | None = [None] * ctx.world_size if ctx.is_main else None
    # The gloo control group: CPU tensors whatever the training backend is.
    dist.gather_object(local, parts, dst=0, group=ctx.control_group)
    if not ctx.is_main:
        return None
    keys = [k for p in parts for k in p["keys"]]
    if len(set(keys)) != len(keys):
        log.warning("duplicate sample keys in the eval split: key order is ambiguous for them")
    order = torch.tensor(sorted(range(len(keys)), key=keys.__getitem__), dtype=torch.long)
    out = {name: torch.cat([p[name] for p in parts])[order] for name in local if name != "keys"}
    out["keys"] = [keys[i] for i in order.tolist()]
    return out


# ---------------------------------------------------------------- metrics


def classification_sums(part: SplitPass, multi_label: bool, ctx: DistContext) -> tuple[dict[str, float], int]:
    """Top-1/top-5 (single-label) or precision@1 (multi-label) over all ranks' valid rows, and their count."""
    if multi_label:
        state = MetricState(["precision_at_1"])
        state.update({"precision_at_1": top1_is_positive(part.logits, part.targets)}, part.valid)
    else:
        state = MetricState(["top1", "top5"])
        state.update(topk_correct(part.logits, part.targets, (1, 5)), part.valid)
    dist.all_reduce(state.sums, group=ctx.control_group)  # one float64 tensor: every sum and the count
    return {f"eval/{k}": v for k, v in state.compute().items()}, int(state.count)


def single_label_rows(rows: dict, multi_label: bool) -> tuple[torch.Tensor, torch.Tensor]:
    """(features [M, D], class [M]) for the linear evaluators: on multi-label data, the samples with
    exactly one label (few-shot and probe are single-label classifiers, as in big_vision)."""
    if not multi_label:
        return rows["features"], rows["targets"].long()
    one = rows["targets"].sum(1) == 1  # [N]
    return rows["features"][one], rows["targets"][one].argmax(1)


def linear_metrics(
    train: dict, test: dict, num_classes: int, multi_label: bool, e: EvalConfig
) -> tuple[dict, dict]:
    """Few-shot ridge and linear probe on frozen features: (metrics to log, details for eval.json)."""
    x_tr, y_tr = single_label_rows(train, multi_label)
    x_te, y_te = single_label_rows(test, multi_label)
    details: dict = {"train_samples": len(y_tr), "test_samples": len(y_te)}
    if multi_label:
        details["rows"] = "single-label samples only (multi-label dataset)"
    if not len(y_tr) or not len(y_te):
        details["skipped"] = "no single-label sample in the train or eval split"
        log.warning("few-shot and probe skipped: %s", details["skipped"])
        return {}, details
    metrics: dict[str, float] = {}
    if e.fewshot_shots:
        fs = fewshot_ridge(
            x_tr,
            y_tr,
            x_te,
            y_te,
            num_classes=num_classes,
            shots=e.fewshot_shots,
            seeds=e.fewshot_seeds,
            l2_reg=e.fewshot_l2,
        )
        metrics.update({f"fewshot/{s}shot": fs[f"{s}shot"] for s in e.fewshot_shots})
        details["fewshot"] = fs  # means and every seed
    if e.linear_probe:
        metrics.update(
            {
                f"probe/{k}": v
                for k, v in linear_probe(x_tr, y_tr, x_te, y_te, num_classes=num_classes).items()
            }
        )
    return metrics, details


# ---------------------------------------------------------------- the stage


def _figures(
    cfg: StageConfig, model: nn.Module, images: torch.Tensor | None, tracker: Tracker
) -> dict[str, str]:
    """Rank 0: analysis PNGs and the source stage's loss curve as artifacts; returns {skipped: why}."""
    out = cfg.run_path / "figures"
    written, skipped = model_figures(model, images, out)
    stores = [cfg.tracking_uri, f"sqlite:///{source_stage_dir(cfg.model.init_from) / 'mlflow.db'}"]
    curve = source_loss_curve(cfg.model.init_from, stores, out / "source_train_loss.png")
    if isinstance(curve, Path):
        written.append(curve)
    else:
        skipped["source_train_loss"] = curve
    for path in written:
        tracker.log_artifact(str(path), "figures")
    for name, why in skipped.items():
        log.info("figure %s skipped: %s", name, why)
    tracker.set_tags({f"figure_skipped.{k}": v[:MAX_TAG_LEN] for k, v in skipped.items()})
    return skipped


def evaluate(
    cfg: StageConfig, report: Callable[[dict], None] | None = None, parent_run_id: str | None = None
) -> dict[str, float]:
    """Run the eval stage on this rank; returns the metrics (the same dict on every rank)."""
    if cfg.model.init_from is None:
        raise ValueError(f"{cfg.name}: an eval stage needs model.init_from")
    # -- distributed set-up, seeds, RUN_DIR/config.yaml
    stage = open_stage(cfg)
    cfg, ctx, e = stage.cfg, stage.ctx, stage.cfg.eval
    batch_size = e.batch_size or cfg.data.batch_size

    # -- model
    info = stage.dataset(e.eval_split)
    if cfg.objective.name == "segmentation":
        return evaluate_segmentation(cfg, stage, info, report, parent_run_id)
    if cfg.objective.name == "detection":
        return evaluate_detection(cfg, stage, info, report, parent_run_id)
    num_classes = cfg.model.num_classes or info.num_classes
    # The train split (few-shot, linear probe): read once, for the export's weights and the EMA's alike.
    train_info = stage.dataset(e.train_split) if e.fewshot_shots or e.linear_probe else None
    model, meta = load_model(cfg, num_classes, ctx.device)

    # -- tracking (rank 0): a re-run of a failed eval stage continues its MLflow run
    tags = {"kind": "eval", "init_from": str(cfg.model.init_from)}
    with stage.tracking(tags, parent_run_id) as tracker:
        if ctx.is_main:
            print(
                f"[{cfg.name}] eval of {cfg.model.init_from} (step {meta.get('step', '?')}) | "
                f"{cfg.data.train} {e.eval_split} | world {ctx.world_size} | batch {batch_size}",
                flush=True,
            )

        def measure(figures: bool) -> tuple[dict[str, float], dict]:
            return _classification(cfg, ctx, info, train_info, model, num_classes, tracker, figures)

        metrics, details = _with_ema(cfg, ctx, model, measure)
        _finish(cfg, ctx, tracker, metrics, details, meta, report)
    dist.barrier(group=ctx.control_group)  # gloo: a rank that failed in rank 0's work is seen at once
    return metrics


def _classification(
    cfg: StageConfig,
    ctx: DistContext,
    info: DatasetInfo,
    train_info: DatasetInfo | None,
    model: nn.Module,
    num_classes: int,
    tracker: Tracker,
    figures: bool,
) -> tuple[dict[str, float], dict]:
    """Every rank: the classification metrics, few-shot and probe of `model` (the same dict on every rank),
    and the details eval.json keeps; the figures too where `figures`. `train_info`: the train split, for
    few-shot and the linear probe."""
    e = cfg.eval
    batch_size = e.batch_size or cfg.data.batch_size
    amp = _amp_dtype(cfg, ctx.device)

    # -- passes: eval split in full; train split up to the cap, in whole batches on every rank
    linear = train_info is not None
    eval_loader = _eval_loader(cfg, ctx, info, crop_fraction=e.crop_fraction)
    norm = dict(mean=cfg.data.mean, std=cfg.data.std)
    test = embed_split(model, eval_loader, ctx.device, with_logits=e.classification, amp_dtype=amp, **norm)
    train = None
    cap = e.fewshot_max_train
    if linear:
        train_loader = _eval_loader(cfg, ctx, train_info, crop_fraction=e.crop_fraction)
        max_batches = math.ceil(cap / (ctx.world_size * batch_size)) if cap else None
        train = embed_split(
            model, train_loader, ctx.device, with_logits=False, max_batches=max_batches, amp_dtype=amp, **norm
        )

    # -- classification: masked sums all-reduced; mAP from the gathered rows
    metrics: dict[str, float] = {}
    details: dict = {}
    if e.classification:
        sums, details["eval_samples"] = classification_sums(test, info.multi_label, ctx)
        metrics.update(sums)
    test_rows = gather_valid(test, ctx) if (linear or (e.classification and info.multi_label)) else None
    train_rows = gather_valid(train, ctx) if train is not None else None

    # -- rank 0: mAP, few-shot, probe, figures; then every rank gets the same results
    if ctx.is_main:
        if test_rows is not None:
            details["eval_samples"] = len(test_rows["keys"])
        if e.classification and info.multi_label:
            metrics["eval/map"] = mean_average_precision(test_rows["logits"], test_rows["targets"])
        if train_rows is not None:
            if cap and len(train_rows["keys"]) > cap:
                train_rows = {k: v[:cap] for k, v in train_rows.items()}  # the first `cap` by key
            lin, details["linear"] = linear_metrics(train_rows, test_rows, num_classes, info.multi_label, e)
            metrics.update(lin)
        if figures:
            try:
                details["figures_skipped"] = _figures(cfg, model, test.images, tracker)
            except Exception as exc:  # figures are optional: a plotting failure must not lose the metrics
                log.exception("figures failed")
                details["figures_skipped"] = {"all": f"failed: {exc!r}"}
        seen = details.get("eval_samples")
        if seen is not None:
            _count_unreadable(cfg, info, seen, details)
    shared = [metrics, details]
    dist.broadcast_object_list(shared, src=0, group=ctx.control_group)
    return shared[0], shared[1]


def _eval_loader(cfg: StageConfig, ctx: DistContext, info: DatasetInfo, **extra) -> DataLoader:
    """This rank's padded loader over a split at the stage's eval batch size, size and resampling."""
    return make_eval_loader(
        info,
        cfg.data,
        rank=ctx.rank,
        world_size=ctx.world_size,
        batch_size=cfg.eval.batch_size or cfg.data.batch_size,
        img_size=cfg.model.img_size,
        interpolation=cfg.eval.interpolation,
        pin_memory=ctx.device.type == "cuda",
        **extra,
    )


def _with_ema(
    cfg: StageConfig, ctx: DistContext, model: nn.Module, measure: Callable[[bool], tuple[dict, dict]]
) -> tuple[dict[str, float], dict]:
    """`measure(figures)` of the export's weights, then, where the export has a weight EMA (and eval.ema), of
    the EMA weights loaded into the same model: their metrics as eval_ema/*, beside eval/*, and their details
    in eval.json's "ema". Rank 0 decides whether there is one (every rank then agrees)."""
    metrics, details = measure(cfg.eval.figures)
    found = [ema_weights(cfg.model.init_from) if cfg.eval.ema and ctx.is_main else None]
    dist.broadcast_object_list(found, src=0, group=ctx.control_group)
    if found[0] is None:
        return metrics, details
    init_weights(model, found[0], cfg.model.init_head, cfg.model.name)
    ema_metrics, ema_details = measure(False)
    metrics.update({EMA_PREFIX + k.removeprefix("eval/"): v for k, v in ema_metrics.items()})
    details["ema"] = {"weights": found[0], **{k: v for k, v in ema_details.items() if k != "figures_skipped"}}
    return metrics, details


def _count_unreadable(cfg: StageConfig, info: DatasetInfo, seen: int, details: dict) -> None:
    """Rank 0: samples of the split left unread (skipped within data.max_skip_fraction) go to eval.json and
    the log: counted, never a silently short pass."""
    if info.num_samples is None or seen >= info.num_samples:
        return
    details["eval_unreadable"] = info.num_samples - seen
    log.warning(
        "%s: evaluated %d of the %d samples of split %r; %d unreadable (skipped within data.max_skip_fraction %g)",
        cfg.name,
        seen,
        info.num_samples,
        cfg.eval.eval_split,
        info.num_samples - seen,
        cfg.data.max_skip_fraction,
    )


def _finish(
    cfg: StageConfig,
    ctx: DistContext,
    tracker: Tracker,
    metrics: dict[str, float],
    details: dict,
    meta: dict,
    report: Callable[[dict], None] | None,
) -> None:
    """Every rank, with the same metrics: log them (rank 0), write RUN_DIR/eval.json, report to Ray."""
    tracker.log_metrics(metrics, step=max(1, int(meta.get("step") or 1)))  # the Tracker drops step 0
    if ctx.is_main:
        summary = {
            "stage": cfg.name,
            "model": cfg.model.name,
            "init_from": str(cfg.model.init_from),
            "source_step": meta.get("step"),
            "world_size": ctx.world_size,
            "metrics": metrics,
            **details,
        }
        atomic.write_json(cfg.run_path / EVAL_FILE, summary, indent=2, default=str)
        for ema in (False, True):  # the weight EMA's metrics on a line of their own
            shown = [f"{k} {v:.4f}" for k, v in metrics.items() if k.startswith(EMA_PREFIX) == ema]
            if shown:
                print(f"[{cfg.name}] " + " | ".join(shown), flush=True)
    if report is not None:
        report(dict(metrics))  # every rank, once (Ray Train needs equal report counts)


# ---------------------------------------------------------------- segmentation


def evaluate_segmentation(
    cfg: StageConfig,
    stage: Stage,
    info: DatasetInfo,
    report: Callable[[dict], None] | None,
    parent_run_id: str | None,
) -> dict[str, float]:
    """The eval stage of a SETR export: mIoU, pixel accuracy and mean class accuracy over eval_split (a
    confusion matrix summed over every rank's valid pixels), the per-class IoU in eval.json, and a figure of
    predicted against true masks. Few-shot and the probe are classification evaluations: not run here."""
    ctx, e = stage.ctx, cfg.eval
    classes = list(info.segmentation_classes or [])
    num_classes = output_classes(cfg, info)
    model, meta = load_model(cfg, num_classes, ctx.device, classifier=False)
    amp = _amp_dtype(cfg, ctx.device)
    tags = {"kind": "eval", "init_from": str(cfg.model.init_from)}
    with stage.tracking(tags, parent_run_id) as tracker:
        if ctx.is_main:
            print(
                f"[{cfg.name}] segmentation eval of {cfg.model.init_from} (step {meta.get('step', '?')}) | "
                f"{cfg.data.train} {e.eval_split} | {num_classes} classes | world {ctx.world_size}",
                flush=True,
            )

        def measure(figures: bool) -> tuple[dict[str, float], dict]:
            loader = _eval_loader(cfg, ctx, info, crop_fraction=e.crop_fraction, masks=True)
            conf = torch.zeros(num_classes, num_classes, dtype=torch.int64)
            seen = torch.zeros(1, dtype=torch.int64)
            shown: list[tuple[torch.Tensor, torch.Tensor, torch.Tensor]] = []  # (image, true, predicted) rows
            with torch.no_grad():
                for batch in loader:
                    x = normalize(
                        batch["image"].to(ctx.device, non_blocking=True), cfg.data.mean, cfg.data.std
                    )
                    with torch.autocast(ctx.device.type, dtype=amp or torch.float32, enabled=amp is not None):
                        pred = model(x).argmax(1)  # [B, H, W] on the device
                    valid, target = batch["valid"], batch["mask"]
                    counted = (target != MASK_IGNORE) & valid[:, None, None]
                    dev = ctx.device
                    conf += confusion_matrix(
                        pred, target.to(dev), num_classes, counted.to(dev)
                    ).cpu()  # K x K moves
                    seen += int(valid.sum())
                    if len(shown) < FIGURE_ROWS:
                        rows = zip(batch["image"][valid], target[valid], pred.cpu()[valid])
                        shown += list(rows)[: FIGURE_ROWS - len(shown)]
            dist.all_reduce(conf, group=ctx.control_group)  # gloo: CPU tensors whatever the training backend
            dist.all_reduce(seen, group=ctx.control_group)
            scores = segmentation_scores(conf)
            metrics = {
                "eval/miou": scores["miou"],
                "eval/pixel_accuracy": scores["pixel_accuracy"],
                "eval/mean_accuracy": scores["mean_accuracy"],
            }
            details: dict = {
                "eval_samples": int(seen),
                "iou_per_class": dict(zip(classes or map(str, range(num_classes)), scores["iou"])),
            }
            if ctx.is_main and figures:
                if not shown:
                    details["figures_skipped"] = {"segmentation_masks": "no readable eval image on rank 0"}
                try:
                    if shown:
                        images, true, pred = (torch.stack(t) for t in zip(*shown))
                        out = cfg.run_path / "figures" / "segmentation_masks.png"
                        tracker.log_artifact(
                            str(segmentation_figure(images, true, pred, classes, out)), "figures"
                        )
                except Exception as exc:  # figures are optional: a plotting failure must not lose the metrics
                    log.exception("segmentation figure failed")
                    details["figures_skipped"] = {"segmentation_masks": f"failed: {exc!r}"}
            if ctx.is_main:
                _count_unreadable(cfg, info, int(seen), details)
            return metrics, details

        metrics, details = _with_ema(cfg, ctx, model, measure)
        _finish(cfg, ctx, tracker, metrics, details, meta, report)
    dist.barrier(group=ctx.control_group)  # gloo: a rank that failed in rank 0's work is seen at once
    return metrics


# ---------------------------------------------------------------- detection


def _pixels_xywh(boxes: torch.Tensor, size: torch.Tensor) -> np.ndarray:
    """(cx, cy, w, h) fractions [k, 4] of an image of `size` (w, h) -> COCO [x, y, w, h] pixels [k, 4]."""
    w, h = size.tolist()
    b = boxes.double().numpy() * [w, h, w, h]
    return np.stack([b[:, 0] - b[:, 2] / 2, b[:, 1] - b[:, 3] / 2, b[:, 2], b[:, 3]], axis=1)


def _fraction_xyxy(boxes: torch.Tensor) -> np.ndarray:
    return cxcywh_to_xyxy(boxes.float()).numpy()


def evaluate_detection(
    cfg: StageConfig,
    stage: Stage,
    info: DatasetInfo,
    report: Callable[[dict], None] | None,
    parent_run_id: str | None,
) -> dict[str, float]:
    """The eval stage of a DETR export: COCO box AP (mAP@[.5:.95], AP50, AP75 to MLflow; by object size in
    eval.json) over eval_split by pycocotools, and a figure of true and predicted boxes on a few images.

    Each image is evaluated whole, resized to img_size (no centre crop, which would cut objects off); the
    predictions (every query, scored by its class probability: DETR's post-processing) are mapped back to
    the stored image's pixels, where the true boxes are. Every rank's rows are gathered on rank 0 in key
    order, the order one process sees whatever the world size, evaluated there, and the metrics broadcast.
    Few-shot and the probe are classification evaluations: not run here."""
    ctx, e = stage.ctx, cfg.eval
    classes = list(info.detection_classes or [])
    num_classes = output_classes(cfg, info)
    model, meta = load_model(cfg, num_classes, ctx.device, classifier=False)
    amp = _amp_dtype(cfg, ctx.device)
    tags = {"kind": "eval", "init_from": str(cfg.model.init_from)}
    with stage.tracking(tags, parent_run_id) as tracker:
        if ctx.is_main:
            print(
                f"[{cfg.name}] detection eval of {cfg.model.init_from} (step {meta.get('step', '?')}) | "
                f"{cfg.data.train} {e.eval_split} | {num_classes} classes, {model.num_queries} queries | "
                f"world {ctx.world_size}",
                flush=True,
            )

        def measure(figures: bool) -> tuple[dict[str, float], dict]:
            loader = _eval_loader(cfg, ctx, info, boxes=model.num_queries)
            rows: list[
                tuple
            ] = []  # (key, true boxes, true classes, (w, h), boxes, scores, classes) per image
            shown: list[
                tuple
            ] = []  # (image, (true xyxy, classes), (predicted xyxy, scores, classes)) for the figure
            with torch.no_grad():
                for batch in loader:
                    x = normalize(
                        batch["image"].to(ctx.device, non_blocking=True), cfg.data.mean, cfg.data.std
                    )
                    with torch.autocast(ctx.device.type, dtype=amp or torch.float32, enabled=amp is not None):
                        logits, boxes = model(x)
                    scores, labels, found = (t.cpu() for t in detections(logits[-1], boxes[-1]))
                    for i in batch["valid"].nonzero().flatten().tolist():
                        real = batch["box_classes"][i] >= 0
                        true, true_classes = batch["boxes"][i][real], batch["box_classes"][i][real]
                        size = batch["image_size"][i]
                        rows.append(
                            (
                                batch["key"][i],
                                _pixels_xywh(true, size),
                                true_classes.numpy(),
                                tuple(size.tolist()),
                                _pixels_xywh(found[i], size),
                                scores[i].numpy(),
                                labels[i].numpy(),
                            )
                        )
                        if len(shown) < FIGURE_ROWS:
                            truth = (_fraction_xyxy(true), true_classes.numpy())
                            guess = (_fraction_xyxy(found[i]), scores[i].numpy(), labels[i].numpy())
                            shown.append((batch["image"][i], truth, guess))
            parts: list | None = [None] * ctx.world_size if ctx.is_main else None
            dist.gather_object(
                rows, parts, dst=0, group=ctx.control_group
            )  # gloo: whatever the training backend
            result: list = [None]
            if ctx.is_main:
                ordered = sorted((r for p in parts for r in p), key=lambda r: r[0])
                ap = coco_box_ap(
                    [(r[1], r[2], r[3]) for r in ordered], [(r[4], r[5], r[6]) for r in ordered], num_classes
                )
                result = [(ap, len(ordered))]
            dist.broadcast_object_list(result, src=0, group=ctx.control_group)
            ap, seen = result[0]
            metrics = {"eval/box_map": ap["map"], "eval/box_ap50": ap["ap50"], "eval/box_ap75": ap["ap75"]}
            details: dict = {
                "eval_samples": seen,
                "box_ap_by_size": {k: ap[k] for k in ("ap_small", "ap_medium", "ap_large")},
                "detection_classes": classes,
            }
            if ctx.is_main and figures:
                try:
                    if shown:
                        images = torch.stack([row[0] for row in shown])
                        out = cfg.run_path / "figures" / "detection_boxes.png"
                        figure = detection_figure(
                            images, [r[1] for r in shown], [r[2] for r in shown], classes, out
                        )
                        tracker.log_artifact(str(figure), "figures")
                    else:
                        details["figures_skipped"] = {"detection_boxes": "no readable eval image on rank 0"}
                except Exception as exc:  # figures are optional: a plotting failure must not lose the metrics
                    log.exception("detection figure failed")
                    details["figures_skipped"] = {"detection_boxes": f"failed: {exc!r}"}
            if ctx.is_main:
                _count_unreadable(cfg, info, seen, details)
            return metrics, details

        metrics, details = _with_ema(cfg, ctx, model, measure)
        _finish(cfg, ctx, tracker, metrics, details, meta, report)
    dist.barrier(group=ctx.control_group)  # gloo: a rank that failed in rank 0's work is seen at once
    return metrics
