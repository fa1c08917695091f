"""CvT: the Convolutional vision Transformer of "CvT: Introducing Convolutions to Vision Transformers"
(Wu et al. 2021), after the official microsoft/CvT code (`lib/models/cls_cvt.py`), single-device.

    from pipeline.models import create_model
    import pipeline.models.cvt  # noqa: F401  (registers cvt_13, cvt_21, cvt_debug)
    model = create_model("cvt_13", num_classes=1000)      # 20.0M parameters, 4.57 GMACs at 224 px
    model.forward_macs(384)                               # the same weights run at any resolution

Tests: `DS_ACCELERATOR=cpu .venv/bin/python -m pytest -q tests/test_model_cvt.py -p no:cacheprovider`

Three stages; each begins with a convolutional token embedding (an overlapping strided convolution, 7x7
stride 4 then 3x3 stride 2, and a LayerNorm) that cuts the token count and widens the channels, then
transformer blocks whose attention projects q, k and v by a depthwise 3x3 convolution + BatchNorm
("dw_bn") and a linear layer, keys and values at stride 2 (the "squeezed" projection: 4x fewer keys).
The convolutions carry the position information, so there is no position embedding anywhere and the
same weights run at any input size. The class token (and, with `distilled=True`, a DeiT distillation
token beside it) joins only in the last stage; it is split off before the convolutional projections,
which need a 2-D map, and concatenated back in front of q, k and v. (The distillation token is DeiT's
idea carried over; the official CvT has none.) One consequence: the last block's query convolution
only shapes patch tokens that the classifier never reads, so a classification loss gives it a zero
(present, not None) gradient, in the official model as here.

Faithful to the official code, where it differs from a plain ViT:
- the attention scale is `dim ** -0.5` over the full stage width, not `head_dim ** -0.5`
  (`Attention.scale` in cls_cvt.py; the Hugging Face port keeps it too), so converted weights agree;
- the MLP activation is QuickGELU, `x * sigmoid(1.702 x)` (the official `get_cls_model`);
- LayerNorm eps 1e-5; stochastic depth only in the last stage (DROP_PATH_RATE [0, 0, 0.1]).
Parameter names follow the official state dict (`stage0.patch_embed.proj`, `stage2.cls_token`,
`stage2.blocks.N.attn.conv_proj_k.bn`, `proj_q`, `norm`, `head`), so its checkpoints load by name.
Unlike the official code, the classifier is zero-initialised with bias `head_bias_init` (house rule).

Masked image modelling (SimMIM, Xie et al. 2022): `forward_mim` replaces the masked tokens of stage 1's
token grid (one token per 4x4 pixels, `mim_patch_size = 4`) by `mask_token` right after the first
convolutional token embedding, and returns the normalised stage-3 patch tokens as a map at stride 16
(`mim_stride`). The 7x7 stride-4 embedding overlaps: a token's receptive field crosses into its
neighbours by up to 2 pixels on each side (the padding-2 border), so a little of a masked 4x4 patch's
pixels leak into the unmasked tokens beside it. SimMIM accepts this for convolutional embeddings (it
masks at 32 px with 4 px tokens, so a masked region is far larger than the leak).
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.layers import (
    BatchNorm2d,
    DropPath,
    MaskedImageModelling,
    Mlp,
    checkpoints_block,
    classify,
    init_linear_and_norm,
)
from pipeline.models.macs import conv_macs, conv_out, heads_macs, reject_mask_ratio
from pipeline.models.registry import register

# Convolutional token embedding of each stage (kernel, stride, padding), as in the official configs.
EMBED_KERNELS, EMBED_STRIDES, EMBED_PADDINGS = (7, 3, 3), (4, 2, 2), (2, 1, 1)


class QuickGELU(nn.Module):
    """The sigmoid approximation of GELU the official CvT (and CLIP) trains with."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return x * torch.sigmoid(1.702 * x)


class ConvEmbed(nn.Module):
    """Convolutional token embedding: overlapping strided conv, then LayerNorm over the channels."""

    def __init__(self, in_chans: int, embed_dim: int, kernel: int, stride: int, padding: int):
        super().__init__()
        self.proj = nn.Conv2d(in_chans, embed_dim, kernel_size=kernel, stride=stride, padding=padding)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> tuple[torch.Tensor, tuple[int, int]]:
        x = self.proj(x)  # [B, C, H', W']
        hw = (x.shape[2], x.shape[3])
        return self.norm(x.flatten(2).transpose(1, 2)), hw  # [B, H'W', C]


class ConvProjection(nn.Module):
    """The "dw_bn" projection: depthwise 3x3 conv (no bias) + BatchNorm, map -> tokens."""

    def __init__(self, dim: int, kernel: int, stride: int):
        super().__init__()
        self.conv = nn.Conv2d(dim, dim, kernel, stride=stride, padding=kernel // 2, bias=False, groups=dim)
        self.bn = BatchNorm2d(dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.bn(self.conv(x)).flatten(2).transpose(1, 2)  # [B, C, H, W] -> [B, H'W', C]


class ConvAttention(nn.Module):
    """Multi-head attention with convolutional projections; keys and values squeezed by `stride_kv`."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        qkv_bias: bool = True,
        stride_kv: int = 2,
        kernel: int = 3,
        num_prefix_tokens: int = 0,
    ):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.dim, self.num_heads, self.num_prefix_tokens = dim, num_heads, num_prefix_tokens
        self.scale = dim**-0.5  # the official code's scale: full width, not head_dim (see module docstring)
        # Queries at stride 1: the block's residual needs one output per input token.
        self.conv_proj_q = ConvProjection(dim, kernel, 1)
        self.conv_proj_k = ConvProjection(dim, kernel, stride_kv)
        self.conv_proj_v = ConvProjection(dim, kernel, stride_kv)
        self.proj_q = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj_k = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj_v = nn.Linear(dim, dim, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        B, N, _ = x.shape  # N = P + h*w
        P, D, heads = self.num_prefix_tokens, self.dim, self.num_heads
        prefix, x = x[:, :P], x[:, P:]  # the class token has no place on the map: it is not convolved
        x = x.transpose(1, 2).reshape(B, D, h, w)
        q = torch.cat([prefix, self.conv_proj_q(x)], dim=1)  # [B, P + h*w, D]
        k = torch.cat([prefix, self.conv_proj_k(x)], dim=1)  # [B, P + h/s*w/s, D]
        v = torch.cat([prefix, self.conv_proj_v(x)], dim=1)
        q = self.proj_q(q).reshape(B, N, heads, D // heads).transpose(1, 2)  # [B, heads, Nq, D/heads]
        k = self.proj_k(k).reshape(B, k.shape[1], heads, D // heads).transpose(1, 2)  # [B, heads, Nk, ...]
        v = self.proj_v(v).reshape(B, v.shape[1], heads, D // heads).transpose(1, 2)
        x = F.scaled_dot_product_attention(q, k, v, scale=self.scale)  # [B, heads, Nq, D/heads]
        return self.proj(x.transpose(1, 2).reshape(B, N, D))

    def forward_macs(self, hw: tuple[int, int]) -> int:
        """MACs on an hw token map (plus the prefix tokens): depthwise convs, linears, QK^T and AV."""
        P = self.num_prefix_tokens
        conv_q, q_hw = conv_macs(self.conv_proj_q.conv, hw)
        conv_k, kv_hw = conv_macs(self.conv_proj_k.conv, hw)
        conv_v, _ = conv_macs(self.conv_proj_v.conv, hw)
        n_q, n_kv = P + q_hw[0] * q_hw[1], P + kv_hw[0] * kv_hw[1]  # prefix tokens join q, k and v unsqueezed
        linears = (n_q + 2 * n_kv + n_q) * self.dim * self.dim  # proj_q, proj_k, proj_v, proj
        return conv_q + conv_k + conv_v + linears + 2 * n_q * n_kv * self.dim  # QK^T and AV over all heads


class CvTBlock(nn.Module):
    """Pre-LN block: convolutional attention and an MLP, each a residual branch with stochastic depth."""

    def __init__(
        self,
        dim: int,
        num_heads: int,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        stride_kv: int = 2,
        drop_path: float = 0.0,
        num_prefix_tokens: int = 0,
    ):
        super().__init__()
        self.norm1 = nn.LayerNorm(dim)
        self.attn = ConvAttention(dim, num_heads, qkv_bias, stride_kv, num_prefix_tokens=num_prefix_tokens)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        self.mlp.act = QuickGELU()  # the official activation, in place of layers.Mlp's GELU

    def forward(self, x: torch.Tensor, h: int, w: int) -> torch.Tensor:
        x = x + self.drop_path(self.attn(self.norm1(x), h, w))
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def forward_macs(self, hw: tuple[int, int]) -> int:
        tokens = self.attn.num_prefix_tokens + hw[0] * hw[1]
        mlp = tokens * self.mlp.fc1.in_features * self.mlp.fc1.out_features * 2  # fc1 and fc2
        return self.attn.forward_macs(hw) + mlp


class CvTStage(nn.Module):
    """Convolutional token embedding, then blocks; the last stage adds the class (and distillation) token."""

    def __init__(
        self,
        in_chans: int,
        dim: int,
        depth: int,
        num_heads: int,
        embed: tuple[int, int, int],
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        stride_kv: int = 2,
        drop_path_rate: float = 0.0,
        num_prefix_tokens: int = 0,
        grad_checkpointing: float = 0.0,
    ):
        super().__init__()
        self.dim, self.num_prefix_tokens, self.grad_checkpointing = dim, num_prefix_tokens, grad_checkpointing
        self.patch_embed = ConvEmbed(in_chans, dim, *embed)
        self.cls_token = nn.Parameter(torch.zeros(1, 1, dim)) if num_prefix_tokens >= 1 else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, dim)) if num_prefix_tokens == 2 else None
        dpr = [drop_path_rate * i / max(1, depth - 1) for i in range(depth)]  # linspace(0, rate, depth)
        self.blocks = nn.ModuleList(
            CvTBlock(dim, num_heads, mlp_ratio, qkv_bias, stride_kv, dpr[i], num_prefix_tokens)
            for i in range(depth)
        )

    def forward(
        self, x: torch.Tensor, mask: torch.Tensor | None = None, mask_token: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """Map [B, C_in, H, W] -> tokens [B, P + h*w, C] and (h, w); `mask` [B, h*w, 1] blends in `mask_token`."""
        x, (h, w) = self.patch_embed(x)  # [B, h*w, C]
        if mask is not None:
            x = x * (1 - mask) + mask_token.to(x.dtype) * mask  # SimMIM: masked tokens -> the mask token
        prefix = [t.expand(x.shape[0], -1, -1) for t in (self.cls_token, self.dist_token) if t is not None]
        if prefix:
            x = torch.cat([*prefix, x], dim=1)  # [B, P + h*w, C]
        for i, blk in enumerate(self.blocks):
            if self.training and checkpoints_block(self.grad_checkpointing, i, len(self.blocks)):
                # Recompute activations in backward. The recompute updates BatchNorm's running stats a
                # second time, as for any BN model under checkpointing: they move about twice as fast.
                x = checkpoint(blk, x, h, w, use_reentrant=False)
            else:
                x = blk(x, h, w)
        return x, (h, w)


class ConvolutionalVisionTransformer(MaskedImageModelling, nn.Module):
    supports_mim = True
    mim_patch_size = EMBED_STRIDES[0]  # input pixels per token of stage 1's grid
    mim_stride = EMBED_STRIDES[0] * EMBED_STRIDES[1] * EMBED_STRIDES[2]  # of the stage-3 map

    def __init__(
        self,
        img_size: int = 224,
        in_chans: int = 3,
        num_classes: int = 1000,
        dims: tuple[int, int, int] = (64, 192, 384),
        depths: tuple[int, int, int] = (1, 2, 10),
        num_heads: tuple[int, int, int] = (1, 3, 6),
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        stride_kv: int = 2,
        distilled: bool = False,
        head_bias_init: float = 0.0,
        drop_path_rate: float = 0.1,
        grad_checkpointing: float = 0.0,
        mask_token: bool = False,
    ):
        super().__init__()
        if not len(dims) == len(depths) == len(num_heads) == len(EMBED_STRIDES):
            raise ValueError(
                f"CvT has {len(EMBED_STRIDES)} stages: dims {dims}, depths {depths} and num_heads "
                f"{num_heads} must each have {len(EMBED_STRIDES)} entries"
            )
        self.img_size = img_size  # the default resolution of forward_macs; any size runs
        self.num_classes, self.distilled = num_classes, distilled
        self.num_features = dims[-1]
        self.num_stages = len(dims)
        self.num_prefix_tokens = 1 + distilled  # in the last stage only
        self.distilled_training = False  # set by the distillation objective: forward returns both heads

        chans = in_chans
        for i in range(self.num_stages):
            last = i == self.num_stages - 1
            stage = CvTStage(
                chans,
                dims[i],
                depths[i],
                num_heads[i],
                (EMBED_KERNELS[i], EMBED_STRIDES[i], EMBED_PADDINGS[i]),
                mlp_ratio,
                qkv_bias,
                stride_kv,
                drop_path_rate if last else 0.0,  # the official configs: DROP_PATH_RATE [0, 0, rate]
                self.num_prefix_tokens if last else 0,
                grad_checkpointing,
            )
            self.add_module(f"stage{i}", stage)  # official names: stage0, stage1, stage2
            chans = dims[i]
        self.norm = nn.LayerNorm(dims[-1])
        self.head = nn.Linear(dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = None
        if distilled:
            self.head_dist = nn.Linear(dims[-1], num_classes) if num_classes > 0 else nn.Identity()
        # SimMIM's mask token lives in stage 1's embedding space; only built when asked for, so that
        # every parameter gets a gradient in supervised training.
        self.mask_token = nn.Parameter(torch.zeros(1, 1, dims[0])) if mask_token else None
        self._init_weights(head_bias_init)

    def _init_weights(self, head_bias_init: float) -> None:
        # The official trunc_norm init; convolutions keep PyTorch's default (as there).
        init_linear_and_norm(self, (nn.LayerNorm, nn.BatchNorm2d))
        for stage in self.stages:
            for t in (stage.cls_token, stage.dist_token):
                if t is not None:
                    nn.init.trunc_normal_(t, std=0.02)
        if self.mask_token is not None:
            nn.init.trunc_normal_(self.mask_token, std=0.02)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)  # zero-initialised classifier (house rule, as vit.py)
                nn.init.constant_(head.bias, head_bias_init)

    @property
    def stages(self) -> tuple[CvTStage, ...]:
        return tuple(getattr(self, f"stage{i}") for i in range(self.num_stages))

    # ------------------------------------------------------------------ forward

    def _forward_stages(
        self, x: torch.Tensor, mask: torch.Tensor | None = None
    ) -> tuple[torch.Tensor, tuple[int, int]]:
        """Images [B, C, H, W] -> last stage's tokens after the final norm [B, P + h*w, C_last], (h, w)."""
        hw, prefix = (0, 0), 0
        for i, stage in enumerate(self.stages):
            if i:  # the previous stage's patch tokens back to a map (only the last stage has a prefix)
                x = x[:, prefix:].transpose(1, 2).reshape(x.shape[0], -1, *hw)  # [B, C, h, w]
            x, hw = stage(x, mask, self.mask_token) if i == 0 and mask is not None else stage(x)
            prefix = stage.num_prefix_tokens
        return self.norm(x), hw

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        return self._forward_stages(x)[0]  # [B, P + h*w, C]: class (, distillation) token first

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if pre_logits:
            return x[:, 0]  # the class token, normalised
        return classify(self, x[:, 0], x[:, 1])

    def _forward_mim(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SimMIM: images [B, C, H, W], mask bool [B, H/4, W/4] (True = masked) -> [B, C_last, H/16, W/16]."""
        if self.mask_token is None:
            raise RuntimeError("forward_mim needs the model built with mask_token=True")
        B, _, H, W = x.shape
        grid = (
            conv_out(H, EMBED_KERNELS[0], EMBED_STRIDES[0], EMBED_PADDINGS[0]),
            conv_out(W, EMBED_KERNELS[0], EMBED_STRIDES[0], EMBED_PADDINGS[0]),
        )
        if tuple(mask.shape) != (B, *grid):
            raise ValueError(
                f"mask must be [B, H/{self.mim_patch_size}, W/{self.mim_patch_size}] = {[B, *grid]} "
                f"for images {list(x.shape)}, got {list(mask.shape)}"
            )
        w = mask.flatten(1).unsqueeze(-1).to(x.dtype)  # [B, h*w, 1]: 1 is masked
        tokens, hw = self._forward_stages(x, w)  # [B, P + h*w, C]
        return tokens[:, self.num_prefix_tokens :].transpose(1, 2).reshape(B, -1, *hw)

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image, from module shapes alone (works on meta).

        Counted: every convolution (the depthwise q/k/v projections at in/groups = 1 per output), every
        linear, QK^T and AV over the squeezed keys (the class token joins k and v unsqueezed), the heads.
        Left out: norms (incl. BatchNorm), softmax, activations, adds, biases.
        """
        reject_mask_ratio(self, mask_ratio)
        size = self.img_size if img_size is None else img_size
        hw, macs = (size, size), 0
        for stage in self.stages:
            m, hw = conv_macs(stage.patch_embed.proj, hw)
            macs += m + sum(blk.forward_macs(hw) for blk in stage.blocks)
        return macs + heads_macs(self)


def _cvt(dims, depths, num_heads, /, **overrides) -> ConvolutionalVisionTransformer:
    # Positional-only shape, so an override may name any of them (create_model("cvt_13", depths=...)).
    kw = dict(dims=tuple(dims), depths=tuple(depths), num_heads=tuple(num_heads))
    return ConvolutionalVisionTransformer(**{**kw, **overrides})


@register
def cvt_debug(**kw):
    """Tiny CvT for tests and smoke runs: 32 px images, widths 16/32/64, depths 1/1/2 (0.21M parameters)."""
    return _cvt((16, 32, 64), (1, 1, 2), (1, 2, 4), **{"img_size": 32, **kw})


@register
def cvt_13(**kw):
    """CvT-13: widths 64/192/384, heads 1/3/6, depths 1/2/10 (19.98M parameters, paper 20M)."""
    return _cvt((64, 192, 384), (1, 2, 10), (1, 3, 6), **kw)


@register
def cvt_21(**kw):
    """CvT-21: widths 64/192/384, heads 1/3/6, depths 1/4/16 (31.54M parameters, paper 32M)."""
    return _cvt((64, 192, 384), (1, 4, 16), (1, 3, 6), **kw)
