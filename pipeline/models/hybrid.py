"""The ViT paper's hybrid stem: ResNet-50 (BiT-style ResNetV2) stages feeding 1x1 patches.

"R50+ViT-B/16": the ResNet's stage 4 is removed and stage 3 extended to 9 blocks (3, 4, 9), so the
feature map has stride 16 and 1024 channels; a 1x1 projection turns each position into a token.
Standardised-weight convolutions and GroupNorm as in BiT, so batch size does not matter.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from pipeline.models.macs import conv_macs, conv_out, pair


class StdConv2d(nn.Conv2d):
    """Weight-standardised convolution (BiT)."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        w = F.batch_norm(
            self.weight.reshape(1, self.out_channels, -1), None, None, training=True, momentum=0.0, eps=1e-8
        )
        return F.conv2d(
            x, w.reshape_as(self.weight), self.bias, self.stride, self.padding, self.dilation, self.groups
        )


def _gn(c: int) -> nn.GroupNorm:
    return nn.GroupNorm(32, c, eps=1e-5)


class Bottleneck(nn.Module):
    """Post-activation bottleneck with GroupNorm (timm's ResNetV2 hybrid stem layout)."""

    def __init__(self, in_c: int, out_c: int, stride: int):
        super().__init__()
        mid = out_c // 4
        self.downsample = None
        if stride != 1 or in_c != out_c:
            self.downsample = nn.Sequential(StdConv2d(in_c, out_c, 1, stride=stride, bias=False), _gn(out_c))
        self.conv1, self.norm1 = StdConv2d(in_c, mid, 1, bias=False), _gn(mid)
        self.conv2, self.norm2 = StdConv2d(mid, mid, 3, stride=stride, padding=1, bias=False), _gn(mid)
        self.conv3, self.norm3 = StdConv2d(mid, out_c, 1, bias=False), _gn(out_c)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        shortcut = x if self.downsample is None else self.downsample(x)
        x = F.relu(self.norm1(self.conv1(x)))
        x = F.relu(self.norm2(self.conv2(x)))
        x = self.norm3(self.conv3(x))
        return F.relu(x + shortcut)


class ResNetStem(nn.Module):
    """Stem (7x7/2 conv, 3x3/2 max-pool) and bottleneck stages; output stride 4 * 2^(len(layers)-1)."""

    def __init__(self, layers: tuple[int, ...] = (3, 4, 9), in_chans: int = 3, width: int = 64):
        super().__init__()
        self.stem = nn.Sequential(
            StdConv2d(in_chans, width, 7, stride=2, padding=3, bias=False),
            _gn(width),
            nn.ReLU(),
            nn.MaxPool2d(3, 2, 1),
        )
        stages, in_c = [], width
        for i, depth in enumerate(layers):
            out_c = width * 4 * 2**i
            blocks = [
                Bottleneck(in_c if j == 0 else out_c, out_c, stride=(1 if i == 0 or j > 0 else 2))
                for j in range(depth)
            ]
            stages.append(nn.Sequential(*blocks))
            in_c = out_c
        self.stages = nn.Sequential(*stages)
        self.out_channels = in_c
        self.reduction = 4 * 2 ** (len(layers) - 1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.stages(self.stem(x))


class HybridEmbed(nn.Module):
    """CNN feature map -> tokens: 1x1 patches of the backbone's output, projected to the width."""

    def __init__(self, img_size: int, embed_dim: int, layers: tuple[int, ...] = (3, 4, 9), in_chans: int = 3):
        super().__init__()
        self.backbone = ResNetStem(layers, in_chans)
        r = self.backbone.reduction
        if img_size % r:
            raise ValueError(f"img_size {img_size} is not a multiple of the hybrid stem's stride {r}")
        self.patch_size = r
        self.grid_size = (img_size // r, img_size // r)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        self.proj = nn.Conv2d(self.backbone.out_channels, embed_dim, kernel_size=1)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.proj(self.backbone(x)).flatten(2).transpose(1, 2)  # [B, N, D]

    def forward_macs(self, img_hw: tuple[int, int]) -> tuple[int, int]:
        """(MACs, number of patch tokens): the ResNet's convolutions, then the 1x1 projection."""
        macs, hw = _cnn_macs(self.backbone, img_hw)
        proj, hw = conv_macs(self.proj, hw)
        return macs + proj, hw[0] * hw[1]


def _cnn_macs(module: nn.Module, hw: tuple[int, int]) -> tuple[int, tuple[int, int]]:
    """Walk the ResNet in execution order, carrying the spatial size from layer to layer."""
    if isinstance(module, nn.Conv2d):
        return conv_macs(module, hw)
    if isinstance(module, (nn.MaxPool2d, nn.AvgPool2d)):  # no MACs, but it shrinks the map
        k, s, p = pair(module.kernel_size), pair(module.stride or module.kernel_size), pair(module.padding)
        if getattr(module, "ceil_mode", False):
            raise ValueError("ceil_mode pooling is not supported by the analytic count")
        return 0, (conv_out(hw[0], k[0], s[0], p[0]), conv_out(hw[1], k[1], s[1], p[1]))
    if isinstance(module, Bottleneck):
        # The residual branch and the shortcut both start from the block's input.
        macs, out = 0, hw
        for conv in (module.conv1, module.conv2, module.conv3):
            m, out = conv_macs(conv, out)
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
