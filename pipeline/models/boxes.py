"""Set prediction for detection (DETR, Carion et al. 2020): box arithmetic, Hungarian matching and the set loss.

    matches = hungarian_match(logits, boxes, target_boxes, target_classes)     # one assignment per image
    loss, parts = set_loss(logits, boxes, target_boxes, target_classes, matches, no_object_weight=0.1)

Boxes are (centre x, centre y, w, h) as fractions of the image, as the model predicts them and the loader
hands them over; targets come padded, [B, M, 4] boxes and [B, M] classes with -1 in rows without an object.
Logits are [B, Q, K + 1]: K classes and "no object" last. The matching cost and the loss weigh class,
L1 and generalized IoU alike, by DETR's (1, 5, 2). Matching runs scipy's `linear_sum_assignment` on the
host: the cost matrices of every decoder layer come over in one copy per step.
"""

from __future__ import annotations

import numpy as np
import torch
import torch.nn.functional as F

DETR_WEIGHTS = (1.0, 5.0, 2.0)  # class, L1, generalized IoU: DETR's cost and loss weights


def cxcywh_to_xyxy(boxes: torch.Tensor) -> torch.Tensor:
    cx, cy, w, h = boxes.unbind(-1)
    return torch.stack([cx - w / 2, cy - h / 2, cx + w / 2, cy + h / 2], -1)


def box_area(boxes: torch.Tensor) -> torch.Tensor:
    """Areas of (x0, y0, x1, y1) boxes [..., 4]."""
    return (boxes[..., 2] - boxes[..., 0]).clamp_min(0) * (boxes[..., 3] - boxes[..., 1]).clamp_min(0)


def box_iou(a: torch.Tensor, b: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(IoU [..., N, M], union [..., N, M]) of (x0, y0, x1, y1) boxes a [..., N, 4] and b [..., M, 4]
    (leading dims broadcast: every image's and decoder layer's at once)."""
    a, b = a.unsqueeze(-2), b.unsqueeze(-3)  # [..., N, 1, 4], [..., 1, M, 4]
    top_left = torch.max(a[..., :2], b[..., :2])
    bottom_right = torch.min(a[..., 2:], b[..., 2:])
    inter = (bottom_right - top_left).clamp_min(0).prod(-1)
    union = box_area(a) + box_area(b) - inter
    return inter / union.clamp_min(1e-12), union


def generalized_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Generalized IoU (Rezatofighi et al. 2019) [..., N, M] of (x0, y0, x1, y1) boxes a [..., N, 4] and
    b [..., M, 4]: IoU - (area of the smallest enclosing box not covered by the union) / (that area); in
    [-1, 1]."""
    iou, union = box_iou(a, b)
    a, b = a.unsqueeze(-2), b.unsqueeze(-3)
    top_left = torch.min(a[..., :2], b[..., :2])
    bottom_right = torch.max(a[..., 2:], b[..., 2:])
    hull = (bottom_right - top_left).clamp_min(0).prod(-1)
    return iou - (hull - union) / hull.clamp_min(1e-12)


def paired_generalized_box_iou(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Generalized IoU [K] of box a[i] with box b[i], (x0, y0, x1, y1) boxes [K, 4] each."""
    return generalized_box_iou(a.unsqueeze(-2), b.unsqueeze(-2))[..., 0, 0]


@torch.no_grad()
def match_costs(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    target_boxes: torch.Tensor,
    target_classes: torch.Tensor,
    weights: tuple[float, float, float] = DETR_WEIGHTS,
) -> torch.Tensor:
    """DETR's matching cost [..., Q, M] between predictions (logits [..., Q, K + 1], boxes [..., Q, 4]) and
    the padded targets (boxes [..., M, 4], classes [..., M]): -w_class p(class) + w_l1 L1 - w_giou GIoU.
    Padding columns (class -1) hold garbage; `hungarian_match` leaves them out."""
    w_class, w_l1, w_giou = weights
    prob = logits.float().softmax(-1)  # [..., Q, K + 1]
    index = target_classes.clamp_min(0).unsqueeze(-2).expand(*prob.shape[:-1], target_classes.shape[-1])
    cost_class = -prob.gather(-1, index)  # [..., Q, M]
    pred = boxes.float()
    tgt = target_boxes.float()
    cost_l1 = (pred.unsqueeze(-2) - tgt.unsqueeze(-3)).abs().sum(-1)  # [..., Q, M]
    cost_giou = -generalized_box_iou(cxcywh_to_xyxy(pred), cxcywh_to_xyxy(tgt))  # [..., Q, M]
    return w_class * cost_class + w_l1 * cost_l1 + w_giou * cost_giou


def assign(costs: np.ndarray, target_classes: np.ndarray) -> list[tuple[np.ndarray, np.ndarray]]:
    """Per image, the (query rows, target rows) of the cheapest one-to-one assignment of its real targets
    (class >= 0) to queries: costs [B, Q, M] and classes [B, M] on the host."""
    from scipy.optimize import linear_sum_assignment  # scipy's import: 0.2 s, for detection only

    out = []
    for cost, classes in zip(costs, target_classes):
        real = np.flatnonzero(classes >= 0)
        rows, cols = linear_sum_assignment(cost[:, real])
        out.append((rows.astype(np.int64), real[cols].astype(np.int64)))
    return out


def hungarian_match(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    target_boxes: torch.Tensor,
    target_classes: torch.Tensor,
    weights: tuple[float, float, float] = DETR_WEIGHTS,
) -> list[list[tuple[np.ndarray, np.ndarray]]]:
    """Matches for every decoder layer's predictions at once: logits [L, B, Q, K + 1], boxes [L, B, Q, 4]
    against targets [B, M, 4] / [B, M] -> per layer, per image (query rows, target rows)."""
    costs = match_costs(logits, boxes, target_boxes.unsqueeze(0), target_classes.unsqueeze(0), weights)
    costs, classes = costs.cpu().numpy(), target_classes.cpu().numpy()  # one copy for every layer
    return [assign(layer, classes) for layer in costs]


def set_loss(
    logits: torch.Tensor,
    boxes: torch.Tensor,
    target_boxes: torch.Tensor,
    target_classes: torch.Tensor,
    matches: list[tuple[np.ndarray, np.ndarray]],
    no_object_weight: float = 0.1,
    weights: tuple[float, float, float] = DETR_WEIGHTS,
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """DETR's loss of one decoder layer (logits [B, Q, K + 1], boxes [B, Q, 4]) under `matches`: class
    cross-entropy over every query (unmatched ones learn "no object", weighted `no_object_weight`), and the
    matched boxes' L1 and 1 - GIoU summed and divided by the number of target boxes (at least 1)."""
    b, q, k1 = logits.shape
    device = logits.device
    batch_idx = np.concatenate([np.full(len(rows), i, dtype=np.int64) for i, (rows, _) in enumerate(matches)])
    query_idx = np.concatenate([rows for rows, _ in matches])
    target_idx = np.concatenate([cols for _, cols in matches])
    bi = torch.from_numpy(batch_idx).to(device, non_blocking=True)
    qi = torch.from_numpy(query_idx).to(device, non_blocking=True)
    ti = torch.from_numpy(target_idx).to(device, non_blocking=True)
    classes = torch.full((b, q), k1 - 1, dtype=torch.long, device=device)  # "no object" everywhere...
    classes[bi, qi] = target_classes[bi, ti]  # ...but the matched queries
    class_weight = torch.ones(k1, device=device)
    class_weight[-1] = no_object_weight
    loss_class = F.cross_entropy(logits.float().transpose(1, 2), classes, weight=class_weight)
    num_boxes = max(len(target_idx), 1)
    pred, tgt = boxes[bi, qi].float(), target_boxes[bi, ti].float()
    loss_l1 = F.l1_loss(pred, tgt, reduction="sum") / num_boxes
    giou = paired_generalized_box_iou(cxcywh_to_xyxy(pred), cxcywh_to_xyxy(tgt))
    loss_giou = (1 - giou).sum() / num_boxes
    w_class, w_l1, w_giou = weights
    loss = w_class * loss_class + w_l1 * loss_l1 + w_giou * loss_giou
    return loss, {
        "loss_class": loss_class.detach(),
        "loss_l1": loss_l1.detach(),
        "loss_giou": loss_giou.detach(),
    }
