"""Objectives: what turns (model, batch) into a loss. The training loop knows nothing else.

Each objective has `loss(model, batch) -> (loss, metrics)`; `metrics` holds detached scalars
that the loop logs at its log steps (no host sync inside the step).
"""

from __future__ import annotations

from typing import Protocol

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import ObjectiveConfig
from pipeline.data.transforms import normalize


class Objective(Protocol):
    name: str

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


class SupervisedSoftmax:
    """Softmax cross-entropy; multi-hot targets become normalised soft targets (big_vision)."""

    name = "supervised_softmax"
    head_bias_init = 0.0

    def __init__(self, label_smoothing: float = 0.0):
        self.label_smoothing = label_smoothing

    def loss(self, model, batch):
        logits = model(normalize(batch["image"]))  # [B, C]
        target = batch["target"]
        if target.ndim == 2:  # multi-hot -> distribution over the image's labels
            target = target / target.sum(dim=1, keepdim=True).clamp_min(1.0)
        loss = F.cross_entropy(logits, target, label_smoothing=self.label_smoothing)
        hard = target.argmax(1) if target.ndim == 2 else target
        return loss, {"accuracy": (logits.argmax(1) == hard).float().mean().detach()}


class SupervisedSigmoid:
    """Per-class sigmoid cross-entropy summed over classes, mean over the batch (JFT, big_vision)."""

    name = "supervised_sigmoid"
    head_bias_init = -10.0

    def loss(self, model, batch):
        logits = model(normalize(batch["image"]))  # [B, C]
        target = batch["target"]
        if target.ndim == 1:
            target = F.one_hot(target, logits.shape[1]).to(logits.dtype)
        loss = (
            F.binary_cross_entropy_with_logits(logits, target.to(logits.dtype), reduction="none")
            .sum(1)
            .mean()
        )
        top1 = target.gather(1, logits.argmax(1, keepdim=True)).mean()
        return loss, {"precision_at_1": top1.detach()}


def build_objective(cfg: ObjectiveConfig) -> Objective:
    if cfg.name == "supervised_softmax":
        return SupervisedSoftmax(cfg.label_smoothing)
    if cfg.name == "supervised_sigmoid":
        return SupervisedSigmoid()
    raise ValueError(f"objective.name: unknown objective {cfg.name!r}")


def head_bias_init(cfg: ObjectiveConfig) -> float:
    """The configured classifier bias, else the objective's conventional one."""
    if cfg.head_bias_init is not None:
        return cfg.head_bias_init
    return {"supervised_softmax": SupervisedSoftmax, "supervised_sigmoid": SupervisedSigmoid}[
        cfg.name
    ].head_bias_init
