"""Objectives: what turns (model, batch) into a loss. The training loop knows nothing else.

Every objective offers
    model_kwargs(cfg, num_classes) -> dict extra `create_model` arguments (head size, bias, tokens); a
                                           static method, so evaluation asks `model_kwargs(cfg, n)` below
                                           without building an objective
    prepare(model, device)                 one-time set-up after the model exists (teacher, flags)
    loss(model, batch) -> (loss, metrics)  `metrics` holds detached scalars, read only at log steps

Batches arrive as uint8 images; normalisation happens here, on the training device. Randomness
(masks, mixup) comes from `batch["seed"]`, which the loop derives from (seed, step, micro-step,
rank): the same step draws the same mask after a resume.
"""

from __future__ import annotations

from typing import Protocol

import numpy as np
import torch
import torch.nn.functional as F
from torch import nn

from pipeline.config import ObjectiveConfig
from pipeline.data.batching import MASK_IGNORE
from pipeline.data.transforms import IMAGENET_MEAN, IMAGENET_STD, mixup_cutmix, normalize
from pipeline.exported import load_exported  # the teacher: a folder, a .safetensors file or a storage URI
from pipeline.models import create_model
from pipeline.models.boxes import hungarian_match, set_loss
from pipeline.models.masked_patch import mean_colour_classes


class Objective(Protocol):
    name: str

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict: ...

    def prepare(self, model: nn.Module, device: torch.device) -> None: ...

    def loss(self, model: nn.Module, batch: dict) -> tuple[torch.Tensor, dict[str, torch.Tensor]]: ...


def _generator(batch: dict, device: torch.device) -> torch.Generator:
    return torch.Generator(device=device).manual_seed(int(batch["seed"]))


def _soft_targets(target: torch.Tensor, num_classes: int, smoothing: float) -> torch.Tensor:
    """Class indices or multi-hot -> a distribution over classes, with label smoothing."""
    if target.ndim == 1:
        dist = F.one_hot(target, num_classes).float()
    else:  # multi-hot -> uniform over the image's labels (big_vision's softmax on multi-label data)
        dist = target.float() / target.float().sum(dim=1, keepdim=True).clamp_min(1.0)
    return dist * (1 - smoothing) + smoothing / num_classes


def _unwrap(model: nn.Module) -> nn.Module:
    return getattr(model, "module", model)  # the DeepSpeed engine wraps the model


class _Objective:
    """What every objective shares: its config, and the pixel statistics its model's inputs are normalised
    with (data.mean / data.std, resolved when the stage starts: pipeline.stage.resolve_preprocessing)."""

    def __init__(self, cfg: ObjectiveConfig, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        self.cfg, self.mean, self.std = cfg, tuple(mean), tuple(std)

    def pixels(self, model: nn.Module, images: torch.Tensor) -> torch.Tensor:
        """uint8 batch -> normalised floats in the model's dtype (a bf16 engine casts the weights)."""
        return normalize(images, self.mean, self.std).to(next(_unwrap(model).parameters()).dtype)


class SupervisedSoftmax(_Objective):
    """Softmax cross-entropy with label smoothing and optional Mixup/CutMix."""

    name = "supervised_softmax"

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        bias = cfg.head_bias_init if cfg.head_bias_init is not None else 0.0
        return {"num_classes": num_classes, "head_bias_init": bias}

    def prepare(self, model, device) -> None:
        pass

    def _inputs(self, model, batch):
        images = self.pixels(model, batch["image"])
        target = _soft_targets(batch["target"], _unwrap(model).num_classes, self.cfg.label_smoothing).to(
            images.dtype
        )
        rng = np.random.default_rng(int(batch["seed"]))
        c = self.cfg
        return mixup_cutmix(images, target, rng, c.mixup_alpha, c.cutmix_alpha, c.mixup_switch_prob)

    def loss(self, model, batch):
        images, target = self._inputs(model, batch)
        logits = model(images)  # [B, K]
        loss = torch.sum(-target * F.log_softmax(logits.float(), dim=-1), dim=-1).mean()
        hard = batch["target"].argmax(1) if batch["target"].ndim == 2 else batch["target"]
        return loss, {"accuracy": (logits.argmax(1) == hard).float().mean().detach()}


class SupervisedSigmoid(_Objective):
    """Per-class sigmoid cross-entropy summed over classes, mean over the batch (JFT, big_vision)."""

    name = "supervised_sigmoid"

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        # Bias -10: every class starts near probability 0, as on ImageNet-21k / JFT in big_vision.
        bias = cfg.head_bias_init if cfg.head_bias_init is not None else -10.0
        return {"num_classes": num_classes, "head_bias_init": bias}

    def prepare(self, model, device) -> None:
        pass

    def loss(self, model, batch):
        logits = model(self.pixels(model, batch["image"])).float()  # [B, K]
        target = batch["target"]
        if target.ndim == 1:
            target = F.one_hot(target, logits.shape[1])
        target = target.to(logits.dtype)
        loss = F.binary_cross_entropy_with_logits(logits, target, reduction="none").sum(1).mean()
        top1 = target.gather(1, logits.argmax(1, keepdim=True)).mean()
        return loss, {"precision_at_1": top1.detach()}


class MaskedAutoencoder(_Objective):
    """MAE: reconstruct the pixels of the masked patches from the visible ones."""

    name = "mae"

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        return {}

    def prepare(self, model, device) -> None:
        pass

    def loss(self, model, batch):
        # fp32: the model casts what its encoder reads; its pixel targets stay fp32, as the reference's.
        images = normalize(batch["image"], self.mean, self.std)
        loss, _, mask = model(images, generator=_generator(batch, images.device))
        return loss, {"mask_ratio": mask.float().mean().detach()}


class SimMIMObjective(MaskedAutoencoder):
    """SimMIM: mask tokens in place of the masked patches, L1 on their pixels (hierarchical families)."""

    name = "simmim"  # the same call as MAE: model(images, generator) -> (loss, reconstruction, mask)


class MaskedPatchPrediction(_Objective):
    """The ViT paper's self-supervision: predict the 3-bit mean colour of corrupted patches."""

    name = "masked_patch_prediction"

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        return {}

    def prepare(self, model, device) -> None:
        pass

    def loss(self, model, batch):
        images = self.pixels(model, batch["image"])
        targets = mean_colour_classes(batch["image"], _unwrap(model).patch_size)  # [B, N]
        loss, logits, corrupted = model(images, targets, generator=_generator(batch, images.device))
        hits = (logits.argmax(-1) == targets) & corrupted  # no boolean indexing: it syncs with the host
        acc = hits.float().sum() / corrupted.float().sum().clamp_min(1.0)
        return loss, {"patch_accuracy": acc.detach()}


class Distillation(_Objective):
    """DeiT: the class token learns the labels, the distillation token the teacher (hard or soft)."""

    name = "distill"

    def __init__(self, cfg: ObjectiveConfig, mean=IMAGENET_MEAN, std=IMAGENET_STD):
        super().__init__(cfg, mean, std)
        self.teacher: nn.Module | None = None
        self.teacher_size: int | None = None

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        return {"num_classes": num_classes, "distilled": True}

    def prepare(self, model, device) -> None:
        t = self.cfg.teacher
        _unwrap(model).distilled_training = True  # the student returns (class, distillation) logits
        kwargs = {"num_classes": _unwrap(model).num_classes, **t.overrides}
        if t.img_size:
            kwargs["img_size"] = t.img_size
        teacher = create_model(t.model, **kwargs)
        try:
            teacher.load_state_dict(load_exported(t.weights)[0])
        except FileNotFoundError as exc:
            raise FileNotFoundError(f"objective.teacher.weights: {exc}") from None
        except RuntimeError as exc:
            raise ValueError(
                f"objective.teacher.weights: {t.weights} does not fit {t.model}: {exc}"
            ) from None
        # The teacher runs in the student's precision (bf16 on GPU): an fp32 teacher would cost more than
        # the student's own forward.
        dtype = next(_unwrap(model).parameters()).dtype
        self.teacher = teacher.to(device=device, dtype=dtype).eval().requires_grad_(False)
        self.teacher_size = t.img_size

    def loss(self, model, batch):
        images = self.pixels(model, batch["image"])
        num_classes = _unwrap(model).num_classes
        target = _soft_targets(batch["target"], num_classes, self.cfg.label_smoothing)
        cls_logits, dist_logits = model(images)
        base = torch.sum(-target * F.log_softmax(cls_logits.float(), dim=-1), dim=-1).mean()
        with torch.no_grad():
            t_in = (
                images
                if not self.teacher_size
                else F.interpolate(images, size=self.teacher_size, mode="bicubic")
            )
            t_logits = self.teacher(t_in).float()
        if self.cfg.distill_type == "hard":
            dist = F.cross_entropy(dist_logits.float(), t_logits.argmax(-1))
        else:
            tau = self.cfg.distill_tau
            dist = (
                F.kl_div(
                    F.log_softmax(dist_logits.float() / tau, -1),
                    F.log_softmax(t_logits / tau, -1),
                    reduction="batchmean",
                    log_target=True,
                )
                * tau
                * tau
            )
        alpha = self.cfg.distill_alpha
        loss = (1 - alpha) * base + alpha * dist
        agree = (dist_logits.argmax(-1) == t_logits.argmax(-1)).float().mean()
        return loss, {
            "teacher_agreement": agree.detach(),
            "loss_base": base.detach(),
            "loss_distill": dist.detach(),
        }


class Segmentation(_Objective):
    """Semantic segmentation (SETR): per-pixel softmax cross-entropy against the batch's masks.

    The loader's masks ([B, H, W] uint8, class per pixel) follow the image's crop and flip; pixels marked
    MASK_IGNORE count in no loss or metric. The model's classes are the dataset's segmentation classes.
    """

    name = "segmentation"

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        return {"num_classes": num_classes, "head_bias_init": cfg.head_bias_init or 0.0}

    def prepare(self, model, device) -> None:
        pass

    def loss(self, model, batch):
        logits = model(self.pixels(model, batch["image"])).float()  # [B, K, H, W]
        target = batch["mask"].long()  # [B, H, W]
        loss = F.cross_entropy(
            logits, target, ignore_index=MASK_IGNORE, label_smoothing=self.cfg.label_smoothing
        )
        counted = target != MASK_IGNORE
        hits = (logits.argmax(1) == target) & counted
        acc = hits.float().sum() / counted.float().sum().clamp_min(1.0)
        return loss, {"pixel_accuracy": acc.detach()}


class Detection(_Objective):
    """Set-prediction detection (DETR): each image's objects matched one-to-one to the model's queries by the
    Hungarian algorithm, then class cross-entropy ("no object" for unmatched queries, down-weighted), box L1
    and generalized IoU (`pipeline.models.boxes`), at every decoder layer with `aux_loss`.

    The loader's boxes ([B, M, 4] centre x, y, w, h as fractions, classes [B, M] with -1 for no object)
    follow the image's crop and flip. The model's classes are the dataset's detection classes. The box terms
    are divided by this rank's number of objects (DETR divides by the mean over ranks: the same where every
    rank's batch holds as many)."""

    name = "detection"

    @staticmethod
    def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
        return {"num_classes": num_classes, "head_bias_init": cfg.head_bias_init or 0.0}

    def prepare(self, model, device) -> None:
        pass

    def loss(self, model, batch):
        logits, boxes = model(self.pixels(model, batch["image"]))  # [L, B, Q, K + 1], [L, B, Q, 4]
        if not self.cfg.aux_loss:
            logits, boxes = logits[-1:], boxes[-1:]
        target_boxes, target_classes = batch["boxes"], batch["box_classes"]  # [B, M, 4], [B, M]
        weights = tuple(self.cfg.detection_weights)
        matches = hungarian_match(logits, boxes, target_boxes, target_classes, weights)
        total, parts = 0.0, {}
        for layer_logits, layer_boxes, layer_matches in zip(logits, boxes, matches):
            loss, parts = set_loss(
                layer_logits,
                layer_boxes,
                target_boxes,
                target_classes,
                layer_matches,
                self.cfg.no_object_weight,
                weights,
            )
            total = total + loss
        return total, parts  # the parts of the last layer, the one evaluation reads


OBJECTIVES = {
    c.name: c
    for c in (
        SupervisedSoftmax,
        SupervisedSigmoid,
        MaskedAutoencoder,
        SimMIMObjective,
        MaskedPatchPrediction,
        Distillation,
        Segmentation,
        Detection,
    )
}


def build_objective(cfg: ObjectiveConfig, mean=IMAGENET_MEAN, std=IMAGENET_STD) -> Objective:
    """The configured objective, normalising its model's inputs with `mean` and `std` (data.mean/std)."""
    return OBJECTIVES[cfg.name](cfg, mean, std)


def model_kwargs(cfg: ObjectiveConfig, num_classes: int) -> dict:
    """The `create_model` arguments the configured objective needs (head size and bias, distillation
    token), from its config alone: the loop, the eval stage and tests build the same model."""
    return OBJECTIVES[cfg.name].model_kwargs(cfg, num_classes)
