"""Classification metrics on one device, plus running sums that a caller all-reduces across ranks.

    from pipeline.eval.metrics import topk_accuracy, mean_average_precision, precision_at_1
    topk_accuracy(logits, targets)             # {"top1": 0.75, "top5": 1.0}; logits [N, K], targets [N]
    mean_average_precision(scores, multi_hot)  # 0.61; scores, multi_hot [N, K]
    precision_at_1(scores, multi_hot)          # 0.5

Distributed evaluation (the sums are one float64 tensor, so a single all-reduce covers every metric):

    state = MetricState(["top1", "top5", "prec@1"], device=device)
    for batch in loader:                        # every rank, padded batches carry valid=False rows
        state.update({**topk_correct(logits, y, (1, 5)), "prec@1": top1_is_positive(logits, y_multi)},
                     valid)
    dist.all_reduce(state.sums)                 # the caller owns the communication
    results = state.compute()                   # {"top1": ..., "top5": ..., "prec@1": ...}

Ties are broken deterministically, the way `torch.argmax` does: of equal scores, the lower class index
ranks first. mAP needs every score of a class at once and is not a sum of per-sample terms; gather
the valid rows of all ranks first, then call `mean_average_precision` once.
"""

from __future__ import annotations

import contextlib
import io
from collections.abc import Mapping, Sequence

import numpy as np
import torch
from pycocotools.coco import COCO
from pycocotools.cocoeval import COCOeval


def _target_rank(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """0-based rank of each target class among the K scores of its row; ties go to the lower index."""
    num_classes = logits.shape[1]
    target_score = logits.gather(1, targets[:, None])  # [N, 1]
    higher = (logits > target_score).sum(1)  # [N]
    lower_index = torch.arange(num_classes, device=logits.device)[None, :] < targets[:, None]  # [N, K]
    tied_before = ((logits == target_score) & lower_index).sum(1)  # [N]
    return higher + tied_before


def topk_correct(
    logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)
) -> dict[str, torch.Tensor]:
    """Per-sample hits {"top{k}": [N] float (1.0 if the target ranks in the top k)}.

    A k above the class count is clamped to it (timm's convention): top-5 of a 3-class task is 1.0.
    """
    if logits.ndim != 2 or targets.shape != logits.shape[:1]:
        raise ValueError(
            f"expected logits [N, K] and targets [N], got {tuple(logits.shape)} and {tuple(targets.shape)}"
        )
    rank = _target_rank(logits, targets.long())
    return {f"top{k}": (rank < min(k, logits.shape[1])).to(torch.float64) for k in ks}


def topk_accuracy(
    logits: torch.Tensor, targets: torch.Tensor, ks: Sequence[int] = (1, 5)
) -> dict[str, float]:
    """Top-k accuracy of single-label predictions: {"top1": float, "top5": float}."""
    return {name: hits.mean().item() for name, hits in topk_correct(logits, targets, ks).items()}


def top1_is_positive(scores: torch.Tensor, multi_hot: torch.Tensor) -> torch.Tensor:
    """Per-sample hits [N] float: 1.0 where the highest-scored class (lowest index on ties) is a positive."""
    if scores.shape != multi_hot.shape or scores.ndim != 2:
        raise ValueError(
            f"expected scores and multi_hot of one shape [N, K], got {tuple(scores.shape)} and {tuple(multi_hot.shape)}"
        )
    top1 = scores.argmax(1, keepdim=True)  # [N, 1]; argmax returns the first maximal index
    return (multi_hot.gather(1, top1)[:, 0] > 0).to(torch.float64)


def precision_at_1(scores: torch.Tensor, multi_hot: torch.Tensor) -> float:
    """Fraction of samples whose top-scored class is one of their labels (big_vision's prec@1).

    Samples without any label count as misses, so the value is comparable across label densities.
    """
    return top1_is_positive(scores, multi_hot).mean().item()


def average_precision_per_class(scores: torch.Tensor, multi_hot: torch.Tensor) -> torch.Tensor:
    """AP of each class [K] float64, as sklearn's `average_precision_score`; NaN for a class with no positive.

    AP = sum over thresholds of (R_n - R_{n-1}) * P_n. Tied scores form one threshold, so the result
    does not depend on the order of tied samples; without ties it is the mean of the precision at
    the rank of each positive.
    """
    if scores.shape != multi_hot.shape or scores.ndim != 2:
        raise ValueError(
            f"expected scores and multi_hot of one shape [N, K], got {tuple(scores.shape)} and {tuple(multi_hot.shape)}"
        )
    n = scores.shape[0]
    order = torch.sort(scores, dim=0, descending=True, stable=True)
    sorted_scores = order.values  # [N, K], each column descending
    positive = multi_hot.gather(0, order.indices).to(torch.float64) > 0  # [N, K]
    tp = positive.cumsum(0).to(torch.float64)  # [N, K] true positives among the first i+1
    rank = torch.arange(1, n + 1, device=scores.device, dtype=torch.float64)[:, None]  # [N, 1]
    precision = tp / rank  # [N, K]
    # The precision that counts for a sample is the one at the last row of its tie group.
    group_end = torch.ones_like(positive)
    group_end[:-1] = sorted_scores[:-1] != sorted_scores[1:]
    row = torch.arange(n, device=scores.device)[:, None].expand_as(positive)
    end_row = torch.where(group_end, row, torch.full_like(row, n - 1))
    end_row = end_row.flip(0).cummin(0).values.flip(0)  # [N, K] first group end at or below each row
    precision_at_end = precision.gather(0, end_row)
    num_pos = positive.sum(0).to(torch.float64)  # [K]
    ap = (precision_at_end * positive).sum(0) / num_pos
    return torch.where(num_pos > 0, ap, torch.full_like(ap, float("nan")))


def mean_average_precision(scores: torch.Tensor, multi_hot: torch.Tensor) -> float:
    """Mean of the per-class AP over the classes that have at least one positive (NaN if none has)."""
    ap = average_precision_per_class(scores, multi_hot)
    present = ~ap.isnan()
    return ap[present].mean().item() if present.any() else float("nan")


class MetricState:
    """Running sums of per-sample metric values over valid samples, ready for one all-reduce.

    API:
      - `MetricState(names, device=None)`: one slot per metric name, plus the count of valid samples.
      - `update(per_sample, valid=None)`: `per_sample` maps each name to a [N] tensor (e.g. from
        `topk_correct` or `top1_is_positive`); `valid` [N] bool masks out padded rows (None: all valid).
      - `sums`: a float64 tensor [len(names) + 1] (the last slot is the count). The caller reduces it in
        place, e.g. `torch.distributed.all_reduce(state.sums)`, before `compute()`. float64 keeps
        counts exact to 2^53 samples; put it on the device the collective backend needs (NCCL: CUDA).
      - `compute()`: {name: sum / count}; NaN when no valid sample was seen.
    """

    def __init__(self, names: Sequence[str], device: torch.device | str | None = None):
        if len(set(names)) != len(names):
            raise ValueError(f"duplicate metric names: {list(names)}")
        self.names = list(names)
        self.sums = torch.zeros(len(self.names) + 1, dtype=torch.float64, device=device)

    @property
    def count(self) -> float:
        return self.sums[-1].item()

    def update(self, per_sample: Mapping[str, torch.Tensor], valid: torch.Tensor | None = None) -> None:
        missing = [n for n in self.names if n not in per_sample]
        if missing:
            raise KeyError(f"update() lacks metrics {missing}; this state holds {self.names}")
        n = per_sample[self.names[0]].shape[0]
        mask = torch.ones(n, dtype=torch.bool) if valid is None else valid.to(torch.bool)
        mask = mask.to(self.sums.device)
        values = torch.stack([per_sample[name].to(self.sums) for name in self.names])  # [M, N]
        # where(), not multiply: a padded row may hold NaN or inf and must not leak into the sums.
        masked = torch.where(mask[None, :], values, torch.zeros_like(values))
        self.sums[:-1] += masked.sum(1)
        self.sums[-1] += mask.sum()

    def compute(self) -> dict[str, float]:
        count = self.sums[-1]
        means = self.sums[:-1] / count if count > 0 else torch.full_like(self.sums[:-1], float("nan"))
        return {name: v.item() for name, v in zip(self.names, means)}


# ---------------------------------------------------------------------- segmentation


def confusion_matrix(
    pred: torch.Tensor, target: torch.Tensor, num_classes: int, counted: torch.Tensor
) -> torch.Tensor:
    """Pixel counts [K, K] int64, row = true class, column = predicted, over the `counted` pixels.

    pred, target, counted: [B, H, W] (class indices; bool). A sum: all-reduce it across ranks, then call
    `segmentation_scores` once."""
    t, p = target[counted].long(), pred[counted].long()
    return torch.bincount(t * num_classes + p, minlength=num_classes * num_classes).reshape(
        num_classes, num_classes
    )


def segmentation_scores(conf: torch.Tensor) -> dict[str, float | list[float | None]]:
    """mIoU, pixel accuracy and mean class accuracy of a confusion matrix (rows true, columns predicted), with
    the per-class IoU. As mmsegmentation: a class with no true and no predicted pixel has no IoU (None) and
    is left out of the mean."""
    conf = conf.double()
    inter = conf.diag()
    union = conf.sum(0) + conf.sum(1) - inter
    true = conf.sum(1)
    iou = [float(i / u) if u > 0 else None for i, u in zip(inter, union)]
    acc = [float(i / t) for i, t in zip(inter, true) if t > 0]
    present = [v for v in iou if v is not None]
    total = float(conf.sum())
    return {
        "miou": sum(present) / len(present) if present else float("nan"),
        "pixel_accuracy": float(inter.sum()) / total if total else float("nan"),
        "mean_accuracy": sum(acc) / len(acc) if acc else float("nan"),
        "iou": iou,
    }


# ---------------------------------------------------------------- detection


COCO_AP_NAMES = ("map", "ap50", "ap75", "ap_small", "ap_medium", "ap_large")  # COCOeval.stats[0:6]


def coco_box_ap(
    truth: Sequence[tuple[Sequence[Sequence[float]], Sequence[int], tuple[int, int]]],
    found: Sequence[tuple[Sequence[Sequence[float]], Sequence[float], Sequence[int]]],
    num_classes: int,
) -> dict[str, float | None]:
    """COCO box AP by pycocotools (the reference implementation): `truth` per image (boxes [[x, y, w, h], ...]
    in pixels, their classes, the image's (w, h)), `found` per image in the same order (boxes, scores,
    classes) -> {"map": AP@[.5:.95], "ap50", "ap75", "ap_small", "ap_medium", "ap_large"}, each in [0, 1], or
    None where no object of that size exists (COCOeval's -1). Up to 100 detections per image count."""
    if len(truth) != len(found):
        raise ValueError(f"{len(truth)} images of ground truth, {len(found)} of detections")
    images, annotations, rows = [], [], []
    for i, ((boxes, classes, (w, h)), (pred, scores, labels)) in enumerate(zip(truth, found)):
        images.append({"id": i, "width": int(w), "height": int(h)})
        for box, c in zip(boxes, classes):
            bw, bh = float(box[2]), float(box[3])
            annotations.append(
                {
                    "id": len(annotations) + 1,  # COCO ids start at 1
                    "image_id": i,
                    "category_id": int(c),
                    "bbox": [float(v) for v in box],
                    "area": bw * bh,
                    "iscrowd": 0,
                }
            )
        for box, score, c in zip(pred, scores, labels):
            rows.append([i, *(float(v) for v in box), float(score), int(c)])
    if not annotations:
        raise ValueError("no ground-truth box in the evaluated images: AP is undefined")
    with contextlib.redirect_stdout(io.StringIO()):  # pycocotools prints its progress and the table
        coco = COCO()
        coco.dataset = {
            "images": images,
            "annotations": annotations,
            "categories": [{"id": c, "name": str(c)} for c in range(num_classes)],
        }
        coco.createIndex()
        if not rows:
            return {name: 0.0 for name in COCO_AP_NAMES}
        evaluator = COCOeval(coco, coco.loadRes(np.asarray(rows, dtype=np.float64)), "bbox")
        evaluator.evaluate()
        evaluator.accumulate()
        evaluator.summarize()
    return {name: (None if v < 0 else float(v)) for name, v in zip(COCO_AP_NAMES, evaluator.stats[:6])}
