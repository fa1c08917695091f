"""The Vision Transformer of "An Image is Worth 16x16 Words", single-device PyTorch.

Parameter names follow the layout timm, DeiT and MAE publish, so their state dicts map one to one.
"""

from __future__ import annotations

from typing import Literal

import torch
from torch import nn
from torch.utils.checkpoint import checkpoint

from pipeline.models.layers import Block, PatchEmbed


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
        qkv_bias: bool = True,
        head_bias_init: float = 0.0,
        grad_checkpointing: bool = False,
    ):
        super().__init__()
        if pool not in ("cls", "gap"):
            raise ValueError(f"pool must be 'cls' or 'gap', got {pool!r}")
        self.pool = pool
        self.num_classes = num_classes
        self.embed_dim = embed_dim
        self.grad_checkpointing = grad_checkpointing
        self.patch_embed = PatchEmbed(img_size, patch_size, in_chans, embed_dim)
        self.num_prefix_tokens = 1 if pool == "cls" else 0
        self.cls_token = nn.Parameter(torch.zeros(1, 1, embed_dim)) if pool == "cls" else None
        self.pos_embed = nn.Parameter(
            torch.zeros(1, self.patch_embed.num_patches + self.num_prefix_tokens, embed_dim)
        )
        self.blocks = nn.ModuleList(Block(embed_dim, num_heads, mlp_dim, qkv_bias) for _ in range(depth))
        # cls pooling: final norm on every token; gap: norm after pooling (timm's fc_norm).
        self.norm = nn.LayerNorm(embed_dim, eps=1e-6) if pool == "cls" else nn.Identity()
        self.fc_norm = nn.LayerNorm(embed_dim, eps=1e-6) if pool == "gap" else nn.Identity()
        self.head = nn.Linear(embed_dim, num_classes)
        self._init_weights(head_bias_init)

    def _init_weights(self, head_bias_init: float) -> None:
        nn.init.trunc_normal_(self.pos_embed, std=0.02)
        if self.cls_token is not None:
            nn.init.trunc_normal_(self.cls_token, std=0.02)
        for m in self.modules():
            if isinstance(m, nn.Linear):
                nn.init.trunc_normal_(m.weight, std=0.02)
                if m.bias is not None:
                    nn.init.zeros_(m.bias)
            elif isinstance(m, nn.LayerNorm):
                nn.init.ones_(m.weight)
                nn.init.zeros_(m.bias)
        w = self.patch_embed.proj.weight
        nn.init.xavier_uniform_(w.view(w.shape[0], -1))  # as a linear layer (MAE, big_vision)
        nn.init.zeros_(self.patch_embed.proj.bias)
        nn.init.zeros_(self.head.weight)  # zero-initialised classifier, as the paper does
        nn.init.constant_(self.head.bias, head_bias_init)

    def forward_features(self, x: torch.Tensor) -> torch.Tensor:
        x = self.patch_embed(x)  # [B, N, D]
        if self.cls_token is not None:
            x = torch.cat([self.cls_token.expand(x.shape[0], -1, -1), x], dim=1)  # [B, 1+N, D]
        x = x + self.pos_embed
        for blk in self.blocks:
            if self.grad_checkpointing and self.training:
                x = checkpoint(blk, x, use_reentrant=False)
            else:
                x = blk(x)
        return self.norm(x)

    def forward_head(self, x: torch.Tensor, pre_logits: bool = False) -> torch.Tensor:
        x = x[:, 0] if self.pool == "cls" else self.fc_norm(x.mean(dim=1))  # [B, D]
        return x if pre_logits else self.head(x)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.forward_head(self.forward_features(x))
