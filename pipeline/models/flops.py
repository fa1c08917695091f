"""Analytic forward FLOPs of the ViT family, and model FLOPs utilisation (MFU) from throughput.

The other families (TNT, CvT, LeViT, Swin) and the SimMIM wrapper count themselves in
`forward_macs(img_size)` by the same rules; `flops_per_image` dispatches to it.

    from pipeline.models.flops import flops_per_image, flops_per_train_step, estimate_mfu
    flops_per_image("vit_b16") / 2e9                # 17.56 GMACs, timm reports 17.6
    flops_per_image("mae_vit_l16")                  # encoder on 25% of the patches, decoder on all
    estimate_mfu(flops_per_train_step("vit_h14"), images_per_s=300.0)   # per GPU, H100/H200 bf16 peak

Counts come from module shapes alone (nothing runs; named models are built on the meta device), so
ViT-g/14 costs nothing to count. Only matrix multiplications count, FLOPs = 2 x multiply-accumulates:
the patch embedding (or the hybrid ResNet's convolutions and its 1x1 projection), qkv and proj, the
attention products QK^T and AV, the MLPs and the heads. Norms, softmax, GELU, residual adds and the
relative position bias are elementwise and left out, as `torch.utils.flop_counter` and timm's
published numbers leave them out.
"""

from __future__ import annotations

import torch
from torch import nn

from pipeline.models.hybrid import Bottleneck, HybridEmbed, ResNetStem
from pipeline.models.layers import Block, PatchEmbed
from pipeline.models.mae import MaskedAutoencoderViT
from pipeline.models.masked_patch import MaskedPatchPredictionViT
from pipeline.models.registry import create_model
from pipeline.models.vit import VisionTransformer

# H100 / H200 dense bf16 peak (REFERENCE.md): the default denominator of `estimate_mfu`.
H100_BF16_PEAK_FLOPS = 989e12


def _build(name: str, img_size: int | None, overrides: dict) -> nn.Module:
    kw = dict(overrides) if img_size is None else {"img_size": img_size, **overrides}
    with torch.device("meta"):  # shapes only: no memory, no initialisation cost
        return create_model(name, **kw)


# ---------------------------------------------------------------------- multiply-accumulates per layer


def _linear_macs(linear: nn.Linear, tokens: int) -> int:
    return tokens * linear.in_features * linear.out_features


def _conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def _pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def _conv_macs(conv: nn.Conv2d, hw: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """MACs of one Conv2d on an input of spatial size hw, and its output size."""
    if isinstance(conv.padding, str):
        raise ValueError(f"string padding {conv.padding!r} is not supported by the analytic count")
    (kh, kw), (sh, sw) = _pair(conv.kernel_size), _pair(conv.stride)
    (ph, pw), (dh, dw) = _pair(conv.padding), _pair(conv.dilation)
    out = (_conv_out(hw[0], kh, sh, ph, dh), _conv_out(hw[1], kw, sw, pw, dw))
    per_position = conv.out_channels * (conv.in_channels // conv.groups) * kh * kw
    return per_position * out[0] * out[1], out


def _cnn_macs(module: nn.Module, hw: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """Walk the hybrid stem in execution order, carrying the spatial size from layer to layer."""
    if isinstance(module, nn.Conv2d):
        return _conv_macs(module, hw)
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):  # no MACs, but it shrinks the map
        k, s, p = _pair(module.kernel_size), _pair(module.stride or module.kernel_size), _pair(module.padding)
        if getattr(module, "ceil_mode", False):
            raise ValueError("ceil_mode pooling is not supported by the analytic count")
        return 0, (_conv_out(hw[0], k[0], s[0], p[0]), _conv_out(hw[1], k[1], s[1], p[1]))
    if isinstance(module, Bottleneck):
        # The residual branch and the shortcut both start from the block's input.
        macs, out = 0, hw
        for conv in (module.conv1, module.conv2, module.conv3):
            m, out = _conv_macs(conv, out)
            macs += m
        if module.downsample is not None:
            macs += _cnn_macs(module.downsample, hw)[0]
        return macs, out
    if isinstance(module, (nn.Sequential, ResNetStem)):
        children = (module.stem, module.stages) if isinstance(module, ResNetStem) else module
        macs = 0
        for child in children:
            m, hw = _cnn_macs(child, hw)
            macs += m
        return macs, hw
    if any(isinstance(m, nn.Conv2d) for m in module.modules()):
        raise TypeError(f"cannot count {type(module).__name__}: unknown container of convolutions")
    return 0, hw  # norms and activations: no matmuls, same size


def _embed_macs(patch_embed: nn.Module, img_hw: tuple[int, int]) -> tuple[int, int]:
    """(MACs, number of patch tokens) of the patch embedding: one strided conv, or ResNet + 1x1 conv."""
    if isinstance(patch_embed, HybridEmbed):
        macs, hw = _cnn_macs(patch_embed.backbone, img_hw)
        proj, hw = _conv_macs(patch_embed.proj, hw)
        return macs + proj, hw[0] * hw[1]
    if isinstance(patch_embed, PatchEmbed):
        macs, hw = _conv_macs(patch_embed.proj, img_hw)
        return macs, hw[0] * hw[1]
    raise TypeError(f"cannot count patch embedding {type(patch_embed).__name__}")


def block_macs(block: Block, tokens: int) -> int:
    """MACs of one transformer block on `tokens` tokens: qkv, QK^T, AV, proj, fc1, fc2."""
    attn, mlp = block.attn, block.mlp
    inner = attn.qkv.out_features // 3  # heads x head_dim
    attention = 2 * tokens * tokens * inner  # QK^T [T, d] x [d, T] and AV [T, T] x [T, d], summed over heads
    return (
        _linear_macs(attn.qkv, tokens)
        + attention
        + _linear_macs(attn.proj, tokens)
        + _linear_macs(mlp.fc1, tokens)
        + _linear_macs(mlp.fc2, tokens)
    )


def _img_hw(vit: VisionTransformer, img_size: int | None) -> tuple[int, int]:
    if img_size is not None:
        return (img_size, img_size)
    grid, p = vit.patch_embed.grid_size, vit.patch_embed.patch_size
    return (grid[0] * p, grid[1] * p)


def _kept(num_patches: int, mask_ratio: float) -> int:
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    return int(num_patches * (1 - mask_ratio))  # MAE's len_keep: the same rounding as random_masking


def _encoder_macs(
    vit: VisionTransformer, img_size: int | None, mask_ratio: float, heads: bool
) -> tuple[int, int]:
    """(MACs, patch count) of a ViT on the kept tokens; the patch embedding runs on every patch."""
    macs, n = _embed_macs(vit.patch_embed, _img_hw(vit, img_size))
    tokens = vit.num_prefix_tokens + _kept(n, mask_ratio)
    macs += sum(block_macs(blk, tokens) for blk in vit.blocks)
    if heads:  # one pooled vector per head: the class token (and distillation token) or the mean
        # isinstance: pretraining wrappers replace the classifier with nn.Identity.
        macs += sum(_linear_macs(h, 1) for h in (vit.head, vit.head_dist) if isinstance(h, nn.Linear))
    return macs, n


def _mae_macs(mae: MaskedAutoencoderViT, img_size: int | None, mask_ratio: float) -> int:
    """MAE: encoder on the visible tokens, decoder on all of them (mask tokens filled in)."""
    enc = mae.encoder
    macs, n = _encoder_macs(enc, img_size, mask_ratio, heads=False)  # pretraining has no classifier
    prefix = enc.num_prefix_tokens
    visible, full = prefix + _kept(n, mask_ratio), prefix + n
    macs += _linear_macs(mae.decoder_embed, visible)  # before the mask tokens are appended
    macs += sum(block_macs(blk, full) for blk in mae.decoder_blocks)
    macs += _linear_macs(mae.decoder_pred, full)  # MAE predicts on every token, then drops the prefix
    return macs


def _masked_patch_macs(model: MaskedPatchPredictionViT, img_size: int | None) -> int:
    """Masked patch prediction (ViT paper, B.1.2): encoder on all tokens, a head on every patch."""
    macs, n = _encoder_macs(model.encoder, img_size, 0.0, heads=False)
    return macs + _linear_macs(model.head, n)


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
        MAE and 0 otherwise; a ViT given a ratio runs its blocks on the kept tokens only.
    """
    if isinstance(name_or_model, str):
        model = _build(name_or_model, img_size, overrides)
    else:
        if overrides:
            raise TypeError(f"overrides {sorted(overrides)} need a model name, not a built model")
        model = name_or_model

    if isinstance(model, MaskedAutoencoderViT):
        ratio = model.mask_ratio if mask_ratio is None else mask_ratio
        return 2 * _mae_macs(model, img_size, ratio)
    if isinstance(model, MaskedPatchPredictionViT):
        if mask_ratio:
            raise ValueError("masked patch prediction corrupts patches, it does not drop them: no mask_ratio")
        return 2 * _masked_patch_macs(model, img_size)
    if isinstance(model, VisionTransformer):
        return 2 * _encoder_macs(model, img_size, mask_ratio or 0.0, heads=True)[0]
    if hasattr(model, "forward_macs"):  # TNT, CvT, LeViT, Swin, SimMIM: each counts its own shapes
        if mask_ratio:
            raise ValueError(
                f"{type(model).__name__} runs every token (mask tokens, not dropped ones): no mask_ratio"
            )
        return 2 * model.forward_macs(img_size)
    raise TypeError(f"cannot count FLOPs of {type(model).__name__}")


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
