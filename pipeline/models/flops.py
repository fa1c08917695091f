"""Forward FLOPs of any registered model, and model FLOPs utilisation (MFU) from throughput.

Every model class counts its own multiply-accumulates in `forward_macs(img_size, mask_ratio)`, from
module shapes alone by the rules of `macs.py`; `flops_per_image` builds the model on the meta device
(so ViT-g/14 costs nothing to count) and doubles that count.

    from pipeline.models.flops import flops_per_image, flops_per_train_step, estimate_mfu
    flops_per_image("vit_b16") / 2e9                # 17.56 GMACs, timm reports 17.6
    flops_per_image("mae_vit_l16")                  # encoder on 25% of the patches, decoder on all
    estimate_mfu(flops_per_train_step("vit_h14"), images_per_s=300.0)   # per GPU, H100/H200 bf16 peak
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.hardware import H100_BF16_PEAK_FLOPS
from pipeline.models.registry import create_model


def _build(name: str, img_size: int | None, overrides: dict) -> nn.Module:
    kw = dict(overrides) if img_size is None else {"img_size": img_size, **overrides}
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return create_model(name, **kw)


# ---------------------------------------------------------------------- public API


def flops_per_image(
    name_or_model: str | nn.Module,
    img_size: int | None = None,
    mask_ratio: float | None = None,
    **overrides,
) -> int:
    """Forward matmul FLOPs (2 x MACs) for one image, counted from the model's shapes.

    name_or_model: a registered name (built on the meta device with `img_size` and `overrides`) or a
        model; for a model, `img_size` counts it at another resolution than it was built for.
    mask_ratio: fraction of patches the encoder drops. None means the model's own `mask_ratio` for
        MAE and 0 otherwise; a ViT given a ratio runs its blocks on the kept tokens only. Families that
        keep every token (masked patch prediction, SimMIM, TNT, CvT, Swin, LeViT) refuse a ratio.
    """
    if isinstance(name_or_model, str):
        model = _build(name_or_model, img_size, overrides)
    else:
        if overrides:
            raise TypeError(f"overrides {sorted(overrides)} need a model name, not a built model")
        model = name_or_model

    forward_macs = getattr(model, "forward_macs", None)
    if forward_macs is None:
        raise TypeError(
            f"cannot count FLOPs of {type(model).__name__}: it has no forward_macs(img_size, mask_ratio)"
        )
    return 2 * forward_macs(img_size, mask_ratio)


def flops_per_train_step(
    name_or_model: str | nn.Module,
    img_size: int | None = None,
    mask_ratio: float | None = None,
    **overrides,
) -> int:
    """Training FLOPs per image: 3 x the forward FLOPs.

    The backward pass costs about twice the forward (one matmul for the gradient of the activations,
    one for the gradient of the weights, per forward matmul), as in nanoGPT and the scaling-law papers.
    Activation checkpointing recomputes the forward on top (about 4x); that is hardware work, not
    model FLOPs, so MFU leaves it out.
    """
    return 3 * flops_per_image(name_or_model, img_size, mask_ratio, **overrides)


def estimate_mfu(
    flops_per_image: float, images_per_s: float, peak_flops: float = H100_BF16_PEAK_FLOPS
) -> float:
    """Model FLOPs utilisation: achieved FLOP/s over the accelerator's peak, as a fraction (0.4 = 40%).

    Pass `flops_per_train_step(...)` for training throughput and `flops_per_image(...)` for inference;
    `images_per_s` and `peak_flops` must describe the same thing (one GPU, or all of them).
    """
    if peak_flops <= 0:
        raise ValueError(f"peak_flops must be positive, got {peak_flops}")
    return flops_per_image * images_per_s / peak_flops
