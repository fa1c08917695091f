"""The Vision Transformer of "An Image is Worth 16x16 Words" with the variants its papers ablate.

Single-device PyTorch. Parameter names follow the layout timm, DeiT and MAE publish
(`patch_embed.proj`, `cls_token`, `dist_token`, `pos_embed`, `blocks.N.attn.qkv`, `norm`, `fc_norm`,
`head`, `head_dist`), so their state dicts map one to one (see `convert.py`).

`VIT_SHAPES` is the one table of ViT sizes: `vit_*` here, `mae_vit_*` and `mpp_vit_*` are built from it.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.hybrid import HybridEmbed
from pipeline.models.layers import (
    Block,
    PatchEmbed,
    checkpoints_block,
    classify,
    drop_patches,
    init_linear_and_norm,
)
from pipeline.models.macs import heads_macs, kept_patches
from pipeline.models.pos_embed import POS_EMBED_KINDS, resample_abs_pos_embed, sincos_2d
from pipeline.models.registry import register

# Width, depth, heads, MLP size and patch of the ViT paper's models (Table 1; G/14 from Zhai et al. 2022),
# named as the registered models are (vit_b16, mae_vit_b16, mpp_vit_b16). "debug" is the tiny size every
# test and smoke run uses; it also sets its 32px image size.
VIT_SHAPES: dict[str, dict] = {
    "debug": dict(img_size=32, patch_size=8, embed_dim=64, depth=4, num_heads=4, mlp_dim=128),
    "ti16": dict(patch_size=16, embed_dim=192, depth=12, num_heads=3, mlp_dim=768),
    "s16": dict(patch_size=16, embed_dim=384, depth=12, num_heads=6, mlp_dim=1536),
    "b16": dict(patch_size=16, embed_dim=768, depth=12, num_heads=12, mlp_dim=3072),
    "b32": dict(patch_size=32, embed_dim=768, depth=12, num_heads=12, mlp_dim=3072),
    "l16": dict(patch_size=16, embed_dim=1024, depth=24, num_heads=16, mlp_dim=4096),
    "l32": dict(patch_size=32, embed_dim=1024, depth=24, num_heads=16, mlp_dim=4096),
    "h14": dict(patch_size=14, embed_dim=1280, depth=32, num_heads=16, mlp_dim=5120),
    "g14": dict(patch_size=14, embed_dim=1408, depth=40, num_heads=16, mlp_dim=6144),
    "G14": dict(patch_size=14, embed_dim=1664, depth=48, num_heads=16, mlp_dim=8192),
}


class VisionTransformer(nn.Module):
    def __init__(
        self,
        img_size: int = 224,
        patch_size: int = 16,
        in_chans: int = 3,
        num_classes: int = 1000,
        embed_dim: int = 768,
        depth: int = 12,
        num_heads: int = 12,
        mlp_dim: int = 3072,
        pool: Literal["cls", "gap"] = "cls",
        pos_embed: Literal["learned", "learned_2d", "sincos2d", "relative", "none"] = "learned",
        distilled: bool = False,
        hybrid_layers: tuple[int, ...] | None = None,
        qkv_bias: bool = True,
        drop_path_rate: float = 0.0,
        init_values: float | None = None,
        head_bias_init: float = 0.0,
        grad_checkpointing: float = 0.0,
        patch_dropout: float = 0.0,
    ):
        super().__init__()
        if pool not in ("cls", "gap"):
            raise ValueError(f"pool must be 'cls' or 'gap', got {pool!r}")
        if pos_embed not in POS_EMBED_KINDS:
            raise ValueError(f"pos_embed must be one of {POS_EMBED_KINDS}, got {pos_embed!r}")
        if distilled and pool != "cls":
            raise ValueError("distilled=True needs pool='cls' (DeiT reads the class and distillation tokens)")
        if not 0.0 <= patch_dropout < 1.0:
            raise ValueError(f"patch_dropout must be in [0, 1), got {patch_dropout}")
        if patch_dropout and pos_embed == "relative":
            raise ValueError(
                "patch_dropout cannot use pos_embed='relative': the per-offset bias table is built for the "
                "full grid, and dropped patches break it; use 'learned', 'learned_2d' or 'sincos2d'"
            )
        self.pool, self.pos_embed_kind, self.distilled = pool, pos_embed, distilled
        self.patch_dropout = patch_dropout  # training only: the fraction of patch tokens dropped (FLIP)
        self.num_classes, self.embed_dim, self.depth = num_classes, embed_dim, depth
        self.grad_checkpointing = grad_checkpointing
        self.distilled_training = False  # set by the distillation objective: forward returns both heads

        if hybrid_layers:
            self.patch_embed: nn.Module = HybridEmbed(img_size, embed_dim, tuple(hybrid_layers), in_chans)
        else:
            self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        grid = self.patch_embed.grid_size
        self.num_prefix_tokens = (pool == "cls") + distilled
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "cls" else None
        self.dist_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if distilled else None

        # Absolute position embeddings; `relative` lives in the blocks, `none` has none.
        self.pos_embed = None
        if pos_embed == "learned":
            self.pos_embed = nn.Parameter(
                torch.zeros(1, self.num_prefix_tokens + grid[0] * grid[1], embed_dim)
            )
        elif pos_embed == "learned_2d":
            if embed_dim % 2:
                raise ValueError(f"learned_2d needs an even width, got {embed_dim}")
            self.pos_embed_row = nn.Parameter(torch.zeros(1, grid[0], embed_dim // 2))
            self.pos_embed_col = nn.Parameter(torch.zeros(1, grid[1], embed_dim // 2))
        elif pos_embed == "sincos2d":
            self.register_buffer("pos_embed_fixed", sincos_2d(*grid, embed_dim)[None], persistent=False)

        dpr = [
            drop_path_rate * i / max(1, depth - 1) for i in range(depth)
        ]  # stochastic depth grows with depth
        rel_grid = grid if pos_embed == "relative" else None
        self.blocks = nn.ModuleList(
            Block(
                embed_dim, num_heads, mlp_dim, qkv_bias, dpr[i], init_values, rel_grid, self.num_prefix_tokens
            )
            for i in range(depth)
        )
        # cls pooling: final norm on every token; gap: norm after pooling (timm's fc_norm).
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if pool == "cls" else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if pool == "gap" else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes)
        self.head_dist = nn.Linear(embed_dim, num_classes) if distilled else None
        self._init_weights(head_bias_init)

    # ------------------------------------------------------------------ init

    def _init_weights(self, head_bias_init: float) -> None:
        for p in (
            self.pos_embed,
            self.cls_token,
            self.dist_token,
            getattr(self, "pos_embed_row", None),
            getattr(self, "pos_embed_col", None),
        ):
            if p is not None:
                nn.init.trunc_normal_(p, std=0.02)
        init_linear_and_norm(self)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as a linear layer (MAE, big_vision)
        nn.init.zeros_(self.patch_embed.proj.bias)
        for head in (self.head, self.head_dist):
            if head is not None:
                nn.init.zeros_(head.weight)  # zero-initialised classifier, as the paper does
                nn.init.constant_(head.bias, head_bias_init)

    # ------------------------------------------------------------------ embeddings

    @property
    def grid_size(self) -> tuple[int, int]:
        return self.patch_embed.grid_size

    def patch_pos_embed(self) -> torch.Tensor | None:
        """The absolute position embedding of the patch tokens [1, N, D], or None (relative / none)."""
        if self.pos_embed_kind == "learned":
            return self.pos_embed[:, self.num_prefix_tokens :]
        if self.pos_embed_kind == "learned_2d":
            h, w = self.grid_size
            row = self.pos_embed_row[:, :, None].expand(-1, h, w, -1)  # [1, H, W, D/2]
            col = self.pos_embed_col[:, None, :].expand(-1, h, w, -1)
            return torch.cat([row, col], dim=-1).reshape(1, h * w, self.embed_dim)
        if self.pos_embed_kind == "sincos2d":
            return self.pos_embed_fixed
        return None

    def prefix_tokens(self, batch: int) -> torch.Tensor | None:
        """Class and distillation tokens with their position embedding [B, P, D], or None (gap)."""
        tokens = [t for t in (self.cls_token, self.dist_token) if t is not None]
        if not tokens:
            return None
        x = torch.cat(tokens, dim=1)
        if self.pos_embed_kind == "learned":
            x = x + self.pos_embed[:, : self.num_prefix_tokens]
        return x.expand(batch, -1, -1)

    def embed_patches(self, x: torch.Tensor) -> torch.Tensor:
        """Images -> patch tokens with absolute position added [B, N, D] (no prefix tokens)."""
        x = self.patch_embed(x)
        pos = self.patch_pos_embed()
        # The sin-cos table is an fp32 buffer, which DeepSpeed does not cast: it joins x in x's dtype.
        return x if pos is None else x + pos.to(x.dtype)

    def forward_blocks(self, x: torch.Tensor) -> torch.Tensor:
        for i, blk in enumerate(self.blocks):
            if self.training and checkpoints_block(self.grad_checkpointing, i, len(self.blocks)):
                x = checkpoint(blk, x, use_reentrant=False)  # recompute activations in backward
            else:
                x = blk(x)
        return x

    # ------------------------------------------------------------------ forward

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.embed_patches(x)  # [B, N, D]
        if self.patch_dropout and self.training:  # position is added already: kept tokens keep theirs
            x = drop_patches(x, kept_patches(x.shape[1], self.patch_dropout))  # [B, N_keep, D]
        prefix = self.prefix_tokens(x.shape[0])
        if prefix is not None:
            x = torch.cat([prefix, x], dim=1)  # [B, P+N, D]
        return self.norm(self.forward_blocks(x))

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False):
        if self.pool == "gap":
            x = self.fc_norm(x[:, self.num_prefix_tokens :].mean(dim=1))  # [B, D]
            return x if pre_logits else self.head(x)
        if pre_logits:
            return x[:, 0]
        return classify(self, x[:, 0], x[:, 1])

    def forward(self, x: torch.Tensor):
        return self.forward_head(self.forward_features(x))

    # ------------------------------------------------------------------ FLOPs

    def encoder_macs(self, img_size: int | None = None, mask_ratio: float = 0.0) -> tuple[int, int]:
        """(MACs without the heads, patch count): the patch embedding on every patch, the blocks on the
        prefix tokens and the `kept_patches` (MAE's encoder drops the rest). Meta-safe, nothing runs."""
        if img_size is None:
            (gh, gw), p = self.grid_size, self.patch_embed.patch_size
            img_hw = (gh * p, gw * p)
        else:
            img_hw = (img_size, img_size)
        macs, n = self.patch_embed.forward_macs(img_hw)
        tokens = self.num_prefix_tokens + kept_patches(n, mask_ratio)
        return macs + sum(blk.forward_macs(tokens) for blk in self.blocks), n

    def forward_macs(self, img_size: int | None = None, mask_ratio: float | None = None) -> int:
        """Forward multiply-accumulates for one image; a `mask_ratio` runs the blocks on the kept tokens only
        (pass `patch_dropout` to count a training step under patch dropout).

        Counted: the patch embedding (or the hybrid ResNet and its 1x1 projection), qkv and proj, QK^T and
        AV, the MLPs and the heads, one pooled vector each.
        """
        return self.encoder_macs(img_size, mask_ratio or 0.0)[0] + heads_macs(self)

    # ------------------------------------------------------------------ resolution change

    def set_grid(self, img_size: int) -> None:
        """Change the input resolution in place: position embeddings are resampled (bicubic), prefix rows kept."""
        p = self.patch_embed.patch_size
        if img_size % p:
            raise ValueError(f"img_size {img_size} is not a multiple of the patch size {p}")
        old, new = self.grid_size, (img_size // p, img_size // p)
        if old == new:
            return
        self.patch_embed.grid_size, self.patch_embed.num_patches = new, new[0] * new[1]
        if self.pos_embed_kind == "learned":
            table = resample_abs_pos_embed(self.pos_embed.data, new, self.num_prefix_tokens, old)
            self.pos_embed = nn.Parameter(table)
        elif self.pos_embed_kind == "learned_2d":
            for name, size in (("pos_embed_row", new[0]), ("pos_embed_col", new[1])):
                t = getattr(self, name).data.transpose(1, 2)  # [1, D/2, L]
                t = nn.functional.interpolate(t, size=size, mode="linear", align_corners=False)
                setattr(self, name, nn.Parameter(t.transpose(1, 2).contiguous()))
        elif self.pos_embed_kind == "sincos2d":
            self.pos_embed_fixed = sincos_2d(*new, self.embed_dim)[None].to(self.pos_embed_fixed.device)
        elif self.pos_embed_kind == "relative":
            for blk in self.blocks:
                blk.rel_pos.resample(new)


# ---------------------------------------------------------------------- registered variants


def _vit(shape: str, /, **overrides) -> VisionTransformer:
    # Any shape field may be overridden (create_model("vit_b16", depth=2)).
    return VisionTransformer(**{**VIT_SHAPES[shape], **overrides})


@register
def vit_debug(**kw):
    """Tiny ViT for tests and smoke runs: 32px images, 8px patches, 4 blocks of width 64."""
    return _vit("debug", **kw)


@register
def vit_ti16(**kw):
    return _vit("ti16", **kw)


@register
def vit_s16(**kw):
    return _vit("s16", **kw)


@register
def vit_b16(**kw):
    return _vit("b16", **kw)


@register
def vit_b32(**kw):
    return _vit("b32", **kw)


@register
def vit_l16(**kw):
    return _vit("l16", **kw)


@register
def vit_l32(**kw):
    return _vit("l32", **kw)


@register
def vit_h14(**kw):
    return _vit("h14", **kw)


@register
def vit_g14(**kw):
    return _vit("g14", **kw)


@register
def vit_G14(**kw):
    """ViT-G/14 of "Scaling Vision Transformers" (Zhai et al. 2022): width 1664, depth 48, MLP 8192, 16 heads."""
    return _vit("G14", **kw)


@register
def vit_r50_b16(**kw):
    """R50+ViT-B/16 hybrid: ResNet-50 stages (3, 4, 9) at stride 16 feed 1x1 patches into ViT-B."""
    return _vit("b16", **{"hybrid_layers": (3, 4, 9), **kw})
