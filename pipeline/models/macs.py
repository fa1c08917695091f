"""Multiply-accumulate counting from module shapes: the rules every family's `forward_macs` follows.

Only matrix multiplications count (FLOPs = 2 x MACs): linears, convolutions, and the attention
products QK^T and AV. Norms, softmax, activations, residual adds and biases are elementwise and left
out, as `torch.utils.flop_counter` and timm's published numbers leave them out. Nothing here runs a
forward, so a model built on the meta device counts at no cost.

Every model class offers `forward_macs(img_size=None, mask_ratio=None) -> int` (MACs for one image);
`pipeline.models.flops.flops_per_image` only calls it.
"""

from __future__ import annotations

from torch import nn


def linear_macs(linear: nn.Linear, tokens: int) -> int:
    return tokens * linear.in_features * linear.out_features


def conv_out(size: int, kernel: int, stride: int, padding: int, dilation: int = 1) -> int:
    """Output length of a convolution or pooling along one axis."""
    return (size + 2 * padding - dilation * (kernel - 1) - 1) // stride + 1


def pair(v) -> tuple[int, int]:
    return (v, v) if isinstance(v, int) else tuple(v)


def conv_macs(conv: nn.Conv2d, hw: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """MACs of one Conv2d on an input of spatial size hw (grouped: in/groups per output), and its output size."""
    if isinstance(conv.padding, str):
        raise ValueError(f"string padding {conv.padding!r} is not supported by the analytic count")
    (kh, kw), (sh, sw) = pair(conv.kernel_size), pair(conv.stride)
    (ph, pw), (dh, dw) = pair(conv.padding), pair(conv.dilation)
    out = (conv_out(hw[0], kh, sh, ph, dh), conv_out(hw[1], kw, sw, pw, dw))
    per_position = conv.out_channels * (conv.in_channels // conv.groups) * kh * kw
    return per_position * out[0] * out[1], out


def heads_macs(model: nn.Module) -> int:
    """The classifier heads on one pooled vector each: `head` and DeiT's `head_dist`, where they are Linear
    (pretraining wrappers replace the classifier with nn.Identity, and a missing head is None)."""
    heads = (getattr(model, "head", None), getattr(model, "head_dist", None))
    return sum(linear_macs(h, 1) for h in heads if isinstance(h, nn.Linear))


def reject_mask_ratio(model: nn.Module, mask_ratio: float | None) -> None:
    """For the families that keep every token (masked image modelling replaces tokens, it drops none)."""
    if mask_ratio:
        raise ValueError(
            f"{type(model).__name__} runs every token (mask tokens, not dropped ones): no mask_ratio"
        )


def kept_patches(num_patches: int, mask_ratio: float) -> int:
    """Patches the MAE encoder keeps: `int(N * (1 - mask_ratio))`, the rounding of `random_masking`."""
    if not 0.0 <= mask_ratio < 1.0:
        raise ValueError(f"mask_ratio must be in [0, 1), got {mask_ratio}")
    return int(num_patches * (1 - mask_ratio))
