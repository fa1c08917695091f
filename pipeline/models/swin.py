"""Swin Transformer (Liu et al. 2021, "Hierarchical Vision Transformer using Shifted Windows"), single-device.

Four stages of windowed attention over a 4x4-patch token grid, halved in resolution and doubled in
width by patch merging between stages; odd blocks shift the windows by half a window (a cyclic roll
plus an attention mask that keeps the wrapped-around regions apart). Parameter names follow the
official microsoft/Swin-Transformer layout (`patch_embed.proj`, `patch_embed.norm`,
`layers.S.blocks.B.attn.relative_position_bias_table`, `layers.S.downsample.reduction`, `norm`, `head`),
which SimMIM shares.

    model = create_model("swin_t", num_classes=1000)          # 28.29M parameters, 4.49 GMACs at 224 px
    model = create_model("swin_t", img_size=64)               # stages at 16, 8, 4, 2 tokens: padded windows
    feats = model.forward_mim(imgs, mask)                     # SimMIM: mask [B, H/4, W/4] -> [B, 768, H/32, W/32]

Resolution rules, as the official code: a stage whose token grid is no larger than the window uses one
window covering the grid and no shift; a grid that is not a multiple of the window is zero-padded at the
bottom and right (official detection code), and the shift mask is built on the padded grid; as there,
the padding tokens are not masked out (border windows attend to them), and the outputs are cropped back.
The window layout is fixed at construction, so the model runs at the `img_size` it was built for.

ZeRO-3: every parameter is read only in the forward of the module that registers it; the bias table
belongs to `WindowAttention`, and `forward_mim` runs through `self(x, mim_mask=mask)` so that the
model's own `mask_token` is used inside its own forward.

Tests: `DS_ACCELERATOR=cpu .venv/bin/python -m pytest -q tests/test_model_swin.py`.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.layers import (
    DropPath,
    MaskedImageModelling,
    Mlp,
    PatchEmbed,
    checkpoints_block,
    classify,
    init_linear_and_norm,
)
from pipeline.models.macs import heads_macs, reject_mask_ratio
from pipeline.models.registry import register

MASK_VALUE = -100.0  # the official code's "minus infinity": exp(-100) is 0 in fp16/bf16, no NaN on full rows


# ---------------------------------------------------------------------- windows


def stage_window(resolution: tuple[int, int], window_size: int) -> tuple[int, int]:
    """(window, shift) of a shifted block at this token grid: clipped to the grid, unshifted, when it covers it."""
    if min(resolution) <= window_size:
        return min(resolution), 0
    return window_size, window_size // 2


def window_partition(x: torch.Tensor, window: int) -> torch.Tensor:
    """[B, H, W, C] -> [B * nW, window * window, C], windows in row-major order, batch outermost."""
    B, H, W, C = x.shape
    x = x.view(B, H // window, window, W // window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, window * window, C)


def window_reverse(windows: torch.Tensor, window: int, height: int, width: int) -> torch.Tensor:
    """[B * nW, window * window, C] -> [B, H, W, C]; the inverse of `window_partition`."""
    C = windows.shape[-1]
    x = windows.view(-1, height // window, width // window, window, window, C).permute(0, 1, 3, 2, 4, 5)
    return x.reshape(-1, height, width, C)


def shifted_window_mask(height: int, width: int, window: int, shift: int) -> torch.Tensor:
    """Additive attention mask [nW, N, N] (0 or MASK_VALUE) for windows of the map rolled by (-shift, -shift).

    After the roll the last window row and column hold tokens from both ends of the map; each axis splits
    into three regions ([0, H-window), [H-window, H-shift), [H-shift, H)) and a token only attends within
    its own region pair, which is exactly its window of the shifted partition in the original coordinates.
    Built from arange so it works on the meta device.
    """

    def regions(n: int) -> torch.Tensor:  # [n] region id along one axis of the rolled map
        i = torch.arange(n)
        return (i >= n - window).long() + (i >= n - shift).long()

    ids = regions(height)[:, None] * 3 + regions(width)[None, :]  # [H, W]
    ids = window_partition(ids[None, :, :, None], window).squeeze(-1)  # [nW, N]
    same = ids[:, :, None] == ids[:, None, :]  # [nW, N, N]
    return torch.zeros(same.shape).masked_fill(~same, MASK_VALUE)


def relative_position_index(window: int) -> torch.Tensor:
    """[N, N] index into the (2W-1)^2 bias table for every (query, key) pair of a window (official layout)."""
    coords = torch.stack(torch.meshgrid(torch.arange(window), torch.arange(window), indexing="ij")).flatten(1)
    rel = (coords[:, :, None] - coords[:, None, :]).permute(1, 2, 0) + (window - 1)  # [N, N, 2] in [0, 2W-2]
    return rel[..., 0] * (2 * window - 1) + rel[..., 1]


# ---------------------------------------------------------------------- modules


class WindowAttention(nn.Module):
    """Multi-head self-attention inside windows, with a learned bias per head and relative offset.

    The bias table lives here and is read only in this forward (ZeRO-3 gathers it with this module).
    """

    def __init__(self, dim: int, window: int, num_heads: int, qkv_bias: bool = True):
        super().__init__()
        if dim % num_heads:
            raise ValueError(f"width {dim} is not divisible by {num_heads} heads")
        self.num_heads, self.window, self.window_area = num_heads, window, window * window
        self.relative_position_bias_table = nn.Parameter(torch.zeros((2 * window - 1) ** 2, num_heads))
        self.register_buffer("relative_position_index", relative_position_index(window), persistent=False)
        self.qkv = nn.Linear(dim, dim * 3, bias=qkv_bias)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> torch.Tensor:
        """x [B * nW, N, C]; mask [nW, N, N] additive (shifted blocks) or None."""
        Bw, N, C = x.shape
        H = self.num_heads
        qkv = self.qkv(x).reshape(Bw, N, 3, H, C // H).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)  # [B * nW, H, N, C/H]
        bias = self.relative_position_bias_table[self.relative_position_index.view(-1)]
        bias = bias.view(self.window_area, self.window_area, H).permute(2, 0, 1)  # [H, N, N]
        if mask is None:
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[None].to(q.dtype))
        else:
            # Windows and heads share one axis, so the [nW * H, N, N] bias broadcasts over the batch
            # instead of being materialised per image.
            nW = mask.shape[0]
            bias = (bias[None] + mask[:, None]).reshape(1, nW * H, N, N).to(q.dtype)
            q, k, v = (t.reshape(Bw // nW, nW * H, N, C // H) for t in (q, k, v))
            x = F.scaled_dot_product_attention(q, k, v, attn_mask=bias).reshape(Bw, H, N, C // H)
        return self.proj(x.transpose(1, 2).reshape(Bw, N, C))

    def extra_repr(self) -> str:
        return f"window={self.window}, num_heads={self.num_heads}"


class SwinBlock(nn.Module):
    """Pre-LN block: (shifted) window attention, then an MLP, each with a residual and stochastic depth."""

    def __init__(
        self,
        dim: int,
        resolution: tuple[int, int],
        num_heads: int,
        window_size: int = 7,
        shifted: bool = False,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path: float = 0.0,
    ):
        super().__init__()
        self.resolution = tuple(resolution)
        window, shift = stage_window(self.resolution, window_size)
        self.window_size, self.shift_size = window, shift if shifted else 0
        H, W = self.resolution
        self.pad_h, self.pad_w = -H % window, -W % window  # zero padding to whole windows (bottom, right)
        self.norm1 = nn.LayerNorm(dim)
        self.attn = WindowAttention(dim, window, num_heads, qkv_bias)
        self.drop_path = DropPath(drop_path) if drop_path > 0 else nn.Identity()
        self.norm2 = nn.LayerNorm(dim)
        self.mlp = Mlp(dim, int(dim * mlp_ratio))
        mask = None
        if self.shift_size:
            mask = shifted_window_mask(H + self.pad_h, W + self.pad_w, window, self.shift_size)
        self.register_buffer("attn_mask", mask, persistent=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape  # [B, H*W, C]
        H, W = self.resolution
        ws, s = self.window_size, self.shift_size
        shortcut = x
        x = self.norm1(x).view(B, H, W, C)
        if self.pad_h or self.pad_w:
            x = F.pad(x, (0, 0, 0, self.pad_w, 0, self.pad_h))  # [B, Hp, Wp, C]
        Hp, Wp = H + self.pad_h, W + self.pad_w
        if s:
            x = torch.roll(x, shifts=(-s, -s), dims=(1, 2))  # cyclic shift: windows move by (s, s)
        x = self.attn(window_partition(x, ws), self.attn_mask)  # [B*nW, ws*ws, C]
        x = window_reverse(x, ws, Hp, Wp)
        if s:
            x = torch.roll(x, shifts=(s, s), dims=(1, 2))
        x = x[:, :H, :W].reshape(B, L, C)
        x = shortcut + self.drop_path(x)
        return x + self.drop_path(self.mlp(self.norm2(x)))

    def extra_repr(self) -> str:
        return f"resolution={self.resolution}, window={self.window_size}, shift={self.shift_size}"


class PatchMerging(nn.Module):
    """2x2 neighbouring tokens concatenated (4C), normalised, projected to 2C: half the grid, twice the width."""

    def __init__(self, dim: int, resolution: tuple[int, int]):
        super().__init__()
        self.resolution = tuple(resolution)
        H, W = self.resolution
        self.out_resolution = ((H + 1) // 2, (W + 1) // 2)  # odd grids are zero-padded (detection code)
        self.norm = nn.LayerNorm(4 * dim)
        self.reduction = nn.Linear(4 * dim, 2 * dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, L, C = x.shape
        H, W = self.resolution
        x = x.view(B, H, W, C)
        if H % 2 or W % 2:
            x = F.pad(x, (0, 0, 0, W % 2, 0, H % 2))
        # The official concatenation order: (0,0), (1,0), (0,1), (1,1).
        x = torch.cat([x[:, 0::2, 0::2], x[:, 1::2, 0::2], x[:, 0::2, 1::2], x[:, 1::2, 1::2]], dim=-1)
        return self.reduction(self.norm(x.view(B, -1, 4 * C)))  # [B, H/2 * W/2, 2C]


class SwinPatchEmbed(PatchEmbed):
    """4x4 patch partition and linear embedding (one strided conv), then LayerNorm (official `patch_norm`)."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, embed_dim: int):
        super().__init__(img_size, patch_size, in_chans, embed_dim)
        self.norm = nn.LayerNorm(embed_dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.norm(super().forward(x))  # [B, N, D]


class SwinStage(nn.Module):
    """The blocks of one resolution (even blocks plain windows, odd blocks shifted), then patch merging."""

    def __init__(
        self,
        dim: int,
        resolution: tuple[int, int],
        depth: int,
        num_heads: int,
        window_size: int,
        mlp_ratio: float,
        qkv_bias: bool,
        drop_path: list[float],
        downsample: bool,
    ):
        super().__init__()
        self.dim, self.resolution = dim, tuple(resolution)
        self.blocks = nn.ModuleList(
            SwinBlock(dim, resolution, num_heads, window_size, i % 2 == 1, mlp_ratio, qkv_bias, drop_path[i])
            for i in range(depth)
        )
        self.downsample = PatchMerging(dim, resolution) if downsample else None

    def forward(self, x: torch.Tensor, grad_checkpointing: float = 0.0) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            ckpt = checkpoints_block(grad_checkpointing, i, len(self.blocks))
            x = checkpoint(blk, x, use_reentrant=False) if ckpt else blk(x)
        return x if self.downsample is None else self.downsample(x)


class SwinTransformer(MaskedImageModelling, nn.Module):
    """Patch partition, four stages of (shifted) window attention with patch merging, LayerNorm, mean pool."""

    supports_mim = True  # SimMIM: mask tokens replace patch embeddings before the first stage

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 4,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 96,
        depths: tuple[int, ...] = (2, 2, 6, 2),
        num_heads: tuple[int, ...] = (3, 6, 12, 24),
        window_size: int = 7,
        mlp_ratio: float = 4.0,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.1,
        distilled: bool = False,
        head_bias_init: float = 0.0,
        grad_checkpointing: float = 0.0,
        mask_token: bool = False,
    ):
        super().__init__()
        depths, num_heads = tuple(depths), tuple(num_heads)
        if len(depths) != len(num_heads):
            raise ValueError(f"depths {depths} and num_heads {num_heads} need one entry per stage")
        self.img_size, self.patch_size, self.window_size = img_size, patch_size, window_size
        self.num_classes, self.distilled, self.embed_dim = num_classes, distilled, embed_dim
        self.depths, self.num_layers = depths, len(depths)
        self.num_features = embed_dim * 2 ** (self.num_layers - 1)
        self.grad_checkpointing = grad_checkpointing
        self.distilled_training = False  # set by the distillation objective: forward returns both heads
        self.mim_patch_size = patch_size
        self.mim_stride = patch_size * 2 ** (self.num_layers - 1)

        self.patch_embed = SwinPatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if mask_token else None
        total = sum(depths)
        dpr = [drop_path_rate * i / max(1, total - 1) for i in range(total)]  # grows over all blocks
        resolution = self.patch_embed.grid_size
        self.layers = nn.ModuleList()
        for i, (depth, heads) in enumerate(zip(depths, num_heads)):
            last = i == self.num_layers - 1
            stage = SwinStage(
                embed_dim * 2**i,
                resolution,
                depth,
                heads,
                window_size,
                mlp_ratio,
                qkv_bias,
                dpr[sum(depths[:i]) : sum(depths[: i + 1])],
                downsample=not last,
            )
            self.layers.append(stage)
            if not last:
                resolution = stage.downsample.out_resolution
        self.norm = nn.LayerNorm(self.num_features)
        self.head = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = None
        if distilled:
            self.head_dist = nn.Linear(self.num_features, num_classes) if num_classes > 0 else nn.Identity()
        self._init_weights(head_bias_init)

    def _init_weights(self, head_bias_init: float) -> None:
        # As the official code: trunc-normal linears and bias tables, unit LayerNorms, default conv init.
        init_linear_and_norm(self)
        for m in self.modules():
            if isinstance(m, WindowAttention):
                nn.init.trunc_normal_(m.relative_position_bias_table, std=0.02)
        if self.mask_token is not None:
            nn.init.trunc_normal_(self.mask_token, std=0.02)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)  # zero-initialised classifier
                nn.init.constant_(head.bias, head_bias_init)

    # ------------------------------------------------------------------ forward

    def _check_size(self, x: torch.Tensor) -> None:
        if tuple(x.shape[-2:]) != (self.img_size, self.img_size):
            raise ValueError(
                f"Swin built for {self.img_size}px images got {tuple(x.shape[-2:])}: the window layout "
                f"(clipping, padding, shift masks) is fixed at construction; create the model with that img_size"
            )

    def forward_layers(self, x: torch.Tensor) -> torch.Tensor:
        """Patch tokens [B, N, C] -> normalised tokens of the last stage [B, N / 4^(S-1), num_features]."""
        ckpt = self.grad_checkpointing if self.training else 0.0  # the fraction of each stage's blocks
        for layer in self.layers:
            x = layer(x, ckpt)
        return self.norm(x)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        self._check_size(x)
        return self.forward_layers(self.patch_embed(x))  # [B, N_last, num_features]

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        x = x.mean(dim=1)  # global average pooling [B, num_features]
        if pre_logits:
            return x
        return classify(self, x, x)

    # ------------------------------------------------------------------ masked image modelling

    def _forward_mim(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SimMIM encoder: images [B, 3, H, W], mask bool [B, H/4, W/4] (True = masked) -> [B, C, H/32, W/32]."""
        if self.mask_token is None:
            raise ValueError("forward_mim needs the model built with mask_token=True")
        self._check_size(x)
        x = self.patch_embed(x)  # [B, N, C]
        B, N, _ = x.shape
        if mask.shape != (B, *self.patch_embed.grid_size):
            raise ValueError(
                f"mask must be [B, H/{self.patch_size}, W/{self.patch_size}], got {tuple(mask.shape)}"
            )
        w = mask.reshape(B, N, 1).to(x.dtype)  # 1 = masked
        x = x * (1 - w) + self.mask_token.to(x.dtype) * w
        x = self.forward_layers(x)  # [B, N_last, C]
        h, w_ = self.layers[-1].resolution
        return x.transpose(1, 2).reshape(B, self.num_features, h, w_)

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image, from module shapes (never runs forward; meta-safe).

        Counts the patch conv, qkv / proj / fc1 / fc2, QK^T and AV in every window, patch merging and the
        heads. qkv, attention and proj run on the padded grid, the MLP on the real tokens. Norms, softmax,
        GELU, bias gathers and pooling are left out. `img_size` counts the model this one would be at that
        size (same weights, windows clipped and padded for that grid).
        """
        reject_mask_ratio(self, mask_ratio)
        size = self.img_size if img_size is None else img_size
        if size % self.patch_size:
            raise ValueError(f"img_size {size} is not a multiple of the patch size {self.patch_size}")
        H = W = size // self.patch_size
        conv = self.patch_embed.proj
        k = conv.kernel_size[0] * conv.kernel_size[1]
        macs = conv.out_channels * conv.in_channels * k * H * W
        for layer in self.layers:
            ws, _ = stage_window((H, W), self.window_size)
            padded = (H + -H % ws) * (W + -W % ws)
            for blk in layer.blocks:
                attn, mlp = blk.attn, blk.mlp
                width = attn.qkv.out_features // 3
                macs += padded * attn.qkv.in_features * attn.qkv.out_features
                macs += 2 * padded * ws * ws * width  # QK^T and AV, summed over windows and heads
                macs += padded * attn.proj.in_features * attn.proj.out_features
                macs += (
                    H
                    * W
                    * (
                        mlp.fc1.in_features * mlp.fc1.out_features
                        + mlp.fc2.in_features * mlp.fc2.out_features
                    )
                )
            if layer.downsample is not None:
                H, W = (H + 1) // 2, (W + 1) // 2
                red = layer.downsample.reduction
                macs += H * W * red.in_features * red.out_features
        return macs + heads_macs(self)


# ---------------------------------------------------------------------- registered variants


def _swin(embed_dim: int, depths: tuple, num_heads: tuple, /, **overrides) -> SwinTransformer:
    # Positional-only shape, so an override may name any of them (create_model("swin_t", depths=(2, 2, 2, 2))).
    kw = dict(embed_dim=embed_dim, depths=depths, num_heads=num_heads)
    return SwinTransformer(**{**kw, **overrides})


@register
def swin_debug(**kw):
    """Tiny Swin for tests and smoke runs: 32 px in 2x2 patches, width 16, window 4.

    Token grids 16, 8, 4, 2: stages 1-2 alternate plain and shifted windows, stages 3-4 are one clipped
    window. (4x4 patches would leave stage 4 a single token, whose bias table gets no gradient.)
    """
    return _swin(16, (2, 2, 2, 1), (1, 2, 4, 8), **{"img_size": 32, "patch_size": 2, "window_size": 4, **kw})


@register
def swin_t(**kw):
    """Swin-T: 28.29M parameters. The paper trains it from scratch with drop_path_rate=0.2 (default 0.1)."""
    return _swin(96, (2, 2, 6, 2), (3, 6, 12, 24), **kw)


@register
def swin_s(**kw):
    """Swin-S: 49.61M parameters. The paper trains it from scratch with drop_path_rate=0.3 (default 0.1)."""
    return _swin(96, (2, 2, 18, 2), (3, 6, 12, 24), **kw)


@register
def swin_b(**kw):
    """Swin-B: 87.77M parameters. The paper trains it from scratch with drop_path_rate=0.5 (default 0.1)."""
    return _swin(128, (2, 2, 18, 2), (4, 8, 16, 32), **kw)
