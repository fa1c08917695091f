"""Transformer in Transformer (TNT, Han et al. 2021), single-device.

Every 16x16 patch ("sentence") is also cut into 4x4 sub-patches ("words"). Each block runs an inner
transformer over the words of each patch on its own (attention never crosses patches), projects the
patch's words (flattened, LayerNorm, Linear, LayerNorm) and adds them to that patch's embedding, then
runs an outer transformer over the patch sequence with its class token. Shapes follow the paper's code
(huawei-noah/Efficient-AI-Backbones `tnt_pytorch`) and timm's non-legacy `tnt_s_patch16_224`: the words
come from a 7x7 stride-4 convolution applied to each unfolded patch, so a word sees pixels of its own
patch only. timm's `legacy` layout convolves the whole image first, which lets the 7x7 kernel read 3
pixels across every patch border; the per-patch layout is what makes masked image modelling clean.

    model = create_model("tnt_s16", num_classes=100)
    logits = model(images)                                   # [B, 100]
    feats = create_model("tnt_s16", mask_token=True).forward_mim(images, mask)   # [B, 384, 14, 14]

Masked image modelling (SimMIM): a masked patch loses both streams. Its words are replaced by
`mask_token_pixel` right after the word convolution (before the word position embedding), and its patch
embedding by `mask_token` (before the patch position embedding). Replacing only the patch embedding
would leak: every block adds the projected words of the patch, computed from its real pixels, to the
outer stream. Since words are computed per patch, no visible token ever depends on masked pixels
(`tests/test_model_tnt.py` checks that perturbing masked pixels leaves `forward_mim` unchanged).

Differences from timm: qkv is one fused Linear (`layers.Attention`, no bias as in TNT) rather than
separate `qk` and `v`; LayerNorm eps is 1e-6 (layers.Block) rather than 1e-5; the word position embedding
is stored as [1, words, inner_dim] rather than [1, inner_dim, 4, 4].

Tests: `.venv/bin/python -m pytest tests/test_model_tnt.py -q`.
"""

from __future__ import annotations

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.layers import (
    Block,
    MaskedImageModelling,
    checkpoints_block,
    classify,
    init_linear_and_norm,
)
from pipeline.models.macs import conv_out, heads_macs, reject_mask_ratio
from pipeline.models.registry import register

# The word convolution of the paper: kernel 7, padding 3, stride `inner_stride` inside each patch.
_WORD_KERNEL, _WORD_PADDING = 7, 3


class PixelEmbed(nn.Module):
    """Images -> words: unfold into patches, then a strided convolution inside every patch on its own."""

    def __init__(self, img_size: int, patch_size: int, in_chans: int, inner_dim: int, stride: int):
        super().__init__()
        if img_size % patch_size:
            raise ValueError(f"img_size {img_size} is not a multiple of patch_size {patch_size}")
        self.img_size, self.patch_size, self.in_chans = img_size, patch_size, in_chans
        self.grid_size = (img_size // patch_size, img_size // patch_size)
        self.num_patches = self.grid_size[0] * self.grid_size[1]
        side = conv_out(patch_size, _WORD_KERNEL, stride, _WORD_PADDING)  # 4 for p=16, stride 4
        self.words_size = (side, side)
        self.num_words = side * side
        self.proj = nn.Conv2d(in_chans, inner_dim, _WORD_KERNEL, stride=stride, padding=_WORD_PADDING)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        B, C, H, W = x.shape
        if (H, W) != (self.img_size, self.img_size):
            raise ValueError(f"TNT was built for {self.img_size}px images, got {H}x{W}")
        p, (h, w) = self.patch_size, self.grid_size
        x = x.reshape(B, C, h, p, w, p).permute(0, 2, 4, 1, 3, 5)  # [B, h, w, C, p, p]
        x = self.proj(x.reshape(B * h * w, C, p, p))  # [B*N, d, k, k]: zero padding at patch borders
        return x.flatten(2).transpose(1, 2)  # [B*N, k*k, d], words row-major inside the patch


class WordsToPatch(nn.Module):
    """The words of each patch, flattened -> LayerNorm -> Linear -> LayerNorm: one vector per patch."""

    def __init__(self, num_words: int, inner_dim: int, embed_dim: int, bias: bool):
        super().__init__()
        self.flat_dim = num_words * inner_dim
        self.norm1 = nn.LayerNorm(self.flat_dim)
        self.proj = nn.Linear(self.flat_dim, embed_dim, bias=bias)
        self.norm2 = nn.LayerNorm(embed_dim)

    def forward(self, words: torch.Tensor, batch: int) -> torch.Tensor:
        x = words.reshape(batch, -1, self.flat_dim)  # [B*N, W, d] -> [B, N, W*d]
        return self.norm2(self.proj(self.norm1(x)))  # [B, N, C]


class TNTBlock(nn.Module):
    """Inner block over the words of each patch, their projection added to the patch, outer block."""

    def __init__(
        self,
        embed_dim: int,
        inner_dim: int,
        num_words: int,
        num_heads_outer: int,
        num_heads_inner: int,
        mlp_ratio: float,
        qkv_bias: bool,
        drop_path: float,
        num_prefix_tokens: int,
    ):
        super().__init__()
        self.num_prefix_tokens = num_prefix_tokens
        self.inner = Block(inner_dim, num_heads_inner, int(inner_dim * mlp_ratio), qkv_bias, drop_path)
        self.words_to_patch = WordsToPatch(num_words, inner_dim, embed_dim, bias=False)
        self.outer = Block(embed_dim, num_heads_outer, int(embed_dim * mlp_ratio), qkv_bias, drop_path)

    def forward(self, words: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        words = self.inner(words)  # [B*N, W, d]: the batch dimension is B*N, so attention stays in a patch
        P = self.num_prefix_tokens
        patches = tokens[:, P:] + self.words_to_patch(words, tokens.shape[0])  # [B, N, C]
        tokens = torch.cat([tokens[:, :P], patches], dim=1)  # class (and distillation) token untouched
        return words, self.outer(tokens)


class TNT(MaskedImageModelling, nn.Module):
    supports_mim = True

    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 384,
        inner_dim: int = 24,
        depth: int = 12,
        num_heads_outer: int = 6,
        num_heads_inner: int = 4,
        mlp_ratio: float = 4.0,
        inner_stride: int = 4,
        qkv_bias: bool = False,
        distilled: bool = False,
        head_bias_init: float = 0.0,
        drop_path_rate: float = 0.1,
        grad_checkpointing: float = 0.0,
        mask_token: bool = False,
    ):
        super().__init__()
        self.num_classes, self.distilled = num_classes, distilled
        self.embed_dim = self.num_features = embed_dim
        self.inner_dim, self.depth = inner_dim, depth
        self.grad_checkpointing = grad_checkpointing
        self.distilled_training = False  # set by the distillation objective: forward returns both heads
        self.mim_patch_size = self.mim_stride = patch_size  # one patch token per mask cell, no downsampling

        self.pixel_embed = PixelEmbed(img_size, patch_size, in_chans, inner_dim, inner_stride)
        self.grid_size = self.pixel_embed.grid_size
        self.num_patches, self.num_words = self.pixel_embed.num_patches, self.pixel_embed.num_words
        self.words_to_patch = WordsToPatch(self.num_words, inner_dim, embed_dim, bias=True)  # as timm

        self.num_prefix_tokens = 1 + distilled
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim))
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None
        self.patch_pos = nn.Parameter(torch.zeros(1, self.num_prefix_tokens + self.num_patches, embed_dim))
        self.pixel_pos = nn.Parameter(torch.zeros(1, self.num_words, inner_dim))
        # SimMIM: a masked patch loses its words and its patch embedding (see the module docstring).
        self.mask_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if mask_token else None
        self.mask_token_pixel = nn.Parameter(torch.zeros(1, 1, inner_dim)) if mask_token else None

        dpr = [drop_path_rate * i / max(1, depth - 1) for i in range(depth)]  # stochastic depth grows
        self.blocks = nn.ModuleList(
            TNTBlock(
                embed_dim,
                inner_dim,
                self.num_words,
                num_heads_outer,
                num_heads_inner,
                mlp_ratio,
                qkv_bias,
                dpr[i],
                self.num_prefix_tokens,
            )
            for i in range(depth)
        )
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6)
        self.head = nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()
        self.head_dist = (
            (nn.Linear(embed_dim, num_classes) if num_classes > 0 else nn.Identity()) if distilled else None
        )
        self._init_weights(head_bias_init)

    def _init_weights(self, head_bias_init: float) -> None:
        # timm's TNT: trunc_normal(0.02) on tokens, position tables and every Linear; the word
        # convolution keeps PyTorch's default (kaiming-uniform) initialisation.
        for p in (
            self.cls_token,
            self.dist_token,
            self.patch_pos,
            self.pixel_pos,
            self.mask_token,
            self.mask_token_pixel,
        ):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02)
        init_linear_and_norm(self)
        for head in (self.head, self.head_dist):
            if isinstance(head, nn.Linear):
                nn.init.zeros_(head.weight)  # zero-initialised classifier, as vit.py
                nn.init.constant_(head.bias, head_bias_init)

    # ------------------------------------------------------------------ embeddings

    def embed(self, x: torch.Tensor, mask: torch.Tensor | None = None) -> tuple[torch.Tensor, torch.Tensor]:
        """Images -> (words [B*N, W, d], tokens [B, P+N, C]) with position embeddings and prefix tokens.

        mask: bool [B, H/p, W/p], True = masked; needs `mask_token=True`.
        """
        B = x.shape[0]
        words = self.pixel_embed(x)  # [B*N, W, d]
        if mask is not None:
            if self.mask_token is None:
                raise ValueError("a mask needs a model built with mask_token=True")
            if tuple(mask.shape) != (B, *self.grid_size):
                raise ValueError(
                    f"mask must be [B, {self.grid_size[0]}, {self.grid_size[1]}], got {tuple(mask.shape)}"
                )
            w = mask.reshape(B * self.num_patches, 1, 1).to(words.dtype)  # 1 = masked patch
            words = words * (1 - w) + self.mask_token_pixel * w
        words = words + self.pixel_pos
        patches = self.words_to_patch(words, B)  # [B, N, C]
        if mask is not None:
            w = mask.reshape(B, self.num_patches, 1).to(patches.dtype)
            patches = patches * (1 - w) + self.mask_token * w
        prefix = [self.cls_token] + ([self.dist_token] if self.dist_token is not None else [])
        tokens = torch.cat([t.expand(B, -1, -1) for t in prefix] + [patches], dim=1)  # [B, P+N, C]
        return words, tokens + self.patch_pos

    def forward_blocks(self, words: torch.Tensor, tokens: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        for i, blk in enumerate(self.blocks):
            if self.training and checkpoints_block(self.grad_checkpointing, i, len(self.blocks)):
                words, tokens = checkpoint(blk, words, tokens, use_reentrant=False)
            else:
                words, tokens = blk(words, tokens)
        return words, tokens

    # ------------------------------------------------------------------ forward

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> normalised tokens [B, P+N, C] (class token first)."""
        _, tokens = self.forward_blocks(*self.embed(x))
        return self.norm(tokens)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if pre_logits:
            return x[:, 0]
        return classify(self, x[:, 0], x[:, 1])

    def _forward_mim(self, x: torch.Tensor, mask: torch.Tensor) -> torch.Tensor:
        """SimMIM features: images [B, 3, H, W], mask bool [B, H/p, W/p] -> map [B, C, H/p, W/p]."""
        _, tokens = self.forward_blocks(*self.embed(x, mask))
        x = self.norm(tokens)[:, self.num_prefix_tokens :]  # [B, N, C]
        return x.transpose(1, 2).reshape(x.shape[0], self.embed_dim, *self.grid_size)

    # ------------------------------------------------------------------ FLOPs

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image, from module shapes (works on the meta device)."""
        reject_mask_ratio(self, mask_ratio)
        pe = self.pixel_embed
        p = pe.patch_size
        side = pe.img_size if img_size is None else img_size
        if side % p:
            raise ValueError(f"img_size {side} is not a multiple of the patch size {p}")
        n = (side // p) ** 2
        conv = pe.proj
        k_side = conv_out(p, conv.kernel_size[0], conv.stride[0], conv.padding[0])
        words = k_side * k_side
        macs = n * conv.out_channels * conv.in_channels * conv.kernel_size[0] * conv.kernel_size[1] * words
        wtp = self.words_to_patch.proj
        macs += n * wtp.in_features * wtp.out_features
        tokens = self.num_prefix_tokens + n
        for blk in self.blocks:
            macs += n * blk.inner.forward_macs(words)  # one inner sequence of `words` tokens per patch
            macs += n * blk.words_to_patch.proj.in_features * blk.words_to_patch.proj.out_features
            macs += blk.outer.forward_macs(tokens)
        return macs + heads_macs(self)


def _tnt(
    patch_size: int,
    embed_dim: int,
    inner_dim: int,
    depth: int,
    heads_outer: int,
    heads_inner: int,
    /,
    **overrides,
):
    # Positional-only shape, so an override may name any of them (create_model("tnt_s16", depth=2)).
    kw = dict(
        patch_size=patch_size,
        embed_dim=embed_dim,
        inner_dim=inner_dim,
        depth=depth,
        num_heads_outer=heads_outer,
        num_heads_inner=heads_inner,
    )
    return TNT(**{**kw, **overrides})


@register
def tnt_debug(**kw):
    """Tiny TNT for tests and smoke runs: 32px images, 8px patches of 4x4 words (stride 2), 4 blocks of width 64."""
    return _tnt(8, 64, 8, 4, 4, 2, **{"img_size": 32, "inner_stride": 2, **kw})


@register
def tnt_s16(**kw):
    """TNT-S: outer width 384 (6 heads), inner width 24 (4 heads), 16 words per 16x16 patch; 23.8M params."""
    return _tnt(16, 384, 24, 12, 6, 4, **kw)


@register
def tnt_b16(**kw):
    """TNT-B: outer width 640 (10 heads), inner width 40 (4 heads), 16 words per 16x16 patch; 65.6M params."""
    return _tnt(16, 640, 40, 12, 10, 4, **kw)
